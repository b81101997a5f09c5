"""Launching jobs: the local launcher behind `elastrain run`."""
