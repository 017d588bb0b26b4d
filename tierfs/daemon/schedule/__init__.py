"""The schedule: the plans, the position and the pass rule that moves it, the views, the cache policy, the jobs
reading a mount."""
