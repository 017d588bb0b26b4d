"""The human form of a status object: what ``tierfs status`` prints without ``--json``.

A pure function of the JSON object the mount serves (the client's view: it never sees the daemon's objects), so
it renders a status from any tierfs of the same format.  It is meant to be read at a glance: every line is at
most :data:`WIDTH` characters however long the mount has run (the per-mini-epoch history is shown as its last
few entries and a count), counts have their denominators (``mini-epoch 3/8``, counted from 1 where the JSON's
indices count from 0), rates come with what they mean (an ETA), and each warning says what to do.
"""

from __future__ import annotations

import textwrap
import time
from typing import Any

from tierfs.common.options import format_size

__all__ = ["WIDTH", "format_status"]

#: The longest line :func:`format_status` writes.
WIDTH = 100
_HISTORY_SHOWN = 6  # entries of rf_effective shown


def format_status(st: dict[str, Any], *, now: float | None = None) -> str:
    """The summary of status object ``st`` (``now``: wall-clock time, for the ages of stalls)."""
    now = time.time() if now is None else now
    lines = [_mount(st), _position(st), _rf(st), _view(st), _cache(st), *_staging(st), _reads(st), _io(st),
             *_memory(st), *_consumers(st, now)]
    arf = st.get("arf") or {}
    if arf.get("mode", "off") != "off":
        score = arf.get("score")
        lines.append(f"arf        {arf.get('mode')}, last score {'-' if score is None else f'{score:.4g}'}")
    lines = [_clip(line) for line in lines]
    for warning in _warnings(st, now):  # wrapped, not clipped: each says what to do
        lines += textwrap.wrap(warning, WIDTH, initial_indent="warning    ", subsequent_indent=" " * 11,
                               max_lines=6, placeholder=" … (tierfs status --json: all of it)")
    return "\n".join(lines)


def _clip(line: str, width: int = WIDTH) -> str:
    return line if len(line) <= width else line[: width - 1] + "…"


def _shorten(path: str, width: int = 48) -> str:
    """A long path as its start and its end, the end being what tells files apart."""
    return path if len(path) <= width else path[: width // 3] + "…" + path[-(width - width // 3 - 1):]


def _n(v: Any) -> str:
    return f"{int(v or 0):,}"


def _count(v: Any, one: str, many: str | None = None) -> str:
    """``1 pass``, ``2 passes``, ``1,200 copies``: a count with its noun in the right number."""
    n = int(v or 0)
    return f"{n:,} {one if n == 1 else many or one + 's'}"


def _bar(done: float, total: float, width: int = 20) -> str:
    frac = 0.0 if total <= 0 else min(1.0, done / total)
    full = int(frac * width)
    return "[" + "#" * full + "." * (width - full) + f"] {100 * frac:5.1f}%"


def _duration(seconds: float) -> str:
    s = round(seconds)
    if s < 120:
        return f"{s} s"
    if s < 3600:
        return f"{s // 60} min {s % 60:02d} s"
    return f"{s // 3600} h {s % 3600 // 60:02d} min"


def _mount(st: dict[str, Any]) -> str:
    """Which mount and which build serves it (two nodes' summaries are compared by this line)."""
    return (f"tierfs     {st.get('version', '?')}  policy {st.get('policy', '?')}  "
            f"mounted on {_shorten(str(st.get('mountpoint', '?')), 40)}")


def _position(st: dict[str, Any]) -> str:
    rf, passes = st.get("rf", 1) or 1, st.get("pass", 0) + 1
    if st.get("policy") == "lru":
        return f"position   epoch {st.get('epoch', 0) + 1}  pass {passes}  (policy lru: no mini-epochs)"
    # a pass beyond rf is no "5/4": it is an extra pass, out of the most the mini-epoch may get (rf_max)
    where = (f"pass {passes}/{rf}" if passes <= rf else
             f"pass {passes} (beyond rf {rf} until staged; max {st.get('rf_max', rf)})")
    return (f"position   epoch {st.get('epoch', 0) + 1}  mini-epoch {st.get('mini_epoch', 0) + 1}/{st.get('nm', 0)}  "
            f"{where}  ({_count(st.get('passes_total'), 'pass', 'passes')} in all)")


def _rf(st: dict[str, Any]) -> str:
    made = list(st.get("rf_effective") or [])[:-1]  # (the last entry is the current mini-epoch's, in progress)
    setting = st.get("rf_setting", st.get("rf"))
    text = f"rf         {st.get('rf')}"
    if setting == "auto":
        wanted = st.get("rf_wanted")
        text += f" (auto: the IO model wants {'-' if wanted is None else wanted}, at most rf_max={st.get('rf_max')})"
    if made:
        last = " ".join(str(x) for x in made[-_HISTORY_SHOWN:])
        more = "… " if len(made) > _HISTORY_SHOWN else ""
        text += f"  passes made per mini-epoch: {more}{last} ({_count(len(made), 'mini-epoch')} done)"
    return text


def _view(st: dict[str, Any]) -> str:
    return (f"view       {_n(st.get('view_files'))} of {_n(st.get('dataset_files'))} files, "
            f"{format_size(st.get('view_bytes', 0))} of {format_size(st.get('dataset_bytes', 0))}  "
            f"(view={st.get('view', 'mini-epoch')}, composition={st.get('composition', 'random')})")


def _cache(st: dict[str, Any]) -> str:
    used, cap = st.get("cache_bytes", 0), st.get("cache_capacity", 0)
    return (f"cache      {format_size(used)} of {format_size(cap)} {_bar(used, cap)}  "
            f"{_n(st.get('cache_files'))} copies")


def _staging(st: dict[str, Any]) -> list[str]:
    """What staging does now and what it does next: the current mini-epoch while it is incomplete (after a mount
    or a late switch), then the next one."""
    if st.get("policy") == "lru":
        return ["staging    copies are made as files are opened (policy lru)"]
    sg, nm = st.get("staging") or {}, st.get("nm", 0)
    me = st.get("mini_epoch", 0)
    current, nxt = st.get("current_staging") or {}, st.get("prefetch") or {}
    lines = []
    if current.get("bytes_done", 0) < current.get("bytes_total", 0):
        lines.append(_progress_line(f"current mini-epoch ({me + 1}/{nm})", current))
    following = f"next mini-epoch ({(me + 1) % max(1, nm) + 1}/{nm})"
    if st.get("next_ready") or nxt.get("bytes_done", 0) >= nxt.get("bytes_total", 0):
        lines.append(f"staging    {following} staged: {_n(nxt.get('files_total'))} files, "
                     f"{format_size(nxt.get('bytes_total', 0))}")
        lines.append("           next: the switch to it after this mini-epoch's last pass")
        return lines
    lines.append(_progress_line(following, nxt))
    # (streams bound staging's threads, not its copies: small files go several to a thread, and a reader's
    # on-demand copy adds one, so "256 copies in flight of 16" read as a broken limit)
    inflight = ""
    if sg:
        batched = " (small files several to a stream)" if sg.get("inflight", 0) > sg.get("streams", 0) else ""
        inflight = (f"{_count(sg.get('inflight'), 'copy', 'copies')} in flight on "
                    f"{_count(sg.get('streams'), 'stream')}{batched}; ")
    when = ("switch once staged and the passes are made" if st.get("advance") != "strict" else
            "switch after pass rf, reading what is missing on demand")
    lines.append(f"           {inflight}next: {when}")
    return lines


def _progress_line(what: str, p: dict[str, Any]) -> str:
    """``staging    WHAT: 1,200/2,000 files [###.....]  60.0%  120M/s, ETA 7 s``."""
    eta = p.get("eta_s")
    rate = p.get("bytes_per_s", 0.0) or 0.0
    return (f"staging    {what}: {_n(p.get('files_done'))}/{_n(p.get('files_total'))} files "
            f"{_bar(p.get('bytes_done', 0), p.get('bytes_total', 0))}  {format_size(rate)}/s"
            + (f", ETA {_duration(eta)}" if eta else ""))


def _reads(st: dict[str, Any]) -> str:
    r = st.get("reads") or {}
    hits, misses = r.get("hits", 0), r.get("misses", 0)
    hit = f"{100 * hits / (hits + misses):.1f}%" if hits + misses else "-"
    return (f"reads      {_n(hits)} hits, {_n(misses)} misses ({hit} hits), {_n(r.get('out_of_view'))} out of view, "
            f"{_n(r.get('direct'))} direct, {_n(r.get('plan'))} plan")


def _io(st: dict[str, Any]) -> str:
    rate = st.get("consumption_bytes_per_s", 0.0) or 0.0
    return (f"traffic    readers opened {format_size(st.get('opened_bytes', 0))} at {format_size(rate)}/s; "
            f"backing read {format_size(st.get('backing_bytes_read', 0))}; "
            f"readers stalled {st.get('stall_seconds', 0.0):.1f} s")


def _memory(st: dict[str, Any]) -> list[str]:
    """The daemon's memory against what the kernel holds it to (its cgroup's limit), once it was measured."""
    m = st.get("memory") or {}
    if not m.get("rss_bytes"):
        return []
    limit, charge = m.get("cgroup_limit_bytes"), m.get("cgroup_charge_bytes")
    cgroup = ("no memory cgroup found" if charge is None else
              f"cgroup {format_size(charge)} charged, no limit" if limit is None else
              f"cgroup {format_size(charge)} charged of its {format_size(limit)} limit ({100 * charge / limit:.0f}%)")
    return [f"memory     {format_size(m['rss_bytes'])} resident (after the last heap trim); {cgroup}"]


_CONSUMERS_SHOWN = 8


def _consumers(st: dict[str, Any], now: float) -> list[str]:
    """One line per job reading the mount (consumers.py), once a job has named itself or several read; none for
    a mount read by one anonymous reader (as before consumers)."""
    c = st.get("consumers") or {}
    table = list(c.get("consumers") or ())
    if not table or [x.get("name") for x in table] == ["anonymous"]:
        return []
    rf, view = st.get("rf", 1) or 1, st.get("view_files", 0)
    lines = [f"consumers  {_n(c.get('live'))} live of {len(table)}, {_n(c.get('drops'))} dropped; a job done with "
             f"its rf passes waits <= {c.get('timeout', 0):g} s (consumer_timeout)"]
    for x in sorted(table, key=lambda x: (x.get("state") != "live", x.get("name", "")))[:_CONSUMERS_SHOWN]:
        waiting = x.get("waiting_s")
        extra = f", waiting {_duration(waiting)}" if waiting is not None else ""
        rate = x.get("samples_per_s", 0.0) or 0.0
        lines.append(f"  {_shorten(str(x.get('name')), 16):<16} {x.get('state'):<7} pass {x.get('passes', 0)}/{rf}, "
                     f"{_n(x.get('position'))}/{_n(view)} files  {rate:,.0f} files/s  "
                     f"seen {_duration(max(0.0, now - (x.get('last_seen') or now)))} ago{extra}")
    if len(table) > _CONSUMERS_SHOWN:
        lines.append(f"  … {len(table) - _CONSUMERS_SHOWN} more (tierfs status --json)")
    return lines


def _warnings(st: dict[str, Any], now: float) -> list[str]:
    """Each condition that needs a person, with what to do about it."""
    out: list[str] = []
    b = st.get("backing") or {}
    if b.get("state") == "lost":
        since = f" {_duration(now - b['lost_since'])} ago" if b.get("lost_since") else ""
        out.append(f"backing lost{since} ({b.get('reason') or 'gone'}): cached files are still served; mount the "
                   "slow tier again and tierfs takes it back by itself")
    elif b.get("state") == "stalled":
        since = f" for {_duration(now - b['stalled_since'])}" if b.get("stalled_since") else ""
        out.append(f"backing stalled{since} ({_n(b.get('waiting'))} requests waiting): uncached opens wait up to "
                   "backing_timeout; check the slow tier (server, network)")
    sg = st.get("staging") or {}
    if sg.get("unstaged_files"):
        newest = (sg.get("unstaged") or [{}])[0]
        out.append(f"{_n(sg['unstaged_files'])} files could not be staged and are read from the backing (newest: "
                   f"{_shorten(str(newest.get('file')))}: {newest.get('why')}); check the cache disk and the backing, "
                   "see the log")
    tier = st.get("slow_tier") or {}
    if tier.get("state", "ok") != "ok":
        since = f" for {_duration(now - tier['since'])}" if tier.get("since") else ""
        repeats = _count(tier.get("repeats_beyond_rf"), "pass", "passes")
        switches = _count(tier.get("stalled_switches"), "switch", "switches")
        out.append(f"slow tier behind the readers{since} ({repeats} beyond rf, {switches} before staging finished, "
                   f"readers stalled {st.get('stall_seconds', 0.0):.1f} s): {tier.get('why')}; to fix it: "
                   f"{tier.get('fix')}")
    # (the loader's own warning, and only while it stands: it names the fix for this mount's listing; the
    # out_of_view count is a total since mount, history once the loader follows the view again)
    tree = st.get("tree") or {}
    if tree.get("unlistable"):
        first = (tree.get("unlistable_dirs") or ["?"])[0]
        out.append(f"{_count(tree['unlistable'], 'directory', 'directories')} of the backing dir could not be listed "
                   f"(first: {_shorten(str(first))}): the files under them are not in the data set; let the daemon's "
                   "user read and search them and remount (unlistable=refuse refuses such a mount)")
    loader = st.get("loader") or {}
    if loader.get("warning"):
        out.append(loader["warning"])
    if st.get("last_error"):
        out.append(f"last error: {st['last_error']}")
    return out
