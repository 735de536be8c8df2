"""A replica's state beyond its weights: optimizer and random-generator state, to checkpoint and restore."""

from __future__ import annotations

from typing import Any

import numpy as np

from ..outer import OuterMomentum, OuterSpec
from .sessions import _session


def _rng_variables(model: Any) -> list[Any]:
    """A Keras model's variables that are neither weights nor optimizer state: random-generator states (dropout)."""
    weights = {id(w) for w in model.weights}
    return [v for v in model.variables if id(v) not in weights]


def _optimizer_built(model: Any) -> bool:
    if hasattr(model, "get_optimizer_state"):
        return bool(model.optimizer_built)
    return bool(model.optimizer.built)


def _rng_state(model: Any) -> list[np.ndarray]:
    if hasattr(model, "get_rng_state"):
        return model.get_rng_state()
    return [np.asarray(v.numpy()) for v in _rng_variables(model)]


def _set_rng_state(model: Any, state: list[np.ndarray]) -> None:
    if hasattr(model, "set_rng_state"):
        model.set_rng_state(state)
        return
    rng = _rng_variables(model)
    if len(rng) == len(state):
        for v, s in zip(rng, state):
            v.assign(s)


def session_state(run_id: str) -> dict[str, Any]:
    """What this worker carries from round to round besides the weights: its optimizer state, its random
    generators' state and its top-k residual. Saved in checkpoints, so a resumed run continues identically."""
    session = _session(run_id)
    model = session.model
    return {
        "optimizer": _optimizer_state(model) if _optimizer_built(model) else None,
        "rng": _rng_state(model),
        "residual": session.residual,
        "outer": session.outer.state() if session.outer is not None else None,
    }


def restore_state(run_id: str, state: dict[str, Any]) -> None:
    """Put back what :func:`session_state` returned (after ``setup`` on a fresh or restarted worker)."""
    session = _session(run_id)
    model = session.model
    if state.get("optimizer") is not None:
        if not hasattr(model, "set_optimizer_state") and not model.optimizer.built:
            model.optimizer.build(model.trainable_variables)
        _set_optimizer_state(model, state["optimizer"])
    _set_rng_state(model, state.get("rng", []))
    session.residual = state.get("residual")
    if state.get("outer") is not None:
        session.outer = OuterMomentum(OuterSpec())  # the spec comes with the next round
        session.outer.load(state["outer"])


def _optimizer_state(model: Any) -> list[np.ndarray]:
    if hasattr(model, "get_optimizer_state"):
        return model.get_optimizer_state()
    return [np.asarray(v.numpy()) for v in model.optimizer.variables]


def _set_optimizer_state(model: Any, state: list[np.ndarray]) -> None:
    if hasattr(model, "set_optimizer_state"):
        # An optimizer that has not stepped yet has no state to take: it adopts the averaged one next round.
        model.set_optimizer_state(state)
        return
    variables = model.optimizer.variables
    if len(variables) != len(state):
        return  # not built yet on this worker: it builds on the first step and adopts the state next round
    for v, s in zip(variables, state):
        v.assign(s)
