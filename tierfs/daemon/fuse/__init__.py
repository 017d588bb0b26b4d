"""The FUSE shell: requests translated into calls on the engine and its parts; the life of a mount."""
