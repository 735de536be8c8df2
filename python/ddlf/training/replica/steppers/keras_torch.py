"""Keras on PyTorch: eager, as Keras's torch trainer."""

from __future__ import annotations

from typing import Any

import numpy as np

from ....frameworks.adapter import adapter_for
from .base import torch_buckets
from .keras import _CatchApply, _KerasStepper


class _TorchKerasStepper(_KerasStepper):
    def __init__(self, model: Any) -> None:
        super().__init__(model)
        import torch

        self._torch = torch
        self._custom = adapter_for(model).overrides_train_step()

    def backward(self, x: Any, y: Any, sw: Any = None) -> None:
        import keras

        model, torch = self.model, self._torch
        x, y = keras.tree.map_structure(keras.ops.convert_to_tensor, (x, y))
        sw = None if sw is None else keras.ops.convert_to_tensor(sw)
        y_pred = self._forward(x)
        model.zero_grad()
        loss = self._loss(x, y, y_pred, sw)
        model._loss_tracker.update_state(loss, sample_weight=keras.tree.flatten(x)[0].shape[0])
        model.optimizer.scale_loss(loss).backward()
        with torch.no_grad():
            model.compute_metrics(x, y, y_pred, sample_weight=sw)

    def gradients(self, x: Any, y: Any, sw: Any = None) -> list[np.ndarray]:
        if self._custom:  # the model's own train_step, its optimizer's apply caught (see _CatchApply)
            with _CatchApply(self.model.optimizer) as catch:
                self.model.train_step((x, y) if sw is None else (x, y, sw))
            self.trainable = catch.variables
            return [
                np.zeros(tuple(v.shape), np.dtype(v.dtype)) if g is None else np.asarray(g.detach().cpu().numpy())
                for g, v in catch.pairs
            ]
        self.backward(x, y, sw)
        out = []
        for v in self.trainable:
            g = v.value.grad
            out.append(np.zeros(tuple(v.shape), np.dtype(v.dtype)) if g is None else g.detach().cpu().numpy())
        return out

    def buckets(self, cap_bytes: int, wire: str | None = None) -> Any:
        if self._custom:
            return None  # its gradients come from its own train_step, not from backward()
        return torch_buckets(self, [v.value for v in self.trainable], cap_bytes)

    def apply(self, gradients: list[np.ndarray]) -> None:
        import keras

        with self._torch.no_grad():
            self.model.optimizer.apply([keras.ops.convert_to_tensor(g) for g in gradients], self.trainable)

    def set_trainable(self, values: list[np.ndarray]) -> None:
        with self._torch.no_grad():
            super().set_trainable(values)
