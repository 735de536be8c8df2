"""A :class:`~ddlf.models.TorchModel`'s batches as torch code expects them: structures of arrays (a dict name ->
array, a tuple or list, nested alike), how they are mapped, sliced and counted, matched to the outputs a loss is given
for, and passed to ``forward``. Pure logic: nothing here imports torch."""

from __future__ import annotations

import inspect
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from ..errors import ConfigError, ConfigTypeError


def structured(value: Any) -> bool:
    return isinstance(value, (dict, tuple, list))


def map_arrays(fn: Callable[[Any], Any], value: Any) -> Any:
    """``fn`` applied to every array of ``value``, the structure kept (a list stays a list)."""
    if isinstance(value, dict):
        return {k: map_arrays(fn, v) for k, v in value.items()}
    if isinstance(value, (tuple, list)):
        return type(value)(map_arrays(fn, v) for v in value)
    return fn(value)


def leaves(value: Any) -> list[Any]:
    if isinstance(value, dict):
        return [leaf for v in value.values() for leaf in leaves(v)]
    if isinstance(value, (tuple, list)):
        return [leaf for v in value for leaf in leaves(v)]
    return [value]


def slice_rows(value: Any, start: int, end: int) -> Any:
    """Rows ``start:end`` of every array of ``value``."""
    return map_arrays(lambda a: a[start:end], value)


def count_rows(value: Any) -> int:
    """The batch's number of samples: the length of its first array."""
    found = leaves(value)
    if not found:
        raise ConfigError("an empty dict, tuple or list holds no samples")
    return len(found[0])


def entry(value: Any, key: str | int, what: str) -> Any:
    """Output or target ``key`` of a structure, with what went wrong if it has none."""
    if isinstance(value, dict) and isinstance(key, str) and key in value:
        return value[key]
    if isinstance(value, (tuple, list)) and isinstance(key, int) and key < len(value):
        return value[key]
    have = f"keys {sorted(value)}" if isinstance(value, dict) else f"{len(value)} entries"
    if not structured(value):
        have = "one tensor"
    raise ConfigError(f"the loss is given for {what} {key!r}, but the {what}s are {have}")


def detached(value: Any) -> Any:
    return value.detach() if hasattr(value, "detach") else value


def to_numpy(value: Any, widen: Any = None) -> Any:
    """An output as numpy (anything that is not a tensor as it is); bfloat16, which numpy lacks, and ``widen`` (the
    dtype mixed precision computed in) as float32."""
    if not hasattr(value, "detach"):
        return value
    value = value.detach()
    if str(value.dtype) == "torch.bfloat16" or (widen is not None and value.dtype == widen):
        value = value.float()
    return value.cpu().numpy()


def plain_module(module: Any) -> Any:
    """The module a ``torch.compile`` wrapper (``OptimizedModule``) compiles, else ``module`` itself: its
    ``forward``'s signature and its ``state_dict``'s keys are the user's."""
    return getattr(module, "_orig_mod", module)


def output_name(key: str | int) -> str:
    return key if isinstance(key, str) else f"output_{key}"


def per_output(spec: Any, what: str) -> list[tuple[str | int, Any]]:
    """A dict or sequence given per output as ``(key, value)`` pairs (dict keys, or indices)."""
    if isinstance(spec, Mapping):
        return list(spec.items())
    if isinstance(spec, Sequence) and not isinstance(spec, str):
        return list(enumerate(spec))
    raise ConfigTypeError(
        f"{what} must be one for all outputs, a dict by output name or a list by position, got {spec!r}"
    )


def takes_keywords(module: Any, names: tuple[str, ...]) -> bool:
    """Whether ``module.forward`` takes parameters ``names`` (a dict's keys) by keyword: it has ``**kwargs`` or all of
    them. If not, it must take one positional argument (the dict). A compiled module's forward is read where it was
    written (the wrapper takes anything)."""
    module = plain_module(module)
    try:
        signature = inspect.signature(module.forward)
    except (TypeError, ValueError):  # no signature to read (a builtin): pass the dict
        return False
    params = list(signature.parameters.values())
    if any(p.kind is p.VAR_KEYWORD for p in params):
        return True
    if set(names) <= {p.name for p in params if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)}:
        return True
    positional = [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    required = [p for p in params if p.default is p.empty and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]
    if len(required) > 1 or not (positional or any(p.kind is p.VAR_POSITIONAL for p in params)):
        raise ConfigTypeError(
            f"the batch's inputs are a dict with keys {list(names)}, but {type(module).__name__}.forward{signature} "
            "takes neither those names as parameters nor one dict"
        )
    return False
