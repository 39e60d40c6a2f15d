"""Chaos for a live run: the faults and attacks a driver injects, and broker failovers."""
