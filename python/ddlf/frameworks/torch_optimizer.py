"""A ``torch.optim`` optimizer's state as a flat list of tensors, for :class:`~.torch_model.TorchModel`: read in a
fixed order, and set, also on an optimizer that has not stepped yet (torch creates its state at the first step),
so that a model fresh from ``create_model`` takes a checkpoint's or the master's state."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any


def state_tensors(optimizer: Any, scaler: Any, torch: Any) -> list[Any] | None:
    """The optimizer's per-parameter state tensors in a fixed order (each parameter's by key), then (``"16-mixed"``)
    the gradient scaler's scale and growth tracker, which every replica must share to take the same step; None
    before the first step (a parameter without state)."""
    out: list[Any] = []
    for group in optimizer.param_groups:
        for p in group["params"]:
            state = optimizer.state.get(p)
            if not state:
                return None
            out.extend(state[k] for k in sorted(state) if torch.is_tensor(state[k]))
    if scaler is not None and getattr(scaler, "_scale", None) is not None:
        out += [scaler._scale, scaler._growth_tracker]
    return out


def fits(tensors: list[Any] | None, state: Sequence[Any]) -> bool:
    """Whether ``state`` has ``tensors``' number and shapes."""
    return (
        tensors is not None
        and len(tensors) == len(state)
        and all(tuple(t.shape) == tuple(s.shape) for t, s in zip(tensors, state))
    )


def prime(optimizer: Any, torch: Any) -> None:
    """Create the optimizer's per-parameter state as its first step does: one step with zero gradients, the
    parameters and their gradients put back as they were. Its values are to be overwritten at once; parameters
    that do not train (``requires_grad=False``) get none, as in a real step."""
    params = [p for group in optimizer.param_groups for p in group["params"] if p.requires_grad]
    with torch.no_grad():
        saved = [(p, p.detach().clone(), p.grad) for p in params]
        for p in params:
            p.grad = torch.zeros_like(p)
        try:
            optimizer.step()
        finally:
            for p, value, grad in saved:
                p.copy_(value)
                p.grad = grad


def set_state(optimizer: Any, scaler: Any, torch: Any, state: Sequence[Any]) -> bool:
    """Copy ``state`` (tensors in :func:`state_tensors`' order) into the optimizer, priming one that has not stepped
    yet; False, and the optimizer as it was, if it does not fit (another optimizer or layout)."""
    tensors = state_tensors(optimizer, scaler, torch)
    if tensors is None and len(state):
        prime(optimizer, torch)
        tensors = state_tensors(optimizer, scaler, torch)
        if not fits(tensors, state):
            optimizer.state.clear()  # as it was: no state
            return False
    if tensors is None or not fits(tensors, state):
        return False
    with torch.no_grad():
        for t, s in zip(tensors, state):
            t.copy_(s)
    return True
