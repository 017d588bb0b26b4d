import sys

from tierfs.cli.commands import main

sys.exit(main())
