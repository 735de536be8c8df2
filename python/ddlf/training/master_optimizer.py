"""The master's model holds the run's optimizer state, as a model does after ``fit``.

``fit`` leaves its model's optimizer stepped: Adam's moments and step count are in ``model.optimizer``, they go
with ``model.save``, ``save_weights`` and ``keras.callbacks.BackupAndRestore``, and the next ``fit`` goes on from
them (a learning-rate schedule too, which reads the step count). ddlf's optimizers step on the workers, so:

- :func:`pull`: when ``train`` ends (and at each epoch's end, before Keras' callbacks hear of it, when the run has
  any: ``BackupAndRestore`` and ``ModelCheckpoint`` save the optimizer with the model), the master's optimizer
  takes the workers' state. With gradient averaging that is the replicas' one state (the same on every worker;
  with sharded state, the shards joined); with model averaging or asynchronous training, the mean of the workers'
  own states (step counts rounded), as the master's weights are the mean of theirs.
- :func:`push`: when ``train`` starts with the master's optimizer built (a second ``train``, a model loaded with
  its optimizer, a backup restored), every worker starts from that state instead of a fresh one.

The learning rate stays out of both: it is the run's (compiled, scaled by ``scale_learning_rate``, set by a
callback). A :class:`ddlf.models.TorchModel`'s ``torch.optim`` state goes both ways the same (its parameter groups'
hyperparameters are not part of it), except with sharded optimizer state, whose shards stay on the workers (and in
ddlf's checkpoints).
"""

from __future__ import annotations

import warnings
from typing import TYPE_CHECKING, Any

import numpy as np

from ..errors import OptimizerStateWarning
from ..frameworks.adapter import adapter_for
from ..frameworks.shard_optimizers import KerasShard, trainable_variables
from . import replica as remote
from .options import GradientAveraging
from .replica.sharded import join
from .replica.state import LEARNING_RATE, set_optimizer_state

if TYPE_CHECKING:
    from .options import TrainConfig
    from .run import TrainingRun


def keras_optimizer(model: Any) -> Any | None:
    """``model``'s Keras optimizer (None: no compiled optimizer, or a ``TorchModel``)."""
    return None if model is None else adapter_for(model).keras_optimizer()


def sharded(cfg: TrainConfig) -> bool:
    """Whether the run shards its optimizer state (``GradientAveraging(shard_optimizer=True)``)."""
    return cfg.gradients is not None and bool(cfg.gradients.shard_optimizer)


def pull(run: TrainingRun) -> bool:
    """The master's optimizer takes the run's state from the live workers; whether it did (not when no worker
    answers, or the model has no Keras optimizer). A failure here is a warning, recorded in History: the run's
    weights are kept."""
    try:
        return _pull(run)
    except Exception as exc:  # the trained weights must not be lost to it
        message = f"the master's model did not take the run's optimizer state ({type(exc).__name__}: {exc})"
        warnings.warn(message, OptimizerStateWarning, stacklevel=2)
        run.members.note("optimizer_state_not_kept", reason=message)
        return False


def _torch(model: Any) -> bool:
    """Whether ``model`` is a :class:`ddlf.models.TorchModel` (its ``torch.optim`` state travels as arrays)."""
    return model is not None and adapter_for(model).kind == "torch"


def _pull(run: TrainingRun) -> bool:
    model = run.app.model
    torch = _torch(model)
    if keras_optimizer(model) is None and not torch:
        return False
    if torch and sharded(run.cfg):
        return False  # the shards of a torch optimizer are not joined on the master (kept in checkpoints)
    live = run.members.live()
    if not live:
        return False
    cfg = run.cfg
    shards = sharded(cfg)
    same_everywhere = isinstance(cfg.strategy, GradientAveraging) and not shards
    replies = run.cluster.call(
        remote.optimizer_state,
        (run.state.run_id,),
        workers=live[:1] if same_everywhere else live,
        return_exceptions=True,
    )
    states = [r for r in replies if isinstance(r, dict)]
    if shards:
        held = [s["optimizer_shard"] for s in states if s.get("optimizer_shard") is not None]
        return bool(held) and set_whole(model, join(held))
    held = [s["optimizer"] for s in states if s.get("optimizer")]
    if torch:
        return set_mean_torch(model, held)
    return set_mean(model, held)


def push(app: Any, cfg: TrainConfig, run_id: str, live: list[int]) -> bool:
    """Every live worker starts run ``run_id`` from the master's optimizer state, when it has one (its
    optimizer built); whether they do."""
    model = app.model
    if _torch(model):
        if sharded(cfg) or not live or not model.optimizer_built:
            return False
        torch_state = {"optimizer": model.get_optimizer_state()}
        app.cluster.call(remote.adopt_optimizer_state, (run_id, torch_state), workers=live)
        return True
    optimizer = keras_optimizer(model)
    if optimizer is None or not optimizer.built or not live:
        return False
    if sharded(cfg):
        whole = whole_state(model)
        if whole is None:
            return False
        state: dict[str, Any] = {"optimizer_shard": whole}
    else:
        state = {"optimizer": [np.asarray(v.numpy()) for v in optimizer.variables]}
    app.cluster.call(remote.adopt_optimizer_state, (run_id, state), workers=live)
    return True


def set_mean(model: Any, states: list[list[np.ndarray]]) -> bool:
    """The model's optimizer (built here if it is not yet) takes the mean of ``states`` (each a list of its
    variables' values, in order), every variable but the learning rate; whether any state fitted."""
    optimizer = model.optimizer
    if not optimizer.built:
        if not model.trainable_variables:
            return False
        optimizer.build(model.trainable_variables)
    means = _means(states, [tuple(v.shape) for v in optimizer.variables])
    if means is None:
        return False
    set_optimizer_state(model, means, keep_learning_rate=True)
    return True


def set_mean_torch(model: Any, states: list[list[np.ndarray]]) -> bool:
    """A ``TorchModel``'s optimizer takes the mean of ``states`` (each :meth:`~ddlf.models.TorchModel.
    get_optimizer_state`'s arrays; its parameter groups' rates are not among them); whether any fitted."""
    means = _means(states, [np.shape(a) for a in states[0]]) if states else None
    return means is not None and bool(model.set_optimizer_state(means))


def _means(states: list[list[np.ndarray]], shapes: list[tuple[int, ...]]) -> list[np.ndarray] | None:
    """The element-wise mean of the ``states`` whose arrays have ``shapes`` (None: none has)."""
    fitting = [s for s in states if [np.shape(a) for a in s] == shapes]
    if not fitting:
        return None
    return [_mean([np.asarray(s[i]) for s in fitting]) for i in range(len(shapes))]


def _mean(arrays: list[np.ndarray]) -> np.ndarray:
    """The element-wise mean, in the arrays' own dtype (integers, step counts, rounded)."""
    if len(arrays) == 1:
        return arrays[0]
    dtype = arrays[0].dtype
    if dtype.kind in "iub":
        return np.rint(np.mean(np.stack(arrays), axis=0, dtype=np.float64)).astype(dtype)
    return (np.sum(np.stack(arrays), axis=0, dtype=dtype) / len(arrays)).astype(dtype)


def _layout(model: Any) -> tuple[list[list[Any]], list[Any]] | None:
    """Where the sharded state goes in the master's (built) Keras optimizer: for each slot kind of the shard
    optimizer (:class:`ddlf.frameworks.shard_optimizers.KerasShard`, in its order), the model optimizer's variable of
    that kind for each trainable weight (in the flat order), and its scalar variables (the step count, the rate,
    Nadam's running product), in the shard optimizer's order. None where a variable is not found by Keras'
    naming (``{weight path}_{kind}``, ``/`` as ``_``)."""
    if not trainable_variables(model):
        return None
    shard = KerasShard(model)
    shard.build(1)
    prefix = f"{shard.variable.name}_"
    kinds = [v.name.removeprefix(prefix) for v in shard.slots]
    by_name: dict[str, list[Any]] = {}
    for v in model.optimizer.variables:
        by_name.setdefault(v.name, []).append(v)
    table = []
    for kind in kinds:
        row = []
        for w in trainable_variables(model):
            found = by_name.get(f"{w.path.replace('/', '_')}_{kind}", [])
            if len(found) != 1 or tuple(found[0].shape) != tuple(w.shape):
                return None
            row.append(found[0])
        table.append(row)
    scalars = [v for v in model.optimizer.variables if len(v.shape) == 0]  # the same class: the same order
    if len(scalars) != len(shard.scalars):
        return None
    return table, scalars


def set_whole(model: Any, whole: dict[str, Any] | None) -> bool:
    """The master's optimizer (built here if it is not yet) takes the whole sharded state (:func:`.sharded.join`
    of the workers' shards), every variable but the learning rate; whether it fitted."""
    optimizer = model.optimizer
    if whole is None:
        return False
    if not optimizer.built:
        optimizer.build(model.trainable_variables)
    layout = _layout(model)
    if layout is None:
        return False
    table, scalars = layout
    length = sum(int(np.prod(w.shape)) for w in trainable_variables(model))
    if int(whole["length"]) != length or len(whole["slots"]) != len(table) or len(whole["scalars"]) != len(scalars):
        return False
    for flat, row in zip(whole["slots"], table):
        at = 0
        for v in row:
            n = int(np.prod(v.shape))
            v.assign(np.asarray(flat[at : at + n], np.float32).reshape(tuple(v.shape)))
            at += n
    for v, value in zip(scalars, whole["scalars"]):
        if v.name != LEARNING_RATE:
            v.assign(value)
    return True


def whole_state(model: Any) -> dict[str, Any] | None:
    """The master's (built) optimizer state in the sharded form (:meth:`.sharded.Held.to_dict`, start 0, whole
    length), for the workers to cut their shards from; None where it does not map (:func:`_layout`)."""
    layout = _layout(model)
    if layout is None:
        return None
    table, scalars = layout
    slots = [np.concatenate([np.asarray(v.numpy(), np.float32).ravel() for v in row]) for row in table]
    length = sum(int(np.prod(w.shape)) for w in trainable_variables(model))
    return {"length": length, "start": 0, "slots": slots, "scalars": [np.asarray(v.numpy()) for v in scalars]}
