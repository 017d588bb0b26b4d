"""tierfs: a FUSE filesystem that shows the current mini-epoch of a dataset and stages the next one.

Importing the package is cheap: the FUSE layer (pyfuse3) is imported only by the modules that mount.
"""

__version__ = "0.1.0"
