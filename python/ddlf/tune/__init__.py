"""Hyperparameter sweeps on one cluster: many trainings at once on disjoint workers, with early stopping (ASHA)."""

from __future__ import annotations

from .result import SweepResult, Trial
from .sweep import sweep

__all__ = ["SweepResult", "Trial", "sweep"]
