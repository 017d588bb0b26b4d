"""dslide: the D-SLIDE trainer -- LSH-selected sparse layers, numba kernels, model parallelism over MPI."""

import os as _os

# numba's OpenMP threads spin while they wait by default; on a CPU shared with other processes (or ranks
# oversubscribing cores) spinning threads steal the time the working ones need -- 5-10x slower steps were
# measured.  Must be set before the OpenMP runtime starts, hence here; an explicit setting wins.
_os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
# numpy's OpenBLAS runs single-threaded: the batch-shared active set's products already run one per numba thread
# (10.1 vs 15.9 ms a step at 100,000 labels with OpenBLAS's own 2 threads on 2 cores), and OpenBLAS threads left
# spinning after an evaluation slowed the next training steps by 15-20 %.  Only takes effect when dslide is
# imported before numpy (the ``dslide`` command); an explicit setting wins.
_os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")


def __getattr__(name: str) -> str:
    # ``__version__``: tierfs's -- tierfs, sampler and dslide ship as one distribution, versioned from git.
    if name != "__version__":
        raise AttributeError(f"module 'dslide' has no attribute {name!r}")
    from tierfs import __version__

    return __version__
