"""The Prometheus table against the status snapshot (issue 25): every field of :class:`Status` and of the snapshots
it nests has a metric or a reason in ``NOT_METRICS``, and every metric reads fields that exist -- so a renamed or
a new field fails here instead of rendering 0 or going unexported unnoticed."""

from __future__ import annotations

import dataclasses
import types
import typing
from collections.abc import Iterator

from tierfs.daemon.coordinator.status import METRICS, NOT_METRICS, Status


def _item(tp: object) -> type | None:
    """The snapshot a ``tuple[Snapshot, ...]`` holds, else None."""
    args = typing.get_args(tp)
    if typing.get_origin(tp) is tuple and args and dataclasses.is_dataclass(args[0]):
        return typing.cast(type, args[0])
    return None


def _nodes(cls: type, prefix: str = "") -> Iterator[tuple[str, object]]:
    """(path, type) of every field under ``cls``, down into nested snapshots (``backing.refused``) and tuples of
    them (``consumers.consumers[].name``)."""
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        path, tp = prefix + f.name, hints[f.name]
        yield path, tp
        if dataclasses.is_dataclass(tp):
            yield from _nodes(typing.cast(type, tp), path + ".")
        elif (item := _item(tp)) is not None:
            yield from _nodes(item, path + "[].")


NODES = dict(_nodes(Status))
LEAVES = {p: tp for p, tp in NODES.items() if not dataclasses.is_dataclass(tp) and _item(tp) is None}


def _read_by(metric) -> list[str]:
    """The paths a metric reads, its labels' included, from the top of Status."""
    base = f"{metric.each}[]." if metric.each else ""
    return [base + p for p in (*metric.fields, *(path for _, path in metric.labels))]


def _numeric(tp: object) -> bool:
    return all(a in (int, float, bool, types.NoneType) for a in (typing.get_args(tp) or (tp,)))


def test_every_metric_reads_fields_that_exist():
    for m in METRICS:
        assert m.each is None or _item(NODES.get(m.each)) is not None, f"{m.name}: each={m.each} is no tuple"
        for path in _read_by(m):
            assert path in LEAVES, f"tierfs_{m.name} reads {path}, which Status does not have"
        if m.value is None:  # rendered as it is: one number
            assert len(m.fields) == 1, f"tierfs_{m.name}: several fields and no value to combine them"
            path = _read_by(m)[0]
            assert _numeric(LEAVES[path]), f"tierfs_{m.name}: {path} is {LEAVES[path]}, not a number"
    for path, why in NOT_METRICS.items():
        assert path in NODES, f"NOT_METRICS names {path}, which Status does not have"
        assert why.strip(), path


def test_every_field_has_a_metric_or_a_reason_not_to():
    exported = {p for m in METRICS for p in _read_by(m)}

    def excused(path: str) -> bool:
        return any(path == k or path.startswith((f"{k}.", f"{k}[].")) for k in NOT_METRICS)

    missing = sorted(p for p in LEAVES if p not in exported and not excused(p))
    both = sorted(p for p in LEAVES if p in exported and excused(p))
    assert not missing, f"fields with neither a metric nor a NOT_METRICS entry: {missing}"
    assert not both, f"fields with a metric that NOT_METRICS also excuses: {both}"


def test_the_table_follows_the_naming_conventions():
    seen: dict[str, tuple[str, str]] = {}
    previous = None
    for m in METRICS:
        assert m.kind in ("gauge", "counter") and m.help.strip(), m.name
        assert m.name.endswith("_total") == (m.kind == "counter"), m.name
        if m.name in seen:  # one family per name: its entries (one per label value) in a row, one header
            assert previous == m.name and seen[m.name] == (m.kind, m.help), m.name
        seen[m.name] = (m.kind, m.help)
        previous = m.name
