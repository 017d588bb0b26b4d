"""``python -m dslide`` is the ``dslide`` command."""

from dslide.cli import main

raise SystemExit(main())
