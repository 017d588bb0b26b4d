"""The loader watch's fix reads the mount's own options: on a ``listing=all`` mount it never advises what is
wrong there (mounting with ``listing=all``, re-creating the dataset each pass)."""

from __future__ import annotations

import json
import logging

from tierfs.daemon.schedule.loader_watch import off_view_fix


def _warning(e) -> str | None:
    return json.loads(e.status().to_json())["loader"]["warning"]


def test_the_off_view_fix_on_a_listing_all_mount_names_no_wrong_fix(open_engine, t, caplog):
    e = open_engine(listing="all")  # 32 files, nm 4: a view of about 8

    async def main():
        for f in list(range(e.tree.n_files)) * 2:  # a loader that built its list once, with no sampler
            await t.read_file(e, f)

    with caplog.at_level(logging.WARNING, logger="tierfs"):
        t.run(main)
    warning = _warning(e)
    assert warning is not None and "does not follow the view" in warning
    assert "sampler=tierfs.torch.MountSampler(dataset)" in warning and "lists every file" in warning
    for wrong in ("mount with listing=all", "--listing all", "re-create the dataset each pass"):
        assert wrong not in warning, wrong
    logged = [r.getMessage() for r in caplog.records if "does not follow" in r.getMessage()]
    assert logged and all("re-create the dataset each pass" not in m for m in logged)


def test_each_mount_s_options_get_their_own_fix():
    view, all_, sub = off_view_fix("view", False), off_view_fix("all", False), off_view_fix("all", True)
    assert "listing=all" in view and "re-create the dataset each pass" in view
    assert "remount with listing=all" not in all_ and "MountSampler" in all_
    assert "composition=stratified" in sub and "listing" not in sub
