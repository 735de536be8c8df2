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

from abc import ABC, abstractmethod
from typing import Any

import numpy as np

from ...errors import ConfigError, InvalidStateError
from ...frameworks.torch_model import TorchModel
from .tracing import AnyBatchSize


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

    sharded = False
    """Set by a sharded optimizer (:mod:`.sharded`): the model's own optimizer is never built (its state lives
    in shards), and the new weights come through :meth:`set_trainable`."""

    @abstractmethod
    def set_trainable(self, values: list[np.ndarray]) -> None:
        """Write ``values`` into the trainable weights (in order)."""


def torch_buckets(stepper: Any, params: list[Any], cap_bytes: int) -> Any:
    """The torch steppers' :meth:`Stepper.buckets`: one per stepper and cap, ``None`` unless every parameter is
    float32."""
    from .buckets import Buckets

    held = getattr(stepper, "_buckets", None)
    if held is not None and held[0] == cap_bytes:
        return held[1]
    if held is not None and held[1] is not None:
        held[1].close()
    made = Buckets(params, cap_bytes) if Buckets.supports(params) else None
    stepper._buckets = (cap_bytes, made)
    return made


def stepper_for(model: Any) -> Stepper:
    """The stepper for ``model``: a :class:`ddlf.models.TorchModel`'s, or the one for the Keras backend it runs
    on."""
    if isinstance(model, TorchModel):
        return _TorchModelStepper(model)
    import keras

    backend = keras.backend.backend()
    if backend == "tensorflow":
        return _TensorFlowStepper(model)
    if backend == "jax":
        return _JaxStepper(model)
    if backend == "torch":
        return _TorchKerasStepper(model)
    raise ConfigError(f"GradientAveraging does not support the Keras backend {backend!r}")


def steps_whole_rounds(model: Any) -> bool:
    """Whether model averaging's rounds should run through the model's :class:`Stepper` rather than
    ``train_on_batch``: for Keras on JAX or TensorFlow, whose ``train_on_batch`` writes every variable back and
    waits for the step's logs after each batch (slower per epoch than ``fit``: BENCHMARKS.md, *GPUs*); the
    stepper keeps the state in the framework for a whole round and reads the logs once. Other models (the torch
    backend, :class:`ddlf.models.TorchModel`, ``run_eagerly``) keep ``train_on_batch``."""
    if isinstance(model, TorchModel) or getattr(model, "optimizer", None) is None:
        return False
    try:
        import keras
    except ImportError:
        return False
    if not isinstance(model, keras.Model) or getattr(model, "run_eagerly", False):
        return False
    return keras.backend.backend() in ("jax", "tensorflow")


def check_scalable(model: Any) -> None:
    """Refuse ``scale_learning_rate`` for a Keras optimizer driven by a learning-rate schedule (its rate is a
    function of the step, not a variable to scale)."""
    optimizer = getattr(model, "optimizer", None)
    rate = getattr(optimizer, "_learning_rate", None)
    if rate is None or isinstance(model, TorchModel):
        return
    import keras

    if isinstance(rate, keras.optimizers.schedules.LearningRateSchedule):
        raise ConfigError(
            f"scale_learning_rate does not work with a learning-rate schedule ({type(rate).__name__}): "
            "scale the schedule itself (its initial rate times the number of workers)"
        )


def overrides_train_step(model: Any) -> bool:
    """Whether ``model`` brings its own ``train_step`` (Keras' guide *Customizing what happens in fit*)."""
    for cls in type(model).__mro__:
        if "train_step" in vars(cls):
            return not cls.__module__.startswith("keras.")
    return False


def check_steppable(model: Any, workers: int) -> None:
    """Refuse gradient averaging across ``workers`` > 1 for a model with its own ``train_step`` on JAX. On
    TensorFlow and torch the step runs as written and its optimizer's ``apply`` is caught: the gradients it hands
    over are averaged, then applied (one apply per batch); on one worker the model's own step runs, as in
    ``fit``."""
    if workers > 1 and overrides_train_step(model):
        import keras

        if keras.backend.backend() == "jax":
            raise ConfigError(
                f"GradientAveraging on {workers} workers cannot run {type(model).__name__}'s own train_step on JAX "
                "(its gradients stay inside one compiled, stateless step): train it with ModelAveraging(every=1) "
                "or Asynchronous(), on one worker (RunConfig(workers=[0])), or with Keras on TensorFlow or torch"
            )


def local_mask(model: Any) -> list[bool]:
    """For each array of ``model.get_weights()``: True where it is a float weight the optimizer does not train
    (BatchNorm's moving mean and variance), which each replica updates from its own batches."""
    own = getattr(model, "untrained_mask", None)
    if own is not None:
        return list(own())
    trained = {id(v) for v in model.trainable_weights}
    return [id(v) not in trained and np.dtype(v.dtype).kind == "f" for v in model.weights]


# -- whole steps gathered for one compiled call (Keras on TensorFlow) -------------------------------------------

GROUP_STEPS = 16
"""On TensorFlow, model averaging's rounds run up to this many whole steps in one ``tf.function`` call (as Keras's
``steps_per_execution``): a small model's step costs less than the call into it (BENCHMARKS.md, *Small models*).
Not on JAX, whose calls are dispatched asynchronously: there the same loop (``lax.fori_loop`` or ``scan``) made the
CNN's epoch far slower on CPU and added seconds of compiling."""
GROUP_BYTES = 8 << 20
"""...and only while the gathered batches of one call take at most this many bytes (large batches gain nothing)."""


def _joins(stack: np.ndarray | None, a: np.ndarray) -> bool:
    return stack is not None and stack.shape[1:] == a.shape and stack.dtype == a.dtype


class _Grouped:
    """Gathers a round's batches into a stack of :data:`GROUP_STEPS` for ``many(xs, ys, n)``, one compiled call
    that steps through the first ``n`` in order (``n`` is an argument of the call, not of its compilation: one
    compiled loop serves full stacks and the round's last, partial one). ``one(x, y, sw)`` steps a batch that
    cannot join a stack (not a numpy array (a dict of named inputs), weighted, or too large to gain from it).
    The steps and their order are those of one
    call each."""

    def __init__(self, one: Any, many: Any) -> None:
        self._one, self._many = one, many
        self._xs: np.ndarray | None = None
        self._ys: np.ndarray | None = None
        self._n = 0

    def add(self, x: Any, y: Any, sw: Any = None) -> None:
        if type(x) is not np.ndarray or type(y) is not np.ndarray or sw is not None:
            self.flush()
            self._one(x, y, sw)
            return
        xs, ys = self._xs, self._ys
        if not (_joins(xs, x) and _joins(ys, y)):
            self.flush()
            k = min(GROUP_STEPS, GROUP_BYTES // max(1, x.nbytes + y.nbytes))
            if k < 2:
                self._one(x, y, None)
                return
            # A new stack each time: the framework may keep a reference to the last one (TensorFlow can alias a
            # numpy array's memory).
            xs = self._xs = np.empty((k, *x.shape), x.dtype)
            ys = self._ys = np.empty((k, *y.shape), y.dtype)
        assert xs is not None and ys is not None
        xs[self._n] = x
        ys[self._n] = y
        self._n += 1
        if self._n == len(xs):
            self.flush()

    def flush(self) -> None:
        """Step the gathered batches now."""
        xs, ys, n = self._xs, self._ys, self._n
        self._xs = self._ys = None
        self._n = 0
        if n:
            self._many(xs, ys, n)


# -- Keras ---------------------------------------------------------------------------------------------------


class _KerasStepper(Stepper):
    def __init__(self, model: Any) -> None:
        if getattr(model, "optimizer", None) is None:
            raise ConfigError("ddlf trains a compiled model: create_model must compile it (model.compile(...))")
        self.model = model
        self.trainable = list(model.trainable_weights)
        if not self.trainable:
            raise ConfigError(
                "the model has no trainable weights: every layer is frozen (trainable=False), so there is nothing "
                "to train"
            )
        self.base_lr: float | None = None

    def _flush(self) -> None:
        """Run the whole steps gathered so far (TensorFlow) before anything else reads or changes the model's
        state."""

    def _loss(self, x: Any, y: Any, y_pred: Any, sw: Any = None) -> Any:
        model = self.model
        compute = getattr(model, "_compute_loss", None) or model.compute_loss
        return compute(x=x, y=y, y_pred=y_pred, sample_weight=sw, training=True)

    def _build(self, x: Any, y: Any, sw: Any = None) -> None:
        """Build what Keras builds on a model's first batch (its compiled metrics and loss), and the optimizer."""
        if x is not None:
            self.model._symbolic_build(data_batch=(x, y, sw))
        if not self.sharded:
            self.build_optimizer()

    def _forward(self, x: Any) -> Any:
        model = self.model
        return model(x, training=True) if getattr(model, "_call_has_training_arg", True) else model(x)

    def zeros(self) -> list[np.ndarray]:
        return [np.zeros(tuple(v.shape), dtype=np.dtype(v.dtype)) for v in self.trainable]

    def set_trainable(self, values: list[np.ndarray]) -> None:
        self._flush()
        for v, a in zip(self.trainable, values):
            v.assign(a)

    def build_optimizer(self) -> None:
        if not self.model.optimizer.built:
            self.model.optimizer.build(self.trainable)

    def end(self) -> dict[str, float]:
        self._flush()
        if not all(getattr(m, "built", True) for m in self.model.metrics):
            return {}  # no batch here yet (fewer rows than workers): Keras builds compiled metrics on the first
        return {k: float(v) for k, v in self.model.get_metrics_result().items()}

    def set_learning_rate_factor(self, factor: float) -> None:
        self._flush()
        optimizer = self.model.optimizer
        check_scalable(self.model)
        if self.base_lr is None:
            self.base_lr = float(np.asarray(optimizer.learning_rate))
        optimizer.learning_rate = self.base_lr * factor


class _CatchApply:
    """While open, the optimizer's ``apply`` (which ``apply_gradients`` calls too) records the gradients and
    variables a custom ``train_step`` hands it, and applies nothing: the gradients are averaged first."""

    def __init__(self, optimizer: Any) -> None:
        self.optimizer = optimizer
        self.pairs: list[tuple[Any, Any]] = []

    @property
    def variables(self) -> list[Any]:
        return [v for _, v in self.pairs]

    def __enter__(self) -> _CatchApply:
        def catch(grads: Any, trainable_variables: Any = None) -> None:
            if self.pairs:
                raise ConfigError(
                    "GradientAveraging: this train_step applies gradients more than once per batch (several "
                    "optimizers, a GAN's two steps); train it with ModelAveraging or Asynchronous"
                )
            self.pairs = list(zip(grads, trainable_variables))

        self.optimizer.apply = catch  # an instance attribute: found before the class's method
        return self

    def __exit__(self, *exc: object) -> None:
        del self.optimizer.apply
        if exc[0] is None and not self.pairs:
            raise ConfigError("GradientAveraging: this train_step applied no gradients (it calls no optimizer)")


class _TensorFlowStepper(_KerasStepper):
    def __init__(self, model: Any) -> None:
        super().__init__(model)
        import tensorflow as tf  # type: ignore[import-untyped]

        self._tf = tf
        trainable = self.trainable
        jit = bool(getattr(model, "jit_compile", False))

        @tf.function(reduce_retracing=True, jit_compile=jit, autograph=False)
        def gradients(x: Any, y: Any, sw: Any) -> Any:
            return self.graph_gradients(x, y, sw)

        @tf.function(reduce_retracing=True, jit_compile=jit, autograph=False)
        def apply(grads: Any) -> None:
            model.optimizer.apply_gradients(zip(grads, trainable))

        @tf.function(reduce_retracing=True, jit_compile=jit, autograph=False)
        def step(x: Any, y: Any, sw: Any) -> None:
            model.train_step((x, y) if sw is None else (x, y, sw))

        @tf.function(reduce_retracing=True, jit_compile=jit, autograph=False)
        def steps(xs: Any, ys: Any, n: Any) -> None:
            def body(i: Any) -> Any:
                model.train_step((xs[i], ys[i]))
                return (i + 1,)

            # one step after another (each reads the weights the previous one wrote)
            tf.while_loop(lambda i: i < n, body, (tf.constant(0, tf.int32),), parallel_iterations=1)

        # Each traced once for batches of any size (the epoch's last, short one too): tracing.py
        self._gradients: Any = AnyBatchSize(tf, gradients)
        self._apply = apply
        self._one_step = AnyBatchSize(tf, step)  # a batch...
        self._grouped_steps = AnyBatchSize(tf, steps, leading=2)  # ...and a stack of them (model averaging, async)
        if overrides_train_step(model):
            # The model's own train_step computes the gradients; the optimizer's apply is caught (not run) and
            # the averaged gradients are applied to the variables it was given.
            @tf.function(reduce_retracing=True, jit_compile=jit, autograph=False)
            def caught(x: Any, y: Any, sw: Any) -> Any:
                with _CatchApply(model.optimizer) as catch:
                    model.train_step((x, y) if sw is None else (x, y, sw))
                self.trainable = catch.variables
                return [tf.zeros_like(v) if g is None else tf.convert_to_tensor(g) for g, v in catch.pairs]

            @tf.function(reduce_retracing=True, jit_compile=jit, autograph=False)
            def apply_caught(grads: Any) -> None:
                model.optimizer.apply(grads, self.trainable)

            self._gradients, self._apply = AnyBatchSize(tf, caught), apply_caught
        # n as a tensor: a Python int would trace the loop again for each count
        self._grouped = _Grouped(
            self._one_step, lambda xs, ys, n: self._grouped_steps(xs, ys, tf.constant(n, tf.int32))
        )
        self._built = False
        self._batch: tuple[Any, Any, Any] | None = None
        self._graph_buckets: tuple[int, Any] | None = None

    def graph_gradients(self, x: Any, y: Any, sw: Any) -> list[Any]:
        """Inside a ``tf.function``: this batch's gradients (Keras's ``train_step`` up to the optimizer), the
        model's loss tracker and metrics updated."""
        tf, model, trainable = self._tf, self.model, self.trainable
        with tf.GradientTape() as tape:
            y_pred = self._forward(x)
            loss = self._loss(x, y, y_pred, sw)
            model._loss_tracker.update_state(loss, sample_weight=tf.shape(tf.nest.flatten(x)[0])[0])
            loss = model.optimizer.scale_loss(loss)
        grads = tape.gradient(loss, trainable)
        model.compute_metrics(x, y, y_pred, sample_weight=sw)
        return [tf.zeros_like(v) if g is None else tf.convert_to_tensor(g) for g, v in zip(grads, trainable)]

    def buckets(self, cap_bytes: int, wire: str | None = None) -> Any:
        """A :class:`~.graph_buckets.GraphBuckets` (the reduction inside the step's graph), or ``None`` for a
        model it does not support or with half precision on the wire (whose overflow check reads the averages
        as arrays)."""
        from .graph_buckets import GraphBuckets

        if wire is not None or overrides_train_step(self.model):
            return None  # its own train_step computes its gradients (caught at its optimizer's apply)
        if not GraphBuckets.supports(self.model, self.trainable):
            return None
        if self._graph_buckets is None or self._graph_buckets[0] != cap_bytes:
            self._graph_buckets = (cap_bytes, GraphBuckets(self, cap_bytes))
        return self._graph_buckets[1]

    def backward(self, x: Any, y: Any, sw: Any = None) -> None:
        """Hold the batch for :meth:`take_batch`: the in-graph exchange computes its gradients."""
        self._ready(x, y, sw)
        self._flush()
        self._batch = (x, y, sw)

    def take_batch(self) -> tuple[Any, Any, Any]:
        """The batch :meth:`backward` was given."""
        batch, self._batch = self._batch, None
        if batch is None:
            raise InvalidStateError("take_batch() without a batch: backward() first")
        return batch

    def _ready(self, x: Any, y: Any, sw: Any = None) -> None:
        if not self._built:
            self._build(x, y, sw)
            self._built = True

    def step(self, x: Any, y: Any, sw: Any = None) -> None:
        self._ready(x, y, sw)
        self._grouped.add(x, y, sw)

    def _flush(self) -> None:
        self._grouped.flush()

    def gradients(self, x: Any, y: Any, sw: Any = None) -> list[np.ndarray]:
        self._ready(x, y, sw)
        self._flush()
        return [np.asarray(g.numpy()) for g in self._gradients(x, y, sw)]  # 0-d gradients as 0-d arrays

    def apply(self, gradients: list[np.ndarray]) -> None:
        self._flush()
        self._apply([self._tf.convert_to_tensor(g) for g in gradients])


class _JaxStepper(_KerasStepper):
    """Keras's JAX trainer keeps the model's state as arrays during ``fit`` and writes it back at the end; this
    does the same for a round."""

    def __init__(self, model: Any) -> None:
        super().__init__(model)
        import jax

        self._jax = jax

        def gradients(tv: Any, ntv: Any, mv: Any, ov: Any, x: Any, y: Any, sw: Any) -> Any:
            grad_fn = jax.value_and_grad(model.compute_loss_and_updates, has_aux=True)
            (_loss, aux), grads = grad_fn(tv, ntv, mv, x, y, sw, training=True, optimizer_variables=ov)
            unscaled, y_pred, ntv, mv = aux
            _logs, mv = model._update_metrics_variables(mv, unscaled, x, y, y_pred, sw)
            return grads, ntv, mv

        def apply(ov: Any, grads: Any, tv: Any) -> Any:
            return model.optimizer.stateless_apply(ov, grads, tv)

        def step(tv: Any, ntv: Any, mv: Any, ov: Any, x: Any, y: Any, sw: Any) -> Any:
            _logs, (tv, ntv, ov, mv) = model.train_step((tv, ntv, ov, mv), (x, y) if sw is None else (x, y, sw))
            return tv, ntv, mv, ov

        self._gradients = jax.jit(gradients)
        self._apply = jax.jit(apply)
        self._step = jax.jit(step)
        self._state: list[list[Any]] | None = None
        self._open = False

    def _variables(self) -> list[list[Any]]:
        m = self.model
        return [m.trainable_variables, m.non_trainable_variables, m.metrics_variables, m.optimizer.variables]

    def begin(self) -> None:
        self._open = True  # the state is read at the first batch (Keras builds its metrics on it)

    def _ready(self, x: Any, y: Any, sw: Any = None) -> list[list[Any]]:
        if self._state is None:
            assert self._open, "begin() first"
            self._build(x, y, sw)
            self._state = [[v.value for v in group] for group in self._variables()]
        return self._state

    def step(self, x: Any, y: Any, sw: Any = None) -> None:
        state = self._ready(x, y, sw)
        self._state = [list(group) for group in self._step(*state, x, y, sw)]

    def gradients(self, x: Any, y: Any, sw: Any = None) -> list[np.ndarray]:
        tv, ntv, mv, ov = state = self._ready(x, y, sw)
        grads, ntv, mv = self._gradients(tv, ntv, mv, ov, x, y, sw)
        state[1], state[2] = ntv, mv
        return [np.asarray(g) for g in grads]

    def apply(self, gradients: list[np.ndarray]) -> None:
        tv, _ntv, _mv, ov = state = self._ready(None, None)  # None: no batch here yet this round
        tv, ov = self._apply(ov, gradients, tv)
        state[0], state[3] = list(tv), list(ov)

    def set_trainable(self, values: list[np.ndarray]) -> None:
        # Copies: the caller reuses its buffer, and JAX takes a numpy array's memory as its own where it is
        # 64-byte aligned (a variable assigned a view would change when the buffer is written next).
        if self._state is None:
            super().set_trainable([np.array(a) for a in values])
            return
        self._state[0] = [self._jax.numpy.array(a) for a in values]

    def end(self) -> dict[str, float]:
        if self._state is not None:
            for group, values in zip(self._variables(), self._state):
                for v, value in zip(group, values):
                    v.assign(value)
            self._state = None
        self._open = False
        return super().end()

    def set_learning_rate_factor(self, factor: float) -> None:
        super().set_learning_rate_factor(factor)
        if self._state is not None:  # the learning rate is one of the optimizer's variables: update its copy
            optimizer = self.model.optimizer
            for i, v in enumerate(optimizer.variables):
                if v is optimizer._learning_rate:
                    self._state[3][i] = v.value


class _TorchKerasStepper(_KerasStepper):
    def __init__(self, model: Any) -> None:
        super().__init__(model)
        import torch

        self._torch = torch
        self._custom = overrides_train_step(model)

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

    def begin(self) -> None:
        pass

    def backward(self, x: Any, y: Any, sw: Any = None) -> None:
        _no_sample_weights(sw)
        self.model._backward(x, y)

    def buckets(self, cap_bytes: int, wire: str | None = None) -> Any:
        return torch_buckets(self, self.params, cap_bytes)

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
        m.optimizer.step()

    def end(self) -> dict[str, float]:
        return {k: float(v) for k, v in self.model.get_metrics_result().items()}

    def zeros(self) -> list[np.ndarray]:
        return [np.zeros(tuple(p.shape), np.float32) for p in self.params]

    def set_trainable(self, values: list[np.ndarray]) -> None:
        torch = self.model._torch
        with torch.no_grad():
            for p, a in zip(self.params, values):
                p.copy_(torch.from_numpy(np.asarray(a)))

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
