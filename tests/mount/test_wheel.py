"""A wheel of this tree, installed into a fresh venv outside the checkout, is a whole tierfs: ``tierfs`` and
``dslide`` answer with the git-derived version, a mount serves the bytes, ``tierfs install`` writes wrappers and
units that run the wheel's tierfs (not the checkout's) and the docs the units name.

The wheel is built from a clone of the checkout (``git clone --shared``: the checkout's git state is only read)
with the working tree's changes copied over it, so the checkout gets no ``build/`` or ``*.egg-info``.  The venv
gets the project's dependencies from the test venv's site-packages by a ``.pth`` line: that directory as a
plain path (its own ``.pth`` files, the editable install's finder among them, are not run), never the checkout.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import sysconfig
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

from tierfs.cli.install import Layout
from tierfs.testing.harness import abort_connection, force_unmount, is_mounted, within

# (a wheel build: ~5-10 s, once for the module -- on one pytest-xdist worker, not once on each)
pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("wheel")]

ROOT = Path(__file__).resolve().parents[2]
MINIMAL_ENV = {"PATH": "/usr/sbin:/usr/bin:/sbin:/bin"}


@dataclass(frozen=True)
class WheelVenv:
    venv: Path
    site: Path  # its site-packages, where the wheel went
    version: str  # the version the wheel was built with (its file name's)
    away: Path  # a working directory outside the checkout
    src: Path  # the tree the wheel was built from (a git clone)

    def run(self, *args: object, timeout: float = 120) -> subprocess.CompletedProcess[str]:
        """``venv/bin/ARGS[0] ARGS[1:]`` from outside the checkout, with no PYTHON* variable that could reach it."""
        env = {k: v for k, v in os.environ.items() if not k.startswith("PYTHON")}
        return subprocess.run([str(self.venv / "bin" / str(args[0])), *map(str, args[1:])], cwd=self.away,
                              env=env, capture_output=True, text=True, timeout=timeout, stdin=subprocess.DEVNULL)


def _git(*args: str, cwd: Path = ROOT) -> str:
    return subprocess.run(["git", *args], cwd=cwd, check=True, capture_output=True, text=True, timeout=60).stdout


def _tree_copy(dest: Path) -> None:
    """A clone of the checkout with its uncommitted changes (modified, new, deleted files) over it."""
    _git("clone", "--quiet", "--shared", str(ROOT), str(dest), cwd=dest.parent)
    for rel in _git("ls-files", "-z", "--modified", "--others", "--exclude-standard").split("\0"):
        if rel and (ROOT / rel).is_file():
            (dest / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / rel, dest / rel)
    for rel in _git("ls-files", "-z", "--deleted").split("\0"):
        if rel:
            (dest / rel).unlink(missing_ok=True)


@pytest.fixture(scope="module")
def wheel_venv(tmp_path_factory: pytest.TempPathFactory) -> WheelVenv:
    if shutil.which("git") is None or not (ROOT / ".git").exists():
        pytest.skip("builds the wheel from the checkout's git (setuptools-scm takes the version from it)")
    work = tmp_path_factory.mktemp("wheel")
    src = work / "src"
    _tree_copy(src)
    # (no build isolation: setuptools and setuptools-scm come from the test extra, so no index is needed)
    build = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
                            "-w", str(work / "dist"), str(src)],
                           capture_output=True, text=True, timeout=600, stdin=subprocess.DEVNULL)
    assert build.returncode == 0, build.stderr[-3000:]
    (wheel,) = (work / "dist").glob("tierfs-*.whl")
    venv, site = _fresh_venv(work / "venv")
    _pip_install(venv, str(wheel))
    away = work / "elsewhere"
    away.mkdir()
    return WheelVenv(venv, site, wheel.name.split("-")[1], away, src)


def _fresh_venv(venv: Path) -> tuple[Path, Path]:
    """A venv with no pip and no tierfs; the dependencies (and pip) from the test venv's site-packages."""
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=120)
    where = "import sysconfig; print(sysconfig.get_path('purelib'))"
    site = Path(subprocess.run([venv / "bin" / "python", "-c", where], check=True, capture_output=True, text=True,
                               timeout=60).stdout.strip())
    (site / "project-deps.pth").write_text(sysconfig.get_path("purelib") + "\n")
    return venv, site


def _pip_install(venv: Path, *args: str) -> None:
    res = subprocess.run([venv / "bin" / "python", "-m", "pip", "install", "-q", "--no-deps", "--no-index",
                          "--no-build-isolation", *args],
                         capture_output=True, text=True, timeout=300, stdin=subprocess.DEVNULL)
    assert res.returncode == 0, res.stderr[-3000:]


def assert_from_git(version: str) -> None:
    """The version is git's: the commit's hash (or its tag), never the old fixed 0.1.0."""
    assert version != "0.1.0"
    if not _git("tag", "--points-at", "HEAD").split():
        found = re.search(r"\+g([0-9a-f]{7,})", version)
        assert found and _git("rev-parse", "HEAD").startswith(found.group(1)), version


def test_the_wheel_is_a_whole_tierfs_with_the_git_version(wheel_venv):
    # imported from the venv, every sub-package included (tierfs.client), from a directory outside the checkout
    res = wheel_venv.run("python", "-c", "import tierfs, tierfs.client, tierfs.cli.commands, dslide.cli, sampler; "
                         "print(tierfs.__file__)")
    assert res.returncode == 0, res.stderr
    assert Path(res.stdout.strip()).is_relative_to(wheel_venv.site), res.stdout
    version = wheel_venv.version
    assert_from_git(version)
    for command in ("tierfs", "dslide"):
        res = wheel_venv.run(command, "--version")
        assert (res.returncode, res.stdout.strip()) == (0, f"{command} {version}"), res.stderr
    res = wheel_venv.run("dslide", "--help")
    assert res.returncode == 0 and "usage" in res.stdout.lower(), res.stderr


def test_the_wheels_tierfs_mounts_serves_and_unmounts(wheel_venv, dataset, mount_dirs):
    backing, files = dataset
    mnt, cache = mount_dirs
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTHON")}
    log = wheel_venv.away / "mount.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen([str(wheel_venv.venv / "bin" / "tierfs"), "mount", str(backing), str(mnt),
                                 "--cache", str(cache), "--capacity", "1M"], cwd=wheel_venv.away, env=env,
                                stdin=subprocess.DEVNULL, stdout=out, stderr=out)
    try:
        deadline = time.monotonic() + 60
        while not (is_mounted(mnt) and (mnt / ".tierfs" / "status").exists()):
            assert proc.poll() is None, f"tierfs exited with {proc.returncode}: {log.read_text()[-3000:]}"
            assert time.monotonic() < deadline, f"no mount within 60 s: {log.read_text()[-3000:]}"
            time.sleep(0.05)
        status = json.loads(within(str(mnt), (mnt / ".tierfs" / "status").read_text))
        assert status["version"] == wheel_venv.version
        view = within(str(mnt), lambda: [rel for rel in files if (mnt / rel).exists()])
        assert view
        for rel in view[:4]:
            assert within(str(mnt), (mnt / rel).read_bytes) == (backing / rel).read_bytes(), rel
        res = wheel_venv.run("tierfs", "metrics", mnt)
        assert res.returncode == 0, res.stderr
        assert re.search(rf'^tierfs_info\{{.*version="{re.escape(wheel_venv.version)}".*\}} 1(\.0)?$', res.stdout, re.M)
        res = wheel_venv.run("tierfs", "umount", mnt)
        assert res.returncode == 0, res.stderr
        assert proc.wait(timeout=60) == 0, log.read_text()[-3000:]
        assert not is_mounted(mnt)
    finally:
        if proc.poll() is None:
            abort_connection(mnt)
            proc.send_signal(signal.SIGKILL)
            proc.wait(timeout=30)
        force_unmount(mnt)


def test_install_from_the_wheel_points_at_the_wheels_environment(wheel_venv, tmp_path):
    inst = tmp_path / "inst"
    layout = Layout(prefix=str(inst / "usr"), sbin_dir=str(inst / "sbin"), unit_dir=str(inst / "units"),
                    generator_dir=str(inst / "generators"), conf_dir=str(inst / "etc-tierfs"))
    res = wheel_venv.run("tierfs", "install", "--prefix", layout.prefix, "--sbin-dir", layout.sbin_dir,
                         "--unit-dir", layout.unit_dir, "--generator-dir", layout.generator_dir,
                         "--conf-dir", layout.conf_dir)
    assert res.returncode == 0, res.stderr
    python = str(wheel_venv.venv / "bin" / "python")
    for wrapper, name in [(f"{layout.bin_dir}/tierfs", "tierfs"), (f"{layout.bin_dir}/dslide", "dslide"),
                          (f"{layout.sbin_dir}/mount.fuse.tierfs", "tierfs")]:
        text = Path(wrapper).read_text()
        exec_line = text.splitlines()[-1]
        # the venv's interpreter (isolated) and the wheel's package dir: nothing of the checkout
        assert exec_line.startswith(f"exec {python} -I -c "), exec_line
        assert f" {wheel_venv.site} {name} " in exec_line, exec_line
        assert str(ROOT) not in text, text
        assert f"(tierfs {wheel_venv.version})" in text
        out = subprocess.run([wrapper, "--version"], cwd=wheel_venv.away, env=MINIMAL_ENV, capture_output=True,
                             text=True, timeout=120, stdin=subprocess.DEVNULL)
        assert (out.returncode, out.stdout.strip()) == (0, f"{name} {wheel_venv.version}"), out.stderr
    # the docs the units name come with the wheel (share/doc/tierfs of the venv), not from a checkout
    service = Path(layout.unit_dir, "tierfs@.service").read_text()
    assert f"Documentation=file:{layout.doc_dir}/operations.md" in service
    installed = Path(layout.doc_dir, "operations.md").read_bytes()
    assert installed == (wheel_venv.venv / "share" / "doc" / "tierfs" / "operations.md").read_bytes()
    res = wheel_venv.run("tierfs", "install", "--uninstall", "--prefix", layout.prefix, "--sbin-dir",
                         layout.sbin_dir, "--unit-dir", layout.unit_dir, "--generator-dir", layout.generator_dir,
                         "--conf-dir", layout.conf_dir)
    assert res.returncode == 0, res.stderr
    assert not [p for p in inst.rglob("*") if p.is_file()]


def test_an_editable_install_reports_the_git_version_too(wheel_venv, tmp_path):
    """What scripts/setup.sh (and so CI) does: ``pip install -e`` of a git tree; the version is git's there too."""
    venv, _ = _fresh_venv(tmp_path / "venv")
    _pip_install(venv, "-e", str(wheel_venv.src))
    for command in ("tierfs", "dslide"):
        res = subprocess.run([venv / "bin" / command, "--version"], cwd=wheel_venv.away, env=MINIMAL_ENV,
                             capture_output=True, text=True, timeout=120, stdin=subprocess.DEVNULL)
        assert (res.returncode, res.stdout.strip()) == (0, f"{command} {wheel_venv.version}"), res.stderr
    assert_from_git(wheel_venv.version)
