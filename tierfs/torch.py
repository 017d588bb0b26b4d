"""``tierfs.torch``, the short name users import: a face of :mod:`tierfs.client.torch` (PyTorch datasets and
samplers that follow a mount's passes; imports torch), which holds the code and its documentation; the client
side is described in :mod:`tierfs.client`."""

from tierfs.client.torch import MiniEpochDataset, MiniEpochIterableDataset, MountSampler, MountShards, read_file

__all__ = ["MiniEpochDataset", "MiniEpochIterableDataset", "MountSampler", "MountShards", "read_file"]
