"""The state you can see: one immutable snapshot, rendered as the ``status`` JSON and as Prometheus text.

The engine builds a :class:`Status` in one go on the trio thread (nothing changes while it is built) from the
frozen ``statistics()`` of its parts -- the cache, the stager, the pusher, the backing, the revalidator --
and its own counters; this module reads nothing private, it only renders.  ``/.tierfs/status`` and
``/.tierfs/metrics`` render that object once per open, so a reader always gets one complete, consistent object.

Prometheus names follow the conventions: base units in the name's suffix (``_bytes``, ``_seconds``), counters
end in ``_total``, no rates (use ``rate()`` on the counters).
"""

from __future__ import annotations

import json
import math
import os
import resource
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any

from tierfs import __version__
from tierfs.textfile import escape_label

if TYPE_CHECKING:
    from tierfs.backing import BackingStatistics
    from tierfs.cache import CacheStatistics
    from tierfs.consumers import ConsumersStatistics
    from tierfs.control import Arf
    from tierfs.following import LoaderStatistics
    from tierfs.opening import TreeStatistics
    from tierfs.options import Settings
    from tierfs.pace import PaceStatistics
    from tierfs.plans import PlanStatistics
    from tierfs.pusher import PusherStatistics
    from tierfs.revalidate import RevalidatorStatistics
    from tierfs.schedule import ScheduleStatistics
    from tierfs.staging import StagerStatistics
    from tierfs.substitute import SubstitutionStatistics
    from tierfs.users import FdBudgetStatistics

__all__ = ["ArfStatus", "DataPathStatistics", "Prefetch", "Reads", "Status", "build_status"]


@dataclass(frozen=True)
class Prefetch:
    """Staging of a mini-epoch: the next one (``prefetch``), or the current one (``current_staging``: incomplete
    right after a mount or a switch to a next one that was not staged in time).  ``eta_s``: seconds left at the
    staging rate, the current mini-epoch's copies counted first; None while there is no rate."""

    files_done: int = 0
    files_total: int = 0
    bytes_done: int = 0
    bytes_total: int = 0
    bytes_per_s: float = 0.0
    eta_s: float | None = None


@dataclass(frozen=True)
class Reads:
    """Opens of dataset files: served from the cache (hits) or the backing dir (misses); outside the view;
    hits answered with the cached copy's path for the reader to open itself (``direct``, see lend)."""

    hits: int = 0
    misses: int = 0
    out_of_view: int = 0
    direct: int = 0
    plan: int = 0  # hits read from a batch plan's copies, as reported (see plans.py)


@dataclass(frozen=True)
class DataPathStatistics:
    """What the data path reports (``DataPath.statistics()``)."""

    reads: Reads
    served_bytes: int
    opened_bytes: int
    stall_seconds: float
    handles: int
    plans: PlanStatistics
    fd_budget: FdBudgetStatistics


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
    rf_wanted: int | None = None  # the IO model's stall-free rf, ceil(EB1/B2), once both rates are measured
    rf_max: int = 8  # the ceiling in force: the most passes a mini-epoch gets (rf_max, never below an integer rf)
    rf_effective: tuple[int, ...] = ()
    advance: str = "ready"
    policy: str = "met"
    composition: str = "random"
    view: str = "mini-epoch"
    view_files: int = 0
    view_bytes: int = 0
    dataset_files: int = 0
    dataset_bytes: int = 0
    cache_bytes: int = 0  # on disk, what the cap counts: allocated blocks of the copies + reservations
    cache_logical_bytes: int = 0  # file sizes of the copies
    cache_files: int = 0
    cache_capacity: int = 0
    cache_repairs: int = 0
    next_ready: bool = False
    prefetch: Prefetch = field(default_factory=Prefetch)
    current_staging: Prefetch = field(default_factory=Prefetch)
    staging: dict[str, Any] = field(default_factory=dict)
    reads: Reads = field(default_factory=Reads)
    backing: dict[str, Any] = field(default_factory=dict)
    revalidate: dict[str, Any] = field(default_factory=dict)
    backing_bytes_read: int = 0
    served_bytes: int = 0
    opened_bytes: int = 0
    pushed_bytes: int = 0
    push: dict[str, Any] = field(default_factory=dict)
    stall_seconds: float = 0.0
    consumption_bytes_per_s: float = 0.0
    slow_tier: dict[str, Any] = field(default_factory=dict)  # staging behind the readers: pace.py
    handles: int = 0
    plans: dict[str, Any] = field(default_factory=dict)  # batch plans: issued, pinned (plans.py)
    fds: int = 0
    fd_limit: int = 0
    fd_budget: dict[str, Any] = field(default_factory=dict)  # the handles' descriptors per user (users.py)
    tree: dict[str, Any] = field(default_factory=dict)  # where the tree came from (scan/saved), its rescan
    arf: ArfStatus = field(default_factory=ArfStatus)
    last_error: str | None = None
    mountpoint: str = ""
    #: whether the loader follows the view (following.py): {follows_view, warning, warnings}
    loader: dict[str, Any] = field(default_factory=dict)
    #: the substitute option (substitute.py): {enabled, substituted, rounds}
    substitution: dict[str, Any] = field(default_factory=dict)
    #: the jobs reading the mount (consumers.py): {timeout, live, drops, consumers: [{name, state, passes, ...}]}
    consumers: dict[str, Any] = field(default_factory=dict)

    def as_dict(self) -> dict[str, Any]:
        raw = asdict(self)
        d = {"epoch": raw.pop("epoch"), "mini_epoch": raw.pop("mini_epoch"), "pass": raw.pop("pass_"), **raw}
        d["rf_effective"] = list(self.rf_effective)
        d["arf"]["history"] = list(self.arf.history)
        return d

    def to_json(self) -> str:
        # allow_nan=False: a NaN would make the object invalid JSON; _clean keeps floats clean.
        return json.dumps(_clean(self.as_dict()), allow_nan=False, sort_keys=False) + "\n"

    def to_prometheus(self) -> str:
        out: list[str] = []

        def metric(name: str, kind: str, help_: str, value: float | int | None, labels: str = "") -> None:
            if help_:  # the second sample of a labelled metric shares the first one's header
                out.append(f"# HELP tierfs_{name} {help_}\n# TYPE tierfs_{name} {kind}\n")
            v = "NaN" if value is None else repr(float(value)) if isinstance(value, float) else str(int(value))
            out.append(f"tierfs_{name}{labels} {v}\n")

        p, r, st, b, rv = self.prefetch, self.reads, self.staging, self.backing, self.revalidate
        metric("info", "gauge", "The mount and its tierfs; 1.", 1,
               f'{{mountpoint="{escape_label(self.mountpoint)}",version="{escape_label(__version__)}"}}')
        metric("epoch", "gauge", "Current epoch.", self.epoch)
        metric("mini_epoch", "gauge", "Current mini-epoch within the epoch.", self.mini_epoch)
        metric("pass", "gauge", "Current pass within the mini-epoch.", self.pass_)
        metric("passes_total", "counter", "Passes completed since the first mount of this cache.",
               self.passes_total)
        metric("nm", "gauge", "Mini-epochs in the current epoch.", self.nm)
        metric("rf", "gauge", "Repeating factor in force.", self.rf)
        metric("rf_wanted", "gauge", "The stall-free rf of the IO model, ceil(consumption / staging rate); NaN "
               "until both are measured.", self.rf_wanted)
        metric("rf_max", "gauge", "The most passes a mini-epoch gets (the ceiling of advance=ready and rf=auto).",
               self.rf_max)
        metric("rf_effective", "gauge", "Passes made in the current mini-epoch so far.",
               self.rf_effective[-1] if self.rf_effective else 0)
        metric("view_files", "gauge", "Files in the current view.", self.view_files)
        metric("view_bytes", "gauge", "Bytes in the current view.", self.view_bytes)
        metric("dataset_files", "gauge", "Files in the backing dir.", self.dataset_files)
        metric("dataset_bytes", "gauge", "Bytes in the backing dir.", self.dataset_bytes)
        metric("cache_bytes", "gauge", "Disk bytes the cache occupies (allocated blocks, copies in flight included).",
               self.cache_bytes)
        metric("cache_logical_bytes", "gauge", "File sizes of the cached copies.", self.cache_logical_bytes)
        metric("cache_files", "gauge", "Cached copies.", self.cache_files)
        metric("cache_capacity_bytes", "gauge", "Cache capacity.", self.cache_capacity)
        metric("cache_repairs_total", "counter", "Cached copies found damaged or missing (cache misses).",
               self.cache_repairs)
        metric("next_ready", "gauge", "1 if the next mini-epoch is staged.", int(self.next_ready))
        metric("prefetch_files", "gauge", "Files of the mini-epoch being staged.", p.files_total)
        metric("prefetch_done_files", "gauge", "Files of the mini-epoch being staged that are cached.", p.files_done)
        metric("prefetch_bytes", "gauge", "Bytes of the mini-epoch being staged.", p.bytes_total)
        metric("prefetch_done_bytes", "gauge", "Bytes of the mini-epoch being staged that are cached.", p.bytes_done)
        c = self.current_staging
        metric("current_pending_files", "gauge", "Files of the current mini-epoch not cached yet.",
               c.files_total - c.files_done)
        metric("current_pending_bytes", "gauge", "Bytes of the current mini-epoch not cached yet.",
               c.bytes_total - c.bytes_done)
        metric("staged_bytes_total", "counter", "Bytes copied into the cache.", st.get("bytes_staged", 0))
        metric("staged_files_total", "counter", "Files copied into the cache.", st.get("files_staged", 0))
        metric("staging_streams", "gauge", "Copies allowed in flight now.", st.get("streams", 0))
        metric("staging_failed_files", "gauge", "Files waiting to retry staging.", st.get("failed", 0))
        metric("staging_skipped_total", "counter", "Times a file could not be staged and was skipped.",
               st.get("skipped", 0))
        metric("staging_unstaged_files", "gauge", "Files whose last staging try failed.", st.get("unstaged_files", 0))
        metric("staging_stuck_copies", "gauge", "Copies abandoned on a backing call that has not come back.",
               st.get("stuck", 0))
        metric("staging_yielded_seconds_total", "counter", "Seconds staging waited so that readers kept the CPU.",
               st.get("yielded_seconds", 0))
        metric("reads_total", "counter", "Opens of dataset files by where they were served from.", r.hits,
               '{result="hit"}')
        metric("reads_total", "counter", "", r.misses, '{result="miss"}')
        metric("reads_out_of_view_total", "counter", "Opens of files outside the current view.", r.out_of_view)
        metric("loader_off_view", "gauge", "1 while the loader does not follow the view (status: loader.warning).",
               int(not self.loader.get("follows_view", True)))
        metric("loader_warnings_total", "counter", "Times a pass showed a loader not following the view.",
               self.loader.get("warnings", 0))
        metric("substituted_lookups_total", "counter", "Names resolved to another file of the view (substitute).",
               self.substitution.get("substituted", 0))
        metric("reads_direct_total", "counter", "Hits answered with the cached copy's path (user.tierfs.cache_path).",
               r.direct)
        metric("reads_plan_total", "counter", "Hits read from batch-plan copies (reported with consumed).", r.plan)
        metric("reads_unconfirmed_total", "counter",
               "Hits served while a stalled backing could not confirm the fingerprint.", rv.get("unconfirmed", 0))
        metric("backing_read_bytes_total", "counter", "Bytes read from the backing dir.", self.backing_bytes_read)
        metric("backing_stalled", "gauge", "1 while a backing request is outstanding for over a second.",
               int(b.get("state") == "stalled"))
        metric("backing_lost", "gauge", "1 while the backing filesystem is gone (e.g. a dead FUSE daemon).",
               int(b.get("state") == "lost"))
        metric("backing_refused_total", "counter",
               "Backing calls failed at once: the backing lost, or a file whose calls are stuck.", b.get("refused", 0))
        metric("backing_recoveries_total", "counter", "Times a lost backing was re-opened.", b.get("recoveries", 0))
        metric("backing_waiting_requests", "gauge", "Backing requests outstanding now.", b.get("waiting", 0))
        metric("backing_requests_total", "counter", "Requests made to the backing dir.", b.get("requests", 0))
        metric("backing_timeouts_total", "counter", "Backing requests abandoned after backing_timeout.",
               b.get("timeouts", 0))
        metric("revalidations_total", "counter", "Backing stats made to confirm fingerprints.", rv.get("checked", 0))
        metric("revalidation_changes_total", "counter", "Files found changed by them.", rv.get("changed", 0))
        metric("open_revalidations_total", "counter", "Opens that asked the backing first.", rv.get("open_checks", 0))
        metric("served_bytes_total", "counter",
               "Bytes the daemon returned to readers (reads from the kernel page cache are not seen).",
               self.served_bytes)
        metric("pushed_bytes_total", "counter", "Staged bytes pushed into the kernel page cache ahead of readers.",
               self.pushed_bytes)
        metric("opened_bytes_total", "counter", "Sizes of the dataset files opened (what loaders consume).",
               self.opened_bytes)
        metric("stall_seconds_total", "counter", "Seconds readers waited on the backing dir.", self.stall_seconds)
        tier = self.slow_tier
        metric("slow_tier_behind", "gauge", "1 while staging is behind the readers (repeats beyond rf, or stalls); "
               "status.slow_tier says why and what would fix it.", int(tier.get("state", "ok") != "ok"))
        metric("slow_tier_episodes_total", "counter", "Times staging fell behind the readers.", tier.get("episodes", 0))
        metric("repeats_beyond_rf_total", "counter", "Passes made beyond rf because the next mini-epoch was not "
               "staged (advance=ready, up to rf_max).", tier.get("repeats_beyond_rf", 0))
        metric("stalled_switches_total", "counter", "Switches made before the next mini-epoch was staged "
               "(advance=strict, or the rf_max ceiling): its readers wait on the slow tier.",
               tier.get("stalled_switches", 0))
        metric("consumption_bytes_per_second", "gauge", "Readers' consumption rate measured over the last pass "
               "(its counter: tierfs_opened_bytes_total).", self.consumption_bytes_per_s)
        metric("staging_bytes_per_second", "gauge", "Staging rate now (its counter: tierfs_staged_bytes_total).",
               p.bytes_per_s)
        metric("open_handles", "gauge", "Dataset files open now.", self.handles)
        metric("open_fds", "gauge", "File descriptors the daemon holds.", self.fds)
        metric("fd_limit", "gauge", "The daemon's descriptor limit.", self.fd_limit)
        metric("fd_refused_total", "counter",
               "Opens refused with EMFILE because their user held its share of the descriptors.",
               self.fd_budget.get("refused", 0))
        metric("arf_score", "gauge", "Last ARF score reported through feedback.", self.arf.score)
        metric("consumers_live", "gauge", "Consumers (jobs) the mini-epoch waits for.", self.consumers.get("live", 0))
        metric("consumer_drops_total", "counter", "Times a consumer was dropped from the wait (consumer_timeout).",
               self.consumers.get("drops", 0))
        per_consumer = (
            ("consumer_live", "gauge", "1 while the consumer takes part in the count of passes.",
             lambda c: int(c["state"] == "live")),
            ("consumer_passes", "gauge", "Passes the consumer made in the current mini-epoch.", lambda c: c["passes"]),
            ("consumer_passes_total", "counter", "Passes the consumer made.", lambda c: c["passes_total"]),
            ("consumer_position_files", "gauge", "View files the consumer opened in its current pass.",
             lambda c: c["position"]),
            ("consumer_opens_total", "counter", "Opens of dataset files by the consumer.", lambda c: c["opens"]),
            ("consumer_samples_per_second", "gauge", "The consumer's opens per second over its last pass.",
             lambda c: float(c["samples_per_s"])),
            ("consumer_last_seen_timestamp_seconds", "gauge", "When the consumer last opened or listed (Unix time).",
             lambda c: float(c["last_seen"])),
            ("consumer_waiting", "gauge", "1 while the consumer waits for the others (it made its rf passes).",
             lambda c: int(c["waiting_s"] is not None)),
        )
        for name, kind, help_, value in per_consumer:
            for i, c in enumerate(self.consumers.get("consumers", ())):
                metric(name, kind, help_ if i == 0 else "", value(c), f'{{consumer="{escape_label(c["name"])}"}}')
        metric("last_error", "gauge", "1 if a control write or staging error is on record.",
               0 if self.last_error is None else 1)
        return "".join(out)


def build_status(*, mountpoint: str, settings: Settings, rf: int, rf_wanted: int | None, rf_max: int,
                 next_ready: bool, schedule: ScheduleStatistics,
                 data: DataPathStatistics, cache: CacheStatistics, stager: StagerStatistics,
                 pusher: PusherStatistics, backing: BackingStatistics, revalidation: RevalidatorStatistics,
                 pace: PaceStatistics, arf: Arf, last_error: str | None, tree: TreeStatistics,
                 loader: LoaderStatistics, substitution: SubstitutionStatistics,
                 consumers: ConsumersStatistics) -> Status:
    """A :class:`Status` from the parts' statistics (the one place that knows the JSON's shape)."""
    s, sch = settings, schedule
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    fd_limit = soft if soft != resource.RLIM_INFINITY else hard
    return Status(
        epoch=sch.epoch, mini_epoch=sch.mini_epoch, pass_=sch.pass_index, passes_total=sch.passes_total,
        nm=sch.nm, rf=rf, rf_setting=s.rf, rf_wanted=rf_wanted, rf_max=rf_max, rf_effective=sch.rf_effective,
        advance=s.advance, policy=s.policy,
        composition=s.composition, view=s.view, view_files=sch.view_files, view_bytes=sch.view_bytes,
        dataset_files=sch.dataset_files, dataset_bytes=sch.dataset_bytes,
        cache_bytes=cache.disk_bytes, cache_logical_bytes=cache.logical_bytes, cache_files=cache.files,
        cache_capacity=cache.capacity, cache_repairs=cache.repairs, next_ready=next_ready,
        prefetch=Prefetch(files_done=sch.next_files - sch.next_pending, files_total=sch.next_files,
                          bytes_done=sch.next_bytes - sch.next_pending_bytes, bytes_total=sch.next_bytes,
                          bytes_per_s=stager.bytes_per_s,
                          eta_s=_eta(sch.current_pending_bytes + sch.next_pending_bytes, stager.bytes_per_s)),
        current_staging=Prefetch(files_done=sch.current_files - sch.current_pending, files_total=sch.current_files,
                                 bytes_done=sch.current_bytes - sch.current_pending_bytes,
                                 bytes_total=sch.current_bytes,
                                 bytes_per_s=stager.bytes_per_s,
                                 eta_s=_eta(sch.current_pending_bytes, stager.bytes_per_s)),
        staging=asdict(stager), reads=data.reads, backing=asdict(backing), revalidate=asdict(revalidation),
        backing_bytes_read=backing.bytes_read, served_bytes=data.served_bytes,
        opened_bytes=data.opened_bytes, pushed_bytes=pusher.pushed_bytes, push=asdict(pusher),
        stall_seconds=data.stall_seconds, consumption_bytes_per_s=sch.consumption_bytes_per_s,
        slow_tier=asdict(pace),
        handles=data.handles, plans=asdict(data.plans), fds=_open_fds(fd_limit), fd_limit=fd_limit,
        fd_budget=asdict(data.fd_budget), tree=asdict(tree),
        arf=ArfStatus(s.arf, arf.score, tuple(arf.history[-100:])), last_error=last_error,
        mountpoint=mountpoint, loader=asdict(loader),
        substitution=asdict(substitution), consumers=asdict(consumers),
    )


def _eta(left: int, rate: float) -> float | None:
    if left <= 0:
        return 0.0
    return left / rate if rate > 0 else None


def _open_fds(limit: int) -> int:
    """The descriptors this process holds, also when it holds all it may: ``stat`` of /proc/self/fd needs no
    descriptor and counts them (Linux 6.2+); a listing (older kernels) needs one, and with none left the count
    is the limit."""
    try:
        n = os.stat("/proc/self/fd").st_size
        return n if n > 0 else len(os.listdir("/proc/self/fd"))
    except OSError:
        return limit


def _clean(v: Any) -> Any:
    if isinstance(v, float):
        return v if math.isfinite(v) else None
    if isinstance(v, dict):
        return {k: _clean(x) for k, x in v.items()}
    if isinstance(v, (list, tuple)):
        return [_clean(x) for x in v]
    return v
