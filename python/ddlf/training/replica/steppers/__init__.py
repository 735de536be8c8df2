"""One optimizer step split in two, so that the gradients can be averaged in between
(:class:`~ddlf.GradientAveraging`).

A :class:`Stepper` computes a batch's gradients (and updates the model's loss and metrics, as Keras's own
``train_step`` does), hands them out as numpy arrays, and applies the averaged gradients it is given back with
the model's own optimizer. One stepper per backend:

* Keras on TensorFlow: two ``tf.function``\\ s (gradients under a ``GradientTape``; ``apply_gradients``), traced
  once per run; model averaging's whole steps run :data:`GROUP_STEPS` to a call. Traced without AutoGraph, as
  Keras's own ``fit`` traces its step (``do_not_convert``): converting Keras's code to graph code cost more than
  the whole first epoch of a small model (a user's ``train_step`` runs as it runs under ``fit``).
* Keras on JAX: two jitted, stateless functions over the model's state (as Keras's JAX trainer keeps it), the
  state written back to the Keras variables at the end of each round.
* Keras on PyTorch: eager, as Keras's torch trainer.
* :class:`ddlf.models.TorchModel`: the module's autograd and its ``torch.optim`` optimizer.

Exactness: every replica applies the same averaged gradients to the same weights with the same optimizer state,
so all replicas hold bit-identical trainable weights after every step (the ring's result is bit-identical on every
rank). Weights that are not trained (BatchNorm's moving statistics) follow each replica's own batches during a
round and are averaged at its end (:func:`local_mask` says which).
"""

from __future__ import annotations

from typing import Any

from ....errors import ConfigError
from ....frameworks.adapter import adapter_for
from .base import Stepper, torch_buckets
from .grouped import GROUP_BYTES, GROUP_STEPS, _Grouped

__all__ = [
    "GROUP_BYTES",
    "GROUP_STEPS",
    "Stepper",
    "_Grouped",
    "check_scalable",
    "check_steppable",
    "local_mask",
    "overrides_train_step",
    "stepper_for",
    "steps_whole_rounds",
    "torch_buckets",
]


def stepper_for(model: Any) -> Stepper:
    """The stepper for ``model``'s framework (its adapter's ``kind``: :mod:`ddlf.frameworks.adapter`)."""
    kind = adapter_for(model).kind
    if kind == "keras-tensorflow":
        from .keras_tensorflow import _TensorFlowStepper

        return _TensorFlowStepper(model)
    if kind == "keras-jax":
        from .keras_jax import _JaxStepper

        return _JaxStepper(model)
    if kind == "keras-torch":
        from .keras_torch import _TorchKerasStepper

        return _TorchKerasStepper(model)
    from .torch_model import _TorchModelStepper

    return _TorchModelStepper(model)


def steps_whole_rounds(model: Any) -> bool:
    """Whether model averaging's rounds should run through the model's :class:`Stepper` rather than
    ``train_on_batch``: for Keras on JAX or TensorFlow, whose ``train_on_batch`` writes every variable back and
    waits for the step's logs after each batch (slower per epoch than ``fit``: BENCHMARKS.md, *GPUs*); the
    stepper keeps the state in the framework for a whole round and reads the logs once. Other models (the torch
    backend, :class:`ddlf.models.TorchModel`, ``run_eagerly``) keep ``train_on_batch``."""
    adapter = adapter_for(model)
    if adapter.kind not in ("keras-jax", "keras-tensorflow") or adapter.keras_optimizer() is None:
        return False
    import keras

    return isinstance(model, keras.Model) and not getattr(model, "run_eagerly", False)


def check_scalable(model: Any) -> None:
    """Refuse ``scale_learning_rate`` for a Keras optimizer driven by a learning-rate schedule (its rate is a
    function of the step, not a variable to scale)."""
    schedule = adapter_for(model).learning_rate_schedule()
    if schedule is not None:
        raise ConfigError(
            f"scale_learning_rate does not work with a learning-rate schedule ({type(schedule).__name__}): "
            "scale the schedule itself (its initial rate times the number of workers)"
        )


def overrides_train_step(model: Any) -> bool:
    """Whether ``model`` brings its own ``train_step`` (Keras' guide *Customizing what happens in fit*)."""
    return adapter_for(model).overrides_train_step()


def check_steppable(model: Any, workers: int) -> None:
    """Refuse gradient averaging across ``workers`` > 1 for a model with its own ``train_step`` on JAX. On
    TensorFlow and torch the step runs as written and its optimizer's ``apply`` is caught: the gradients it hands
    over are averaged, then applied (one apply per batch); on one worker the model's own step runs, as in
    ``fit``."""
    adapter = adapter_for(model)
    if workers > 1 and adapter.overrides_train_step() and adapter.kind == "keras-jax":
        raise ConfigError(
            f"GradientAveraging on {workers} workers cannot run {type(model).__name__}'s own train_step on JAX "
            "(its gradients stay inside one compiled, stateless step): train it with ModelAveraging(every=1) "
            "or Asynchronous(), on one worker (RunConfig(workers=[0])), or with Keras on TensorFlow or torch"
        )


def local_mask(model: Any) -> list[bool]:
    """For each array of ``model.get_weights()``: True where it is a float weight the optimizer does not train
    (BatchNorm's moving mean and variance), which each replica updates from its own batches."""
    return adapter_for(model).untrained_mask()
