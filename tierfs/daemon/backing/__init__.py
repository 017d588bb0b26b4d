"""The backing dir: every call into it, and the one verdict on what it answers."""
