"""The tree: the backing's tree scanned, saved and kept."""
