"""Forensics of a run: replay it bit for bit, trace a version's lineage, forget a user's data."""
