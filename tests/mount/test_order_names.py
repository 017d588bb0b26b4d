"""A steering group's member reads ``order`` and ``order0`` (issue 46): they name no file in a directory the member
may not list, while the mount's owner still sees every name of the view."""

from __future__ import annotations

import json
import os

from tierfs.testing.harness import make_dataset, mounted

# As nobody (in group nogroup): order and order0, as text.
_READ_ORDERS = """
import json, os, sys
out = {}
for name in ("order", "order0"):
    with open(os.path.join(sys.argv[1], ".tierfs", name), "rb") as f:
        out[name] = f.read().decode("utf-8", "replace")
print(json.dumps(out))
"""


def test_a_members_orders_name_no_file_it_may_not_list(tmp_path, other_user):
    mnt, as_nobody = other_user
    backing = tmp_path / "backing"
    make_dataset(backing, dirs=2, files_per_dir=3, min_size=4096, max_size=4096, seed=1)
    for name, mode in (("hidden", 0o700), ("blind", 0o711), ("closed", 0o755)):
        d = backing / name
        d.mkdir(mode=mode)
        os.chmod(d, mode)  # (not the umask's)
        for i in range(3):
            (d / f"{name}_{i}.bin").write_bytes(os.urandom(4096))
    # below a directory nobody may search, even a 0755 one stays closed
    inner = backing / "hidden" / "inner"
    inner.mkdir(mode=0o755)
    (inner / "deep.bin").write_bytes(os.urandom(4096))
    with mounted(backing, mnt, tmp_path / "cache", "16M", nm=1, rf=1000, allow_other=True,
                 group="nogroup") as m:
        with open(m.path(".tierfs", "order"), "rb") as f:
            owners = f.read().decode()
        for name in ("hidden/hidden_0.bin", "blind/blind_0.bin", "closed/closed_0.bin", "hidden/inner/deep.bin"):
            assert name in owners  # the owner (root) sees every file of the view
        seen = json.loads(" ".join(as_nobody(_READ_ORDERS, mnt)))
        for text in seen.values():
            names = set(text.replace("\0", "\n").split())
            assert not any(n.startswith(("hidden/", "blind/")) for n in names), names
            assert {f"closed/closed_{i}.bin" for i in range(3)} <= names  # a listable dir's files stay
            assert len(names) == 6 + 3  # the two class dirs' files and closed/'s
        assert seen["order"].split("\n")[:-1] == seen["order0"].split("\0")[:-1]
