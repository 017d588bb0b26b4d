"""``tierfs status``'s human form, rendered from a real engine's status object: bounded lines however long the
mount has run, denominators, and warnings that say what to do."""

from __future__ import annotations

import json
import time

from tierfs.cli.commands import format_status

WIDTH = 100  # what a terminal shows without wrapping (tierfs.cli.status_text.WIDTH)


def _status(engine) -> dict:
    return json.loads(engine.status().to_json())  # what the client reads


def test_status_lines_stay_bounded_after_1000_mini_epochs(open_engine):
    st = _status(open_engine(rf=4, nm=4))
    assert st["rf_effective"] and len(st["rf_effective"]) < 5
    short = format_status(st)
    # a mount 1,000 mini-epochs on (250 epochs at nm 4), with every warning on
    st.update(epoch=249, mini_epoch=2, passes_total=4000 + 3, rf_effective=[4] * 998 + [5, 0],
              last_error="epoch 250: " + "nm=4 does not fit capacity=1M: a mini-epoch must fit " * 20)
    st["backing"].update(state="lost", lost_since=time.time() - 3605, reason="Transport endpoint is not connected")
    st["staging"].update(unstaged_files=12345, unstaged=[{"file": "a/" * 200 + "f.bin", "why": "No space left"}])
    st["reads"].update(out_of_view=7, hits=10**12, misses=10**9)
    st["loader"].update(follows_view=False, warning="7 opens outside the view: the loader keeps an old file list; "
                        "list the mount each pass")  # (the loader's own warning: shown while it stands)
    text = format_status(st)
    lines = text.splitlines()
    assert max(map(len, lines)) <= WIDTH, max(lines, key=len)
    assert len(lines) <= len(short.splitlines()) + 16
    assert "epoch 250  mini-epoch 3/4  pass 1/4" in text
    from tierfs import __version__
    assert lines[0].startswith(f"tierfs     {__version__}  policy met  mounted on ")  # (which build)
    assert "… 4 4 4 4 4 5 (999 mini-epochs done)" in text
    assert "backing lost 1 h 00 min ago (Transport endpoint is not connected)" in text
    assert "mount the slow tier again" in text  # what to do
    assert "12,345 files could not be staged" in text and "out of view" in text and "list the mount" in text


def test_status_says_what_staging_does_now_and_next(open_engine, t):
    e = open_engine(rf=2, nm=4)
    st = _status(e)  # right after the mount: nothing is cached yet, the current mini-epoch first
    cur = st["current_staging"]
    assert cur["files_done"] == 0 and cur["files_total"] == st["view_files"] > 0
    assert cur["bytes_total"] == st["view_bytes"] and cur["eta_s"] is None  # no rate measured yet
    lines = format_status(st).splitlines()
    staging = [ln for ln in lines if ln.startswith("staging")]
    assert staging[0].startswith(f"staging    current mini-epoch (1/4): 0/{cur['files_total']} files [")
    assert staging[1].startswith("staging    next mini-epoch (2/4): 0/")
    assert any(ln.strip().endswith("next: switch once staged and the passes are made") for ln in lines)

    t.stage_all(e)
    st = _status(e)
    assert st["current_staging"]["files_done"] == st["current_staging"]["files_total"]
    assert st["current_staging"]["eta_s"] == 0 and st["prefetch"]["eta_s"] == 0
    text = format_status(st)
    assert "current mini-epoch" not in text  # staged: no line for it
    assert "staging    next mini-epoch (2/4) staged: " in text
    assert "next: the switch to it after this mini-epoch's last pass" in text
