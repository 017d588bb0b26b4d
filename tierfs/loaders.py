"""``tierfs.loaders``, the short name users import: a face of :mod:`tierfs.client.loaders` (loaders on batch
plans, no torch), which holds the code and its documentation; the client side is described in
:mod:`tierfs.client`."""

from tierfs.client.loaders import (
                                   DatasetNotFollowing,
                                   FileList,
                                   PassFiles,
                                   PassIndices,
                                   Sample,
                                   copy_intact,
                                   find_classes,
                                   open_sample,
                                   read_pass,
                                   read_path,
                                   read_plan,
                                   read_sample,
                                   tierfs_mount,
)

__all__ = ["DatasetNotFollowing", "FileList", "PassFiles", "PassIndices", "Sample", "copy_intact", "find_classes",
           "open_sample", "read_pass", "read_path", "read_plan", "read_sample", "tierfs_mount"]
