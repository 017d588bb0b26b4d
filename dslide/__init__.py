"""dslide: the D-SLIDE trainer -- LSH-selected sparse layers, numba kernels, model parallelism over MPI."""

import os as _os

# numba's OpenMP threads spin while they wait by default; on a CPU shared with other processes (or ranks
# oversubscribing cores) spinning threads steal the time the working ones need -- 5-10x slower steps were
# measured.  Must be set before the OpenMP runtime starts, hence here; an explicit setting wins.
_os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

__version__ = "0.1.0"
