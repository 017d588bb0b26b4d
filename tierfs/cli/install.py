"""``tierfs install``: put this tierfs where mount(8) and systemd find it, and take it away again.

mount(8) runs the helper of a ``fuse.tierfs`` fstab line as ``/sbin/mount.fuse.tierfs SOURCE TARGET -o OPTS``
with an *empty* environment (no PATH, no virtual environment), and it looks only in ``/sbin``, ``/sbin/fs.d``
and ``/sbin/fs``.  systemd needs absolute paths in ``ExecStart=``.  So the install writes small ``/bin/sh``
wrappers that name the Python interpreter and the package directory of *this* install (a virtual environment
and an editable checkout work as well as a system install) and run it isolated, importing nothing from the
caller's current directory or ``PYTHON*`` variables (:data:`_ISOLATED_MAIN`), and units that name those wrappers:

=================================================  ========================================================
``SBIN/mount.fuse.tierfs``                          the fstab helper (``SBIN`` = ``/sbin``: mount(8) looks
                                                    nowhere else)
``PREFIX/bin/tierfs``, ``PREFIX/bin/dslide``        the commands, for root's PATH and for the units
``UNITS/tierfs@.service``                           one mount per ``/etc/tierfs/NAME.conf``: ``Type=notify``,
                                                    restart on failure, SIGTERM to stop
``UNITS/tierfs-train@.service``                     an example training job that needs ``tierfs@NAME``
``UNITS/tierfs-metrics@.service``, ``.timer``       the mount's metrics for node-exporter's textfile
                                                    collector, every 15 s once the timer is enabled
``GENERATORS/tierfs-mounts``                        a systemd generator: ``RequiresMountsFor=`` the backing
                                                    and cache dirs named in each ``NAME.conf``
``CONF/example.conf``                               a commented ``NAME.conf`` to copy
``PREFIX/share/doc/tierfs/*.md``                    the docs the units' ``Documentation=`` names
=================================================  ========================================================

Why a generator: a unit cannot take ``RequiresMountsFor=`` from its ``EnvironmentFile=`` (dependencies are
fixed when units load, environment files are read at start).  A generator runs at boot and at every
``systemctl daemon-reload``, before units load, and may add drop-ins for them; so editing ``NAME.conf`` and
reloading is enough, and the backing dir's NFS or Lustre mount is always up before the tierfs mount starts
(and stopped only after it).  It is plain ``/bin/sh``: generators run very early, before ``/opt`` or ``/home``
may be mounted.

Every file written starts with :data:`MARKER`; ``--uninstall`` removes exactly the files that carry it (the
example config only while unchanged), so it never deletes what an admin wrote.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib.metadata
import os
import shlex
import shutil
import sys
from dataclasses import dataclass
from pathlib import Path

import tierfs
from sampler.atomic import atomic_write
from tierfs import __version__

__all__ = ["MARKER", "Layout", "install", "render", "uninstall"]

#: The first comment line of every file ``tierfs install`` writes (what ``--uninstall`` looks for).
MARKER = "Written by `tierfs install`"

#: The directory that holds this tierfs's packages, which the wrappers put first on the import path: the
#: site-packages of the environment a wheel went into (a venv under /opt, a system install), or the source
#: checkout of an editable install or a source tree.
_PACKAGE_PARENT = Path(tierfs.__file__).resolve().parent.parent
_DOCS = ("quickstart.md", "pytorch.md", "loaders.md", "operations.md", "sharing.md", "troubleshooting.md", "usage.md",
         "control.md", "status.md", "tierfs.md", "architecture.md", "tuning.md", "sampler.md")


@dataclass(frozen=True)
class Layout:
    """Where each part goes.  The defaults are what mount(8) and systemd search."""

    prefix: str = "/usr/local"
    sbin_dir: str = "/sbin"
    unit_dir: str = "/etc/systemd/system"
    generator_dir: str = "/etc/systemd/system-generators"
    conf_dir: str = "/etc/tierfs"

    @property
    def bin_dir(self) -> str:
        return os.path.join(self.prefix, "bin")

    @property
    def doc_dir(self) -> str:
        return os.path.join(self.prefix, "share", "doc", "tierfs")

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            if not os.path.isabs(getattr(self, f.name)):
                raise ValueError(f"{f.name.replace('_', '-')} must be an absolute path, got {getattr(self, f.name)!r}")


def _tool(name: str) -> str:
    """Absolute path of a system tool for a unit, preferring ``/bin`` (the same on every Debian, merged or not)."""
    if os.access(f"/bin/{name}", os.X_OK):
        return f"/bin/{name}"
    return shutil.which(name) or f"/bin/{name}"


#: What a wrapper runs: ``python -I`` (isolated: no current directory and no ``PYTHON*`` variable on the import
#: path, no user site-packages) with this install's package directory put first by hand, then the command's
#: ``__main__`` as ``-m`` would run it.  ``-m`` alone would put the caller's current directory first on
#: ``sys.path``: a ``tierfs/`` or ``trio.py`` planted where root types ``tierfs status`` (or where mount(8) runs
#: the helper) would run as root.  The package dir and the module come as arguments, so no path is ever quoted
#: inside Python source.
_ISOLATED_MAIN = ("import runpy, sys; sys.path.insert(0, sys.argv.pop(1)); "
                  "runpy.run_module(sys.argv.pop(1), run_name=\"__main__\", alter_sys=True)")


@functools.cache
def _docs_dir() -> Path | None:
    """Where this tierfs's docs are: a checkout's ``docs/`` when it runs from one, else the ``share/doc/tierfs``
    its wheel installed (pyproject.toml, ``data-files``) wherever the installer's scheme put it; None if neither
    (the install then writes no docs and no ``Documentation=``)."""
    if (_PACKAGE_PARENT / "pyproject.toml").is_file() and (_PACKAGE_PARENT / "docs").is_dir():
        return _PACKAGE_PARENT / "docs"
    try:
        dist = importlib.metadata.distribution("tierfs")
    except importlib.metadata.PackageNotFoundError:
        return None
    for f in dist.files or ():
        if f.parts[-4:-1] == ("share", "doc", "tierfs"):  # e.g. ../../../share/doc/tierfs/usage.md in a venv
            return Path(str(dist.locate_file(f))).resolve().parent  # (a Path: the stub promises less)
    return None


def _wrapper(module: str, purpose: str) -> str:
    # sys.executable as it was called, never resolved: a venv's bin/python is a link to the system's python, and
    # only the link's path makes it the venv's interpreter
    python = sys.executable
    package_parent = str(_PACKAGE_PARENT)
    return f"""#!/bin/sh
# {MARKER} (tierfs {__version__}); `tierfs install --uninstall` removes it.
# {purpose}
# It runs the tierfs installed at {package_parent} with {python}, whatever the caller's environment and
# current directory: python -I imports nothing from either (docs/operations.md, Install).
export PATH="${{PATH:-/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin}}"
exec {shlex.quote(python)} -I -c {shlex.quote(_ISOLATED_MAIN)} {shlex.quote(package_parent)} {module} "$@"
"""


def _doc_source(page: str) -> Path | None:
    docs = _docs_dir()
    return docs / page if docs is not None and (docs / page).is_file() else None


def _documentation(layout: Layout, page: str) -> str:
    return f"Documentation=file:{layout.doc_dir}/{page}\n" if _doc_source(page) else ""


def _service(layout: Layout) -> str:
    conf = os.path.join(layout.conf_dir, "%i.conf")
    tierfs = os.path.join(layout.bin_dir, "tierfs")
    return f"""# {MARKER} (tierfs {__version__}); `tierfs install --uninstall` removes it.
# One tierfs mount per {conf}: `systemctl start tierfs@NAME` (see example.conf there).
# Type=notify: active only once the mount answers, so a unit ordered After=tierfs@NAME.service sees the dataset,
# never an empty mountpoint.  RequiresMountsFor= the backing and cache dirs of NAME.conf comes from the
# tierfs-mounts generator (systemctl daemon-reload after editing NAME.conf).
[Unit]
Description=tierfs mini-epoch cache for %i
{_documentation(layout, "operations.md")}After=network-online.target remote-fs.target
Wants=network-online.target
ConditionPathExists={conf}

[Service]
Type=notify
NotifyAccess=main
EnvironmentFile={conf}
ExecStartPre={_tool("mkdir")} -p ${{MOUNTPOINT}}
ExecStart={tierfs} mount ${{BACKING}} ${{MOUNTPOINT}} -o ${{OPTIONS}}
# SIGTERM unmounts cleanly and writes the journal; the next start resumes the same mini-epoch and pass.
KillSignal=SIGTERM
# `systemctl reload`: SIGHUP reopens the daemon's log and never unmounts (the journal needs no reopening).
ExecReload={_tool("kill")} -HUP $MAINPID
TimeoutStopSec=60
# Runs after any end, a crash included: never leaves a dead mount ("Transport endpoint is not connected")
# in the way of the restart.
ExecStopPost=-{_tool("fusermount3")} -uz ${{MOUNTPOINT}}
Restart=on-failure
RestartSec=5
# A loader that keeps every core busy delays the mount's answers: give it a core the jobs do not get, in a
# drop-in (systemctl edit tierfs@NAME: CPUAffinity=0 and Nice=-5; operations.md, "A core for the daemon").

[Install]
WantedBy=multi-user.target
"""


def _train_service(layout: Layout) -> str:
    conf = os.path.join(layout.conf_dir, "%i.conf")
    dslide = os.path.join(layout.bin_dir, "dslide")
    return f"""# {MARKER} (tierfs {__version__}); `tierfs install --uninstall` removes it.
# An example training job on the tierfs mount of NAME: `systemctl start tierfs-train@NAME` starts
# tierfs@NAME first and stops with it.  Copy it under another name for your own trainer; this one runs
# dslide with TRAIN_ARGS from {conf} (e.g. TRAIN_ARGS=--test /data/test.txt --epochs 12).
[Unit]
Description=train from the tierfs mount of %i
{_documentation(layout, "operations.md")}Requires=tierfs@%i.service
After=tierfs@%i.service
PartOf=tierfs@%i.service

[Service]
Type=exec
EnvironmentFile={conf}
ExecStart={dslide} train --train ${{MOUNTPOINT}} --control ${{MOUNTPOINT}}/.tierfs/control $TRAIN_ARGS

[Install]
WantedBy=multi-user.target
"""


#: Where node-exporter's textfile collector reads by default (its Debian package's dir); ``TEXTFILE_DIR=`` in
#: NAME.conf names another.
TEXTFILE_DIR = "/var/lib/node_exporter/textfile_collector"


def _metrics_service(layout: Layout) -> str:
    conf = os.path.join(layout.conf_dir, "%i.conf")
    tierfs = os.path.join(layout.bin_dir, "tierfs")
    return f"""# {MARKER} (tierfs {__version__}); `tierfs install --uninstall` removes it.
# The metrics of the tierfs mount of NAME, written into node-exporter's textfile-collector dir
# (TEXTFILE_DIR in {conf}, default {TEXTFILE_DIR}): run every 15 s by
# tierfs-metrics@NAME.timer (`systemctl enable --now tierfs-metrics@NAME.timer`).  A mount that stops answering
# turns its file into tierfs_up 0; a mountpoint that never answered gets no file (operations.md, Monitoring).
[Unit]
Description=tierfs metrics of %i for node-exporter
{_documentation(layout, "operations.md")}After=tierfs@%i.service
ConditionPathExists={conf}

[Service]
Type=oneshot
Environment=TEXTFILE_DIR={TEXTFILE_DIR}
EnvironmentFile={conf}
ExecStart={tierfs} metrics ${{MOUNTPOINT}} --textfile ${{TEXTFILE_DIR}}
"""


def _metrics_timer(layout: Layout) -> str:
    return f"""# {MARKER} (tierfs {__version__}); `tierfs install --uninstall` removes it.
# Runs tierfs-metrics@NAME.service every 15 s: `systemctl enable --now tierfs-metrics@NAME.timer`.
[Unit]
Description=tierfs metrics of %i every 15 s
{_documentation(layout, "operations.md")}
[Timer]
OnBootSec=15s
OnUnitActiveSec=15s
AccuracySec=1s

[Install]
WantedBy=timers.target
"""


def _generator(layout: Layout) -> str:
    return f"""#!/bin/sh
# {MARKER} (tierfs {__version__}); `tierfs install --uninstall` removes it.
# A systemd generator (run at boot and on every daemon-reload): for each {layout.conf_dir}/NAME.conf, a drop-in
# tierfs@NAME.service.d/50-tierfs-mounts.conf with RequiresMountsFor= its BACKING dir and its cache= dir, so
# the slow tier's mount (NFS, Lustre) and the fast tier's are up before the tierfs mount and stopped after it.
# Paths with blanks are not supported here (RequiresMountsFor= splits on them).
out="${{1:-/run/systemd/generator}}"
unquote() {{ sed -e 's/^"\\(.*\\)"$/\\1/' -e "s/^'\\(.*\\)'$/\\1/"; }}
value() {{  # the value of the last KEY=... line of an environment file ($1 = KEY), without quotes
    sed -n "s/^[[:space:]]*$1[[:space:]]*=[[:space:]]*//p" "$2" | tail -n 1 | unquote
}}
for conf in {shlex.quote(layout.conf_dir)}/*.conf; do
    [ -f "$conf" ] || continue
    name=$(basename "$conf" .conf)
    [ "$name" = example ] && continue
    backing=$(value BACKING "$conf")
    cache=$(value OPTIONS "$conf" | tr ',' '\\n' | sed -n 's/^[[:space:]]*cache=//p' | tail -n 1)
    paths=""
    for p in "$backing" "$cache"; do
        case "$p" in /*) paths="$paths $(printf '%s' "$p" | sed 's/%/%%/g')" ;; esac
    done
    [ -n "$paths" ] || continue
    dir="$out/tierfs@$name.service.d"
    mkdir -p "$dir"
    printf '# Made by %s from %s\\n[Unit]\\nRequiresMountsFor=%s\\n' "$0" "$conf" "${{paths# }}" \\
        > "$dir/50-tierfs-mounts.conf"
done
exit 0
"""


def _example_conf(layout: Layout) -> str:
    return f"""# {MARKER} (tierfs {__version__}); removed by `tierfs install --uninstall` while unchanged.
# Copy to {layout.conf_dir}/NAME.conf for `systemctl start tierfs@NAME`; then `systemctl daemon-reload`, so the
# tierfs-mounts generator orders the unit after the mounts of BACKING and cache=.  OPTIONS takes the keys of
# `tierfs mount -o` (see usage.md).  No blanks around '=' and no blanks in the paths.
BACKING=/nfs/datasets/imagenet
MOUNTPOINT=/mnt/imagenet
OPTIONS=cache=/nvme/tierfs/imagenet,capacity=150G,nm=16,rf=auto,composition=stratified
# For tierfs-train@NAME (the example training unit): the trainer's own arguments.
TRAIN_ARGS=--test /nfs/datasets/imagenet-test.txt --epochs 12
# For tierfs-metrics@NAME.timer: node-exporter's textfile-collector dir, if not {TEXTFILE_DIR}.
#TEXTFILE_DIR=/var/lib/prometheus/node-exporter
"""


def render(layout: Layout) -> dict[str, tuple[bytes, int]]:
    """Every file the install writes: ``{path: (content, mode)}``."""
    files: dict[str, tuple[str | bytes, int]] = {
        os.path.join(layout.sbin_dir, "mount.fuse.tierfs"):
            (_wrapper("tierfs", "mount(8) runs it for fstab lines of type fuse.tierfs (with no environment)."),
             0o755),
        os.path.join(layout.bin_dir, "tierfs"): (_wrapper("tierfs", "The tierfs command."), 0o755),
        os.path.join(layout.bin_dir, "dslide"): (_wrapper("dslide", "The dslide command."), 0o755),
        os.path.join(layout.unit_dir, "tierfs@.service"): (_service(layout), 0o644),
        os.path.join(layout.unit_dir, "tierfs-train@.service"): (_train_service(layout), 0o644),
        os.path.join(layout.unit_dir, "tierfs-metrics@.service"): (_metrics_service(layout), 0o644),
        os.path.join(layout.unit_dir, "tierfs-metrics@.timer"): (_metrics_timer(layout), 0o644),
        os.path.join(layout.generator_dir, "tierfs-mounts"): (_generator(layout), 0o755),
        os.path.join(layout.conf_dir, "example.conf"): (_example_conf(layout), 0o644),
    }
    for page in _DOCS:
        if source := _doc_source(page):
            files[os.path.join(layout.doc_dir, page)] = (source.read_bytes(), 0o644)
    return {path: (c.encode() if isinstance(c, str) else c, mode) for path, (c, mode) in files.items()}


def _ours(path: str, content: bytes | None = None) -> bool:
    """Whether ``path`` is a file an install wrote (and, for docs and the example config, left unchanged)."""
    try:
        with open(path, "rb") as f:
            data = f.read()
    except (FileNotFoundError, IsADirectoryError):
        return False
    if content is not None:
        return data == content
    return MARKER.encode() in data.split(b"\n", 2)[1 if data.startswith(b"#!") else 0]


def _is_doc(layout: Layout, path: str) -> bool:
    return path.startswith(layout.doc_dir + os.sep)


def install(layout: Layout) -> list[str]:
    """Write every file of :func:`render`; returns what was written.  ``OSError`` names the path that failed.

    A file that exists and is not ours (no marker) is never overwritten: ``FileExistsError``.  The example
    config is written only when missing (an admin may have edited it).
    """
    files = render(layout)
    for path in files:
        if _is_doc(layout, path) or path.endswith("example.conf"):
            continue  # the doc dir is ours; the example config is never overwritten
        if os.path.lexists(path) and not _ours(path):
            raise FileExistsError(f"{path} exists and was not written by tierfs install; move it away first")
    written = []
    for path, (content, mode) in files.items():
        if path.endswith("example.conf") and os.path.exists(path):
            continue
        os.makedirs(os.path.dirname(path), mode=0o755, exist_ok=True)
        atomic_write(path, content, mode)
        os.chmod(path, mode)  # not the umask's idea: others must run the commands and read the units
        written.append(path)
    return written


def uninstall(layout: Layout) -> list[str]:
    """Remove what :func:`install` wrote (and the doc dir if that leaves it empty); returns what was removed."""
    removed = []
    for path, (content, _) in render(layout).items():
        if _is_doc(layout, path):
            ours = os.path.isfile(path)
        else:
            ours = _ours(path, content if path.endswith("example.conf") else None)  # an edited example stays
        if ours:
            os.unlink(path)
            removed.append(path)
    for d in (layout.doc_dir, os.path.dirname(layout.doc_dir)):
        try:
            os.rmdir(d)
        except OSError:
            break
    return removed
