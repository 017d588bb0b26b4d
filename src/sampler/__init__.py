"""sampler: the pure algorithms behind tierfs (numpy + stdlib only; no FUSE, no MPI)."""

__version__ = "0.1.0"
