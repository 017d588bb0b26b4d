"""The mount options: one table, one parser for sizes, one for ``KEY=VALUE``.

Every option exists in three spellings -- ``--arf-wait 3`` on the command line, ``-o arf_wait=3`` in the
fstab form, and ``arf_wait=3`` written into ``/.tierfs/control`` -- and all three go through
:func:`parse_value`, so a value means the same thing wherever it is written and a bad one gets the same
message.  Options marked ``live`` may be changed through the control file; the others are fixed for the
life of a mount (the cache dir, the backing dir and the mountpoint most of all).
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

__all__ = [
    "GENERIC_MOUNT_OPTIONS",
    "OPTIONS",
    "OPTION_SECTIONS",
    "LiveSettings",
    "MountConfig",
    "Option",
    "Settings",
    "apply_assignments",
    "check_layout",
    "format_size",
    "format_size_at_least",
    "parse_assignments",
    "parse_changes",
    "parse_size",
    "parse_value",
]

_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d*)?|\.\d+)\s*([kmgtp]?)(i?b)?\s*$", re.IGNORECASE)
_SIZE_UNITS = {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40, "p": 1 << 50}


def parse_size(text: str | int) -> int:
    """Bytes from ``"20G"``, ``"512M"``, ``"1.5T"``, ``"4096"`` (binary units; a trailing ``B``/``iB`` is fine)."""
    if isinstance(text, int):
        if text < 0:
            raise ValueError(f"size must be >= 0, got {text}")
        return text
    m = _SIZE_RE.match(str(text))
    if not m and str(text).strip().startswith("-") and _SIZE_RE.match(str(text).strip()[1:]):
        raise ValueError(f"must not be negative, got {text!r}")
    if not m:
        raise ValueError(f"not a size: {text!r} (use a number with an optional K/M/G/T suffix, e.g. 20G)")
    return int(float(m.group(1)) * _SIZE_UNITS[m.group(2).lower()])


def format_size(n: int | float) -> str:
    """``1536`` -> ``"1.5K"``; the inverse of :func:`parse_size` up to rounding."""
    n = float(n)
    for unit in ("", "K", "M", "G", "T"):
        if abs(n) < 1024 or unit == "T":
            return f"{n:.0f}{unit}" if unit == "" or n == int(n) else f"{n:.1f}{unit}"
        n /= 1024
    raise AssertionError("unreachable")


def format_size_at_least(n: int) -> str:
    """The shortest size that :func:`parse_size` reads as at least ``n`` bytes (``3.1G`` for 3.04 GiB): what an
    error tells a user to give, so the value it names is one that works (:func:`format_size` rounds down too)."""
    if n < 1024:
        return str(int(n))
    for unit in ("K", "M", "G", "T"):
        scale = _SIZE_UNITS[unit.lower()]
        if n < 1024 * scale or unit == "T":
            tenths = math.ceil(n * 10 / scale)
            while parse_size(f"{tenths / 10:g}{unit}") < n:  # (float rounding in parse_size)
                tenths += 1
            return f"{tenths / 10:g}{unit}"
    raise AssertionError("unreachable")


def _int_between(lo: int, hi: int) -> Callable[[str], int]:
    def parse(text: str) -> int:
        if len(text) > 32:
            raise ValueError(f"expected an integer from {lo} to {hi}, got {text[:32]!r}...")
        try:
            v = int(text)
        except ValueError:
            raise ValueError(f"expected an integer, got {text!r}") from None
        if v < lo:
            raise ValueError(f"must be >= {lo}, got {v}")
        if v > hi:
            raise ValueError(f"must be <= {hi}, got {v}")
        return v

    return parse


def _float_between(lo: float, hi: float) -> Callable[[str], float]:
    """A number in ``(lo, hi]``."""

    def parse(text: str) -> float:
        try:
            v = float(text)
        except ValueError:
            raise ValueError(f"expected a number, got {text[:32]!r}") from None
        if not math.isfinite(v) or not lo < v <= hi:
            what = "a positive number" if lo == 0 else f"a number above {lo:g}"
            raise ValueError(f"must be {what} (at most {hi:g}), got {text[:32]!r}")
        return v

    return parse


_float_positive = _float_between(0.0, 1e6)
_MAX_PASSES = 1_000_000  # rf, arf_wait, arf_window: far above any real use, far below an overflow
_MAX_NM = 100_000_000
_MAX_BANDWIDTH = 1 << 50  # 1 PiB/s


def _revalidate(text: str) -> float | str:
    """Seconds a fingerprint may age before an open uses it, or ``open`` / ``never``."""
    if text in ("open", "never"):
        return text
    try:
        v = float(text.rstrip("s")) if text else float("nan")
    except ValueError:
        raise ValueError(f"expected seconds, open or never, got {text[:32]!r}") from None
    if not math.isfinite(v) or not 0 <= v <= 86400 * 365:
        raise ValueError(f"expected seconds from 0 to a year, open or never, got {text[:32]!r}")
    return "open" if v == 0 else v


def _seconds(text: str) -> float:
    """Seconds, above 0 and at most a day (a trailing ``s`` allowed)."""
    return _float_between(0.0, 86400.0)(text.rstrip("s"))


def _backing_timeout(text: str) -> float | str:
    """Seconds an uncached open waits on a stalled backing before EIO, or ``hard`` (wait as NFS hard does)."""
    if text == "hard":
        return text
    return _seconds(text)


def _streams(text: str) -> int | str:
    return "auto" if text == "auto" else _int_between(1, 64)(text)


@dataclass(frozen=True)
class _Choice:
    """The parser of an option that takes one of a few words (``--help`` lists them)."""

    choices: tuple[str, ...]

    def __call__(self, text: str) -> str:
        if text not in self.choices:
            raise ValueError(f"expected one of {', '.join(self.choices)}, got {text!r}")
        return text


def _choice(*choices: str) -> _Choice:
    return _Choice(choices)


def _rf(text: str) -> int | str:
    return "auto" if text == "auto" else _int_between(1, _MAX_PASSES)(text)


def _optional_size(text: str) -> int | None:
    return None if text in ("", "none", "0") else _size(text)


def _weights(text: str) -> tuple[float, float, float]:
    # (imported on use: importing the options, as the client side does, loads no sampler module nor numpy)
    from sampler.arf import parse_weights

    try:
        return parse_weights(text)
    except ValueError as exc:
        raise ValueError(str(exc).replace("weights must be", "expected")) from None


def _bool(text: str) -> bool:
    t = text.lower()
    if t in ("", "1", "true", "yes", "on"):
        return True
    if t in ("0", "false", "no", "off"):
        return False
    raise ValueError(f"expected true or false, got {text!r}")


def _size(text: str) -> int:
    v = parse_size(text)
    if v > 1 << 60:
        raise ValueError(f"{text!r} is more than an exbibyte")
    return v


def _group(text: str) -> str:
    """A group's name or number (resolved at mount time, see tierfs.daemon.access.Steering); empty: none."""
    if text and not re.fullmatch(r"[A-Za-z0-9_][A-Za-z0-9_.-]{0,63}\$?", text):
        raise ValueError(f"expected a group name or number, got {text[:32]!r}")
    return text


def parse_peer_addr(text: str) -> tuple[str, int]:
    """``HOST`` or ``HOST:PORT`` (``[V6]:PORT``): where a peer listens and what it announces; empty: the host
    name's address and an ephemeral port (peers.py)."""
    if not text:
        return "", 0
    host, sep, port = text.rpartition(":")
    if not sep or "]" in port or (host.count(":") and not host.startswith("[")):
        host, port = text, "0"
    host = host.strip("[]")
    if not host or not port.isdigit() or int(port) > 65535 or any(c.isspace() or c == "," for c in text):
        raise ValueError(f"expected HOST or HOST:PORT (port 0-65535), got {text[:64]!r}")
    return host, int(port)


def _peer_addr(text: str) -> str:
    parse_peer_addr(text)
    return text


def _bandwidth(text: str) -> int:
    v = parse_size(text)
    if v > _MAX_BANDWIDTH:
        raise ValueError(f"must be at most 1P (bytes/s), got {text[:32]!r}")
    return v


@dataclass(frozen=True)
class Option:
    """One mount option: its parser, whether the control file may change it, and what it is for."""

    name: str
    parse: Callable[[str], Any]
    live: bool
    help: str
    flag: bool = False  # a switch: ``--allow-other`` / ``-o allow_other`` without a value

    @property
    def choices(self) -> tuple[str, ...]:
        """The words the option takes, when it takes one of a few (empty otherwise)."""
        return self.parse.choices if isinstance(self.parse, _Choice) else ()


OPTIONS: dict[str, Option] = {
    o.name: o
    for o in [
        Option("rf", _rf, True, "repeating factor: passes per mini-epoch (integer >= 1, or auto)"),
        Option("rf_max", _int_between(1, _MAX_PASSES), True,
               "ceiling on passes per mini-epoch for advance=ready and rf=auto (never below an integer rf)"),
        Option("nm", _int_between(1, _MAX_NM), True, "number of mini-epochs per epoch"),
        Option("mini_epoch_size", _optional_size, True, "mini-epoch byte budget (instead of nm), e.g. 50G"),
        Option("composition", _choice("random", "stratified", "contiguous", "reservoir"), True,
               "how mini-epochs are composed"),
        Option("arf", _choice("off", "score", "bollinger"), True, "adaptive repeating factor"),
        Option("arf_wait", _int_between(1, _MAX_PASSES), True,
               "score ARF: passes without improvement before advancing"),
        Option("arf_window", _int_between(2, _MAX_PASSES), True, "Bollinger ARF: moving window N"),
        Option("arf_k", _float_positive, True, "Bollinger ARF: band width K (standard deviations)"),
        Option("arf_weights", _weights, True, "score weights for loss,train_err,val_err"),
        Option("advance", _choice("ready", "strict"), True,
               "after rf passes, ready: repeat the mini-epoch until the next is staged, up to rf_max passes, then "
               "switch; strict: switch at once (either way readers then wait on what is not staged yet)"),
        Option("bandwidth", _bandwidth, True, "cap on backing reads in bytes/s (0 = none), e.g. 100M"),
        Option("revalidate", _revalidate, True,
               "seconds a backing fingerprint may age before an open uses it, or open (every open) or never"),
        Option("backing_timeout", _backing_timeout, True,
               "seconds an uncached open waits on a stalled backing before EIO, or hard (wait)"),
        Option("consumer_timeout", _seconds, True, "seconds a job that made its rf passes waits for the other "
               "jobs on the mount (TIERFS_CONSUMER) before those holding it back are dropped from the count"),
        Option("staging_streams", _streams, True,
               "staging threads at once (small files go several to one): auto (adapt to the tier) or 1-64"),
        Option("policy", _choice("met", "lru"), False, "met (mini-epochs) or lru (read-through baseline)"),
        Option("seed", _int_between(0, 2**63 - 1), False, "seed of every shuffle"),
        Option("rank", _int_between(0, 1_000_000), False, "this node's rank for node-level sharding"),
        Option("world_size", _int_between(1, 1_000_000), False, "number of nodes sharing the plan"),
        Option("peers", _choice("off", "mpi"), False, "mpi: the daemons of one job (started by mpiexec or srun, one "
               "rank per node) stage from each other's caches; rank and world_size come from MPI"),
        Option("peer_addr", _peer_addr, False, "HOST or HOST:PORT this node's peers reach it at (peers=mpi); "
               "empty: the host name's address, a free port"),
        Option("peer_timeout", _seconds, False, "seconds a peer may take to answer before the file is read from "
               "the backing instead (peers=mpi)"),
        Option("view", _choice("mini-epoch", "full"), False, "what the root shows"),
        Option("listing", _choice("view", "all"), False, "what directories list: the view's files, or all files "
               "(the view, order and passes stay the mini-epoch's: for a dataset built once with MountSampler)"),
        Option("substitute", _bool, False, "a file name resolves, for the current pass, to a file of the view "
               "in its directory (a loader built once gets mini-epochs unchanged; labels must come from the "
               "directories or the files)", flag=True),
        Option("verify", _choice("size-mtime", "xxhash"), False, "how cached copies are checked"),
        Option("stable_inodes", _choice("auto", "yes", "no"), False, "whether the backing keeps a file's inode "
               "number: no = copies are known by size and times only (sshfs without noforget, rclone, gcsfuse, "
               "s3fs number inodes per mount); auto = no on a FUSE backing, yes on any other"),
        Option("rescan", _choice("epoch", "never"), False, "epoch = scan the backing dir again as each epoch starts: "
               "files it gained join the mini-epochs from a later epoch, files back from gone too (no remount); "
               "never = only after a mount that loaded the saved tree (new files show from the next mount)"),
        Option("unlistable", _choice("skip", "refuse"), False, "a directory of the backing dir the daemon cannot "
               "list (a permission, an I/O error): skip = mount without the files under it, said in the log and "
               "status (tree.unlistable); refuse = the mount fails, naming it"),
        Option("passthrough", _choice("auto", "all", "off"), False, "auto = opens of cached files of 1 MiB or more "
               "are served by the kernel from the copy itself (Linux 6.9+ FUSE passthrough, the daemon as root, the "
               "pyfuse3 of scripts/pyfuse3): native speed, one copy in the page cache; all = every cached file "
               "(faster first passes of small files, slower warm ones); status.passthrough says if not and why"),
        Option("allow_other", _bool, False, "let other users read the mount (implies default_permissions)",
               flag=True),
        Option("group", _group, False, "a group whose members steer the mount like its owner: their reads and "
               "listings move the schedule, they read status and order and write control"),
        Option("ro", _bool, False, "read-only at the kernel (statfs says ST_RDONLY, findmnt ro); the control "
               "file then refuses writes too", flag=True),
        Option("log_level", _choice("debug", "info", "warning", "error"), False, "daemon log level"),
    ]
}

#: The option table under headings, as ``tierfs mount --help`` shows it (each option under exactly one).
OPTION_SECTIONS: dict[str, tuple[str, ...]] = {
    "mini-epochs and repetition": ("nm", "mini_epoch_size", "rf", "rf_max", "advance", "composition", "seed"),
    "adaptive repetition (ARF, fed by the trainer's feedback lines)": ("arf", "arf_wait", "arf_window", "arf_k",
                                                                       "arf_weights"),
    "the slow tier and staging": ("bandwidth", "staging_streams", "revalidate", "backing_timeout", "verify",
                                  "stable_inodes", "policy", "passthrough"),
    "what the mount shows": ("view", "listing", "substitute", "ro", "unlistable", "rescan"),
    "several jobs, several nodes": ("consumer_timeout", "rank", "world_size", "peers", "peer_addr",
                                    "peer_timeout"),
    "access and the daemon": ("allow_other", "group", "log_level"),
}

#: Options that mount(8) and systemd pass to every helper; the fstab form accepts and ignores them.
GENERIC_MOUNT_OPTIONS = frozenset(
    {"rw", "nosuid", "suid", "nodev", "dev", "noexec", "exec", "_netdev", "nofail", "auto", "noauto",
     "user", "users", "nouser", "defaults", "async", "sync", "atime", "noatime", "relatime"}
)


def parse_value(key: str, text: str) -> Any:
    """Parse ``text`` as the value of option ``key``; ``ValueError`` names both when either is bad."""
    opt = OPTIONS.get(key)
    if opt is None:
        raise ValueError(f"unknown key {key!r}")
    try:
        return opt.parse(text)
    except ValueError as exc:
        raise ValueError(f"{key}: {exc}") from None


@dataclass(frozen=True)
class Settings:
    """The values of every option in :data:`OPTIONS`; immutable, replaced whole on every change."""

    rf: int | str = 4
    #: the most passes a mini-epoch gets: ``advance=ready`` repeats and ``rf=auto`` choose within it (4: the
    #: largest rf the convergence study measured at no cost in accuracy -- rf 8 cost 3.1 points --, so the
    #: default rf 4 means 4; docs/tuning.md "Why rf_max is 4 by default")
    rf_max: int = 4
    nm: int = 8
    mini_epoch_size: int | None = None
    composition: str = "random"
    arf: str = "off"
    arf_wait: int = 3
    arf_window: int = 5
    arf_k: float = 2.0
    arf_weights: tuple[float, float, float] = (1.0, 0.0, 0.0)
    advance: str = "ready"
    bandwidth: int = 0
    revalidate: float | str = 30.0
    backing_timeout: float | str = 30.0
    #: how long a consumer ahead waits for the others (consumers.py): a few passes of a slow job, not a dead one's
    consumer_timeout: float = 60.0
    staging_streams: int | str = "auto"
    policy: str = "met"
    seed: int = 0
    rank: int = 0
    world_size: int = 1
    peers: str = "off"
    peer_addr: str = ""
    peer_timeout: float = 5.0
    view: str = "mini-epoch"
    listing: str = "view"
    substitute: bool = False
    verify: str = "size-mtime"
    stable_inodes: str = "auto"
    unlistable: str = "skip"
    rescan: str = "epoch"
    passthrough: str = "auto"
    allow_other: bool = False
    group: str = ""
    ro: bool = False
    log_level: str = "info"

    def __post_init__(self) -> None:
        if self.rank >= self.world_size:
            raise ValueError(f"rank must be < world_size ({self.world_size}), got {self.rank}")
        if self.peers != "off" and self.policy != "met":
            raise ValueError(f"peers={self.peers} needs policy=met (peers own the files of the plans' first epoch)")
        if self.policy == "lru" and self.view != "full":
            # The LRU baseline has no mini-epochs to show; it always serves the whole tree.
            object.__setattr__(self, "view", "full")

    @property
    def backing_timeout_s(self) -> float | None:
        """``backing_timeout`` in seconds; None for ``hard`` (a backing call waits as long as the kernel does)."""
        t = self.backing_timeout
        return None if t == "hard" else float(t)

    def as_items(self) -> dict[str, str]:
        """Each option's value as the control file shows it."""
        out = {}
        for f in dataclasses.fields(self):
            v = getattr(self, f.name)
            if f.name == "arf_weights":
                v = ",".join(f"{w:g}" for w in v)
            elif isinstance(v, bool):
                v = "true" if v else "false"
            elif v is None:
                v = "none"
            out[f.name] = str(v)
        return out

    def as_lines(self) -> str:
        """``KEY=VALUE`` lines, the format written to and read from the control file."""
        return "".join(f"{k}={v}\n" for k, v in self.as_items().items())


def _inside(path: str, root: str) -> bool:
    return path == root or path.startswith(root.rstrip("/") + "/")


def check_layout(backing: str, cache: str, mountpoint: str) -> None:
    """``ValueError`` unless the three dirs (real paths; ``mountpoint`` may be empty: an engine without a mount)
    can work together: none inside another that would loop or write into the backing tree.  The one layout check
    (``tierfs mount`` and the engine both ask it)."""
    if mountpoint and (_inside(mountpoint, backing) or _inside(backing, mountpoint)):
        raise ValueError(f"mountpoint {mountpoint} and backing dir {backing} must not contain each other")
    if _inside(cache, backing):
        raise ValueError(f"cache dir {cache} must not be inside the backing dir {backing} (it is never written)")
    if mountpoint and (_inside(cache, mountpoint) or _inside(mountpoint, cache)):
        raise ValueError(f"cache dir {cache} and mountpoint {mountpoint} must not contain each other")


class LiveSettings:
    """The settings in force on a mount: the one place they live.  The engine makes it from the mount's
    :class:`Settings` and puts each validated control write's in (``current``); every part that reads a setting
    holds this object and reads ``current`` when it needs a value, so a change is seen everywhere at once."""

    def __init__(self, settings: Settings) -> None:
        self.current = settings


_BLANKS_BEFORE_EQUALS = re.compile(r"\s+=")
_BLANKS_AFTER_EQUALS = re.compile(r"=\s+(?!\S*=)")


def _join_equals(line: str) -> str:
    """Blanks around ``=`` are not separators (``echo " rf = 5 "`` means rf=5), except after an empty value
    followed by the next item (``mini_epoch_size= nm=4``)."""
    return _BLANKS_AFTER_EQUALS.sub("=", _BLANKS_BEFORE_EQUALS.sub("=", line))


def parse_assignments(text: str) -> list[tuple[str, str]]:
    """Split ``KEY=VALUE`` items separated by newlines, commas or whitespace (the one KEY=VALUE parser).

    Commas inside ``arf_weights=1,0,0`` are kept with their key: an item without ``=`` directly after a
    comma continues the previous value.  A bare word (``allow_other``) is ``("allow_other", "")``.  Blanks
    around ``=`` belong to neither side (``rf = 5`` is ``rf=5``).
    """
    items: list[tuple[str, str]] = []
    for line in text.splitlines():
        line = _join_equals(line.split("#", 1)[0].strip())
        if not line:
            continue
        for token in line.split():
            for piece in token.split(","):
                if "=" in piece or not items or not piece:
                    if not piece:
                        continue
                    key, _, value = piece.partition("=")
                    items.append((key.strip().replace("-", "_"), value.strip()))
                elif _continues_value(items[-1][0], piece):
                    key, value = items[-1]
                    items[-1] = (key, f"{value},{piece}")
                else:
                    items.append((piece.strip().replace("-", "_"), ""))
    return items


def _continues_value(key: str, piece: str) -> bool:
    # Only arf_weights takes a comma-separated value, and only numbers continue it.
    return key == "arf_weights" and re.fullmatch(r"[0-9.eE+-]+", piece) is not None


def apply_assignments(settings: Settings, assignments: Iterable[tuple[str, str]], *, live_only: bool) -> Settings:
    """A new :class:`Settings` with the assignments applied, or ``ValueError`` and nothing changed.

    ``live_only`` is set for control-file writes: options fixed at mount time are refused by name.
    """
    return dataclasses.replace(settings, **parse_changes(assignments, live_only=live_only))


def parse_changes(assignments: Iterable[tuple[str, str]], *, live_only: bool) -> dict[str, Any]:
    """Each assignment's value parsed (:func:`parse_value`), by key; ``ValueError`` naming the first bad one, and
    with ``live_only`` one fixed at mount time."""
    changes: dict[str, Any] = {}
    for key, text in assignments:
        opt = OPTIONS.get(key)
        if opt is None:
            if key in ("cache", "backing", "mountpoint", "capacity"):
                raise ValueError(f"{key} cannot be changed while mounted")
            raise ValueError(f"unknown key {key!r}")
        if live_only and not opt.live:
            raise ValueError(f"{key} is fixed at mount time and cannot be changed through the control file")
        changes[key] = parse_value(key, text)
    return changes


@dataclass(frozen=True)
class MountConfig:
    """Everything a mount needs: the three paths, the capacity, and the initial :class:`Settings`."""

    backing: str
    mountpoint: str
    cache: str
    capacity: int
    settings: Settings = field(default_factory=Settings)

    def __post_init__(self) -> None:
        if self.capacity <= 0:
            raise ValueError(f"capacity must be > 0, got {self.capacity}")

    @classmethod
    def from_options(cls, backing: str, mountpoint: str, options: Mapping[str, str]) -> MountConfig:
        """Build from raw ``key -> text`` options (CLI or ``-o``); ``cache`` and ``capacity`` are required."""
        opts = dict(options)
        missing = [k for k in ("cache", "capacity") if not opts.get(k)]
        if missing:
            raise ValueError(f"missing required option{'s' if len(missing) > 1 else ''}: {', '.join(missing)}")
        cache = opts.pop("cache")
        try:
            capacity = parse_size(opts.pop("capacity"))
        except ValueError as exc:
            raise ValueError(f"capacity: {exc}") from None
        settings = apply_assignments(Settings(), opts.items(), live_only=False)
        return cls(backing=backing, mountpoint=mountpoint, cache=cache, capacity=capacity, settings=settings)
