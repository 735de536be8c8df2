""":class:`ddlf.models.TorchModel`: the module's autograd and its ``torch.optim`` optimizer."""

from __future__ import annotations

from typing import Any

import numpy as np

from ....errors import ConfigError
from ....frameworks.torch_model import TorchModel
from .base import Stepper, torch_buckets


def _no_sample_weights(sw: Any) -> None:
    if sw is not None:
        raise ConfigError(
            "a ddlf.models.TorchModel takes no sample weights (class_weight, sample_weight): weigh the rows in its "
            "loss function instead"
        )


class _TorchModelStepper(Stepper):
    """:class:`TorchModel`'s training step split around the gradient exchange (see
    :class:`ddlf.training.replica.steppers.Stepper`)."""

    def __init__(self, model: TorchModel) -> None:
        self.model = model
        self.params = [p for p in model.module.parameters() if p.requires_grad]
        self.base_lr: list[float] | None = None
        self.scaled = model.scaler is not None

    def begin(self) -> None:
        pass

    def backward(self, x: Any, y: Any, sw: Any = None) -> None:
        _no_sample_weights(sw)
        self.model._backward(x, y)

    def buckets(self, cap_bytes: int, wire: str | None = None) -> Any:
        return torch_buckets(self, self.params, cap_bytes, keep_nonfinite=self.scaled)

    def gradients(self, x: Any, y: Any, sw: Any = None) -> list[np.ndarray]:
        _no_sample_weights(sw)
        self.model._backward(x, y)
        return [
            np.zeros(tuple(p.shape), np.float32) if p.grad is None else p.grad.detach().cpu().numpy()
            for p in self.params
        ]

    def apply(self, gradients: list[np.ndarray]) -> None:
        m = self.model
        for p, g in zip(self.params, gradients):
            p.grad = m._tensor(g).to(device=p.device, dtype=p.dtype)
        m._step()  # unscaled ("16-mixed"), clipped (clip_grad_norm), stepped

    def end(self) -> dict[str, float]:
        return {k: float(v) for k, v in self.model.get_metrics_result().items()}

    def zeros(self) -> list[np.ndarray]:
        return [np.zeros(tuple(p.shape), np.float32) for p in self.params]

    def set_trainable(self, values: list[np.ndarray]) -> None:
        m = self.model
        with m._torch.no_grad():
            for p, a in zip(self.params, values):
                p.copy_(m._tensor(a))

    def build_optimizer(self) -> None:
        """torch creates an optimizer's state on its first step: take one with zero gradients and put the
        weights back (weight decay would have moved them)."""
        m = self.model
        if m.optimizer_built:
            return
        saved = m.get_weights()
        m.optimizer.zero_grad(set_to_none=False)
        for p in self.params:
            if p.grad is None:
                p.grad = m._torch.zeros_like(p)
        m.optimizer.step()
        m.optimizer.zero_grad(set_to_none=True)
        m.set_weights(saved)

    def set_learning_rate_factor(self, factor: float) -> None:
        groups = self.model.optimizer.param_groups
        if self.base_lr is None:
            self.base_lr = [float(g["lr"]) for g in groups]
        for g, lr in zip(groups, self.base_lr):
            g["lr"] = lr * factor
