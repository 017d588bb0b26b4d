"""``tierfs`` on the command line: ``mount``, the fstab form, ``status``, ``set``, ``metrics``, ``umount``,
``install``.

Exit codes: 0 ok, 2 usage error (a bad flag or value), 1 runtime error; every failure prints one line,
``tierfs: error: <reason>``, on stderr.  The fstab form (``tierfs SRC MNT -o cache=...,capacity=...``, what
``mount -t fuse.tierfs`` runs) daemonizes by default, like other FUSE helpers, so ``mount -a`` returns; give
``-f`` (or ``-o foreground``) to stay in the foreground.
"""

from __future__ import annotations

import argparse
import contextlib
import errno
import json
import logging
import os
import re
import shutil
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, NoReturn, overload

from tierfs import __version__
from tierfs.cli.status_text import format_status
from tierfs.client import Client, NotAMount
from tierfs.common.mountinfo import mount_at
from tierfs.common.mountpoint_lock import holders
from tierfs.common.options import GENERIC_MOUNT_OPTIONS, OPTION_SECTIONS, OPTIONS, MountConfig, parse_assignments
from tierfs.common.protocol import Assignments
from tierfs.daemon.fuse.scan_bar import ScanProgress

if TYPE_CHECKING:
    from tierfs.daemon.tree.tree import ScanCount

__all__ = ["main"]

EXIT_OK, EXIT_RUNTIME, EXIT_USAGE = 0, 1, 2


class UsageError(Exception):
    """Bad command line or option value: exit status 2."""


class RuntimeFailure(Exception):
    """Something went wrong doing what was asked: exit status 1."""


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:  # one line, not argparse's usage block
        raise UsageError(message)


def _option_help(name: str, default: str) -> str:
    """An option's help with its default, from the one table (``tierfs.common.options.OPTIONS``; its choices are the
    flag's metavar)."""
    opt = OPTIONS[name]
    shown = "off" if opt.flag and default == "false" else default or "none"
    return f"{opt.help} (default {shown})"


def _mount_parser(prog: str) -> _Parser:
    from tierfs.common.options import Settings

    p = _Parser(prog=prog, description="Mount BACKING at MOUNTPOINT, showing the current mini-epoch.  Every option "
                "is also -o key=value; those marked live can be changed later with 'tierfs set'.")
    p.add_argument("backing", metavar="BACKING", help="the data set on the slow tier (only ever read)")
    p.add_argument("mountpoint", metavar="MOUNTPOINT", help="an empty directory")
    p.add_argument("--cache", metavar="DIR", help="fast-tier cache dir, created 0700 if missing (required)")
    p.add_argument("--capacity", metavar="SIZE", help="cap on the cache's bytes, e.g. 150G; it must hold two "
                   "mini-epochs (required; see docs/tuning.md)")
    p.add_argument("-o", dest="o", action="append", default=[], metavar="KEY=VALUE,...",
                   help="options in fstab form (default none); generic mount options (defaults, rw, nosuid, "
                   "x-systemd.*, ...) are ignored; remount applies the live ones to the running mount")
    p.add_argument("--daemon", action="store_true", help="return once the mount is ready (0) or failed (1) "
                   "(default for the fstab form; mount stays in the foreground)")
    p.add_argument("--nonempty", action="store_true",
                   help="mount over a non-empty mountpoint, hiding what is there (default: refused)")
    p.add_argument("-f", "--foreground", action="store_true", help="stay in the foreground (the default for mount)")
    # what mount(8) may pass a mount helper besides -o: the type, and -n (no mtab), -s (sloppy), -v (verbose)
    p.add_argument("-t", dest="fstype", metavar="TYPE", help=argparse.SUPPRESS)
    for flag in ("-n", "-s", "-v"):
        p.add_argument(flag, action="store_true", help=argparse.SUPPRESS)
    defaults = dict(parse_assignments(Settings().as_lines()))
    for heading, names in OPTION_SECTIONS.items():  # (31 options under headings, not one list)
        group = p.add_argument_group(heading)
        for opt in (OPTIONS[name] for name in names):
            flag = "--" + opt.name.replace("_", "-")
            text = _option_help(opt.name, defaults[opt.name]) + (" [live]" if opt.live else "")
            if opt.flag:
                group.add_argument(flag, dest=f"opt_{opt.name}", action="store_const", const="true", help=text)
            else:
                group.add_argument(flag, dest=f"opt_{opt.name}", metavar="|".join(opt.choices) or "VALUE", help=text)
    return p


#: Mount flags that take a value: ``--cache``, ``--capacity`` and every option that is not a switch.
_VALUE_FLAGS = frozenset({"--cache", "--capacity", *("--" + o.name.replace("_", "-") for o in OPTIONS.values()
                                                    if not o.flag)})


def _attach_negative_values(argv: Sequence[str]) -> list[str]:
    """``--capacity -5G`` as ``--capacity=-5G``, so a negative number reaches our parser and its message.

    argparse takes a value that starts with ``-`` for an option and answers "expected one argument".
    """
    out: list[str] = []
    i = 0
    while i < len(argv):
        if argv[i] in _VALUE_FLAGS and i + 1 < len(argv) and re.match(r"-[0-9.]", argv[i + 1]):
            out.append(f"{argv[i]}={argv[i + 1]}")
            i += 2
        else:
            out.append(argv[i])
            i += 1
    return out


def _collect_mount_options(ns: argparse.Namespace) -> tuple[dict[str, str], set[str]]:
    """Merge ``-o`` items and ``--key value`` flags (flags win); returns (options, switches), the switches
    being those of ``foreground``, ``nonempty`` and ``remount`` that were given."""
    raw: dict[str, str] = {}
    switches = {"nonempty"} if ns.nonempty else set()
    for item in ns.o:
        for key, value in parse_assignments(item):
            if key in GENERIC_MOUNT_OPTIONS or key.startswith("x_"):  # (x-*: userspace options, e.g. x-systemd.*)
                continue
            if key in ("foreground", "nonempty", "remount"):
                switches.add(key)
                continue
            raw[key] = value
    for key in ("cache", "capacity"):
        if getattr(ns, key):
            raw[key] = getattr(ns, key)
    for name in OPTIONS:
        value = getattr(ns, f"opt_{name}")
        if value is not None:
            raw[name] = value
    return raw, switches


def remount(mountpoint: str, raw: dict[str, str]) -> list[str]:
    """``mount -o remount,...``: a FUSE mount cannot be remounted in the kernel, so the live options given are
    applied through the control file; a fixed one given with a value other than the mount's is refused (mount(8)
    repeats the fstab line's options, so the unchanged ones come along).  Returns what changed, as
    ``tierfs set`` prints it."""
    from tierfs.common.options import parse_size, parse_value

    client = _client(mountpoint)
    if client.mountpoint != Path(os.path.abspath(mountpoint)):
        raise RuntimeFailure(f"remount: {mountpoint} is inside the tierfs mount {client.mountpoint}, not it")
    current = client.settings()
    live: dict[str, str] = {}
    for key, text in raw.items():
        try:
            if key == "cache":
                continue  # (the status does not name the cache dir; a mount keeps its own)
            if key == "capacity":
                now = int(client.status()["cache_capacity"])
                if parse_size(text) != now:
                    raise UsageError(f"remount: capacity is fixed at mount time (the mount has {now} bytes); "
                                     "unmount and mount to change it")
            elif OPTIONS.get(key) is None:
                parse_value(key, text)  # unknown key: its message
            elif OPTIONS[key].live:
                live[key] = text
            elif parse_value(key, text) != parse_value(key, current[key]):
                raise UsageError(f"remount: {key} is fixed at mount time (the mount has {key}={current[key]}); "
                                 "unmount and mount to change it")
        except ValueError as exc:
            raise UsageError(str(exc)) from None
    after = current
    if live:
        try:
            after = client.set(Assignments.parse(live.items()), current)
        except ValueError as exc:
            raise UsageError(str(exc)) from None
    return _changes(current, after, live)


def _changes(before: dict[str, str], after: dict[str, str], keys: Iterable[str]) -> list[str]:
    """``rf: 2 -> 7`` for each key (``rf: 7 (unchanged)`` when it was already so): what ``set`` prints."""
    return [f"{k}: {before.get(k)} -> {after.get(k)}" if before.get(k) != after.get(k) else f"{k}: {after.get(k)} "
            "(unchanged)" for k in keys]


def cmd_mount(argv: Sequence[str], *, prog: str, daemon_default: bool) -> int:
    from tierfs.daemon.fuse.mount import MountError, check_paths

    ns = _mount_parser(prog).parse_args(_attach_negative_values(argv))
    raw, switches = _collect_mount_options(ns)
    if "remount" in switches:
        for line in remount(ns.mountpoint, raw):
            print(line)
        return EXIT_OK
    try:
        config = MountConfig.from_options(ns.backing, ns.mountpoint, raw)
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    made_cache = not os.path.isdir(config.cache)
    try:
        config = check_paths(config, nonempty="nonempty" in switches)
    except MountError as exc:
        raise RuntimeFailure(str(exc)) from None
    try:
        return _serve(config, ns, daemon_default and not (ns.foreground or "foreground" in switches))
    finally:
        if made_cache:
            # a mount refused before it began leaves no empty cache dir behind (rmdir fails on a used one)
            with contextlib.suppress(OSError):
                os.rmdir(config.cache)


def _serve(config: MountConfig, ns: argparse.Namespace, daemon_default: bool) -> int:
    from tierfs.daemon.fuse.mount import MountError, configure_logging, daemonize, default_log_path, run_mount

    daemon = ns.daemon or daemon_default
    if daemon and config.settings.peers != "off":
        raise UsageError(f"peers={config.settings.peers} runs under the job's launcher (mpiexec, srun), which waits "
                         "for its ranks: mount in the foreground (tierfs mount, or add --foreground)")
    report = log_path = None
    terminal = ScanProgress(sys.stderr)  # (a foreground mount's; a daemon's parent shows its own)
    scan_progress: Callable[[ScanCount], None] = terminal.update
    if daemon:
        log_path = default_log_path(config.mountpoint)
        report, scan_progress = daemonize(log_path)
    configure_logging(config.settings.log_level, log_path)
    try:
        run_mount(config, on_ready=(lambda: report(None)) if report else terminal.close, scan_progress=scan_progress)
    except MountError as exc:
        if report:
            report(str(exc))
        raise RuntimeFailure(str(exc)) from None
    except BaseException as exc:
        if report:
            report(f"{type(exc).__name__}: {exc}")
        if isinstance(exc, KeyboardInterrupt):
            _exit_past_abandoned_threads(EXIT_OK)
        logging.getLogger("tierfs").exception("the mount failed")
        raise RuntimeFailure(f"{type(exc).__name__}: {exc}") from None
    finally:
        terminal.close()
    _exit_past_abandoned_threads(EXIT_OK)
    return EXIT_OK


def _exit_past_abandoned_threads(code: int) -> None:
    """Unmounted, journal written: exit now if a worker thread is still running.  Threads abandoned on a
    stalled backing (a hard NFS read, a rescan's lstat pool) would keep the interpreter's exit waiting
    (it joins the pool's threads) or trip it (daemon threads holding stdio locks); the exit ends them all."""
    if threading.active_count() <= 1:
        return
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    os._exit(code)


#: What a FUSE mount whose daemon is gone answers (the kernel keeps the mount until it is unmounted).
_DEAD_MOUNT_ERRNOS = (errno.ENOTCONN, errno.ECONNABORTED)


@overload
def _client(mountpoint: str) -> Client: ...
@overload
def _client(mountpoint: str, *, dead_ok: bool) -> Client | None: ...
def _client(mountpoint: str, *, dead_ok: bool = False) -> Client | None:
    """The client of the mount at ``mountpoint``, or a failure that says what is there; ``dead_ok``: None for
    a mount whose daemon is gone."""
    try:
        return Client(mountpoint)
    except NotAMount as exc:
        raise RuntimeFailure(_not_a_mount(mountpoint) or str(exc)) from None
    except OSError as exc:
        if exc.errno in _DEAD_MOUNT_ERRNOS:
            if dead_ok:
                return None
            raise RuntimeFailure(_dead_mount(mountpoint, exc)) from None
        raise RuntimeFailure(f"{mountpoint}: {exc.strerror}") from None


def _dead_mount(path: str, exc: OSError) -> str:
    return (f"{path}: {exc.strerror}: the tierfs daemon of this mount is gone (killed?) and the kernel keeps the "
            f"dead mount; clear it with 'tierfs umount {path}' (or fusermount3 -uz {path}) and mount again: it "
            "resumes from its journal (docs/operations.md, A dead mount)")


def _not_a_mount(path: str) -> str | None:
    """Why ``path`` is not a tierfs mount, and what to do (None: no better reason than the client's)."""
    full = os.path.realpath(path)
    if not os.path.isdir(full):
        return f"{path} is not a tierfs mount: {'it is not a directory' if os.path.exists(full) else 'no such path'}"
    mounted = mount_at(full)
    if mounted is not None:
        fstype = mounted[1]
        what = "a tierfs mount that does not answer" if fstype == "fuse.tierfs" else f"a {fstype} mount"
        return f"{path} is not a tierfs mount: it is {what}"
    # (the daemon's lock on its mountpoint, never other processes' command lines: tierfs.common.mountpoint_lock)
    starting = holders(full)
    if starting:
        who = f"tierfs (pid {starting[0]})" if starting[0] > 0 else "a tierfs"
        return (f"{path} is not a tierfs mount yet: {who} is starting there (a first mount scans the backing dir; "
                "its progress is on its terminal or in its log); try again in a moment")
    return (f"{path} is not a tierfs mount (nothing is mounted there); mount one with 'tierfs mount BACKING {path} "
            "--cache DIR --capacity SIZE'")


def read_status(mountpoint: str) -> dict:
    """The mount's status object (``MOUNTPOINT/.tierfs/status``)."""
    return _client(mountpoint).status()


def _status_parser() -> _Parser:
    p = _Parser(prog="tierfs status", description="Show a mount's status.")
    p.add_argument("mountpoint", metavar="MOUNTPOINT", help="the mountpoint, or any path inside the mount")
    p.add_argument("--json", action="store_true", help="print the raw JSON object (default: a summary)")
    p.add_argument("--watch", type=float, metavar="SECONDS",
                   help="refresh every SECONDS until interrupted (default: print once)")
    return p


def cmd_status(argv: Sequence[str]) -> int:
    ns = _status_parser().parse_args(argv)
    try:
        while True:
            st = read_status(ns.mountpoint)
            text = json.dumps(st, indent=2) if ns.json else format_status(st)  # (tierfs.cli.status_text)
            if ns.watch:
                sys.stdout.write("\x1b[H\x1b[2J" if sys.stdout.isatty() else "")
            print(text, flush=True)
            if not ns.watch:
                return EXIT_OK
            time.sleep(ns.watch)
    except KeyboardInterrupt:
        return EXIT_OK
    except OSError as exc:
        if exc.errno in _DEAD_MOUNT_ERRNOS:
            raise RuntimeFailure(_dead_mount(ns.mountpoint, exc)) from None
        hint = (" (status names files: it is for the mount's owner and root; .tierfs/metrics has the figures for "
                "everyone)") if isinstance(exc, PermissionError) else ""
        raise RuntimeFailure(f"cannot read status of {ns.mountpoint}: {exc.strerror}{hint}") from None


def _metrics_parser() -> _Parser:
    p = _Parser(prog="tierfs metrics", description="Print a mount's Prometheus metrics with its mountpoint on every "
                "sample, or write them atomically into a node-exporter textfile-collector dir (one file per mount, "
                "tierfs-NAME.prom; see docs/operations.md).  tierfs_up is 1; when the mount does not answer the "
                "command exits 1 and, with --textfile, turns an existing file of that mount into tierfs_up 0 (it "
                "answered before: an alert) but writes none for a path that never answered (a typo).")
    p.add_argument("mountpoint", metavar="MOUNTPOINT", help="the mountpoint")
    p.add_argument("--textfile", metavar="DIR", help="write DIR/tierfs-NAME.prom instead of printing (default: print)")
    return p


def cmd_metrics(argv: Sequence[str]) -> int:
    from tierfs.cli.textfile import MountMetrics, textfile_path, write_textfile

    ns = _metrics_parser().parse_args(argv)
    mnt = os.path.realpath(ns.mountpoint)  # (what the mount's tierfs_info names)
    failure: RuntimeFailure | None = None
    text: str | None = None
    try:
        text = _client(mnt).metrics()
    except (RuntimeFailure, OSError) as exc:
        failure = exc if isinstance(exc, RuntimeFailure) else RuntimeFailure(f"{mnt}: {exc.strerror}")
    try:
        exposition = MountMetrics(mnt, text).exposition()
    except ValueError as exc:  # (the mount's text did not parse: a tierfs of another format?)
        raise RuntimeFailure(f"{mnt}/.tierfs/metrics is not Prometheus text: {exc}") from None
    if not ns.textfile:
        sys.stdout.write(exposition.decode())
    elif failure is None or os.path.exists(textfile_path(ns.textfile, mnt)):
        # a mount that answered before and does not now: its file says tierfs_up 0, so an alert fires instead of
        # its last good figures staying in the dir
        try:
            write_textfile(ns.textfile, mnt, exposition)
        except OSError as exc:
            raise RuntimeFailure(f"cannot write into {ns.textfile}: {exc.strerror}") from None
    else:
        # never answered (a typo, a mount not made yet): no file, which would say tierfs_up 0 for good
        raise RuntimeFailure(f"{failure}; nothing written into {ns.textfile}")
    if failure is not None:
        raise failure
    return EXIT_OK


def _plan_parser() -> _Parser:
    from tierfs.cli.sizing import LOADERS

    p = _Parser(prog="tierfs plan", description="Choose a mount's nm and rf from the data set before mounting: scans "
                "BACKING as the cache counts it (allocated blocks), picks the fewest mini-epochs the mount accepts at "
                "the capacity, reads the backing and writes the cache disk briefly to measure them "
                "(docs/tuning.md).")
    p.add_argument("backing", metavar="BACKING", help="the data set on the slow tier (only read)")
    p.add_argument("--capacity", metavar="SIZE", required=True, help="the cache's cap, e.g. 2T (required)")
    p.add_argument("--cache-disk", metavar="DIR", help="an existing dir on the cache's filesystem: its block size, "
                   "and a write test of a few seconds (default: 4K blocks, no write test)")
    p.add_argument("--world-size", metavar="N", default="1", help="nodes sharing the plan (default 1)")
    p.add_argument("--consumption", metavar="RATE", help="bytes/s one node's loader reads at full speed, e.g. 800M: "
                   "gives rf and the time of a pass (default: unknown; then mount with rf=auto)")
    p.add_argument("--epochs", metavar="E", default="1", help="epochs the job makes, for the totals (default 1)")
    p.add_argument("--measure", metavar="SECONDS", default="2",
                   help="seconds of each bandwidth test, timed in slices whose spread is shown; 0 = none (default 2)")
    p.add_argument("--loader", choices=list(LOADERS), default="sampler",
                   help="how the job reads (docs/pytorch.md), for the listing in the mount command: sampler, a dataset "
                   "built once with MountSampler (the README's; --listing all); relist, one re-created each pass; "
                   "shards, MountShards (--listing all) (default sampler)")
    p.add_argument("--mountpoint", metavar="DIR", help="where the command mounts (default /mnt/NAME, NAME the "
                   "backing dir's)")
    p.add_argument("--json", action="store_true", help="print the figures and the command as JSON (default: a "
                   "summary)")
    return p


def cmd_plan(argv: Sequence[str]) -> int:
    from tierfs.cli.sizing import mount_command, size_mount
    from tierfs.common.options import parse_size, parse_value

    ns = _plan_parser().parse_args(_attach_negative_values(argv))
    try:
        capacity = parse_size(ns.capacity)
        world = parse_value("world_size", ns.world_size)
        consumption = float(parse_size(ns.consumption)) if ns.consumption else None
        epochs = int(parse_value("rf", ns.epochs))  # (an integer >= 1, as rf is)
        seconds = float(ns.measure)
        if not 0 <= seconds <= 600:
            raise ValueError(f"--measure: expected seconds from 0 to 600, got {ns.measure!r}")
    except ValueError as exc:
        raise UsageError(str(exc).replace("rf: ", "epochs: ")) from None
    if not os.path.isdir(ns.backing):
        raise RuntimeFailure(f"backing dir {ns.backing} is not a directory")
    if ns.cache_disk and not os.path.isdir(ns.cache_disk):
        raise RuntimeFailure(f"--cache-disk {ns.cache_disk} is not a directory")
    terminal = ScanProgress(sys.stderr)
    try:
        sizing = size_mount(ns.backing, capacity, cache_disk=ns.cache_disk, world_size=world,
                            consumption=consumption, epochs=epochs, measure_seconds=seconds,
                            scan_progress=terminal.update)
    except ValueError as exc:
        raise RuntimeFailure(str(exc)) from None
    except OSError as exc:
        raise RuntimeFailure(f"{exc.filename or ns.backing}: {exc.strerror}") from None
    finally:
        terminal.close()
    backing = os.path.abspath(ns.backing)
    mountpoint = os.path.abspath(ns.mountpoint) if ns.mountpoint else _default_mountpoint(backing)
    command = mount_command(sizing, backing, mountpoint, ns.cache_disk, ns.loader)
    print(json.dumps({**sizing.as_dict(), "mount_command": command}) if ns.json else
          sizing.summary(command, ns.loader, make_mountpoint=not os.path.isdir(mountpoint)))
    return EXIT_OK


def _default_mountpoint(backing: str) -> str:
    """``/mnt/NAME`` for the backing dir ``.../NAME``, as the README mounts; ``/mnt/tierfs-NAME`` where that is
    the backing dir itself or holds it (an NFS export mounted at ``/mnt/NAME``)."""
    name = os.path.basename(backing) or "data"
    plain = os.path.join("/mnt", name)
    return os.path.join("/mnt", f"tierfs-{name}") if (backing + "/").startswith(plain + "/") else plain


def _set_parser() -> _Parser:
    live = ", ".join(o.name for o in OPTIONS.values() if o.live)
    p = _Parser(prog="tierfs set", description="Change live settings of a mount (written to .tierfs/control); "
                "prints what changed.  next-pass and advance are sent as commands.")
    p.add_argument("mountpoint", metavar="MOUNTPOINT", help="the mountpoint, or any path inside the mount")
    p.add_argument("assignments", nargs="+", metavar="KEY=VALUE",
                   help=f"the live options: {live} (their defaults: 'tierfs mount --help'); or next-pass, advance")
    return p


def cmd_set(argv: Sequence[str]) -> int:
    from tierfs.common.options import Settings

    ns = _set_parser().parse_args(argv)
    items = [kv for a in ns.assignments for kv in parse_assignments(a)]
    commands = [k.replace("_", "-") for k, v in items if not v and k in ("next_pass", "advance")]
    items = [(k, v) for k, v in items if v or k not in ("next_pass", "advance")]
    bad = [k for k, v in items if not v]
    if bad:
        raise UsageError(f"expected KEY=VALUE, got {bad[0]!r}")
    try:
        # parsed once, here; bad input is a usage error, mount or not
        assignments = Assignments.parse(items)
        assignments.applied_to(Settings())
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    client = _client(ns.mountpoint)
    before = client.settings()  # (the one read: what changed is known from it and the values parsed)
    try:
        after = client.set(assignments, before, commands)  # checked against the mount's settings first
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    except OSError as exc:
        raise RuntimeFailure(f"cannot write {client.dir}/control: {exc.strerror}") from None
    for line in _changes(before, after, dict(items)):
        print(line)
    for cmd in commands:
        print(f"{cmd}: sent")
    return EXIT_OK


def _install_parser() -> _Parser:
    from tierfs.cli.install import Layout

    defaults = Layout()
    p = _Parser(prog="tierfs install", description="Install the fstab helper (mount.fuse.tierfs), the commands, "
                "the systemd units and generator for this tierfs; --uninstall removes them.  Run as root.")
    p.add_argument("--prefix", default=defaults.prefix, help="commands in PREFIX/bin, docs in PREFIX/share/doc "
                   f"(default {defaults.prefix})")
    p.add_argument("--sbin-dir", default=defaults.sbin_dir,
                   help=f"for mount.fuse.tierfs (default {defaults.sbin_dir}: mount(8) looks nowhere else)")
    p.add_argument("--unit-dir", default=defaults.unit_dir, help=f"systemd units (default {defaults.unit_dir})")
    p.add_argument("--generator-dir", default=defaults.generator_dir,
                   help=f"systemd generators (default {defaults.generator_dir})")
    p.add_argument("--conf-dir", default=defaults.conf_dir, help=f"NAME.conf files (default {defaults.conf_dir})")
    p.add_argument("--uninstall", action="store_true", help="remove what an install with these dirs wrote")
    return p


def cmd_install(argv: Sequence[str]) -> int:
    from tierfs.cli.install import Layout, install, uninstall

    ns = _install_parser().parse_args(argv)
    try:
        layout = Layout(prefix=ns.prefix, sbin_dir=ns.sbin_dir, unit_dir=ns.unit_dir,
                        generator_dir=ns.generator_dir, conf_dir=ns.conf_dir)
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    try:
        paths = uninstall(layout) if ns.uninstall else install(layout)
    except OSError as exc:
        where = f" {exc.filename}" if exc.filename else ""
        hint = " (run as root, or give other dirs)" if isinstance(exc, PermissionError) else ""
        raise RuntimeFailure(f"{'uninstall' if ns.uninstall else 'install'}:{where} {exc.strerror or exc}{hint}") \
            from None
    verb = "removed" if ns.uninstall else "wrote"
    for path in paths:
        print(f"{verb} {path}")
    if not ns.uninstall:
        print(f"next: write {layout.conf_dir}/NAME.conf (see example.conf), systemctl daemon-reload, "
              f"systemctl start tierfs@NAME; or an fstab line of type fuse.tierfs (see operations.md)")
    elif not paths:
        print("nothing to remove")
    return EXIT_OK


def _umount_parser() -> _Parser:
    p = _Parser(prog="tierfs umount", description="Unmount a tierfs mount and wait until its daemon has written "
                "the cache's index and journal and exited, so that the cache dir may then be removed or mounted "
                "again.")
    p.add_argument("mountpoint", metavar="MOUNTPOINT", help="the mountpoint")
    p.add_argument("-z", "--lazy", action="store_true",
                   help="detach now even if files are open, and return at once: the daemon finishes when the last "
                   "of them closes (default: refused while they are open)")
    p.add_argument("--timeout", metavar="SECONDS", type=float, default=_UMOUNT_WAIT_S,
                   help="how long to wait for the daemon to finish; 0 = return once unmounted "
                   f"(default {_UMOUNT_WAIT_S:g})")
    return p


#: how long ``tierfs umount`` waits for the daemon: it awaits a copy in flight (at most 5 s) and writes an index
#: of every copy (seconds for millions)
_UMOUNT_WAIT_S = 120.0


def cmd_umount(argv: Sequence[str]) -> int:
    ns = _umount_parser().parse_args(argv)
    if not 0 <= ns.timeout <= 86400:
        raise UsageError(f"--timeout: expected seconds from 0 to 86400, got {ns.timeout:g}")
    mnt = os.path.realpath(ns.mountpoint)
    _client(mnt, dead_ok=True)  # (a dead mount is unmounted all the same)
    tool = shutil.which("fusermount3") or shutil.which("fusermount")
    if tool is None:
        raise RuntimeFailure("fusermount3 not found (install the fuse3 package)")
    # The daemon's lock is on the directory under the mount, which only a descriptor taken before the mount
    # reaches (one of the mount's root would keep it busy): the parent's, taken now, reaches it once unmounted.
    try:
        parent = os.open(os.path.dirname(mnt), os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
    except OSError as exc:
        raise RuntimeFailure(f"{os.path.dirname(mnt)}: {exc.strerror}") from None
    try:
        res = subprocess.run([tool, "-u", *(["-z"] if ns.lazy else []), mnt], capture_output=True, text=True)
        if res.returncode != 0:
            reason = res.stderr.strip().splitlines()[-1] if res.stderr.strip() else f"{tool} failed"
            if "busy" in reason.lower():
                reason += " (files are open; close them or use --lazy)"
            raise RuntimeFailure(reason)
        if not ns.lazy and ns.timeout > 0:
            _wait_for_daemon(parent, mnt, ns.timeout)
    finally:
        os.close(parent)
    return EXIT_OK


def _wait_for_daemon(parent: int, mnt: str, timeout: float) -> None:
    """Return once no process holds the daemon's lock on the directory ``mnt`` (``tierfs.common.mountpoint_lock``): the
    daemon has exited, its index and journal written; ``RuntimeFailure`` after ``timeout`` seconds.  Returns at
    once where a FUSE mount covers ``mnt`` again (a new mount's daemon is not ours to wait for)."""
    mounted = mount_at(mnt)
    if mounted is not None and mounted[1].startswith("fuse"):
        return
    try:
        fd = os.open(os.path.basename(mnt), os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC,
                     dir_fd=parent)
    except OSError:
        return  # (gone, or not ours to open: nothing to wait on)
    try:
        under = f"/proc/self/fd/{fd}"  # (the directory this fd holds, never what may be mounted there since)
        deadline = time.monotonic() + timeout
        while pids := holders(under):
            if time.monotonic() > deadline:
                who = f"its tierfs daemon (pid {pids[0]})" if pids[0] > 0 else "its tierfs daemon"
                raise RuntimeFailure(
                    f"{mnt} is unmounted, but {who} is still finishing after {timeout:g} s (it writes the cache's "
                    "index and journal, then exits; its log says what it waits on): wait for it to exit before "
                    "removing its cache dir or mounting it again")
            time.sleep(0.02)
    finally:
        os.close(fd)


USAGE = """\
usage: tierfs mount BACKING MOUNTPOINT --cache DIR --capacity SIZE [options]
       tierfs BACKING MOUNTPOINT -o cache=DIR,capacity=SIZE[,key=value...]   (fstab form)
       tierfs status MOUNTPOINT [--json] [--watch SECONDS]
       tierfs set MOUNTPOINT KEY=VALUE ...
       tierfs metrics MOUNTPOINT [--textfile DIR]
       tierfs plan BACKING --capacity SIZE [--cache-disk DIR] [--consumption RATE] [--world-size N] [--epochs E]
                   [--loader sampler|relist|shards] [--mountpoint DIR]
       tierfs umount MOUNTPOINT [--lazy] [--timeout SECONDS]
       tierfs install [--prefix DIR] [--sbin-dir DIR] [--unit-dir DIR] [--generator-dir DIR] [--conf-dir DIR]
                      [--uninstall]   (as root)
       tierfs --version
Run 'tierfs COMMAND --help' for a command's options and their defaults ('tierfs mount --help': the mount
options)."""


def parsers() -> dict[str, argparse.ArgumentParser]:
    """Each command's parser, by command (what ``--help`` shows; tests read their defaults)."""
    return {"mount": _mount_parser("tierfs mount"), "status": _status_parser(), "set": _set_parser(),
            "metrics": _metrics_parser(), "plan": _plan_parser(),
            "umount": _umount_parser(), "install": _install_parser()}


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    try:
        if not args or args[0] in ("-h", "--help", "help"):
            print(USAGE)
            return EXIT_OK if args else EXIT_USAGE
        if args[0] == "--version":
            print(f"tierfs {__version__}")
            return EXIT_OK
        cmd, rest = args[0], args[1:]
        if cmd == "mount":
            return cmd_mount(rest, prog="tierfs mount", daemon_default=False)
        if cmd == "status":
            return cmd_status(rest)
        if cmd == "set":
            return cmd_set(rest)
        if cmd == "metrics":
            return cmd_metrics(rest)
        if cmd == "plan":
            return cmd_plan(rest)
        if cmd in ("umount", "unmount"):
            return cmd_umount(rest)
        if cmd == "install":
            return cmd_install(rest)
        if cmd.startswith("-") or len(args) < 2:
            raise UsageError(f"unknown command {cmd!r} (see 'tierfs --help')")
        return cmd_mount(args, prog="tierfs", daemon_default=True)
    except UsageError as exc:
        print(f"tierfs: error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except RuntimeFailure as exc:
        print(f"tierfs: error: {exc}", file=sys.stderr)
        return EXIT_RUNTIME


if __name__ == "__main__":
    sys.exit(main())
