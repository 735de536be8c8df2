"""A ``torch.optim`` optimizer's state as a flat list of tensors, for :class:`~.torch_model.TorchModel`: read in a
fixed order, and set, also on an optimizer that has not stepped yet (torch creates its state at the first step),
so that a model fresh from ``create_model`` takes a checkpoint's or the master's state.

torch keeps a state only for the parameters that have stepped: a layer frozen from the start has none, one frozen
after training keeps the one it had (and goes on from it when unfrozen). The list carries which parameters hold a
state (:func:`held`, first), and setting it gives exactly those one, so that both cases travel as they are."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any


def params(optimizer: Any) -> list[Any]:
    """The optimizer's parameters, group by group, in order."""
    return [p for group in optimizer.param_groups for p in group["params"]]


def held(optimizer: Any) -> list[bool]:
    """For each of :func:`params`, whether it holds a state (it has stepped, or was given one)."""
    return [bool(optimizer.state.get(p)) for p in params(optimizer)]


def state_tensors(optimizer: Any, scaler: Any, torch: Any) -> list[Any] | None:
    """The state tensors of the parameters that hold one (:func:`held`), in a fixed order (each parameter's by
    key), then (``"16-mixed"``) the gradient scaler's scale and growth tracker, which every replica must share to
    take the same step; None before the first step (no parameter holds a state)."""
    out: list[Any] = []
    for p in params(optimizer):
        state = optimizer.state.get(p)
        if state:
            out.extend(state[k] for k in sorted(state) if torch.is_tensor(state[k]))
    if not out:
        return None
    if scaler is not None and getattr(scaler, "_scale", None) is not None:
        out += [scaler._scale, scaler._growth_tracker]
    return out


def split(state: Sequence[Any], n_params: int) -> tuple[list[bool], Sequence[Any]]:
    """:meth:`~.torch_model.TorchModel.get_optimizer_state`'s arrays as (which parameters hold a state, their
    tensors). A state without the first (saved before it was carried) is every parameter's."""
    if len(state) and getattr(state[0], "dtype", None) is not None and str(state[0].dtype) in ("bool", "torch.bool"):
        return [bool(b) for b in state[0].tolist()], state[1:]
    return [True] * n_params, state


def fits(tensors: list[Any] | None, state: Sequence[Any]) -> bool:
    """Whether ``state`` has ``tensors``' number and shapes."""
    return (
        tensors is not None
        and len(tensors) == len(state)
        and all(tuple(t.shape) == tuple(s.shape) for t, s in zip(tensors, state))
    )


def prime(optimizer: Any, torch: Any, which: list[Any] | None = None) -> None:
    """Create the state of parameters ``which`` (default: those that train, as a real step would) as their first
    step does: one step with zero gradients, the parameters and their gradients put back as they were. Its values
    are to be overwritten at once."""
    every = params(optimizer)
    which = [p for p in every if p.requires_grad] if which is None else which
    chosen = {id(p) for p in which}
    with torch.no_grad():
        saved = [(p, p.detach().clone(), p.grad) for p in every]
        for p in every:  # the others are left out of the step
            p.grad = torch.zeros_like(p) if id(p) in chosen else None
        try:
            optimizer.step()
        finally:
            for p, value, grad in saved:
                p.copy_(value)
                p.grad = grad


def conform(optimizer: Any, torch: Any, flags: list[bool]) -> None:
    """Give a state to exactly the parameters ``flags`` names (:func:`held`'s of another replica): primed where
    one has none, dropped where one has but should not."""
    every = params(optimizer)
    missing = [p for p, f in zip(every, flags) if f and not optimizer.state.get(p)]
    if missing:
        prime(optimizer, torch, missing)
    for p, f in zip(every, flags):
        if not f:
            optimizer.state.pop(p, None)


def set_state(optimizer: Any, scaler: Any, torch: Any, state: Sequence[Any]) -> bool:
    """Copy ``state`` (:func:`held`'s flags, then tensors in :func:`state_tensors`' order) into the optimizer: the
    parameters that held a state get it (:func:`conform`), the others none; False, and the optimizer as it was,
    if it does not fit (another optimizer or layout)."""
    every = params(optimizer)
    flags, tensors_in = split(state, len(every))
    if len(flags) != len(every):
        return False
    if not len(tensors_in):
        return True  # nothing held anywhere: as it is
    before = {p: optimizer.state[p] for p in every if optimizer.state.get(p)}
    conform(optimizer, torch, flags)
    tensors = state_tensors(optimizer, scaler, torch)
    if not fits(tensors, tensors_in):
        optimizer.state.clear()  # as it was
        optimizer.state.update(before)
        return False
    with torch.no_grad():
        for t, s in zip(tensors or [], tensors_in):
            t.copy_(s)
    return True
