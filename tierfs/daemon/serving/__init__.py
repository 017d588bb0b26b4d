"""Names and file data served: lookups and listings, opens and reads, batch plans, pins."""
