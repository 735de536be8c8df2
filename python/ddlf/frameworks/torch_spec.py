"""The part of :mod:`.model_spec` that is a :class:`~ddlf.models.TorchModel`'s: its parameters' ``requires_grad``,
its optimizer (class, parameter groups and their hyperparameters, rebuilt on a worker where the user replaced the
master's), a ``loss_fn`` set after the model was made, its training options, and a digest of its module as torch
prints it (what cannot be carried, such as a ``Dropout``'s ``p``, is warned of)."""

from __future__ import annotations

import hashlib
from typing import TYPE_CHECKING, Any

from ..errors import ModelMismatchError

if TYPE_CHECKING:
    from .model_spec import ModelSpec


def is_torch_model(model: Any) -> bool:
    return hasattr(model, "get_optimizer_state") and hasattr(model, "module")


def _plain(value: Any) -> bool:
    if value is None or isinstance(value, (bool, int, float, str)):
        return True
    if isinstance(value, (tuple, list)):
        return all(_plain(v) for v in value)
    return False


def optimizer_groups(model: Any) -> list[dict[str, Any]] | None:
    """A ``TorchModel`` optimizer's hyperparameters, group by group (what a torch scheduler or the user changes:
    ``lr``, ``momentum``, ``weight_decay``, ``betas``...); None for another model."""
    if not is_torch_model(model):
        return None
    out = []
    for group in model.optimizer.param_groups:
        hyper = {}
        for k, v in group.items():
            if k == "params":
                continue
            if hasattr(v, "item") and getattr(v, "numel", lambda: 0)() == 1:  # a tensor rate (capturable)
                v = v.item()
            if _plain(v):
                hyper[k] = v
        out.append(hyper)
    return out


def set_optimizer_groups(model: Any, groups: list[dict[str, Any]]) -> bool:
    """Give a ``TorchModel`` optimizer the master's hyperparameters (:func:`optimizer_groups`); whether any
    changed."""
    own = model.optimizer.param_groups
    if len(own) != len(groups):
        raise ModelMismatchError(
            f"the master's optimizer has {len(groups)} parameter groups, this worker's {len(own)}: "
            "create_model must build the same optimizer everywhere"
        )
    changed = False
    for group, hyper in zip(own, groups):
        for k, v in hyper.items():
            now = group.get(k)
            if hasattr(now, "fill_") and hasattr(now, "numel"):  # a tensor hyperparameter: in place
                if float(now.item()) != v:
                    now.fill_(v)
                    changed = True
            elif now != v:
                group[k] = tuple(v) if isinstance(now, tuple) and isinstance(v, list) else v
                changed = True
    return changed


def describe(model: Any) -> dict[str, Any]:
    """The :class:`~.model_spec.ModelSpec` fields of a ``TorchModel``."""
    return dict(
        trainable=[bool(p.requires_grad) for p in model.module.parameters()],
        architecture=architecture(model),
        optimizer_class=_class_name(model.optimizer),
        optimizer_type=type(model.optimizer),
        optimizer_groups=optimizer_groups(model),
        optimizer_params=optimizer_params(model),
        loss=model.loss_fn if getattr(model, "loss_changed", False) else None,
        training_options=training_options(model),
    )


def _class_name(obj: Any) -> str:
    return f"{type(obj).__module__}.{type(obj).__qualname__}"


def optimizer_params(model: Any) -> list[list[int]]:
    """A ``TorchModel`` optimizer's parameter groups as indices into ``module.parameters()`` (-1: a parameter
    that is not the module's, which cannot be rebuilt elsewhere)."""
    index = {id(p): i for i, p in enumerate(model.module.parameters())}
    return [[index.get(id(p), -1) for p in group["params"]] for group in model.optimizer.param_groups]


def architecture(model: Any) -> str:
    """A digest of a ``TorchModel``'s module as torch prints it (its layers, sizes and settings such as a
    ``Dropout``'s ``p``), which the workers' ``create_model`` must build alike."""
    module = getattr(model.module, "_orig_mod", model.module)  # torch.compile's wrapper aside
    return hashlib.sha256(repr(module).encode()).hexdigest()[:16]


def _build_optimizer(model: Any, spec: ModelSpec, params: list[Any]) -> None:
    """Give ``model`` the master's optimizer: its class over the same parameter groups, with their
    hyperparameters (its state comes after, as for any worker: :func:`ddlf.training.master_optimizer.push`)."""
    members = spec.optimizer_params or [[-1]]
    if spec.optimizer_type is None or spec.optimizer_groups is None or any(-1 in g for g in members):
        raise ModelMismatchError(
            f"the master's TorchModel trains with {spec.optimizer_class} over other parameter groups than the one "
            "create_model() built here, and not all of its parameters are the module's: create_model must build "
            "the same optimizer everywhere"
        )
    groups = [{**hyper, "params": [params[i] for i in idx]} for idx, hyper in zip(members, spec.optimizer_groups)]
    try:
        model.optimizer = spec.optimizer_type(groups)
    except Exception as exc:  # a user's optimizer class that takes other arguments
        raise ModelMismatchError(
            f"the master's TorchModel trains with {spec.optimizer_class} (its class or its parameter groups changed "
            f"since create_model()), which this worker could not build from its parameter groups ({exc}): build "
            "it in create_model instead"
        ) from exc


def training_options(model: Any) -> dict[str, Any]:
    return {name: getattr(model, name) for name in ("precision", "clip_grad_norm") if hasattr(model, name)}


def apply(model: Any, spec: ModelSpec) -> list[str]:
    """:func:`.model_spec.apply` for a ``TorchModel``."""
    changed: list[str] = []
    params = list(model.module.parameters())
    if spec.trainable is not None:
        if len(params) != len(spec.trainable):
            raise ModelMismatchError(
                f"the master's module has {len(spec.trainable)} parameters, the one create_model() built here "
                f"{len(params)}: create_model must build the same module everywhere"
            )
        flips = [(p, t) for p, t in zip(params, spec.trainable) if p.requires_grad != t]
        for p, t in flips:
            p.requires_grad_(t)
        if flips:
            changed.append("requires_grad")
    other_class = spec.optimizer_class is not None and _class_name(model.optimizer) != spec.optimizer_class
    if other_class or (spec.optimizer_params is not None and optimizer_params(model) != spec.optimizer_params):
        _build_optimizer(model, spec, params)  # the user replaced the master's (fine-tuning a part, another class)
        changed.append("optimizer")
    if spec.loss is not None and model.loss_fn is not spec.loss:
        model.loss_fn = spec.loss
        changed.append("loss")
    groups = spec.optimizer_groups
    if groups is not None and set_optimizer_groups(model, groups) and "optimizer" not in changed:
        changed.append("optimizer")
    for name, value in (spec.training_options or {}).items():
        if hasattr(model, name) and getattr(model, name) != value:
            setattr(model, name, value)
            changed.append(name)
    return changed
