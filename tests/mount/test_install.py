"""``tierfs install``: the units verify, mount(8) finds the helper with an empty environment, uninstall undoes it."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tierfs.install import MARKER, Layout, render
from tierfs.testing import force_unmount, is_mounted

ROOT = Path(__file__).resolve().parents[2]
MINIMAL_ENV = {"PATH": "/usr/sbin:/usr/bin:/sbin:/bin"}  # what `env -i PATH=...` leaves


def tierfs(*args, env=None):
    return subprocess.run([sys.executable, "-m", "tierfs", *map(str, args)], capture_output=True, text=True,
                          timeout=60, stdin=subprocess.DEVNULL, env=env or os.environ)


def layout_args(layout: Layout) -> list[str]:
    return ["--prefix", layout.prefix, "--sbin-dir", layout.sbin_dir, "--unit-dir", layout.unit_dir,
            "--generator-dir", layout.generator_dir, "--conf-dir", layout.conf_dir]


def temp_layout(tmp_path: Path, sbin_dir: str | None = None) -> Layout:
    return Layout(prefix=str(tmp_path / "usr"), sbin_dir=sbin_dir or str(tmp_path / "sbin"),
                  unit_dir=str(tmp_path / "units"), generator_dir=str(tmp_path / "generators"),
                  conf_dir=str(tmp_path / "etc-tierfs"))


def all_files(root: Path) -> set[str]:
    return {str(p) for p in root.rglob("*") if p.is_file() or p.is_symlink()}


def verify(*units: Path) -> str:
    res = subprocess.run(["systemd-analyze", "verify", *map(str, units)], capture_output=True, text=True, timeout=60)
    return (res.stdout + res.stderr).strip() + ("" if res.returncode == 0 else f"\n(exit {res.returncode})")


@pytest.mark.skipif(shutil.which("systemd-analyze") is None, reason="needs systemd-analyze")
def test_units_and_generator_drop_in_verify_clean_and_uninstall_removes_them(tmp_path):
    layout = temp_layout(tmp_path / "inst")
    res = tierfs("install", *layout_args(layout))
    assert res.returncode == 0, res.stderr
    written = {line.split(" ", 1)[1] for line in res.stdout.splitlines() if line.startswith("wrote ")}
    assert written == set(render(layout)) == all_files(tmp_path / "inst")
    units = Path(layout.unit_dir)
    service = (units / "tierfs@.service").read_text()
    assert f"ExecStart={layout.prefix}/bin/tierfs mount ${{BACKING}} ${{MOUNTPOINT}} -o ${{OPTIONS}}" in service
    assert "Type=notify" in service and "Restart=on-failure" in service
    assert f"EnvironmentFile={layout.conf_dir}/%i.conf" in service
    assert f"Documentation=file:{layout.prefix}/share/doc/tierfs/operations.md" in service
    assert (Path(layout.prefix) / "share/doc/tierfs/operations.md").is_file()

    # a data set's config: the generator turns it into RequiresMountsFor= its backing and cache dirs
    conf = Path(layout.conf_dir) / "imagenet.conf"
    conf.write_text('BACKING="/srv/nfs/imagenet"\nMOUNTPOINT=/mnt/imagenet\n'
                    "OPTIONS=nm=16,cache=/srv/nvme/tierfs-imagenet,capacity=150G\n")
    out = tmp_path / "generated"
    subprocess.run([f"{layout.generator_dir}/tierfs-mounts", str(out), str(out) + ".early", str(out) + ".late"],
                   check=True, env=MINIMAL_ENV, timeout=30)
    drop_in = out / "tierfs@imagenet.service.d" / "50-tierfs-mounts.conf"
    assert "[Unit]\nRequiresMountsFor=/srv/nfs/imagenet /srv/nvme/tierfs-imagenet\n" in drop_in.read_text()
    assert [p.name for p in out.iterdir()] == ["tierfs@imagenet.service.d"]  # example.conf makes no unit

    # an instance with the drop-in beside it, as systemd loads it; and the example training unit
    check = tmp_path / "check"
    check.mkdir()
    shutil.copy(units / "tierfs@.service", check / "tierfs@imagenet.service")
    shutil.copytree(out / "tierfs@imagenet.service.d", check / "tierfs@imagenet.service.d")
    shutil.copy(units / "tierfs-train@.service", check / "tierfs-train@imagenet.service")
    assert verify(units / "tierfs@.service", units / "tierfs-train@.service") == ""
    assert verify(check / "tierfs@imagenet.service", check / "tierfs-train@imagenet.service") == ""

    # installing again is fine; a file it did not write is never overwritten
    assert tierfs("install", *layout_args(layout)).returncode == 0
    os.unlink(units / "tierfs-train@.service")
    (units / "tierfs-train@.service").write_text("[Unit]\nDescription=the admin's own\n")
    res = tierfs("install", *layout_args(layout))
    assert res.returncode == 1 and "was not written by tierfs install" in res.stderr
    assert (units / "tierfs-train@.service").read_text() == "[Unit]\nDescription=the admin's own\n"

    res = tierfs("install", "--uninstall", *layout_args(layout))
    assert res.returncode == 0, res.stderr
    # everything it wrote is gone; what the admin wrote stays
    assert all_files(tmp_path / "inst") == {str(conf), str(units / "tierfs-train@.service")}
    assert not Path(layout.prefix, "share", "doc", "tierfs").exists()


def test_shipped_systemd_files_are_what_install_writes_by_default():
    """systemd/ holds the default install's units (so they cannot drift from what `tierfs install` writes)."""
    default = Layout()
    files = render(default)
    for shipped, installed in [("tierfs@.service", f"{default.unit_dir}/tierfs@.service"),
                               ("tierfs-train@.service", f"{default.unit_dir}/tierfs-train@.service"),
                               ("tierfs-mounts.generator", f"{default.generator_dir}/tierfs-mounts"),
                               ("tierfs-example.conf", f"{default.conf_dir}/example.conf")]:
        assert (ROOT / "systemd" / shipped).read_bytes() == files[installed][0], shipped


def test_install_refuses_relative_dirs_and_reports_unwritable_ones(tmp_path):
    res = tierfs("install", "--prefix", "usr/local")
    assert res.returncode == 2 and res.stderr.strip() == (
        "tierfs: error: prefix must be an absolute path, got 'usr/local'")
    blocked = tmp_path / "file"
    blocked.write_text("")
    layout = temp_layout(tmp_path, sbin_dir=str(blocked / "sbin"))
    res = tierfs("install", *layout_args(layout))
    assert res.returncode == 1 and len(res.stderr.strip().splitlines()) == 1
    assert f"{blocked}/sbin" in res.stderr


def _daemons(mnt: Path) -> list[int]:
    pids = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                args = Path(f"/proc/{entry}/cmdline").read_bytes().split(b"\0")
            except OSError:
                continue
            if os.fsencode(mnt) in args and any(b"tierfs" in a for a in args):
                pids.append(int(entry))
    return pids


def _wait_gone(mnt: Path) -> None:
    deadline = time.monotonic() + 30
    while _daemons(mnt):
        assert time.monotonic() < deadline, "the daemon did not exit after umount"
        time.sleep(0.05)


@pytest.mark.skipif(os.geteuid() != 0, reason="writes /sbin/mount.fuse.tierfs and runs mount(8)")
def test_mount_8_finds_the_helper_with_an_empty_environment(dataset, mount_dirs, tmp_path):
    """`mount -t fuse.tierfs` and an fstab line, under `env -i PATH=...`; `umount` ends the daemon."""
    backing, files = dataset
    mnt, cache = mount_dirs
    helper = Path("/sbin/mount.fuse.tierfs")
    if helper.exists() and MARKER not in helper.read_text(errors="replace"):
        pytest.skip(f"{helper} exists and is not ours")
    layout = temp_layout(tmp_path, sbin_dir="/sbin")
    try:
        res = tierfs("install", *layout_args(layout))
        assert res.returncode == 0, res.stderr
        rel = sorted(files)[0]
        res = subprocess.run(["mount", "-t", "fuse.tierfs", str(backing), str(mnt), "-o",
                              f"nosuid,nodev,cache={cache},capacity=1M,rf=3"],
                             capture_output=True, text=True, timeout=60, env=MINIMAL_ENV)
        assert res.returncode == 0, res.stderr
        assert is_mounted(mnt)
        assert json.loads((mnt / ".tierfs" / "status").read_bytes())["rf"] == 3
        assert (mnt / rel).read_bytes() == (backing / rel).read_bytes()
        res = subprocess.run(["umount", str(mnt)], capture_output=True, text=True, timeout=60, env=MINIMAL_ENV)
        assert res.returncode == 0, res.stderr
        assert not is_mounted(mnt)
        _wait_gone(mnt)  # an external unmount ends the daemon

        # the same through an fstab line (mount -T reads another fstab), with the options systemd adds
        fstab = tmp_path / "fstab"
        fstab.write_text(f"{backing} {mnt} fuse.tierfs _netdev,nofail,x-systemd.requires-mounts-for={backing},"
                         f"cache={cache},capacity=1M,nm=2 0 0\n")
        res = subprocess.run(["mount", "-T", str(fstab), str(mnt)], capture_output=True, text=True, timeout=60,
                             env=MINIMAL_ENV)
        assert res.returncode == 0, res.stderr
        assert json.loads((mnt / ".tierfs" / "status").read_bytes())["nm"] == 2
        res = subprocess.run(["umount", str(mnt)], capture_output=True, text=True, timeout=60, env=MINIMAL_ENV)
        assert res.returncode == 0, res.stderr
    finally:
        force_unmount(mnt)
        tierfs("install", "--uninstall", *layout_args(layout))
        for pid in _daemons(mnt):
            os.kill(pid, signal.SIGKILL)
    assert not helper.exists()
