"""The schedule: the plans, the position, the views, the cache policy, the jobs reading a mount."""
