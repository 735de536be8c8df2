"""Model adapters: other frameworks' models behind the training API that ddlf drives on Keras models.

``TorchModel`` wraps a ``torch.nn.Module`` with its optimizer and loss so that an app's ``create_model`` can return
it and train it with ``app.train`` (sync or async), ``app.evaluate``, History, callbacks and checkpoints, exactly
as a compiled Keras model. torch is imported only when a ``TorchModel`` is made.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

__all__ = ["TorchModel"]

_METRICS = ("accuracy",)


def _arrays(tensors: Sequence[Any]) -> list[np.ndarray]:
    """numpy copies of tensors (a copy: the model keeps training in place)."""
    return [t.detach().cpu().numpy().copy() for t in tensors]


class TorchModel:
    """A ``torch.nn.Module`` with a Keras-like training API.

    Args:
        module: the network; its floating-point parameters and buffers are the weights that travel and are averaged
            (integer buffers, such as batch-norm counters, stay local to each copy).
        optimizer: a ``torch.optim.Optimizer`` over ``module.parameters()``, or a function taking the parameters
            and returning one (``lambda p: torch.optim.Adam(p, lr=1e-3)``).
        loss_fn: ``loss_fn(outputs, targets)`` returning a scalar tensor, e.g. ``torch.nn.CrossEntropyLoss()``.
        metrics: ``("accuracy",)`` (argmax of the outputs against integer targets) or ``()``.
        target_dtype: the dtype targets are converted to (``"long"`` suits class labels, ``"float32"`` regression).

    ``get_weights``/``set_weights``, ``train_on_batch``, ``evaluate``, ``predict``, ``reset_metrics``, ``save``,
    ``save_weights``/``load_weights`` behave like Keras's; the optimizer's state and the random generator's state
    are reachable through ``get_optimizer_state``/``set_optimizer_state`` and ``get_rng_state``/``set_rng_state``
    (``ModelAveraging(optimizer_state=True)`` and checkpoints use them).
    """

    def __init__(
        self,
        module: Any,
        optimizer: Any,
        loss_fn: Callable[[Any, Any], Any],
        metrics: Sequence[str] = ("accuracy",),
        target_dtype: str = "long",
    ) -> None:
        import torch

        from .loading import check_torch_compiler_can_load

        check_torch_compiler_can_load()  # an abort (TensorFlow loaded first) becomes an error
        unknown = [m for m in metrics if m not in _METRICS]
        if unknown:
            raise ValueError(f"unknown metrics {unknown}: TorchModel computes {list(_METRICS)}")
        if not isinstance(module, torch.nn.Module):
            raise TypeError(f"module must be a torch.nn.Module, got {type(module).__name__}")
        self.module = module
        self.optimizer = optimizer if isinstance(optimizer, torch.optim.Optimizer) else optimizer(module.parameters())
        if not isinstance(self.optimizer, torch.optim.Optimizer):
            raise TypeError("optimizer must be a torch.optim.Optimizer or a function returning one")
        self.loss_fn = loss_fn
        self.metrics = tuple(metrics)
        self._target_dtype = getattr(torch, target_dtype)
        self._torch = torch
        self.reset_metrics()

    # -- weights ----------------------------------------------------------------------------------------------

    def _tensors(self) -> list[Any]:
        return [t for t in self.module.state_dict(keep_vars=True).values() if t.is_floating_point()]

    def get_weights(self) -> list[np.ndarray]:
        """Copies of the floating-point parameters and buffers, in ``state_dict`` order."""
        return _arrays(self._tensors())

    def set_weights(self, weights: Sequence[np.ndarray]) -> None:
        """Copy ``weights`` (as returned by :meth:`get_weights`) into the module."""
        tensors = self._tensors()
        if len(weights) != len(tensors):
            raise ValueError(f"expected {len(tensors)} weight arrays, got {len(weights)}")
        with self._torch.no_grad():
            for t, w in zip(tensors, weights):
                w = np.asarray(w)
                if tuple(w.shape) != tuple(t.shape):
                    raise ValueError(f"weight of shape {w.shape} does not fit a tensor of shape {tuple(t.shape)}")
                t.copy_(self._tensor(w))

    @property
    def weights(self) -> list[Any]:
        """The tensors behind :meth:`get_weights`."""
        return self._tensors()

    def count_params(self) -> int:
        """Number of trainable parameters."""
        return sum(p.numel() for p in self.module.parameters() if p.requires_grad)

    # -- training and evaluation ------------------------------------------------------------------------------

    def _tensor(self, a: Any) -> Any:
        """A tensor on ``a``'s memory, without a copy. Arrays that arrived over the wire may be read-only; every
        caller only reads them (torch warns about read-only arrays all the same)."""
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)
            return self._torch.from_numpy(np.asarray(a))

    def _targets(self, y: Any) -> Any:
        return self._tensor(y).to(self._target_dtype)

    def reset_metrics(self) -> None:
        """Start the running loss and metrics afresh (as Keras's ``model.reset_metrics``)."""
        self._seen = 0
        self._loss_sum = 0.0
        self._correct = 0

    def _logs(self, loss_sum: float, correct: int, seen: int, return_dict: bool) -> Any:
        logs = {"loss": loss_sum / max(seen, 1)}
        if "accuracy" in self.metrics:
            logs["accuracy"] = correct / max(seen, 1)
        if return_dict:
            return logs
        values = list(logs.values())
        return values[0] if len(values) == 1 else values

    def _count_correct(self, out: Any, target: Any) -> int:
        if "accuracy" not in self.metrics:
            return 0
        return int((out.argmax(dim=-1) == target).sum())

    def _backward(self, x: Any, y: Any) -> None:
        """Forward and backward on a batch (the gradients are in the parameters' ``.grad``); the running loss and
        accuracy count it."""
        self.module.train()
        inputs, target = self._tensor(x), self._targets(y)
        self.optimizer.zero_grad(set_to_none=True)
        out = self.module(inputs)
        loss = self.loss_fn(out, target)
        loss.backward()
        n = len(target)
        self._seen += n
        self._loss_sum += float(loss.detach()) * n
        self._correct += self._count_correct(out.detach(), target)

    def train_on_batch(self, x: Any, y: Any, return_dict: bool = False) -> Any:
        """One optimizer step on a batch; returns the running loss (and accuracy) since :meth:`reset_metrics`."""
        self._backward(x, y)
        self.optimizer.step()
        return self._logs(self._loss_sum, self._correct, self._seen, return_dict)

    def evaluate(
        self, x: Any, y: Any, batch_size: int = 32, verbose: int = 0, return_dict: bool = False, **_: Any
    ) -> Any:
        """Mean loss (and accuracy) over ``x, y``, in evaluation mode without gradients."""
        self.module.eval()
        loss_sum, correct, seen = 0.0, 0, 0
        with self._torch.no_grad():
            for start in range(0, len(x), batch_size):
                inputs, target = (
                    self._tensor(x[start : start + batch_size]),
                    self._targets(y[start : start + batch_size]),
                )
                out = self.module(inputs)
                n = len(target)
                loss_sum += float(self.loss_fn(out, target)) * n
                correct += self._count_correct(out, target)
                seen += n
        return self._logs(loss_sum, correct, seen, return_dict)

    def predict(self, x: Any, batch_size: int = 32, verbose: int = 0) -> np.ndarray:
        """The module's outputs on ``x``, as one numpy array."""
        self.module.eval()
        with self._torch.no_grad():
            parts = [self.module(self._tensor(x[s : s + batch_size])).numpy() for s in range(0, len(x), batch_size)]
        return np.concatenate(parts) if parts else np.empty((0,))

    # -- gradient averaging -------------------------------------------------------------------------------------

    def untrained_mask(self) -> list[bool]:
        """For each array of :meth:`get_weights`: True for buffers the optimizer does not train (BatchNorm's
        running statistics)."""
        trained = {id(p) for p in self.module.parameters() if p.requires_grad}
        return [id(t) not in trained for t in self._tensors()]

    # -- state beyond the weights -----------------------------------------------------------------------------

    def _optimizer_tensors(self) -> list[Any] | None:
        """The optimizer's per-parameter state tensors in a fixed order; None before its first step."""
        out: list[Any] = []
        for group in self.optimizer.param_groups:
            for p in group["params"]:
                state = self.optimizer.state.get(p)
                if not state:
                    return None
                out.extend(state[k] for k in sorted(state) if self._torch.is_tensor(state[k]))
        return out

    @property
    def optimizer_built(self) -> bool:
        """Whether the optimizer has state yet (it is created by the first step)."""
        return self._optimizer_tensors() is not None

    def get_optimizer_state(self) -> list[np.ndarray]:
        """Copies of the optimizer's state tensors (Adam's moments and step), empty before the first step."""
        return _arrays(self._optimizer_tensors() or [])

    def set_optimizer_state(self, state: Sequence[np.ndarray]) -> bool:
        """Adopt ``state`` (from :meth:`get_optimizer_state`); False, and nothing changed, if it does not fit (this
        optimizer has not stepped yet, or another layout)."""
        tensors = self._optimizer_tensors()
        if tensors is None or len(tensors) != len(state):
            return False
        if any(tuple(t.shape) != tuple(np.shape(s)) for t, s in zip(tensors, state)):
            return False
        with self._torch.no_grad():
            for t, s in zip(tensors, state):
                t.copy_(self._tensor(s))
        return True

    def get_rng_state(self) -> list[np.ndarray]:
        """torch's CPU random generator state (dropout masks), so a resumed run draws the same numbers."""
        return [self._torch.get_rng_state().numpy().copy()]

    def set_rng_state(self, state: Sequence[np.ndarray]) -> None:
        """Put back :meth:`get_rng_state`."""
        if len(state) == 1:
            self._torch.set_rng_state(self._tensor(np.asarray(state[0], dtype=np.uint8)))

    # -- saving -----------------------------------------------------------------------------------------------

    def save(self, path: str) -> None:
        """Save the module's ``state_dict`` with ``torch.save``."""
        self._torch.save(self.module.state_dict(), path)

    save_weights = save

    def load_weights(self, path: str) -> None:
        """Load a ``state_dict`` written by :meth:`save`."""
        self.module.load_state_dict(self._torch.load(path, weights_only=True))

    def __repr__(self) -> str:
        return (
            f"TorchModel({type(self.module).__name__}, {type(self.optimizer).__name__}, {self.count_params():,} params)"
        )
