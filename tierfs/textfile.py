"""Metrics for fleets: a mount's Prometheus text with its mountpoint on every sample, written atomically into a
node-exporter textfile-collector dir (``tierfs metrics MOUNTPOINT --textfile DIR``).

The daemon's ``/.tierfs/metrics`` names its mount once, in ``tierfs_info`` (a scrape of one mount per target
needs no more); a textfile dir gathers the files of every mount on the node into one scrape, where the same
series of two mounts would collide, so each file carries ``mountpoint`` on all its samples.  Client side: it
imports nothing of the daemon.
"""

from __future__ import annotations

import os

from sampler.atomic import atomic_write

__all__ = ["escape_label", "mountpoint_file_name", "textfile_path", "with_labels", "write_textfile"]


def escape_label(value: str) -> str:
    """A label value as the exposition format writes it (backslash, double quote and newline escaped)."""
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


def mountpoint_file_name(mountpoint: str) -> str:
    """``/mnt/imagenet`` -> ``mnt-imagenet``: a mount's files outside it (its log, its textfile) are named so; a
    ``-`` in a component is doubled, so two mountpoints never share a name."""
    return os.path.abspath(mountpoint).strip("/").replace("-", "--").replace("/", "-") or "root"


def with_labels(text: str, labels: dict[str, str]) -> str:
    """``text`` (Prometheus exposition, samples without timestamps) with ``labels`` added to every sample that
    does not have them already."""
    out = []
    for line in text.splitlines():
        if line and not line.startswith("#"):
            series, value = line.rsplit(" ", 1)
            extra = ",".join(f'{k}="{escape_label(v)}"' for k, v in labels.items() if f'{k}="' not in series)
            if extra:
                series = f"{series[:-1]},{extra}}}" if series.endswith("}") else f"{series}{{{extra}}}"
            line = f"{series} {value}"
        out.append(line)
    return "\n".join(out) + "\n"


def textfile_path(directory: str, mountpoint: str) -> str:
    """The mount's file in a textfile-collector dir (the collector reads ``*.prom``; the temp file is not one)."""
    return os.path.join(directory, f"tierfs-{mountpoint_file_name(mountpoint)}.prom")


def write_textfile(directory: str, mountpoint: str, text: str) -> str:
    """Write the mount's metrics, labelled with its mountpoint, atomically into ``directory``; returns the path.
    Mode 0644: node-exporter runs as its own user."""
    path = textfile_path(directory, mountpoint)
    atomic_write(path, with_labels(text, {"mountpoint": mountpoint}).encode(), mode=0o644)
    return path
