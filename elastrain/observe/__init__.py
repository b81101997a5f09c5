"""Observability: structured events, recovery phases, goodput."""
