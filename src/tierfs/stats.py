"""The state you can see: one immutable snapshot, rendered as the ``status`` JSON and as Prometheus text.

:func:`snapshot` builds a :class:`Status` from the engine in one go on the trio thread (nothing changes while
it is built), and ``/.tierfs/status`` and ``/.tierfs/metrics`` render that object once per open; so a reader
always gets one complete, consistent object, however fast the engine moves.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from tierfs.engine import Engine

__all__ = ["ArfStatus", "Prefetch", "Reads", "Status", "snapshot"]


@dataclass(frozen=True)
class Prefetch:
    """Staging of the next mini-epoch (the current one too while it is incomplete, e.g. right after mount)."""

    files_done: int = 0
    files_total: int = 0
    bytes_done: int = 0
    bytes_total: int = 0
    bytes_per_s: float = 0.0


@dataclass(frozen=True)
class Reads:
    """Opens of dataset files: served from the cache (hits) or the backing dir (misses); outside the view;
    hits answered with the cached copy's path for the reader to open itself (``direct``, see lend)."""

    hits: int = 0
    misses: int = 0
    out_of_view: int = 0
    direct: int = 0


@dataclass(frozen=True)
class ArfStatus:
    mode: str = "off"
    score: float | None = None
    history: tuple[dict[str, Any], ...] = ()


@dataclass(frozen=True)
class Status:
    epoch: int = 0
    mini_epoch: int = 0
    pass_: int = 0
    passes_total: int = 0
    nm: int = 0
    rf: int = 1
    rf_setting: int | str = 1
    rf_effective: tuple[int, ...] = ()
    advance: str = "ready"
    policy: str = "met"
    composition: str = "random"
    view: str = "mini-epoch"
    view_files: int = 0
    view_bytes: int = 0
    dataset_files: int = 0
    dataset_bytes: int = 0
    cache_bytes: int = 0
    cache_files: int = 0
    cache_capacity: int = 0
    next_ready: bool = False
    prefetch: Prefetch = field(default_factory=Prefetch)
    reads: Reads = field(default_factory=Reads)
    backing_bytes_read: int = 0
    served_bytes: int = 0
    opened_bytes: int = 0
    pushed_bytes: int = 0
    stall_seconds: float = 0.0
    consumption_bytes_per_s: float = 0.0
    arf: ArfStatus = field(default_factory=ArfStatus)
    last_error: str | None = None

    def as_dict(self) -> dict[str, Any]:
        raw = asdict(self)
        d = {"epoch": raw.pop("epoch"), "mini_epoch": raw.pop("mini_epoch"), "pass": raw.pop("pass_"), **raw}
        d["rf_effective"] = list(self.rf_effective)
        d["arf"]["history"] = list(self.arf.history)
        return d

    def to_json(self) -> str:
        # allow_nan=False: a NaN would make the object invalid JSON; _finite_or_none keeps floats clean.
        return json.dumps(_clean(self.as_dict()), allow_nan=False, sort_keys=False) + "\n"

    def to_prometheus(self) -> str:
        out: list[str] = []

        def metric(name: str, kind: str, help_: str, value: float | int | None, labels: str = "") -> None:
            if help_:  # the second sample of a labelled metric shares the first one's header
                out.append(f"# HELP tierfs_{name} {help_}\n# TYPE tierfs_{name} {kind}\n")
            v = "NaN" if value is None else repr(float(value)) if isinstance(value, float) else str(int(value))
            out.append(f"tierfs_{name}{labels} {v}\n")

        metric("epoch", "gauge", "Current epoch.", self.epoch)
        metric("mini_epoch", "gauge", "Current mini-epoch within the epoch.", self.mini_epoch)
        metric("pass", "gauge", "Current pass within the mini-epoch.", self.pass_)
        metric("passes_total", "counter", "Passes completed since the first mount of this cache.",
               self.passes_total)
        metric("rf", "gauge", "Repeating factor in force.", self.rf)
        metric("view_files", "gauge", "Files in the current view.", self.view_files)
        metric("view_bytes", "gauge", "Bytes in the current view.", self.view_bytes)
        metric("cache_bytes", "gauge", "Bytes in the cache, copies in flight included.", self.cache_bytes)
        metric("cache_capacity_bytes", "gauge", "Cache capacity.", self.cache_capacity)
        metric("prefetch_files_done", "gauge", "Files of the mini-epoch being staged that are cached.",
               self.prefetch.files_done)
        metric("prefetch_files_total", "gauge", "Files of the mini-epoch being staged.", self.prefetch.files_total)
        metric("prefetch_bytes_done", "gauge", "Bytes of the mini-epoch being staged that are cached.",
               self.prefetch.bytes_done)
        metric("prefetch_bytes_total", "gauge", "Bytes of the mini-epoch being staged.", self.prefetch.bytes_total)
        metric("staging_bytes_per_second", "gauge", "Measured staging bandwidth.", self.prefetch.bytes_per_s)
        metric("reads_total", "counter", "Opens of dataset files by where they were served from.",
               self.reads.hits, '{result="hit"}')
        metric("reads_total", "counter", "", self.reads.misses, '{result="miss"}')
        metric("reads_out_of_view_total", "counter", "Opens of files outside the current view.",
               self.reads.out_of_view)
        metric("reads_direct_total", "counter", "Hits answered with the cached copy's path (user.tierfs.cache_path).",
               self.reads.direct)
        metric("backing_read_bytes_total", "counter", "Bytes read from the backing dir.", self.backing_bytes_read)
        metric("served_bytes_total", "counter",
               "Bytes the daemon returned to readers (reads from the kernel page cache are not seen).",
               self.served_bytes)
        metric("pushed_bytes_total", "counter", "Staged bytes pushed into the kernel page cache ahead of readers.",
               self.pushed_bytes)
        metric("opened_bytes_total", "counter", "Sizes of the dataset files opened (what loaders consume).",
               self.opened_bytes)
        metric("stall_seconds_total", "counter", "Seconds readers waited on the backing dir.", self.stall_seconds)
        metric("arf_score", "gauge", "Last ARF score reported through feedback.", self.arf.score)
        metric("last_error", "gauge", "1 if a control write or staging error is on record.",
               0 if self.last_error is None else 1)
        return "".join(out)


def snapshot(engine: Engine) -> Status:
    """One consistent snapshot of everything ``status`` and ``metrics`` show."""
    view = engine.view
    nxt = engine.next_files
    sizes = engine.tree.sizes
    total = len(nxt)
    next_bytes = int(sizes[nxt].sum()) if total else 0
    pending_bytes = int(sum(int(sizes[f]) for f in engine.pending_next))
    s = engine.settings
    pos = engine.pos
    return Status(
        epoch=pos.epoch,
        mini_epoch=pos.mini_epoch,
        pass_=pos.pass_index,
        passes_total=pos.passes_total,
        nm=engine.nm_in_force(),
        rf=engine.rf_now(),
        rf_setting=s.rf,
        rf_effective=tuple(pos.rf_effective),
        advance=s.advance,
        policy=s.policy,
        composition=s.composition,
        view=s.view,
        view_files=len(view) if view is not None else 0,
        view_bytes=view.bytes if view is not None else 0,
        dataset_files=engine.tree.n_files,
        dataset_bytes=int(sizes.sum()),
        cache_bytes=engine.cache.used,
        cache_files=len(engine.cache.entries),
        cache_capacity=engine.cache.capacity,
        next_ready=engine.next_ready() if s.policy == "met" else True,
        prefetch=Prefetch(
            files_done=total - len(engine.pending_next),
            files_total=total,
            bytes_done=next_bytes - pending_bytes,
            bytes_total=next_bytes,
            bytes_per_s=engine.staging_bytes_per_s(),
        ),
        reads=Reads(engine.hits, engine.misses, engine.out_of_view, engine.lent),
        backing_bytes_read=engine.backing_bytes_read,
        served_bytes=engine.served_bytes,
        opened_bytes=engine.opened_bytes,
        pushed_bytes=engine.pushed_bytes,
        stall_seconds=engine.stall_seconds,
        consumption_bytes_per_s=engine.consumption_bps,
        arf=ArfStatus(s.arf, engine.arf.score, tuple(engine.arf.history[-100:])),
        last_error=engine.last_error,
    )


def _clean(v: Any) -> Any:
    if isinstance(v, float):
        return v if math.isfinite(v) else None
    if isinstance(v, dict):
        return {k: _clean(x) for k, x in v.items()}
    if isinstance(v, (list, tuple)):
        return [_clean(x) for x in v]
    return v
