"""``tierfs install``: the units verify, mount(8) finds the helper with an empty environment, uninstall undoes it."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tierfs.cli.install import Layout, render
from tierfs.common.mountpoint_lock import holders
from tierfs.testing.harness import is_mounted

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
    """systemd/ holds the default install's units (so they cannot drift from what `tierfs install` writes), but
    for the version in their first line: git's, which changes with every commit, reads ``VERSION`` there."""
    default = Layout()

    def unversioned(text: bytes) -> bytes:
        return re.sub(rb"^(#.*?\(tierfs )[^)\s]+\)", rb"\1VERSION)", text, count=1, flags=re.M)

    files = {path: (unversioned(content), mode) for path, (content, mode) in render(default).items()}
    for shipped, installed in [("tierfs@.service", f"{default.unit_dir}/tierfs@.service"),
                               ("tierfs-train@.service", f"{default.unit_dir}/tierfs-train@.service"),
                               ("tierfs-metrics@.service", f"{default.unit_dir}/tierfs-metrics@.service"),
                               ("tierfs-metrics@.timer", f"{default.unit_dir}/tierfs-metrics@.timer"),
                               ("tierfs-mounts.generator", f"{default.generator_dir}/tierfs-mounts"),
                               ("tierfs-example.conf", f"{default.conf_dir}/example.conf")]:
        assert (ROOT / "systemd" / shipped).read_bytes() == files[installed][0], shipped  # ("tierfs VERSION")


def test_install_writes_the_reload_and_the_metrics_timer_and_uninstall_removes_them(tmp_path):
    """(issue 47) ``systemctl reload tierfs@NAME`` sends SIGHUP (the log reopened, never an unmount); the metrics
    timer and service for node-exporter's textfile collector are installed, not left to the admin."""
    layout = temp_layout(tmp_path / "inst")
    res = tierfs("install", *layout_args(layout))
    assert res.returncode == 0, res.stderr
    units = Path(layout.unit_dir)
    assert "\nExecReload=/bin/kill -HUP $MAINPID\n" in (units / "tierfs@.service").read_text()
    service, timer = (units / "tierfs-metrics@.service").read_text(), (units / "tierfs-metrics@.timer").read_text()
    assert f"\nExecStart={layout.prefix}/bin/tierfs metrics ${{MOUNTPOINT}} --textfile ${{TEXTFILE_DIR}}\n" in service
    assert f"\nEnvironmentFile={layout.conf_dir}/%i.conf\n" in service and "\nType=oneshot\n" in service
    # the conf's TEXTFILE_DIR wins over the default: EnvironmentFile= comes after Environment=
    assert service.index("Environment=TEXTFILE_DIR=/var/lib/node_exporter/textfile_collector\n") < \
        service.index("EnvironmentFile=")
    assert "\nOnUnitActiveSec=15s\n" in timer and "\nWantedBy=timers.target\n" in timer
    if shutil.which("systemd-analyze"):
        check = tmp_path / "check"
        check.mkdir()
        for unit in ("tierfs@", "tierfs-metrics@"):
            for suffix in (".service", ".timer"):
                if (units / f"{unit}{suffix}").exists():
                    shutil.copy(units / f"{unit}{suffix}", check / f"{unit}imagenet{suffix}")
        assert verify(units / "tierfs-metrics@.service", units / "tierfs-metrics@.timer") == ""
        assert verify(*sorted(check.iterdir())) == ""
    res = tierfs("install", "--uninstall", *layout_args(layout))
    assert res.returncode == 0, res.stderr
    assert not (units / "tierfs-metrics@.service").exists() and not (units / "tierfs-metrics@.timer").exists()


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


#: Modules a user may plant where root runs a command: the commands' own packages, what they import first, and
#: what Python imports at startup from PYTHONPATH.  Each writes a marker if imported.
PLANTED = ("tierfs/__init__.py", "tierfs/__main__.py", "dslide/__init__.py", "dslide/__main__.py", "trio.py",
           "numpy/__init__.py", "sitecustomize.py", "usercustomize.py", "startup.py")


def plant(where: Path, markers: Path) -> None:
    for rel in PLANTED:
        path = where / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(f"import os\nopen(os.path.join({str(markers)!r}, {rel.replace('/', '.')!r}), 'w').close()\n")
    site = where / "userbase" / "lib" / f"python{sys.version_info.major}.{sys.version_info.minor}" / "site-packages"
    site.mkdir(parents=True)
    shutil.copy(where / "usercustomize.py", site / "usercustomize.py")
    (site / "planted.pth").write_text(f"import os; open(os.path.join({str(markers)!r}, 'pth'), 'w').close()\n")


def test_installed_commands_import_nothing_from_the_callers_directory_or_environment(tmp_path):
    """Root runs `tierfs status` (or mount(8) runs the helper) in a directory another user can write: a planted
    `tierfs/`, `trio.py` or `numpy/` there, or PYTHON* variables, must never be imported (issue 46)."""
    layout = temp_layout(tmp_path / "inst")
    res = tierfs("install", *layout_args(layout))
    assert res.returncode == 0, res.stderr
    planted, markers = tmp_path / "planted", tmp_path / "markers"
    markers.mkdir()
    plant(planted, markers)
    hostile = {"PYTHONPATH": str(planted), "PYTHONSTARTUP": str(planted / "startup.py"), "PYTHONHOME": str(planted),
               "PYTHONUSERBASE": str(planted / "userbase"), "PYTHONSAFEPATH": "", "PYTHONNOUSERSITE": ""}
    commands = {f"{layout.sbin_dir}/mount.fuse.tierfs": "tierfs", f"{layout.bin_dir}/tierfs": "tierfs",
                f"{layout.bin_dir}/dslide": "dslide"}
    for wrapper, name in commands.items():
        for env in (MINIMAL_ENV, {**MINIMAL_ENV, **hostile}):
            res = subprocess.run([wrapper, "--version"], cwd=planted, env=env, capture_output=True, text=True,
                                 timeout=60, stdin=subprocess.DEVNULL)
            assert (res.returncode, res.stdout.split()[:1]) == (0, [name]), (wrapper, env, res.stdout, res.stderr)
            assert sorted(os.listdir(markers)) == [], (wrapper, env)
        res = subprocess.run([wrapper, "--help"], cwd=planted, env={**MINIMAL_ENV, **hostile}, capture_output=True,
                             text=True, timeout=60, stdin=subprocess.DEVNULL)
        assert res.returncode == 0 and "usage" in res.stdout.lower(), (wrapper, res.stderr)
        assert sorted(os.listdir(markers)) == [], wrapper


def _wait_gone(mnt: Path) -> None:
    """Until no daemon holds ``mnt`` (its lock on the mountpoint: tierfs.common.mountpoint_lock)."""
    deadline = time.monotonic() + 30
    while holders(str(mnt)):
        assert time.monotonic() < deadline, "the daemon did not exit after umount"
        time.sleep(0.05)


def _can_unshare() -> bool:
    return shutil.which("unshare") is not None and shutil.which("nsenter") is not None and subprocess.run(
        ["unshare", "--mount", "true"], capture_output=True, timeout=30).returncode == 0


@pytest.mark.skipif(os.geteuid() != 0 or not _can_unshare(),
                    reason="runs mount(8) in a private mount namespace (root, unshare and nsenter)")
def test_mount_8_finds_the_helper_with_an_empty_environment(dataset, mount_dirs, tmp_path):
    """`mount -t fuse.tierfs` and an fstab line, under `env -i PATH=...`; `umount` ends the daemon.

    mount(8) looks for the helper in /sbin only.  The helper is installed into a temp dir, which a private mount
    namespace shows as /sbin: the real /sbin is never written, and a real install's helper there is neither run
    nor touched (issue 46: this test once took a real helper carrying the install marker for its own and deleted
    it)."""
    backing, files = dataset
    mnt, cache = mount_dirs
    layout = temp_layout(tmp_path / "inst")
    res = tierfs("install", *layout_args(layout))
    assert res.returncode == 0, res.stderr
    real_sbin = sorted(os.listdir("/sbin"))
    # a process that holds the namespace: /sbin is the temp dir there, and only there (propagation private)
    holder = subprocess.Popen(["unshare", "--mount", "--propagation", "private", "sh", "-c",
                               'mount --bind "$0" /sbin && echo ready && exec sleep 3600', layout.sbin_dir],
                              stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, text=True)

    def inside(*cmd: object) -> subprocess.CompletedProcess[bytes]:
        return subprocess.run(["nsenter", f"--target={holder.pid}", "--mount", "--", *map(str, cmd)],
                              capture_output=True, timeout=60, env=MINIMAL_ENV, stdin=subprocess.DEVNULL)

    try:
        assert holder.stdout is not None and holder.stdout.readline() == "ready\n"
        res = inside("mount", "-t", "fuse.tierfs", backing, mnt, "-o", f"nosuid,nodev,cache={cache},capacity=1M,rf=3")
        assert res.returncode == 0, res.stderr
        assert not is_mounted(mnt)  # (in the namespace only)
        assert json.loads(inside("cat", mnt / ".tierfs" / "status").stdout)["rf"] == 3
        rel = sorted(files)[0]
        assert inside("cat", mnt / rel).stdout == (backing / rel).read_bytes()
        res = inside("umount", mnt)
        assert res.returncode == 0, res.stderr
        assert inside("mountpoint", "-q", mnt).returncode != 0
        _wait_gone(mnt)  # an external unmount ends the daemon

        # the same through an fstab line (mount -T reads another fstab), with the options systemd adds
        fstab = tmp_path / "fstab"
        fstab.write_text(f"{backing} {mnt} fuse.tierfs _netdev,nofail,x-systemd.requires-mounts-for={backing},"
                         f"cache={cache},capacity=1M,nm=2 0 0\n")
        res = inside("mount", "-T", fstab, mnt)
        assert res.returncode == 0, res.stderr
        assert json.loads(inside("cat", mnt / ".tierfs" / "status").stdout)["nm"] == 2
        res = inside("umount", mnt)
        assert res.returncode == 0, res.stderr
        _wait_gone(mnt)
    finally:
        for pid in holders(str(mnt)):  # a daemon left by a failure (its mount goes with the namespace)
            if pid > 0:
                os.kill(pid, signal.SIGKILL)
        holder.kill()
        holder.wait(timeout=30)
        if holder.stdout is not None:
            holder.stdout.close()
    assert sorted(os.listdir("/sbin")) == real_sbin
