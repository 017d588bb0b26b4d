"""The kernel's caches: page-cache pushes, entry and inode invalidations, passthrough."""
