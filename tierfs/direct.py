"""``tierfs.direct``, the short name users import: a face of :mod:`tierfs.client.direct` (a cached copy opened
directly), which holds the code and its documentation; the client side is described in :mod:`tierfs.client`."""

from tierfs.client.direct import CACHE_PATH_XATTR, cached_path, open_cached

__all__ = ["CACHE_PATH_XATTR", "cached_path", "open_cached"]
