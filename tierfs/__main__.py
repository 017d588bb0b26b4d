import sys

from tierfs.cli import main

sys.exit(main())
