"""What the master's model is beyond its weights, carried to every worker when a run sets up: the master's model is
the truth of every ``train()``.

Each worker builds its replica with the app's ``create_model()``, and the rounds carry weights (and optimizer state).
What the user changed on the master's model since ``create_model()`` built it would miss the workers: a recompile
(``model.compile(Adam(1e-5))`` in Keras' fine-tuning recipe), a changed ``trainable`` flag, a learning rate or any
other optimizer hyperparameter set by hand or by a callback of an earlier run, the state of a preprocessing layer
(``Normalization.adapt``, a ``StringLookup``'s vocabulary), a ``TorchModel`` optimizer's ``param_groups`` (a torch
scheduler, ``group["lr"] = ...``) or a parameter's ``requires_grad``.

:func:`describe` reads these off the master's model into a :class:`ModelSpec`; :func:`apply` makes a worker's freshly
built model agree with it before the run's first round (and before a kept warm model is looked up, so that one is
lent only when it matches). Each part is compared first and changed only where it differs, so a model that
``create_model()`` built just as the master holds it stays as it is (and its warm model stays lent).

During a run the master's learning rate (Keras) and optimizer groups (torch) travel with every round once they
change (:func:`optimizer_groups`, :func:`set_optimizer_groups`).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import math
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ..errors import ModelMismatchError
from . import torch_spec
from .keras_backend import keeps_tensorflow_unloaded
from .torch_spec import is_torch_model, training_options

log = logging.getLogger("ddlf.training")


@dataclass(frozen=True)
class Rebuilt:
    """A Keras object (optimizer, loss, metric) as its class and configuration: built anew where it lands (its
    variables are the receiving model's own)."""

    cls: Any
    config: dict[str, Any]

    def build(self) -> Any:
        return self.cls.from_config(self.config)


@dataclass
class ModelSpec:
    """What a replica must share with the master's model besides its weights (see the module docs)."""

    framework: str
    """``"keras"`` or ``"torch"``."""
    trainable: list[bool] | None = None
    """Keras: each layer's ``trainable`` flag (the model first, then its layers depth first); torch: each
    parameter's ``requires_grad``."""
    variable_trainable: list[bool] | None = None
    """Keras: each weight's own ``trainable`` flag."""
    compile_key: str | None = None
    """What the compile configuration says (optimizer and its hyperparameters but a plain learning rate, loss, loss
    weights, metrics, ``run_eagerly``, ``jit_compile``, ``steps_per_execution``); None where it cannot be read, in
    which case a worker always recompiles with :attr:`compile_args`."""
    compile_args: Any = None
    """``model.compile``'s arguments as the master's model was last compiled (its optimizer as it holds it now),
    Keras objects as :class:`Rebuilt`; None: the master's model is not compiled."""
    learning_rate: float | None = None
    """The master's plain learning rate now (None: a schedule, or none)."""
    preprocessing: list[tuple[int, list[np.ndarray], Any]] = field(default_factory=list)
    """For each adaptable preprocessing layer (``Normalization``, ``StringLookup``, ``TextVectorization``,
    ``Discretization``...): its index among the layers, its weights and its vocabulary (None: has none)."""
    dtype_policy: str | None = None
    """Keras: the master's global dtype policy (``mixed_float16``...), under which a worker's ``create_model`` runs
    (:func:`building_as`): a policy set in the user's script is not set on the workers otherwise."""
    run_eagerly: bool | None = None
    """Keras: the master's ``model.run_eagerly`` (set as an attribute after ``compile`` as well as by it)."""
    architecture: str | None = None
    """Keras: a digest of the master's built model's configuration (layer names aside); None: not built, or its
    configuration cannot be read. A worker whose model differs says so (the master warns)."""
    weight_shapes: list[tuple[int, ...]] | None = None
    """Keras: the shapes of the master's model's weights (empty: not built)."""
    optimizer_class: str | None = None
    """torch: the optimizer's class, by name..."""
    optimizer_type: Any = None
    """...and itself (a worker whose optimizer is of another class, or holds other parameters, builds the
    master's)."""
    optimizer_groups: list[dict[str, Any]] | None = None
    """torch: each parameter group's hyperparameters (all but its ``params``)."""
    optimizer_params: list[list[int]] | None = None
    """torch: each parameter group's parameters, as indices into ``module.parameters()`` (-1: not the module's)."""
    loss: Any = None
    """torch: the master's ``loss_fn`` where it was set after the model was made (None: ``create_model``'s)."""
    training_options: dict[str, Any] | None = None
    """torch: the ``TorchModel``'s ``precision`` and ``clip_grad_norm`` (not its device: each worker has its own)."""


# -- Keras ----------------------------------------------------------------------------------------------------------


def _keras() -> Any:
    import sys

    return sys.modules.get("keras")


def is_keras_model(model: Any) -> bool:
    keras = _keras()
    return keras is not None and isinstance(model, keras.Model)


def layers(model: Any) -> list[Any]:
    """The model and every layer in it, depth first, in one fixed order (the same for two builds of one
    architecture), without input layers (a ``Sequential`` without ``keras.Input`` gains one when it is built)."""
    return [
        layer
        for layer in model._flatten_layers(include_self=True, recursive=True)
        if type(layer).__name__ != "InputLayer"
    ]


def adaptable(layer: Any) -> bool:
    """Whether ``layer`` keeps state that ``adapt()`` computes outside training (Keras' preprocessing layers)."""
    return callable(getattr(layer, "adapt", None)) and callable(getattr(layer, "finalize_state", None))


def _vocabulary(layer: Any) -> Any:
    get = getattr(layer, "get_vocabulary", None)
    if not callable(get):
        return None
    try:
        return list(get())
    except Exception:  # not adapted yet
        return None


def preprocessing_state(model: Any) -> list[tuple[int, list[np.ndarray], Any]]:
    """Each adaptable layer's index, weights and vocabulary (:attr:`ModelSpec.preprocessing`)."""
    out = []
    for i, layer in enumerate(layers(model)):
        if adaptable(layer):
            weights = [np.asarray(w) for w in layer.get_weights()]
            out.append((i, weights, _vocabulary(layer)))
    return out


def preprocessing_digest(model: Any) -> str:
    """A digest of :func:`preprocessing_state`: two models whose preprocessing layers were adapted to other data
    differ here (their configurations do not)."""
    h = hashlib.sha256()
    for i, weights, vocabulary in preprocessing_state(model):
        h.update(str(i).encode())
        for w in weights:
            h.update(str((w.dtype.str, w.shape)).encode())
            h.update(np.ascontiguousarray(w).tobytes())
        h.update(repr(vocabulary).encode())
    return h.hexdigest()


def plain_learning_rate(optimizer: Any) -> float | None:
    """A Keras optimizer's learning rate now (None: a schedule, none, or not finite)."""
    rate = getattr(optimizer, "_learning_rate", None)
    if rate is None or not hasattr(rate, "assign"):  # a schedule (its config says it) or none
        return None
    value = float(np.asarray(optimizer.learning_rate))
    return value if math.isfinite(value) else None


@keeps_tensorflow_unloaded  # Keras' serialization asks for TensorFlow
def compile_key(model: Any) -> str | None:
    """What ``model``'s compile configuration says, its plain learning rate left out (it is carried on its own and
    changes nothing compiled); None where it cannot be read."""
    keras = _keras()
    if keras is None or not getattr(model, "compiled", False) or getattr(model, "optimizer", None) is None:
        return None
    try:
        config = dict(model.get_compile_config() or {})
        optimizer = keras.optimizers.serialize(model.optimizer)
        optimizer = json.loads(json.dumps(optimizer, default=repr))
        optimizer.get("config", {}).pop("name", None)  # numbered per process (adam_3): not a setting
        if plain_learning_rate(model.optimizer) is not None:
            optimizer.get("config", {}).pop("learning_rate", None)
        config["optimizer"] = optimizer
        return json.dumps(config, sort_keys=True, default=repr)
    except Exception as exc:  # a loss or metric that does not serialise: the spec's compile always applies
        log.debug("compile configuration not readable (%s)", exc)
        return None


def _tree(value: Any, leaf: Any) -> Any:
    """``value`` with ``leaf`` applied to everything but its dicts, lists and tuples (kept, rebuilt)."""
    if isinstance(value, dict):
        return {k: _tree(v, leaf) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_tree(v, leaf) for v in value)
    return leaf(value)


def _portable(value: Any) -> Any:
    """``value`` with every Keras optimizer, loss and metric as a :class:`Rebuilt` (functions and strings stay)."""
    keras = _keras()
    kinds = (keras.optimizers.Optimizer, keras.losses.Loss, keras.metrics.Metric)
    return _tree(value, lambda v: Rebuilt(type(v), v.get_config()) if isinstance(v, kinds) else v)


def _built(value: Any) -> Any:
    return _tree(value, lambda v: v.build() if isinstance(v, Rebuilt) else v)


@keeps_tensorflow_unloaded  # Keras' serialization asks for TensorFlow
def _compile_args(model: Any) -> Any:
    held = getattr(model, "_compile_config", None)
    config = getattr(held, "config", None)
    if not getattr(model, "compiled", False) or not isinstance(config, dict):
        return None
    args = dict(config)
    args["optimizer"] = model.optimizer  # as it is now (hyperparameters set by hand since compile)
    return _portable(args)


def anonymous(config: Any) -> Any:
    """``config`` with layer and model names replaced by their order of appearance: Keras numbers names per
    process (``dense_3``), so two builds of one architecture differ only there."""
    names: dict[str, str] = {}

    def collect(c: Any) -> None:
        if isinstance(c, dict):
            for k, v in c.items():
                if k == "name" and isinstance(v, str):
                    names.setdefault(v, f"#{len(names)}")
                collect(v)
        elif isinstance(c, (list, tuple)):
            for v in c:
                collect(v)

    def rename(c: Any) -> Any:
        if isinstance(c, dict):
            return {k: rename(v) for k, v in c.items()}
        if isinstance(c, (list, tuple)):
            return [rename(v) for v in c]
        if isinstance(c, str):
            return names.get(c, c)
        return c

    collect(config)
    return rename(config)


@keeps_tensorflow_unloaded  # Keras' serialization asks for TensorFlow
def architecture(model: Any) -> str | None:
    """A digest of a built Keras model's configuration, names aside (None: not built, or not readable)."""
    if not getattr(model, "built", False) or not model.weights:
        return None
    try:
        plain = json.loads(json.dumps(model.get_config(), default=repr))
    except Exception:  # a subclassed model without get_config
        return None
    text = json.dumps(anonymous(plain), sort_keys=True, default=repr)
    return hashlib.sha256(text.encode()).hexdigest()


def _check_shapes(mine: list[tuple[int, ...]], masters: list[tuple[int, ...]] | None) -> None:
    """Refuse a model whose weights cannot take the master's (both built)."""
    if not mine or not masters or [tuple(s) for s in masters] == mine:
        return
    at = next((i for i, (a, b) in enumerate(zip(masters, mine)) if tuple(a) != b), min(len(mine), len(masters)))
    what = (
        f"weight {at} is {tuple(masters[at])} on the master, {mine[at]} here"
        if at < min(len(mine), len(masters))
        else f"{len(masters)} weights on the master, {len(mine)} here"
    )
    raise ModelMismatchError(
        f"the master's model and the one create_model() built on this worker differ ({what}): the workers build "
        "create_model()'s model and take the master's weights, so the master's model (app.model) must be of its "
        "architecture; to train another, change create_model"
    )


def _describe_keras(model: Any) -> ModelSpec:
    every = layers(model)
    keras = _keras()
    return ModelSpec(
        framework="keras",
        dtype_policy=keras.config.dtype_policy().name,
        run_eagerly=bool(getattr(model, "run_eagerly", False)),
        architecture=architecture(model),
        trainable=[bool(layer.trainable) for layer in every],
        variable_trainable=[bool(v.trainable) for v in model.weights],
        weight_shapes=[tuple(v.shape) for v in model.weights],
        compile_key=compile_key(model),
        compile_args=_compile_args(model),
        learning_rate=plain_learning_rate(getattr(model, "optimizer", None)),
        preprocessing=preprocessing_state(model),
    )


def _apply_keras(model: Any, spec: ModelSpec) -> list[str]:
    changed: list[str] = []
    _check_shapes([tuple(v.shape) for v in model.weights], spec.weight_shapes)
    every = layers(model)
    if spec.trainable is not None:
        if len(spec.trainable) != len(every):
            raise ModelMismatchError(
                f"the master's model has {len(spec.trainable)} layers, the one create_model() built here "
                f"{len(every)}: create_model must build the same architecture everywhere"
            )
        flipped = False
        for layer, t in zip(every, spec.trainable):  # a parent first: it sets its sublayers, set after it
            if layer.trainable != t:
                layer.trainable = t
                flipped = True
        if flipped:
            changed.append("trainable")
    if spec.variable_trainable is not None and len(spec.variable_trainable) == len(model.weights):
        moved = False
        for v, t in zip(model.weights, spec.variable_trainable):
            if bool(v.trainable) != t:
                v.trainable = t
                moved = True
        if moved:
            changed.append("trainable")
    for index, weights, vocabulary in spec.preprocessing:
        layer = every[index] if index < len(every) else None
        if layer is None or not adaptable(layer):
            raise ModelMismatchError(
                f"the master's model has a preprocessing layer at {index} that create_model() did not build here"
            )
        mine = [np.asarray(w) for w in layer.get_weights()]
        same = len(mine) == len(weights) and all(
            a.shape == b.shape and np.array_equal(a, b) for a, b in zip(mine, weights)
        )
        if vocabulary is not None and _vocabulary(layer) != vocabulary:
            layer.set_vocabulary(vocabulary)
            same = False
        if not same:
            if weights:
                layer.set_weights(weights)
            layer.finalize_state()  # the constants its call uses (Normalization's mean) follow the variables
            changed.append(f"preprocessing:{layer.name}")
    if spec.compile_args is not None and (spec.compile_key is None or compile_key(model) != spec.compile_key):
        model.compile(**_built(spec.compile_args))
        changed.append("compile")
    if spec.run_eagerly is not None and bool(getattr(model, "run_eagerly", False)) != spec.run_eagerly:
        model.run_eagerly = spec.run_eagerly
        changed.append("run_eagerly")
    if spec.learning_rate is not None:
        rate = getattr(getattr(model, "optimizer", None), "_learning_rate", None)
        if rate is not None and hasattr(rate, "assign") and plain_learning_rate(model.optimizer) != spec.learning_rate:
            rate.assign(spec.learning_rate)
            changed.append("learning_rate")
    return changed


def needs_build(model: Any) -> bool:
    """Whether ``model`` is a Keras model that ``fit`` would build on its first batch (a subclassed model, a
    ``Sequential`` without ``keras.Input``): it has no weights yet."""
    return is_keras_model(model) and not model.weights and not getattr(model, "built", False)


def build_from(model: Any, x: Any) -> None:
    """Build ``model`` from a batch of inputs ``x`` (a few rows, after the app's ``preprocess``), as ``fit`` builds
    it on its first batch: each layer's weights created for these shapes."""
    model(x, training=False)


def differs(model: Any, spec: ModelSpec | None) -> str | None:
    """What still differs between ``model`` (after :func:`apply`) and the master's ``spec`` that cannot be carried
    (its architecture: layer types, sizes, activations, dtypes); None: nothing found."""
    if spec is None or spec.architecture is None:
        return None
    if spec.framework == "torch" and is_torch_model(model):
        if torch_spec.architecture(model) == spec.architecture:
            return None
        return (
            "the module create_model() built on this worker prints otherwise than the master's (its layers, sizes "
            "or settings, such as a Dropout's p): the workers train create_model()'s"
        )
    if spec.framework != "keras":
        return None
    mine = architecture(model)
    if mine is None or mine == spec.architecture:
        return None
    return (
        "the model create_model() built on this worker has another configuration than the master's model (layers, "
        "their sizes, activations or dtypes): the workers train create_model()'s architecture"
    )


@contextlib.contextmanager
def building_as(spec: ModelSpec | None) -> Iterator[None]:
    """While a worker runs ``create_model()``: the master's global Keras dtype policy (``mixed_float16`` set in the
    user's script), restored after."""
    if spec is None or spec.framework != "keras" or not spec.dtype_policy:
        yield
        return
    import keras

    before = keras.config.dtype_policy()
    if before.name == spec.dtype_policy:
        yield
        return
    keras.config.set_dtype_policy(spec.dtype_policy)
    try:
        yield
    finally:
        keras.config.set_dtype_policy(before)


def signature(model: Any) -> dict[str, Any]:
    """What of the master's model is carried only when a run sets up (not with each round): its trainable flags,
    compile configuration and ``run_eagerly`` (Keras), its parameters' ``requires_grad`` and optimizer class
    (torch). :func:`changed` compares two of them. (Not the adapted layers: their variables are averaged with the
    weights each round, and so change in the last bits.)"""
    if is_torch_model(model):
        return {
            "requires_grad": [bool(p.requires_grad) for p in model.module.parameters()],
            "optimizer": (type(model.optimizer).__qualname__, torch_spec.optimizer_params(model)),
            "training_options": training_options(model),
        }
    if not is_keras_model(model):
        return {}
    return {
        "trainable": [bool(layer.trainable) for layer in layers(model)],
        "compile": compile_key(model),
        "run_eagerly": bool(getattr(model, "run_eagerly", False)),
    }


def changed(before: dict[str, Any], after: dict[str, Any]) -> list[str]:
    """The parts of two :func:`signature` that differ."""
    return [k for k in before if k in after and before[k] != after[k]]


# -- both -----------------------------------------------------------------------------------------------------------


def describe(model: Any) -> ModelSpec | None:
    """The master's ``model`` as a :class:`ModelSpec`; None for a model of no framework ddlf knows (nothing is
    carried)."""
    if model is None:
        return None
    if is_torch_model(model):
        return ModelSpec(framework="torch", **torch_spec.describe(model))
    if is_keras_model(model):
        return _describe_keras(model)
    return None


def apply(model: Any, spec: ModelSpec | None) -> list[str]:
    """Make ``model`` (built here by ``create_model()``) agree with the master's ``spec``; returns what had to
    change (empty: it agreed already). Raises :class:`~ddlf.errors.ModelMismatchError` where the two cannot be the
    same model."""
    if spec is None:
        return []
    if spec.framework == "torch" and is_torch_model(model):
        return torch_spec.apply(model, spec)
    if spec.framework == "keras" and is_keras_model(model):
        return _apply_keras(model, spec)
    raise ModelMismatchError(
        f"the master's model is a {spec.framework} model, the one create_model() built here a {type(model).__name__}"
    )
