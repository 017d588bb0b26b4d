"""The state you can see: one immutable snapshot, rendered as the ``status`` JSON and as Prometheus text.

The engine builds a :class:`Status` in one go on the trio thread (nothing changes while it is built) from the
frozen ``statistics()`` of its parts -- the cache, the stager, the pusher, the backing, the revalidator --
and its own counters; this module reads nothing private, it only renders.  ``/.tierfs/status`` and
``/.tierfs/metrics`` render that object once per open, so a reader always gets one complete, consistent object.

:class:`Status` holds the parts' snapshots as they are (``status.backing`` is the backing's
:class:`BackingStatistics`), so the JSON's sections are those dataclasses' fields and the Prometheus text reads
them by attribute: :data:`METRICS` names, for each metric, the fields it reads, and :data:`NOT_METRICS` says why
each other field has none.  A renamed field fails (an ``AttributeError``, and tests/engine/test_metrics.py) rather
than rendering 0, and a new field fails that test until it gets a metric or a reason.

Prometheus names follow the conventions: base units in the name's suffix (``_bytes``, ``_seconds``), counters
end in ``_total``, no rates (use ``rate()`` on the counters).  The text is prometheus_client's: :class:`StatusCollector`
turns the table into its metric families and ``generate_latest`` writes them (escapes, headers, number format).
"""

from __future__ import annotations

import json
import math
import operator
import os
import resource
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any

from prometheus_client.exposition import generate_latest
from prometheus_client.metrics_core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.metrics_core import Metric as MetricFamily

from tierfs import __version__
from tierfs.daemon.access import FdBudgetStatistics
from tierfs.daemon.backing.calls import BackingStatistics
from tierfs.daemon.backing.revalidator import RevalidatorStatistics
from tierfs.daemon.kernel.passthrough import PassthroughStatistics
from tierfs.daemon.kernel.pusher import PusherStatistics
from tierfs.daemon.runtime.memory import MemoryStatistics
from tierfs.daemon.schedule.consumers import ConsumersStatistics
from tierfs.daemon.schedule.loader_watch import LoaderStatistics
from tierfs.daemon.schedule.pace_watch import PaceStatistics
from tierfs.daemon.serving.batch_plans import PlanStatistics
from tierfs.daemon.serving.datapath import DataPathStatistics, Reads
from tierfs.daemon.serving.namespace import ListingStatistics
from tierfs.daemon.serving.substitutions import SubstitutionStatistics
from tierfs.daemon.staging.peers import MISS_REASONS, PeerStatistics
from tierfs.daemon.staging.stager import StagerStatistics
from tierfs.daemon.tree.keeper import TreeStatistics

if TYPE_CHECKING:  # (the snapshots Status nests are imported above, at run time: get_type_hints(Status) works)
    from tierfs.common.options import Settings
    from tierfs.daemon.cache.store import CacheStatistics
    from tierfs.daemon.coordinator.control_file import Arf
    from tierfs.daemon.schedule.schedule import ScheduleStatistics

__all__ = ["METRICS", "NOT_METRICS", "ArfStatus", "Metric", "Prefetch", "Status",
           "StatusCollector", "build_status"]


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
class ArfStatus:
    mode: str = "off"
    score: float | None = None
    history: tuple[dict[str, Any], ...] = ()


@dataclass(frozen=True)
class Status:
    """Everything ``status`` shows, in its order; the sections are the parts' own snapshots."""

    epoch: int
    mini_epoch: int
    pass_: int
    passes_total: int
    nm: int
    rf: int
    rf_setting: int | str
    rf_wanted: int | None  # the IO model's stall-free rf, ceil(EB1/B2), once both rates are measured
    rf_max: int  # the ceiling in force: the most passes a mini-epoch gets (rf_max, never below an integer rf)
    rf_effective: tuple[int, ...]
    advance: str
    policy: str
    composition: str
    view: str
    view_files: int
    view_bytes: int
    dataset_files: int
    dataset_bytes: int
    cache_bytes: int  # on disk, what the cap counts: allocated blocks of the copies + reservations
    cache_logical_bytes: int  # file sizes of the copies
    cache_files: int
    cache_capacity: int
    cache_repairs: int
    next_ready: bool
    views_ahead: int  # passes that began with the view the planner made ahead (a worker thread)
    views_inline: int  # passes whose view the request that began them made (it was not ready)
    prefetch: Prefetch
    current_staging: Prefetch
    staging: StagerStatistics
    reads: Reads
    backing: BackingStatistics
    revalidate: RevalidatorStatistics
    backing_bytes_read: int  # (backing.bytes_read, kept at the top where status has always shown it)
    served_bytes: int
    opened_bytes: int
    pushed_bytes: int  # (push.pushed_bytes, likewise)
    push: PusherStatistics
    stall_seconds: float
    consumption_bytes_per_s: float
    slow_tier: PaceStatistics  # staging behind the readers: pace_watch.py
    handles: int
    plans: PlanStatistics  # batch plans: issued, pinned (batch_plans.py)
    fds: int
    fd_limit: int
    fd_budget: FdBudgetStatistics  # the handles' descriptors per user (access.py)
    tree: TreeStatistics  # where the tree came from (scan/saved), its rescan
    arf: ArfStatus
    last_error: str | None
    mountpoint: str
    version: str  # the daemon's tierfs (tierfs.__version__, from git): which build serves this mount
    loader: LoaderStatistics  # whether the loader follows the view (loader_watch.py)
    substitution: SubstitutionStatistics  # the substitute option (substitutions.py)
    consumers: ConsumersStatistics  # the jobs reading the mount (consumers.py)
    peers: PeerStatistics  # the other nodes of the job, with peers=mpi (peers.py)
    listings: ListingStatistics  # directories opened, listings the kernel cached (namespace.py)
    memory: MemoryStatistics  # the daemon's resident bytes, the heap trims (memory.py)
    passthrough: PassthroughStatistics  # cached opens the kernel serves itself (passthrough.py)

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
        """The text of ``/.tierfs/metrics`` (Prometheus exposition format 0.0.4)."""
        return generate_latest(StatusCollector(self)).decode()


class StatusCollector:
    """prometheus_client's collector of one :class:`Status`: the metric families of :data:`METRICS`, in its order
    (a name's entries, one per label value, are one family).  A snapshot, not a live view: one per scrape."""

    def __init__(self, status: Status) -> None:
        self.status = status

    def collect(self) -> Iterator[MetricFamily]:
        family: CounterMetricFamily | GaugeMetricFamily | None = None
        name = ""
        for m in METRICS:
            if family is None or m.name != name:
                if family is not None:
                    yield family
                name = m.name
                family = (CounterMetricFamily if m.kind == "counter" else GaugeMetricFamily)(
                    f"tierfs_{m.name}", m.help, labels=m.label_names())
            for labels, value in m.samples(self.status):
                family.add_metric(labels, math.nan if value is None else float(value))
        if family is not None:
            yield family


def field_at(obj: Any, path: str) -> Any:
    """The field at dotted ``path`` (``"backing.refused"``) of ``obj``: attributes all the way, no default."""
    for name in path.split("."):
        obj = getattr(obj, name)
    return obj


@dataclass(frozen=True)
class Metric:
    """One Prometheus metric and the :class:`Status` fields it is made of.

    ``fields`` are dotted paths; ``value`` makes the sample from their values (left out: the one field as it is,
    a bool as 0/1, None as NaN).  ``labels`` are (label, path of the field giving its value) and ``constant``
    (label, value).  With ``each`` (the path of a tuple of snapshots) the metric has one sample per item, its
    paths relative to the item.  Several entries of one name (one per label value) follow each other and share
    ``kind`` and ``help``."""

    name: str
    kind: str  # "gauge" or "counter"
    help: str
    fields: tuple[str, ...]
    value: Callable[..., float | int | None] | None = None
    labels: tuple[tuple[str, str], ...] = ()
    constant: tuple[tuple[str, str], ...] = ()
    each: str | None = None

    def label_names(self) -> list[str]:
        return [k for k, _ in self.labels] + [k for k, _ in self.constant]

    def samples(self, status: Status) -> Iterator[tuple[list[str], float | int | None]]:
        """(label values in the order of :meth:`label_names`, value) of each sample."""
        for item in field_at(status, self.each) if self.each else (status,):
            values = [field_at(item, p) for p in self.fields]
            labels = [str(field_at(item, p)) for _, p in self.labels] + [v for _, v in self.constant]
            yield labels, self.value(*values) if self.value else values[0]


def _is(value: str) -> Callable[[str], bool]:
    return lambda state: state == value


_READS = "Opens of dataset files by where they were served from."


def _miss_of(reason: str) -> Callable[[dict[str, int]], int]:
    return lambda misses: misses[reason]

#: every metric, in the order of the text (tests/engine/test_metrics.py checks it against the fields)
METRICS: tuple[Metric, ...] = (
    Metric("info", "gauge", "The mount and its tierfs; 1.", (), lambda: 1,
           labels=(("mountpoint", "mountpoint"), ("version", "version"))),
    Metric("epoch", "gauge", "Current epoch.", ("epoch",)),
    Metric("mini_epoch", "gauge", "Current mini-epoch within the epoch.", ("mini_epoch",)),
    Metric("pass", "gauge", "Current pass within the mini-epoch.", ("pass_",)),
    Metric("passes_total", "counter", "Passes completed since the first mount of this cache.", ("passes_total",)),
    Metric("nm", "gauge", "Mini-epochs in the current epoch.", ("nm",)),
    Metric("rf", "gauge", "Repeating factor in force.", ("rf",)),
    Metric("rf_wanted", "gauge", "The stall-free rf of the IO model, ceil(consumption / staging rate); NaN "
           "until both are measured.", ("rf_wanted",)),
    Metric("rf_max", "gauge", "The most passes a mini-epoch gets (the ceiling of advance=ready and rf=auto).",
           ("rf_max",)),
    Metric("rf_effective", "gauge", "Passes made in the current mini-epoch so far.", ("rf_effective",),
           lambda passes: passes[-1] if passes else 0),
    Metric("view_files", "gauge", "Files in the current view.", ("view_files",)),
    Metric("view_bytes", "gauge", "Bytes in the current view.", ("view_bytes",)),
    Metric("dataset_files", "gauge", "Files in the backing dir.", ("dataset_files",)),
    Metric("dataset_bytes", "gauge", "Bytes in the backing dir.", ("dataset_bytes",)),
    Metric("unlistable_dirs", "gauge", "Directories of the backing dir the scan could not list: the files under "
           "them are not in the data set (status: tree.unlistable_dirs).", ("tree.unlistable",)),
    Metric("gone_files", "gauge", "Files of the mount found gone from the backing dir since it mounted: out of "
           "the mini-epochs (status: tree.gone).", ("tree.gone",)),
    Metric("cache_bytes", "gauge", "Disk bytes the cache occupies (allocated blocks, copies in flight included).",
           ("cache_bytes",)),
    Metric("cache_logical_bytes", "gauge", "File sizes of the cached copies.", ("cache_logical_bytes",)),
    Metric("cache_files", "gauge", "Cached copies.", ("cache_files",)),
    Metric("cache_capacity_bytes", "gauge", "Cache capacity.", ("cache_capacity",)),
    Metric("cache_repairs_total", "counter", "Cached copies found damaged or missing (cache misses).",
           ("cache_repairs",)),
    Metric("next_ready", "gauge", "1 if the next mini-epoch is staged.", ("next_ready",)),
    Metric("views_ahead_total", "counter", "Passes that began with a view made ahead, off the FUSE requests.",
           ("views_ahead",)),
    Metric("views_inline_total", "counter", "Passes whose view the request that began them made (not ready).",
           ("views_inline",)),
    Metric("prefetch_files", "gauge", "Files of the mini-epoch being staged.", ("prefetch.files_total",)),
    Metric("prefetch_done_files", "gauge", "Files of the mini-epoch being staged that are cached.",
           ("prefetch.files_done",)),
    Metric("prefetch_bytes", "gauge", "Bytes of the mini-epoch being staged.", ("prefetch.bytes_total",)),
    Metric("prefetch_done_bytes", "gauge", "Bytes of the mini-epoch being staged that are cached.",
           ("prefetch.bytes_done",)),
    Metric("current_pending_files", "gauge", "Files of the current mini-epoch not cached yet.",
           ("current_staging.files_total", "current_staging.files_done"), operator.sub),
    Metric("current_pending_bytes", "gauge", "Bytes of the current mini-epoch not cached yet.",
           ("current_staging.bytes_total", "current_staging.bytes_done"), operator.sub),
    Metric("staged_bytes_total", "counter", "Bytes copied into the cache.", ("staging.bytes_staged",)),
    Metric("staged_files_total", "counter", "Files copied into the cache.", ("staging.files_staged",)),
    Metric("staging_streams", "gauge", "Copies allowed in flight now.", ("staging.streams",)),
    Metric("staging_failed_files", "gauge", "Files waiting to retry staging.", ("staging.failed",)),
    Metric("staging_skipped_total", "counter", "Times a file could not be staged and was skipped.",
           ("staging.skipped",)),
    Metric("staging_unstaged_files", "gauge", "Files whose last staging try failed.", ("staging.unstaged_files",)),
    Metric("staging_stuck_copies", "gauge", "Copies abandoned on a backing call that has not come back.",
           ("staging.stuck",)),
    Metric("staging_yielded_seconds_total", "counter", "Seconds staging waited so that readers kept the CPU.",
           ("staging.yielded_seconds",)),
    Metric("reads_total", "counter", _READS, ("reads.hits",), constant=(("result", "hit"),)),
    Metric("reads_total", "counter", _READS, ("reads.misses",), constant=(("result", "miss"),)),
    Metric("reads_out_of_view_total", "counter", "Opens of files outside the current view.", ("reads.out_of_view",)),
    Metric("loader_off_view", "gauge", "1 while the loader does not follow the view (status: loader.warning).",
           ("loader.follows_view",), operator.not_),
    Metric("loader_warnings_total", "counter", "Times a pass showed a loader not following the view.",
           ("loader.warnings",)),
    Metric("substituted_lookups_total", "counter", "Names resolved to another file of the view (substitute).",
           ("substitution.substituted",)),
    Metric("reads_direct_total", "counter", "Hits answered with the cached copy's path (user.tierfs.cache_path).",
           ("reads.direct",)),
    Metric("reads_plan_total", "counter", "Hits read from batch-plan copies (reported with consumed).",
           ("reads.plan",)),
    Metric("reads_unconfirmed_total", "counter",
           "Hits served while a stalled backing could not confirm the fingerprint.", ("revalidate.unconfirmed",)),
    Metric("backing_read_bytes_total", "counter", "Bytes read from the backing dir.", ("backing.bytes_read",)),
    Metric("backing_stalled", "gauge", "1 while a backing request is outstanding for over a second.",
           ("backing.state",), _is("stalled")),
    Metric("backing_lost", "gauge", "1 while the backing filesystem is gone (e.g. a dead FUSE daemon).",
           ("backing.state",), _is("lost")),
    Metric("backing_refused_total", "counter",
           "Backing calls failed at once: the backing lost, or a file whose calls are stuck.", ("backing.refused",)),
    Metric("backing_recoveries_total", "counter", "Times a lost backing was re-opened.", ("backing.recoveries",)),
    Metric("backing_waiting_requests", "gauge", "Backing requests outstanding now.", ("backing.waiting",)),
    Metric("backing_requests_total", "counter", "Requests made to the backing dir.", ("backing.requests",)),
    Metric("backing_timeouts_total", "counter", "Backing requests abandoned after backing_timeout.",
           ("backing.timeouts",)),
    Metric("revalidations_total", "counter", "Backing stats made to confirm fingerprints.", ("revalidate.checked",)),
    Metric("revalidation_changes_total", "counter", "Files found changed by them.", ("revalidate.changed",)),
    Metric("open_revalidations_total", "counter", "Opens that asked the backing first.",
           ("revalidate.open_checks",)),
    Metric("served_bytes_total", "counter",
           "Bytes the daemon returned to readers (reads from the kernel page cache are not seen).", ("served_bytes",)),
    Metric("pushed_bytes_total", "counter", "Staged bytes pushed into the kernel page cache ahead of readers.",
           ("push.pushed_bytes",)),
    Metric("passthrough_opens_total", "counter", "Opens of cached files the kernel serves itself (passthrough): "
           "their bytes count in served_bytes at the open.", ("passthrough.opens",)),
    Metric("passthrough_registered_copies", "gauge", "Cached copies registered with the kernel for passthrough.",
           ("passthrough.registered",)),
    Metric("opened_bytes_total", "counter", "Sizes of the dataset files opened (what loaders consume).",
           ("opened_bytes",)),
    Metric("stall_seconds_total", "counter", "Seconds readers waited on the backing dir.", ("stall_seconds",)),
    Metric("slow_tier_behind", "gauge", "1 while staging is behind the readers (repeats beyond rf, or stalls); "
           "status.slow_tier says why and what would fix it.", ("slow_tier.state",), lambda state: state != "ok"),
    Metric("slow_tier_episodes_total", "counter", "Times staging fell behind the readers.", ("slow_tier.episodes",)),
    Metric("repeats_beyond_rf_total", "counter", "Passes made beyond rf because the next mini-epoch was not "
           "staged (advance=ready, up to rf_max).", ("slow_tier.repeats_beyond_rf",)),
    Metric("stalled_switches_total", "counter", "Switches made before the next mini-epoch was staged "
           "(advance=strict, or the rf_max ceiling): its readers wait on the slow tier.",
           ("slow_tier.stalled_switches",)),
    Metric("consumption_bytes_per_second", "gauge", "Readers' consumption rate measured over the last pass "
           "(its counter: tierfs_opened_bytes_total).", ("consumption_bytes_per_s",)),
    Metric("staging_bytes_per_second", "gauge", "Staging rate now (its counter: tierfs_staged_bytes_total).",
           ("staging.bytes_per_s",)),
    Metric("open_handles", "gauge", "Dataset files open now.", ("handles",)),
    Metric("open_fds", "gauge", "File descriptors the daemon holds.", ("fds",)),
    Metric("fd_limit", "gauge", "The daemon's descriptor limit.", ("fd_limit",)),
    Metric("resident_bytes", "gauge", "The daemon's resident memory after its last heap trim.", ("memory.rss_bytes",)),
    Metric("cgroup_memory_limit_bytes", "gauge", "The daemon's memory cgroup's limit (the lowest above it too) at its "
           "last heap trim; NaN where there is none.", ("memory.cgroup_limit_bytes",)),
    Metric("cgroup_memory_bytes", "gauge", "The bytes charged to the daemon's memory cgroup at its last heap trim "
           "(what the limit is held against); NaN where none is found.", ("memory.cgroup_charge_bytes",)),
    Metric("fd_refused_total", "counter",
           "Opens refused with EMFILE because their user held its share of the descriptors.",
           ("fd_budget.refused",)),
    Metric("arf_score", "gauge", "Last ARF score reported through feedback.", ("arf.score",)),
    Metric("consumers_live", "gauge", "Consumers (jobs) the mini-epoch waits for.", ("consumers.live",)),
    Metric("consumer_drops_total", "counter", "Times a consumer was dropped from the wait (consumer_timeout).",
           ("consumers.drops",)),
    *(Metric(name, kind, help_, (path,), value, labels=(("consumer", "name"),), each="consumers.consumers")
      for name, kind, help_, path, value in (
          ("consumer_live", "gauge", "1 while the consumer takes part in the count of passes.", "state",
           _is("live")),
          ("consumer_passes", "gauge", "Passes the consumer made in the current mini-epoch.", "passes", None),
          ("consumer_passes_total", "counter", "Passes the consumer made.", "passes_total", None),
          ("consumer_position_files", "gauge", "View files the consumer opened in its current pass.", "position",
           None),
          ("consumer_opens_total", "counter", "Opens of dataset files by the consumer.", "opens", None),
          ("consumer_samples_per_second", "gauge", "The consumer's opens per second over its last pass.",
           "samples_per_s", float),
          ("consumer_last_seen_timestamp_seconds", "gauge",
           "When the consumer last opened or listed (Unix time).", "last_seen", float),
          ("consumer_waiting", "gauge", "1 while the consumer waits for the others (it made its rf passes).",
           "waiting_s", lambda waited: waited is not None),
      )),
    Metric("peer_fetched_files_total", "counter", "Copies staged from peers' caches (peers=mpi).",
           ("peers.fetched_files",)),
    Metric("peer_fetched_bytes_total", "counter", "Bytes staged from peers' caches instead of the slow tier.",
           ("peers.fetched_bytes",)),
    Metric("peer_served_files_total", "counter", "Copies this node sent its peers.", ("peers.served_files",)),
    Metric("peer_served_bytes_total", "counter", "Bytes this node sent its peers.", ("peers.served_bytes",)),
    *(Metric("peer_misses_total", "counter", "Files a peer did not give, by reason: read from the slow tier "
             "instead.", ("peers.misses",), _miss_of(reason), constant=(("reason", reason),))
      for reason in MISS_REASONS),
    Metric("peers_alive", "gauge", "Peers not down.", ("peers.alive",)),
    Metric("peer_strangers_total", "counter", "Connections to the peer port turned away: no token of this job.",
           ("peers.strangers",)),
    Metric("peer_waited_seconds_total", "counter", "Seconds copies waited on peers in requests that ended as a "
           "miss (per peer, waits at once counted once).", ("peers.waited_s",)),
    Metric("peer_probes_total", "counter", "Requests that probed a peer that was down, its window over.",
           ("peers.probes",)),
    Metric("peer_connections_total", "counter", "Connections this node opened to its peers.",
           ("peers.connections",)),
    Metric("peer_requests_total", "counter", "Requests this node sent its peers (more than connections: kept "
           "ones reused).", ("peers.requests",)),
    Metric("peer_kept_connections", "gauge", "Connections from peers the peer port holds open for their next "
           "request.", ("peers.kept_connections",)),
    Metric("owned_files", "gauge", "Files this node owns for its peers (staged in epoch 0), kept while the cap "
           "allows.", ("peers.owned_files",)),
    Metric("owned_cached_files", "gauge", "Owned files cached now.", ("peers.owned_cached_files",)),
    Metric("last_error", "gauge", "1 if a control write or staging error is on record.", ("last_error",),
           lambda error: error is not None),
)

_TEXT = "text: status shows it, a metric carries numbers"
_SETTING = "a setting: status shows it, the control file changes it"
_DIAGNOSTIC = "a diagnostic figure: status shows it, no metric so far"
_SINCE = "the wall-clock start of the state its gauge shows"
_FD_SHARE = "a share of the descriptor limit (tierfs_fd_limit)"
_AT_MOUNT = "found by the tree's load and rescans (rare events): status shows it"
_MEASURED = ("as measured when staging fell behind, for status's why and fix (the live rates: "
             "tierfs_staging_bytes_per_second, tierfs_consumption_bytes_per_second)")

#: why the fields of :class:`Status` that no metric reads have none (a path covers the fields under it)
NOT_METRICS: dict[str, str] = {
    "rf_setting": "a setting, an integer or 'auto': tierfs_rf is the rf in force",
    "advance": _SETTING, "policy": _SETTING, "composition": _SETTING, "view": _SETTING,
    "prefetch.bytes_per_s": "the same rate as staging.bytes_per_s (tierfs_staging_bytes_per_second)",
    "prefetch.eta_s": "bytes left / staging rate: a PromQL expression of the metrics",
    "current_staging.bytes_per_s": "the same rate as staging.bytes_per_s (tierfs_staging_bytes_per_second)",
    "current_staging.eta_s": "bytes left / staging rate: a PromQL expression of the metrics",
    "staging.streams_limit": _SETTING,
    "staging.inflight": _DIAGNOSTIC, "staging.queued": _DIAGNOSTIC,
    "staging.files_per_s": "a rate: rate(tierfs_staged_files_total)",
    "staging.unstaged": "the files and why, text (their count: tierfs_staging_unstaged_files)",
    "staging.threads_left": "the staging threads less the stuck copies (tierfs_staging_stuck_copies)",
    "staging.error": _TEXT,
    "backing.stalled_since": _SINCE, "backing.lost_since": _SINCE, "backing.reason": _TEXT,
    "backing.threads": "the backing's thread limit, fixed at mount",
    "backing.probes": _DIAGNOSTIC,
    "revalidate.setting": _SETTING,
    "backing_bytes_read": "the same count as backing.bytes_read (tierfs_backing_read_bytes_total)",
    "pushed_bytes": "the same count as push.pushed_bytes (tierfs_pushed_bytes_total)",
    "push.window_bytes": _DIAGNOSTIC, "push.budget": _DIAGNOSTIC, "push.queued": _DIAGNOSTIC,
    "push.waiting_for_inode": _DIAGNOSTIC,
    "passthrough.state": _TEXT, "passthrough.plain_opens": _DIAGNOSTIC, "passthrough.registrations": _DIAGNOSTIC,
    "slow_tier.since": _SINCE, "slow_tier.staging_bytes_per_s": _MEASURED,
    "slow_tier.consumption_bytes_per_s": _MEASURED, "slow_tier.rf_needed": _MEASURED,
    "slow_tier.why": _TEXT, "slow_tier.fix": _TEXT,
    "plans.issued": _DIAGNOSTIC, "plans.pinned_plans": _DIAGNOSTIC, "plans.pinned_copies": _DIAGNOSTIC,
    "plans.reported": "the same count as reads.plan (tierfs_reads_plan_total)",
    "fd_budget.reserve": _FD_SHARE, "fd_budget.others_limit": _FD_SHARE, "fd_budget.per_user_limit": _FD_SHARE,
    "fd_budget.others_held": _DIAGNOSTIC,
    "tree.source": _TEXT, "tree.seconds": _AT_MOUNT, "tree.rescan": _TEXT,
    "tree.added": _AT_MOUNT, "tree.removed": _AT_MOUNT, "tree.changed": _AT_MOUNT, "tree.rescans": _AT_MOUNT,
    "tree.joining": _AT_MOUNT, "tree.left_out": _AT_MOUNT,
    "tree.unlistable_dirs": "the first of them, text (their count: tierfs_unlistable_dirs)",
    "tree.stable_inodes": _AT_MOUNT,
    "arf.mode": _SETTING, "arf.history": "a list of scored feedback lines",
    "loader.warning": _TEXT,
    "substitution.enabled": _SETTING, "substitution.rounds": _DIAGNOSTIC, "substitution.entries_dropped": _DIAGNOSTIC,
    "consumers.timeout": _SETTING,
    "listings.kernel_cache": "whether pyfuse3 can ask for the kernel's readdir cache, found at mount",
    "memory.trims": _DIAGNOSTIC, "memory.returned_bytes": _DIAGNOSTIC,
    "listings.opened": _DIAGNOSTIC, "listings.kept": _DIAGNOSTIC, "listings.readdirs": _DIAGNOSTIC,
    "consumers.consumers[].drops": "per consumer; the mount's count is tierfs_consumer_drops_total",
    "consumers.consumers[].advance_vote": _DIAGNOSTIC,
    "peers.enabled": _SETTING, "peers.rank": _SETTING, "peers.world_size": _SETTING, "peers.address": _TEXT,
    "peers.peers": "per peer, status only: the node's totals are the tierfs_peer_* metrics",
}


def build_status(*, mountpoint: str, settings: Settings, rf: int, rf_wanted: int | None, rf_max: int,
                 next_ready: bool, schedule: ScheduleStatistics,
                 data: DataPathStatistics, cache: CacheStatistics, stager: StagerStatistics,
                 pusher: PusherStatistics, backing: BackingStatistics, revalidation: RevalidatorStatistics,
                 pace: PaceStatistics, arf: Arf, last_error: str | None, tree: TreeStatistics,
                 loader: LoaderStatistics, substitution: SubstitutionStatistics,
                 consumers: ConsumersStatistics, peers: PeerStatistics, listings: ListingStatistics,
                 memory: MemoryStatistics, passthrough: PassthroughStatistics) -> Status:
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
        views_ahead=sch.views_ahead, views_inline=sch.views_inline,
        prefetch=Prefetch(files_done=sch.next_files - sch.next_pending, files_total=sch.next_files,
                          bytes_done=sch.next_bytes - sch.next_pending_bytes, bytes_total=sch.next_bytes,
                          bytes_per_s=stager.bytes_per_s,
                          eta_s=_eta(sch.current_pending_bytes + sch.next_pending_bytes, stager.bytes_per_s)),
        current_staging=Prefetch(files_done=sch.current_files - sch.current_pending, files_total=sch.current_files,
                                 bytes_done=sch.current_bytes - sch.current_pending_bytes,
                                 bytes_total=sch.current_bytes,
                                 bytes_per_s=stager.bytes_per_s,
                                 eta_s=_eta(sch.current_pending_bytes, stager.bytes_per_s)),
        staging=stager, reads=data.reads, backing=backing, revalidate=revalidation,
        backing_bytes_read=backing.bytes_read, served_bytes=data.served_bytes,
        opened_bytes=data.opened_bytes, pushed_bytes=pusher.pushed_bytes, push=pusher,
        stall_seconds=data.stall_seconds, consumption_bytes_per_s=sch.consumption_bytes_per_s, slow_tier=pace,
        handles=data.handles, plans=data.plans, fds=_open_fds(fd_limit), fd_limit=fd_limit,
        fd_budget=data.fd_budget, tree=tree, arf=ArfStatus(s.arf, arf.score, tuple(arf.history[-100:])),
        last_error=last_error, mountpoint=mountpoint, loader=loader, substitution=substitution, consumers=consumers,
        peers=peers, version=__version__,
        listings=listings, memory=memory, passthrough=passthrough,
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
