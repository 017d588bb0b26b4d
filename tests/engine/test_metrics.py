"""The Prometheus text of ``/.tierfs/metrics``, read by prometheus_client's own parser (issue 14)."""

from __future__ import annotations

import pytest

from tierfs.daemon.access import OWNER_UID
from tierfs.daemon.coordinator.status import METRICS

prometheus = pytest.importorskip("prometheus_client.parser")


async def _staged(e, t):
    import trio

    async with trio.open_nursery() as n:
        await n.start(e.run)
        await t.settle(e)
        n.cancel_scope.cancel()


def test_metrics_parse_follow_the_naming_conventions_and_carry_every_status_figure(open_engine, t):
    e = open_engine()
    t.run(lambda: _staged(e, t))

    async def read_some():
        for f in e.schedule.view.order.tolist()[:3]:
            await t.read_file(e, f)

    t.run(read_some)
    status = e.status()
    families = {f.name: f for f in prometheus.text_string_to_metric_families(status.to_prometheus())}
    samples = {s.name: s.value for f in families.values() for s in f.samples}
    for f in families.values():
        assert f.name.startswith("tierfs_")
        assert not f.name.endswith(("_per_second", "_rate")) or f.type == "gauge"
        if f.type == "counter":  # the parser strips _total from a counter family's name; its samples have it
            assert all(s.name.endswith("_total") for s in f.samples), f.name
    # every figure of the status JSON a dashboard would graph is exported
    expected = {
        "tierfs_epoch": status.epoch, "tierfs_mini_epoch": status.mini_epoch, "tierfs_pass": status.pass_,
        "tierfs_rf": status.rf, "tierfs_rf_effective": status.rf_effective[-1], "tierfs_nm": status.nm,
        "tierfs_view_files": status.view_files, "tierfs_view_bytes": status.view_bytes,
        "tierfs_dataset_files": status.dataset_files, "tierfs_dataset_bytes": status.dataset_bytes,
        "tierfs_cache_bytes": status.cache_bytes, "tierfs_cache_files": status.cache_files,
        "tierfs_cache_capacity_bytes": status.cache_capacity, "tierfs_next_ready": int(status.next_ready),
        "tierfs_backing_read_bytes_total": status.backing_bytes_read,
        "tierfs_served_bytes_total": status.served_bytes, "tierfs_opened_bytes_total": status.opened_bytes,
        "tierfs_consumption_bytes_per_second": status.consumption_bytes_per_s,
        "tierfs_cache_repairs_total": status.cache_repairs, "tierfs_open_handles": status.handles,
    }
    for name, value in expected.items():
        assert samples[name] == pytest.approx(value), name
    hits = [s for s in families["tierfs_reads"].samples if s.labels == {"result": "hit"}]
    assert hits and hits[0].value == status.reads.hits == 3


def test_every_metric_of_the_table_renders_and_parses_with_consumers(open_engine, t):
    e = open_engine(rf=2)

    async def read_as(who: str) -> None:
        h = await e.data.open_file(int(e.schedule.view.order[0]), OWNER_UID, who)
        await e.data.release(h)

    for who in ("a", 'b"\\'):
        t.run(lambda who=who: read_as(who))
    status = e.status()
    samples = [s for f in prometheus.text_string_to_metric_families(status.to_prometheus()) for s in f.samples]
    assert {s.name for s in samples} == {f"tierfs_{m.name}" for m in METRICS}  # (a counter's samples keep _total)
    per_consumer = [s for s in samples if s.name == "tierfs_consumer_opens_total"]
    assert {s.labels["consumer"]: s.value for s in per_consumer} == {"a": 1, 'b"\\': 1}
