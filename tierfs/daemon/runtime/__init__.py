"""The daemon's runtime machinery: threads, wake-ups, the heap."""
