"""The cache dir: the copies on the fast tier, the index and the journal kept there."""
