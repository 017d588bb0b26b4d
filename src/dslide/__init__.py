"""dslide: the D-SLIDE trainer -- LSH-selected sparse layers, numba kernels, model parallelism over MPI."""

__version__ = "0.1.0"
