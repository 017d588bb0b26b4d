"""tierfs: a FUSE filesystem that shows the current mini-epoch of a dataset and stages the next one.

Importing the package is cheap: the FUSE layer (pyfuse3) is imported only by the modules that mount, and
``__version__`` is looked up when first asked for.
"""

from __future__ import annotations


def __getattr__(name: str) -> str:
    # ``__version__``: the installed distribution's, which setuptools-scm took from git when it was built or
    # installed (pyproject.toml), so two nodes' `tierfs --version` say whether they run the same commit.  Looked
    # up lazily: importlib.metadata costs milliseconds that `tierfs status` and a loader's import need not pay.
    if name != "__version__":
        raise AttributeError(f"module 'tierfs' has no attribute {name!r}")
    from importlib.metadata import PackageNotFoundError, version

    try:
        found = version("tierfs")
    except PackageNotFoundError:  # a source tree on PYTHONPATH, never installed
        found = "0+unknown"
    globals()["__version__"] = found
    return found
