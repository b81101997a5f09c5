"""Elastic data: a seeded global sample order and micro-batch assignment."""

from elastrain.data.order import GlobalOrder, assign_microbatches, assign_rounds, step_microbatches

__all__ = ["GlobalOrder", "assign_microbatches", "assign_rounds", "step_microbatches"]
