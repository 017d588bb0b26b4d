"""A control write is applied whole or refused whole, however the kernel splits it (issue 22).

The kernel hands a ``write()`` of more than its ``max_write`` to the daemon in pieces; before, each piece was
applied on its own: ``rf=7`` and 2 MiB of padding and garbage made rf 7 and returned a short count, and a valid
2 MB write failed "unknown key 'r'" where a piece ended mid-line.  Now any ``write()`` over
``CONTROL_WRITE_MAX`` fails with EFBIG and changes nothing, and one up to it is applied whole.  Every write runs
in a subprocess with a deadline (a hung mount fails the test, never hangs it).
"""

from __future__ import annotations

import errno
import json
import subprocess
import sys

from tierfs.common.protocol import CONTROL_WRITE_MAX

_WRITE = """
import os, sys
fd = os.open(sys.argv[1], os.O_WRONLY | os.O_TRUNC)
data = sys.stdin.buffer.read()
try:
    n = os.write(fd, data)
    print("wrote", n, "of", len(data))
except OSError as exc:
    print("errno", exc.errno)
"""


def write_once(control, data: bytes) -> tuple[str, int]:
    """One ``write()`` of ``data`` to ``control``: ("wrote", count) or ("errno", errno)."""
    out = subprocess.run([sys.executable, "-c", _WRITE, str(control)], input=data, capture_output=True,
                         timeout=60, check=True).stdout.split()
    return out[0].decode(), int(out[1])


def status(mnt) -> dict:
    return json.loads(subprocess.run(["cat", str(mnt / ".tierfs" / "status")], capture_output=True, check=True,
                                     timeout=30).stdout)


def test_rf_then_megabytes_of_garbage_is_refused_whole_and_the_writer_gets_the_error(tierfs_mount, mount_dirs):
    mnt, _ = mount_dirs
    with tierfs_mount(capacity="1M", rf=2) as m:
        control = m.path(".tierfs", "control")
        assert write_once(control, b"rf=7\n" + b"\n" * (2 << 20) + b"garbage here\n") == ("errno", errno.EFBIG)
        st = status(mnt)
        assert st["rf"] == 2  # not a prefix applied
        assert "more than 65536 bytes in one write()" in st["last_error"]
        assert write_once(control, b"rf=7\n") == ("wrote", 5)  # the same open-write-close, short: applied
        assert status(mnt)["rf"] == 7 and status(mnt)["last_error"] is None


def test_a_valid_400001_line_write_is_refused_whole_with_a_clear_error(tierfs_mount, mount_dirs):
    mnt, _ = mount_dirs
    with tierfs_mount(capacity="1M", rf=2) as m:
        data = b"".join(b"rf=%d\n" % (3 + i % 5) for i in range(400_001))  # 2,000,005 bytes, last line rf=3
        assert write_once(m.path(".tierfs", "control"), data) == ("errno", errno.EFBIG)
        st = status(mnt)
        assert st["rf"] == 2
        assert "unknown key" not in st["last_error"] and "nothing applied" in st["last_error"]


def test_a_write_of_exactly_the_limit_is_applied_whole(tierfs_mount, mount_dirs):
    mnt, _ = mount_dirs
    with tierfs_mount(capacity="1M", rf=2) as m:
        line = b"rf=4 # a comment to pad the line out to a round size..........\n"
        data = line * (CONTROL_WRITE_MAX // len(line))
        data += b"#" * (CONTROL_WRITE_MAX - len(data) - len(b"\nrf=5\n")) + b"\nrf=5\n"
        assert len(data) == CONTROL_WRITE_MAX
        assert write_once(m.path(".tierfs", "control"), data) == ("wrote", CONTROL_WRITE_MAX)
        assert status(mnt)["rf"] == 5
        assert write_once(m.path(".tierfs", "control"), data + b"\n") == ("errno", errno.EFBIG)


def test_echo_still_works_and_a_bad_echo_fails_the_writer(tierfs_mount, mount_dirs):
    mnt, _ = mount_dirs
    with tierfs_mount(capacity="1M", rf=2) as m:
        control = m.path(".tierfs", "control")
        ok = subprocess.run(["bash", "-c", f"echo rf=8 > {control}"], capture_output=True, text=True, timeout=30)
        assert ok.returncode == 0, ok.stderr
        assert status(mnt)["rf"] == 8
        bad = subprocess.run(["bash", "-c", f"echo bogus=1 > {control}"], capture_output=True, text=True, timeout=30)
        assert bad.returncode != 0 and "Invalid argument" in bad.stderr
        assert status(mnt)["rf"] == 8 and "bogus" in status(mnt)["last_error"]
        # several writes on one open file (what tierfs.client does): each applied, at growing offsets
        two = subprocess.run([sys.executable, "-c", "import os, sys\n"
                              "fd = os.open(sys.argv[1], os.O_WRONLY)\n"
                              "os.write(fd, b'rf=3\\n'); os.write(fd, b'rf=6\\n')\n", str(control)],
                             capture_output=True, text=True, timeout=30)
        assert two.returncode == 0, two.stderr
        assert status(mnt)["rf"] == 6
