"""Metrics for fleets: a mount's Prometheus text with its mountpoint on every sample, written atomically into a
node-exporter textfile-collector dir (``tierfs metrics MOUNTPOINT --textfile DIR``).

The daemon's ``/.tierfs/metrics`` names its mount once, in ``tierfs_info`` (a scrape of one mount per target
needs no more); a textfile dir gathers the files of every mount on the node into one scrape, where the same
series of two mounts would collide, so each file carries ``mountpoint`` on all its samples.  The text is parsed
and written again by prometheus_client (:class:`MountMetrics`), never edited as a string.  Not the training
job's side (``tierfs.client`` imports none of this, nor prometheus_client): ``tierfs metrics`` and the daemon's
file names.
"""

from __future__ import annotations

import os
from collections.abc import Iterator

from prometheus_client.exposition import generate_latest
from prometheus_client.metrics_core import GaugeMetricFamily, Metric
from prometheus_client.parser import text_string_to_metric_families

from sampler.atomic import atomic_write
from tierfs.common.mountinfo import mountpoint_file_name

__all__ = ["MountMetrics", "textfile_path", "write_textfile"]


class MountMetrics:
    """prometheus_client's collector of one mount's metrics as ``tierfs metrics`` gives them: ``tierfs_up`` (1, or
    0 when ``text`` is None: the mount did not answer), then the families of ``text`` (the mount's
    ``/.tierfs/metrics``), each sample labelled ``mountpoint`` unless it has that label already."""

    def __init__(self, mountpoint: str, text: str | None) -> None:
        self.mountpoint = mountpoint
        self.text = text

    def collect(self) -> Iterator[Metric]:
        up = GaugeMetricFamily("tierfs_up", "1 if the mount answered.", labels=["mountpoint"])
        up.add_metric([self.mountpoint], 0.0 if self.text is None else 1.0)
        yield up
        for family in text_string_to_metric_families(self.text or ""):
            family.samples = [s._replace(labels={"mountpoint": self.mountpoint, **s.labels}) for s in family.samples]
            yield family

    def exposition(self) -> bytes:
        """The Prometheus text (exposition format 0.0.4)."""
        return generate_latest(self)


def textfile_path(directory: str, mountpoint: str) -> str:
    """The mount's file in a textfile-collector dir (the collector reads ``*.prom``; the temp file is not one)."""
    return os.path.join(directory, f"tierfs-{mountpoint_file_name(mountpoint)}.prom")


def write_textfile(directory: str, mountpoint: str, exposition: bytes) -> str:
    """Write ``exposition`` (:meth:`MountMetrics.exposition`) atomically as the mount's file in ``directory``;
    returns the path.

    With the project's one atomic write (temp file in the dir, fsync, rename, fsync the dir) rather than
    prometheus_client's ``write_to_textfile``, which neither syncs nor sets the mode: here mode 0644 whatever the
    umask, since node-exporter runs as its own user."""
    path = textfile_path(directory, mountpoint)
    atomic_write(path, exposition, mode=0o644)
    return path
