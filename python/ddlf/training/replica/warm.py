"""Warm models: a worker keeps the built, compiled model of a finished training run, with its traced training
step, and lends it to the next run whose ``create_model()`` returns the same architecture and compile settings.

Tracing and compiling the training step is most of a first epoch's extra time (a 100k-parameter MLP on JAX: about
5 s against 0.4 s for later epochs), and a sweep, or a user calling ``train()`` again, pays it on every run. With a
warm model, ``setup`` still calls ``create_model()`` (cheap: it builds layers and draws the initial weights from the
run's seed) and then copies everything of the new model into the kept one: weights, non-trainable variables
(BatchNorm statistics, the random generators' seeds), and the optimizer's variables as a freshly built optimizer
has them; its metrics are reset. The run then continues exactly as it would have on the new model (tested: a warm
run's history and weights equal a cold run's, bit for bit), and the kept step functions are not traced again.

A kept model is lent only to a run whose data has the same shapes (:func:`data_signature`): its step was traced
for them. Only Keras ``Sequential`` and functional models made of Keras's own layers, losses and metrics are lent (their
configuration describes all of their code); a subclassed model, a custom layer, loss or metric (whose code may
change between runs while its configuration does not), a ``TorchModel``, or a model whose configuration cannot be
read is always built fresh. A model is lent to one run at a time; at most :data:`KEEP` are kept per worker process
(least recently used first out).
"""

from __future__ import annotations

import json
import logging
import sys
from collections import OrderedDict
from typing import Any

from ...frameworks import model_spec
from ...frameworks.adapter import adapter_for
from ...frameworks.keras_backend import keeps_tensorflow_unloaded

KEEP = 2
"""Warm models kept per worker process."""

log = logging.getLogger("ddlf.training")

_KEPT: OrderedDict[str, tuple[Any, Any]] = OrderedDict()


@keeps_tensorflow_unloaded
def fingerprint(model: Any) -> str | None:
    """What must be equal for a kept model to stand in for ``model``: its class, architecture, trainable flags,
    compile and optimizer settings (a plain learning rate aside: lend copies it), the state of its preprocessing
    layers and the Keras backend; ``None`` when ``model`` is not lent or kept (not a Keras model: Keras is not
    imported to tell, as a PyTorch run in a process without it would load TensorFlow for nothing)."""
    if "keras" not in sys.modules:
        return None  # no Keras loaded: the model is not a Keras model
    import keras

    try:
        from keras.src.models.functional import Functional
    except ImportError:  # a Keras without this module path: lend nothing rather than guess
        return None
    if type(model) not in (keras.Sequential, Functional) or getattr(model, "optimizer", None) is None:
        return None
    try:
        optimizer = json.loads(json.dumps(keras.optimizers.serialize(model.optimizer), default=repr))
        if model_spec.compile_key(model) is not None and adapter_for(model).plain_learning_rate():
            # A plain rate is a variable of the traced step: lend copies it (a rate set on the master reaches a warm
            # model without tracing again)
            optimizer.get("config", {}).pop("learning_rate", None)
        described = [
            keras.backend.backend(),
            type(model).__name__,
            model.get_config(),
            model.get_compile_config(),
            optimizer,
            bool(getattr(model, "jit_compile", False)),
            bool(getattr(model, "run_eagerly", False)),
            str(getattr(model, "dtype_policy", "")),
            [bool(v.trainable) for v in model.weights],
            # an adapted preprocessing layer's state is a constant of the traced step (Normalization's mean): a kept
            # model adapted to other data must not stand in
            model_spec.preprocessing_digest(model),
        ]
        plain = json.loads(json.dumps(described, default=repr))
        outside = _outside_keras(plain)
        if outside is not None:
            # The user's own layer, loss or metric: its code may change between runs while its configuration does
            # not, and a kept step would run the old code. Build fresh.
            log.debug("model not kept warm: it uses %s, which is not Keras's own", outside)
            return None
        return json.dumps(
            model_spec.anonymous(plain),
            sort_keys=True,
            default=repr,
        )
    except Exception as exc:  # a layer whose config does not serialise: build fresh
        log.debug("model not kept warm: its configuration cannot be read (%s)", exc)
        return None


def _outside_keras(config: Any) -> str | None:
    """The first serialised object of ``config`` that Keras does not define (its ``module`` is the user's)."""
    if isinstance(config, dict):
        if "class_name" in config and config["class_name"] != "__keras_tensor__":  # a functional model's edge
            module = config.get("module")
            if not (isinstance(module, str) and (module == "keras" or module.startswith("keras."))):
                return f"{module or '(no module)'}.{config['class_name']}"
        values: Any = config.values()
    elif isinstance(config, list):
        values = config
    else:
        return None
    for v in values:
        found = _outside_keras(v)
        if found is not None:
            return found
    return None


def _same_structure(a: list[Any], b: list[Any]) -> bool:
    return len(a) == len(b) and all(
        tuple(x.shape) == tuple(y.shape) and str(x.dtype) == str(y.dtype) for x, y in zip(a, b)
    )


def data_signature(app: Any, parts: Any, fit: Any) -> str:
    """What the data a run feeds its step must share with the kept model's runs for its traced step to take it:
    each array's dtype, rank and row shape and how they make up ``x``, ``y`` and the sample weights, whether weights
    come with the batches, and the app's ``preprocess`` (which may change any of these: its code, pickled). A step
    traced for labels of one rank fails on another's (Keras' losses squeeze by the traced rank)."""
    import hashlib

    import cloudpickle

    leaves = [(str(getattr(a, "dtype", type(a).__name__)), tuple(getattr(a, "shape", ())[1:])) for a in parts.leaves]
    weighted = fit.class_weight is not None or fit.sample_weight is not None
    try:
        preprocess = hashlib.sha256(cloudpickle.dumps(type(app).preprocess)).hexdigest()
    except Exception:  # not picklable: never the same as another run's
        preprocess = repr(id(app))
    return json.dumps([leaves, repr(parts.specs), weighted, preprocess], default=repr)


def lend(model: Any, data: str = "") -> tuple[Any, Any, str | None]:
    """``(model, stepper, key)`` for a run that built ``model`` and feeds it ``data`` (:func:`data_signature`): a
    kept model holding ``model``'s initial state, with its stepper, or ``model`` itself with no stepper yet.
    ``key`` goes back to :func:`keep` at the run's end."""
    key = fingerprint(model)
    if key is not None:
        key = f"{key}\n{data}"
    if key is None or key not in _KEPT:
        return model, None, key
    kept, stepper = _KEPT.pop(key)
    try:
        fresh = model.optimizer
        if not fresh.built:
            fresh.build(model.trainable_variables)
        groups = [
            (kept.trainable_variables, model.trainable_variables),
            (kept.non_trainable_variables, model.non_trainable_variables),
        ]
        if kept.optimizer.built:
            groups.append((kept.optimizer.variables, fresh.variables))
        if not all(_same_structure(old, new) for old, new in groups):
            log.debug("kept model not lent: its variables differ from the new model's")
            return model, None, key
        for old, new in groups:
            for o, n in zip(old, new):
                o.assign(n.value)
        if adapter_for(kept).plain_learning_rate():
            kept.optimizer._learning_rate.assign(fresh.learning_rate)  # the run's (copied above too when built)
        stepper.base_lr = None  # the rate a scaled run multiplies: read again from this run's
        kept.reset_metrics()
    except Exception as exc:  # anything unexpected: the new model, cold, is always correct
        log.debug("kept model not lent (%s): building fresh", exc)
        return model, None, key
    log.info("training run reuses a warm model (its training step is traced already)")
    return kept, stepper, key


def keep(key: str | None, model: Any, stepper: Any) -> bool:
    """Keep a finished run's model and stepper for the next run with the same ``key``; whether it was kept (a
    stepper not kept, or pushed out, is closed: :meth:`.steppers.Stepper.close`)."""
    if key is None or stepper is None:
        _close(stepper)
        return False  # nothing traced: nothing to save by keeping it
    try:
        stepper.finish()  # a run torn down mid-round leaves its stepper open: close it (lend overwrites the state)
    except Exception as exc:
        log.debug("model not kept warm: its stepper did not close (%s)", exc)
        _close(stepper)
        return False
    old = _KEPT.pop(key, None)
    if old is not None and old[1] is not stepper:
        _close(old[1])
    _KEPT[key] = (model, stepper)
    while len(_KEPT) > KEEP:
        _close(_KEPT.popitem(last=False)[1][1])
    return True


def drop_all() -> int:
    """Forget every kept model (``Cluster.reset``), their steppers closed; how many there were."""
    n = len(_KEPT)
    while _KEPT:
        _close(_KEPT.popitem()[1][1])
    return n


def _close(stepper: Any) -> None:
    close = getattr(stepper, "close", None)
    if close is None:
        return
    try:
        close()
    except Exception as exc:  # a stepper that cannot close must not fail the teardown
        log.debug("stepper did not close (%s)", exc)
