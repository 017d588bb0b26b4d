"""The command line and deployment: ``tierfs`` and its subcommands, ``tierfs install``, ``tierfs plan``."""
