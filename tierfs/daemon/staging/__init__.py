"""Staging: the next mini-epoch copied into the cache, from the backing or a peer."""
