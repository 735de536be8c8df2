"""Callbacks for ``app.train`` (they live in :mod:`ddlf.training.callbacks`)."""

from __future__ import annotations

from .training.callbacks import Callback, EarlyStopping, LambdaCallback, ModelCheckpoint, ProgressBar, TensorBoard

__all__ = ["Callback", "EarlyStopping", "LambdaCallback", "ModelCheckpoint", "ProgressBar", "TensorBoard"]
