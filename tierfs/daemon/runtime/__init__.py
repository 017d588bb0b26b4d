"""The daemon's runtime machinery: threads, wake-ups, background jobs, the heap."""
