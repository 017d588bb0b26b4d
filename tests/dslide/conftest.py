"""The dslide trainer trained, in one process (no MPI): learning, determinism, resume, its command line.  Outside
the fast tier (seconds a test); ``numba_threads`` comes from tests/conftest.py."""
