"""Shared fixtures.  Tier-specific fixtures live in each tier's conftest."""
