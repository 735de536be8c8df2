"""What every stepper does (:class:`Stepper`), and the gradient buckets the torch steppers share."""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any

import numpy as np

from ....errors import InvalidStateError


class Stepper(ABC):
    """A model's training step, split around the gradient exchange."""

    def begin(self) -> None:  # noqa: B027 - a hook, nothing to do unless a stepper says so
        """A round starts (the model's variables hold its start weights)."""

    @abstractmethod
    def gradients(self, x: Any, y: Any, sw: Any = None) -> list[np.ndarray]:
        """This batch's gradients of the mean loss (weighted by the rows' sample weights ``sw``, as ``fit``
        weighs them), one array per trainable weight (zeros for unused weights); the model's running loss and
        metrics count the batch."""

    @abstractmethod
    def apply(self, gradients: list[np.ndarray]) -> None:
        """One optimizer step with ``gradients`` (what :meth:`gradients` returned, averaged)."""

    def step(self, x: Any, y: Any, sw: Any = None) -> None:
        """One whole training step on a batch (model averaging: nothing in between). A stepper may gather several
        and run them together, in order, at the latest by :meth:`end`."""
        self.apply(self.gradients(x, y, sw))

    @abstractmethod
    def end(self) -> dict[str, float]:
        """The round ends: the model's variables hold the result. Returns the running logs."""

    def finish(self) -> None:
        """Close a round without its logs (a finished run's stepper kept warm, or a run torn down mid-round): the
        model's variables hold the result, as after :meth:`end`. By default :meth:`end` itself; a stepper whose
        logs cost a computation overrides it."""
        self.end()

    def close(self) -> None:
        """Let go of what the stepper started (PyTorch's gradient buckets: their thread and hooks), when its run is
        torn down and it is not kept warm. Idempotent."""
        held = getattr(self, "_buckets", None)
        if held is not None and held[1] is not None:
            held[1].close()
        self._buckets = None

    @abstractmethod
    def zeros(self) -> list[np.ndarray]:
        """Zero gradients (a replica without a batch this step contributes them, with weight 0)."""

    @abstractmethod
    def build_optimizer(self) -> None:
        """Create the optimizer's state (slots) if it has none yet, leaving the weights as they are."""

    @abstractmethod
    def set_learning_rate_factor(self, factor: float) -> None:
        """Scale the optimizer's learning rate to ``factor`` times the one the model was compiled with."""

    def buckets(self, cap_bytes: int, wire: str | None = None) -> Any:
        """An exchange that reduces this model's gradients while its backward pass runs (then :meth:`backward`
        hands it a batch): :class:`~.buckets.Buckets` on PyTorch, :class:`~.graph_buckets.GraphBuckets` on
        TensorFlow; ``None`` where the gradients come from one compiled, stateless call (Keras on JAX) or the
        model is not supported (``wire``: the ring's half-precision wire type, if any)."""
        return None

    def backward(self, x: Any, y: Any, sw: Any = None) -> None:
        """Forward and backward on a batch, leaving the gradients where :meth:`buckets`' hooks read them (only for a
        stepper whose :meth:`buckets` gives some)."""
        raise InvalidStateError(f"{type(self).__name__} reduces no gradient buckets: backward() needs buckets()")

    base_lr: Any = None
    """The learning rate (torch: each parameter group's) that :meth:`set_learning_rate_factor` scales; None until
    it is first read."""

    scaled = False
    """The model scales its loss (``TorchModel(precision="16-mixed")``): gradients that are not finite are averaged
    in rather than left out, so that every worker's gradient scaler sees the same overflow, skips the same step and
    shrinks its scale alike (as under DDP)."""

    sharded = False
    """Set by a sharded optimizer (:mod:`.sharded`): the model's own optimizer is never built (its state lives
    in shards), and the new weights come through :meth:`set_trainable`."""

    @abstractmethod
    def set_trainable(self, values: list[np.ndarray]) -> None:
        """Write ``values`` into the trainable weights (in order)."""


def torch_buckets(stepper: Any, params: list[Any], cap_bytes: int, keep_nonfinite: bool = False) -> Any:
    """The torch steppers' :meth:`Stepper.buckets`: one per stepper and cap, ``None`` unless every parameter is
    float32 (``keep_nonfinite``: see :attr:`Stepper.scaled`)."""
    from ..buckets import Buckets

    held = getattr(stepper, "_buckets", None)
    if held is not None and held[0] == cap_bytes:
        return held[1]
    if held is not None and held[1] is not None:
        held[1].close()
    made = Buckets(params, cap_bytes, keep_nonfinite) if Buckets.supports(params) else None
    stepper._buckets = (cap_bytes, made)
    return made
