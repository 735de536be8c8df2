"""Model adapters: other frameworks' models behind the training API that ddlf drives on Keras models.

``TorchModel`` wraps a ``torch.nn.Module`` with its optimizer and loss so that an app's ``create_model`` can return
it and train it with ``app.train`` (sync or async), ``app.evaluate``, History, callbacks and checkpoints, exactly
as a compiled Keras model. torch is imported only when a ``TorchModel`` is made.
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np

from ..errors import ConfigError, ConfigTypeError, ModelMismatchError
from . import torch_optimizer
from .torch_batches import (
    count_rows,
    detached,
    entry,
    map_arrays,
    output_name,
    per_output,
    plain_module,
    slice_rows,
    structured,
    takes_keywords,
    to_numpy,
)
from .torch_placement import PRECISIONS, resolve_device, scaler_step

__all__ = ["TorchModel"]

_METRICS = ("accuracy",)


def _arrays(tensors: Sequence[Any]) -> list[np.ndarray]:
    """C-ordered numpy copies of tensors (a copy: the model keeps training in place; from a GPU the copy to the
    host is the one, unless the tensor is laid out otherwise, channels-last)."""
    return [
        t.detach().numpy().copy() if t.device.type == "cpu" else np.ascontiguousarray(t.detach().cpu().numpy())
        for t in tensors
    ]


class TorchModel:
    """A ``torch.nn.Module`` with a Keras-like training API.

    Args:
        module: the network; its floating-point parameters and buffers are the weights that travel and are averaged
            (integer buffers, such as batch-norm counters, stay local to each copy).
        optimizer: a ``torch.optim.Optimizer`` over ``module.parameters()``, or a function taking the parameters
            and returning one (``lambda p: torch.optim.Adam(p, lr=1e-3)``).
        loss_fn: ``loss_fn(outputs, targets)`` returning a scalar tensor, e.g. ``torch.nn.CrossEntropyLoss()``, on
            whatever the module returns and the batch's targets (a dict or tuple of them included); or one loss per
            output: a dict by output name (the module returns a dict) or a list by position (it returns a tuple),
            each ``loss(output, target)`` on that output and the target of the same name or position; ``None``
            leaves an output out. The loss is then their sum, weighted by ``loss_weights`` (a dict or list alike;
            default 1 each), and the logs hold each one as ``<name>_loss`` (``output_<i>_loss`` by position).
        metrics: ``("accuracy",)`` or ``()``: the share of argmax of an output matching its integer class targets,
            logged as ``accuracy`` for a single output and ``<name>_accuracy`` for each of several, and only where it
            is defined (integer targets, outputs with one more axis: the classes).
        target_dtype: the dtype targets are converted to: ``"long"`` suits class labels, ``"float32"`` regression,
            ``None`` keeps each array's. For a dict or tuple of targets, one for all of them or a dict or list by
            output. The default, ``"auto"``: an array becomes ``long`` (class labels); in a dict or tuple, integer
            arrays become ``long`` and floating ones ``float32``.
        loss_weights: with one loss per output, their weights.
        device: where the module, its optimizer's state and each batch live. ``"auto"`` (the default): the device the
            module is on if that is not the CPU, else the process's GPU (a worker started with ``ddlf-worker --gpu
            N`` or by ``Cluster.local(gpus="auto")`` sees only its own, as ``cuda``), else the CPU; or an explicit
            ``"cpu"``, ``"cuda:0"``, ``torch.device``, refused where this process does not have it. Each worker
            resolves ``"auto"`` itself, so one app trains on GPU and CPU workers alike. Batches go to a GPU from
            pinned memory without blocking; weights and gradients cross to the ring as numpy arrays.
        precision: ``"32-true"`` (the default), ``"bf16-mixed"`` or ``"16-mixed"`` (Lightning's names): the forward
            pass and the loss run under ``torch.autocast`` in bfloat16 or float16, the weights, gradients and
            optimizer stay float32. ``"16-mixed"`` scales the loss with a ``torch.amp.GradScaler``: with gradient
            averaging the scaled gradients are averaged and then unscaled, and a step whose average overflowed is
            skipped on every worker alike while the scale shrinks (as under DDP).
        clip_grad_norm: clip the gradients to this total norm before each optimizer step
            (``torch.nn.utils.clip_grad_norm_``, as a DDP loop does after ``backward``); with gradient averaging the
            averaged gradients are clipped, so every worker takes the same step. ``None``: no clipping.
        channels_last: keep the module's 4-d weights and each 4-d float input in ``torch.channels_last`` memory
            format (faster convolutions on recent CPUs and on GPUs with tensor cores).

    ``module`` may be a ``torch.compile``'d module: it trains as the module does (its backward runs compiled, and
    gradient averaging's buckets hook its parameters); ``save`` writes the plain module's ``state_dict``.

    A batch's inputs ``x`` are an array (``module(x)``), a tuple or list of arrays (``module(*x)``) or a dict name
    -> array: ``module(**x)`` when ``module.forward`` takes those names as parameters (or ``**kwargs``), else
    ``module(x)`` with the dict of tensors, as a ``forward(self, batch)`` expects it. Targets ``y`` are an array, a
    tuple or a dict, matching the outputs the losses take; ``predict`` returns what the module returns, as numpy.

    ``get_weights``/``set_weights``, ``train_on_batch``, ``evaluate``, ``predict``, ``reset_metrics``,
    ``get_metrics_result``, ``save``, ``save_weights``/``load_weights`` behave like Keras's; the optimizer's state
    and the random generator's state are reachable through ``get_optimizer_state``/``set_optimizer_state`` and
    ``get_rng_state``/``set_rng_state`` (``ModelAveraging(optimizer_state=True)`` and checkpoints use them).
    """

    def __init__(
        self,
        module: Any,
        optimizer: Any,
        loss_fn: Callable[[Any, Any], Any] | Mapping[str, Any] | Sequence[Any],
        metrics: Sequence[str] = ("accuracy",),
        target_dtype: str | Mapping[str, str | None] | Sequence[str | None] | None = "auto",
        loss_weights: Mapping[str, float] | Sequence[float] | None = None,
        *,
        device: Any = "auto",
        precision: str = "32-true",
        clip_grad_norm: float | None = None,
        channels_last: bool = False,
    ) -> None:
        import torch

        from .loading import check_torch_compiler_can_load

        check_torch_compiler_can_load()  # an abort (TensorFlow loaded first) becomes an error
        unknown = [m for m in metrics if m not in _METRICS]
        if unknown:
            raise ConfigError(f"unknown metrics {unknown}: TorchModel computes {list(_METRICS)}")
        if not isinstance(module, torch.nn.Module):
            raise ConfigTypeError(f"module must be a torch.nn.Module, got {type(module).__name__}")
        self._torch = torch
        self.module = module
        self._loss_weights = loss_weights
        self.loss_fn = loss_fn
        self.loss_changed = False  # set after the model was made: the workers take it (model_spec)
        self.metrics = tuple(metrics)
        by_output = target_dtype is not None and not isinstance(target_dtype, str)
        self._target_dtype = "auto" if by_output else self._dtype(target_dtype)
        self._array_target_dtype = torch.long if self._target_dtype == "auto" else self._target_dtype
        self._class_dtypes = frozenset((torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64))
        self._target_dtypes: dict[str | int, Any] | None = None
        if by_output:
            self._target_dtypes = {k: self._dtype(v) for k, v in per_output(target_dtype, "target_dtype")}
        self._kwargs_calls: dict[tuple[str, ...], bool] = {}
        if not isinstance(channels_last, bool):
            raise ConfigTypeError(f"TorchModel: channels_last must be True or False, got {channels_last!r}")
        self.channels_last = channels_last
        self.device = resolve_device(torch, device, module)
        """The ``torch.device`` the module, its optimizer's state and the batches are on."""
        self._on_host = self.device.type == "cpu"
        self._memory_format = torch.channels_last if channels_last else None
        module.to(self.device)
        if self._memory_format is not None:
            module.to(memory_format=self._memory_format)
        self.scaler: Any = None
        """The ``torch.amp.GradScaler`` of ``"16-mixed"`` (None otherwise)."""
        self.precision = precision
        self.clip_grad_norm = clip_grad_norm
        if not isinstance(optimizer, torch.optim.Optimizer) and not callable(optimizer):
            raise ConfigTypeError(
                f"optimizer must be a torch.optim.Optimizer or a function returning one (lambda p: "
                f"torch.optim.Adam(p)), not {optimizer!r}"
            )
        self.optimizer = optimizer if isinstance(optimizer, torch.optim.Optimizer) else optimizer(module.parameters())
        if not isinstance(self.optimizer, torch.optim.Optimizer):
            raise ConfigTypeError("optimizer must be a torch.optim.Optimizer or a function returning one")
        self._move_optimizer_state()
        self.reset_metrics()

    @property
    def precision(self) -> str:
        """``"32-true"``, ``"bf16-mixed"`` or ``"16-mixed"`` (see the class's docs); set it between runs and the
        workers' replicas follow the master's."""
        return self._precision

    @precision.setter
    def precision(self, value: str) -> None:
        value = "32-true" if value in ("32", 32) else value
        if value not in PRECISIONS:
            raise ConfigError(
                f"TorchModel: precision must be one of {list(PRECISIONS)}, got {value!r} (the weights stay float32: "
                "'bf16-true' or '16-true' would make the gradients too coarse to average)"
            )
        torch = self._torch
        self._precision = value
        self._autocast_dtype = {"bf16-mixed": torch.bfloat16, "16-mixed": torch.float16}.get(value)
        if value != "16-mixed":
            self.scaler = None
        elif self.scaler is None:
            self.scaler = torch.amp.GradScaler(self.device.type)
            # The scale exists from the start, not from the first scale(): a worker without a batch on its first
            # step still unscales and steps with the others' average (and its state travels with the optimizer's).
            init = getattr(self.scaler, "_lazy_init_scale_growth_tracker", None)
            if init is not None:
                init(self.device)

    @property
    def clip_grad_norm(self) -> float | None:
        """The total norm the gradients are clipped to before each step (None: not clipped); set it between runs
        and the workers' replicas follow the master's."""
        return self._clip_grad_norm

    @clip_grad_norm.setter
    def clip_grad_norm(self, value: float | None) -> None:
        if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0):
            raise ConfigError(f"TorchModel: clip_grad_norm must be a positive number or None, got {value!r}")
        self._clip_grad_norm = None if value is None else float(value)

    def _move_optimizer_state(self) -> None:
        """An optimizer built (and stepped) before the module moved: its state tensors to the module's device."""
        for state in self.optimizer.state.values():
            for k, v in state.items():
                if self._torch.is_tensor(v) and v.device != self.device and v.dim() > 0:
                    state[k] = v.to(self.device)

    def _autocast(self) -> Any:
        """The forward pass's precision: ``torch.autocast`` for the mixed ones, nothing for float32."""
        if self._autocast_dtype is None:
            return contextlib.nullcontext()
        return self._torch.autocast(device_type=self.device.type, dtype=self._autocast_dtype)

    def _dtype(self, name: Any) -> Any:
        if name is None or name == "auto":
            return name
        if not isinstance(name, str) or not isinstance(getattr(self._torch, name, None), self._torch.dtype):
            raise ConfigError(f"target_dtype: {name!r} is not a torch dtype (e.g. 'long', 'float32')")
        return getattr(self._torch, name)

    @property
    def loss_fn(self) -> Any:
        """The loss (see the class docs); set anew, it trains from then on, on the workers from the next
        ``train()``."""
        return self._loss_fn

    @loss_fn.setter
    def loss_fn(self, loss_fn: Any) -> None:
        self._loss_fn, self.loss_changed = loss_fn, True
        if isinstance(loss_fn, self._torch.nn.ModuleDict):  # losses that are modules, by output
            loss_fn = dict(loss_fn.items())
        elif isinstance(loss_fn, self._torch.nn.ModuleList):
            loss_fn = list(loss_fn)
        self._losses = self._per_output_losses(loss_fn, self._loss_weights)

    @staticmethod
    def _per_output_losses(loss_fn: Any, loss_weights: Any) -> list[tuple[str | int, Any, float]] | None:
        """``(output key, loss, weight)`` for each output a loss is given for; None for one loss over everything."""
        if callable(loss_fn) and not isinstance(loss_fn, (Mapping, Sequence)):
            if loss_weights is not None:
                raise ConfigError("loss_weights weigh one loss per output: give loss_fn as a dict or list of losses")
            return None
        given = per_output(loss_fn, "loss_fn")
        losses = [(k, fn) for k, fn in given if fn is not None]
        if not losses or any(not callable(fn) for _, fn in losses):
            raise ConfigTypeError(f"loss_fn: a loss (a callable) or None per output, got {loss_fn!r}")
        weights = dict(per_output(loss_weights, "loss_weights")) if loss_weights is not None else {}
        if unknown := [k for k in weights if k not in dict(given)]:
            raise ConfigError(f"loss_weights for {unknown}, which loss_fn does not name")
        return [(k, fn, float(weights.get(k, 1.0))) for k, fn in losses]

    # -- weights ----------------------------------------------------------------------------------------------

    def _tensors(self) -> list[Any]:
        return [t for t in self.module.state_dict(keep_vars=True).values() if t.is_floating_point()]

    def get_weights(self) -> list[np.ndarray]:
        """Copies of the floating-point parameters and buffers, in ``state_dict`` order."""
        return _arrays(self._tensors())

    def set_weights(self, weights: Sequence[np.ndarray]) -> None:
        """Copy ``weights`` (as returned by :meth:`get_weights`) into the module."""
        tensors = self._tensors()
        if len(weights) != len(tensors):
            raise ModelMismatchError(f"expected {len(tensors)} weight arrays, got {len(weights)}")
        with self._torch.no_grad():
            for t, w in zip(tensors, weights):
                w = np.asarray(w)
                if tuple(w.shape) != tuple(t.shape):
                    raise ModelMismatchError(
                        f"weight of shape {w.shape} does not fit a tensor of shape {tuple(t.shape)}"
                    )
                t.copy_(self._tensor(w))

    @property
    def weights(self) -> list[Any]:
        """The tensors behind :meth:`get_weights`."""
        return self._tensors()

    def count_params(self) -> int:
        """Number of trainable parameters."""
        return sum(p.numel() for p in self.module.parameters() if p.requires_grad)

    # -- training and evaluation ------------------------------------------------------------------------------

    def _tensor(self, a: Any) -> Any:
        """A tensor on ``a``'s memory, without a copy. Arrays that arrived over the wire may be read-only; every
        caller only reads them (torch warns about read-only arrays all the same)."""
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)
            return self._torch.from_numpy(np.asarray(a))

    def _batch(self, a: Any, dtype: Any = None) -> Any:
        """An array of a batch as a tensor on the model's device (of ``dtype``, if given): on the CPU the array's
        memory itself where the dtype agrees; to a GPU from pinned memory, without blocking the host, converted on
        whichever side keeps the copy narrower."""
        t = self._tensor(a)
        convert = dtype is not None and t.dtype != dtype
        if convert and (self._on_host or t.element_size() >= dtype.itemsize):
            t, convert = t.to(dtype), False
        if not self._on_host:
            if self.device.type == "cuda":
                t = t.pin_memory()
            t = t.to(self.device, non_blocking=self.device.type == "cuda")
            if convert:
                t = t.to(dtype)
        if self._memory_format is not None and t.dim() == 4 and t.is_floating_point():
            t = t.contiguous(memory_format=self._memory_format)
        return t

    def _inputs(self, x: Any) -> Any:
        return map_arrays(self._batch, x) if structured(x) else self._batch(x)

    def _targets(self, y: Any) -> Any:
        if not structured(y):
            if self._target_dtypes is not None:
                raise ConfigError("target_dtype is given per output, but the targets are one array")
            return self._batch(y, self._array_target_dtype)
        if isinstance(y, dict):
            return {k: self._target(v, k) for k, v in y.items()}
        return type(y)(self._target(v, i) for i, v in enumerate(y))

    def _target(self, a: Any, key: str | int) -> Any:
        """Target ``key`` of a dict or tuple of targets, converted as ``target_dtype`` says."""
        dtype = self._target_dtype if self._target_dtypes is None else self._target_dtypes.get(key)
        t = map_arrays(self._batch, a)
        if dtype is None or structured(t):
            return t
        if dtype == "auto":
            if t.is_floating_point():
                return t.to(self._torch.float32)
            return t.to(self._torch.long) if not t.is_complex() and t.dtype != self._torch.bool else t
        return t.to(dtype)

    def _forward(self, inputs: Any) -> Any:
        """The module on a batch's inputs: ``module(x)``, ``module(*x)`` for a tuple or list, ``module(**x)`` or
        ``module(x)`` for a dict (see the class's docstring)."""
        if isinstance(inputs, dict):
            return self.module(**inputs) if self._by_keyword(tuple(inputs)) else self.module(inputs)
        if isinstance(inputs, (tuple, list)):
            return self.module(*inputs)
        return self.module(inputs)

    def _by_keyword(self, names: tuple[str, ...]) -> bool:
        """Whether ``module.forward`` takes a dict's entries ``names`` as keyword arguments (else: the dict)."""
        known = self._kwargs_calls.get(names)
        if known is None:
            known = self._kwargs_calls[names] = takes_keywords(self.module, names)
        return known

    def _loss(self, out: Any, target: Any) -> tuple[Any, dict[str, Any]]:
        """The loss to minimise, and each output's (per-output losses only), by log name."""
        if self._losses is None:
            return self.loss_fn(out, target), {}
        total: Any = None
        parts: dict[str, Any] = {}
        for key, fn, weight in self._losses:
            value = fn(entry(out, key, "output"), entry(target, key, "target"))
            parts[f"{output_name(key)}_loss"] = value
            total = value * weight if total is None else total + value * weight
        return total, parts

    def _accuracies(self, out: Any, target: Any) -> dict[str, float]:
        """The accuracy of each output where it is defined (integer class targets, outputs with one more axis),
        in samples (the share of the batch's targets right, times its rows): ``accuracy`` for one output,
        ``<name>_accuracy`` for several."""
        if "accuracy" not in self.metrics:
            return {}
        if not structured(out) or not structured(target):
            if structured(out) or structured(target):
                return {}
            share = self._accuracy(out, target)
            return {} if share is None else {"accuracy": share}
        if isinstance(out, dict) != isinstance(target, dict):
            return {}
        keys: list[Any] = list(out) if isinstance(out, dict) else list(range(len(out)))
        found = {}
        for key in keys:
            o = out.get(key) if isinstance(out, dict) else out[key]
            t = target.get(key) if isinstance(target, dict) else (target[key] if key < len(target) else None)
            if t is None or structured(o) or structured(t):
                continue
            share = self._accuracy(o, t)
            if share is not None:
                found[f"{output_name(key)}_accuracy"] = share
        return found

    def _accuracy(self, out: Any, target: Any) -> float | None:
        if not self._torch.is_tensor(out) or not self._torch.is_tensor(target):
            return None
        if target.dtype not in self._class_dtypes or out.dim() != target.dim() + 1 or out.shape[:-1] != target.shape:
            return None
        if target.numel() == 0:
            return None
        right = int((out.argmax(dim=-1) == target).sum())
        n, total = len(target), target.numel()
        return right if total == n else right * n / total  # one target per sample: the count itself, exactly

    def reset_metrics(self) -> None:
        """Start the running loss and metrics afresh (as Keras's ``model.reset_metrics``)."""
        self._seen = 0
        self._sums: dict[str, float] = {}

    def _count(self, sums: dict[str, float], n: int, loss: Any, parts: dict[str, Any], out: Any, target: Any) -> None:
        """Add a batch of ``n`` samples to running ``sums`` (of each log's value times samples)."""
        sums["loss"] = sums.get("loss", 0.0) + float(loss.detach()) * n
        for name, value in parts.items():
            sums[name] = sums.get(name, 0.0) + float(value.detach()) * n
        for name, right in self._accuracies(out, target).items():
            sums[name] = sums.get(name, 0.0) + right

    @staticmethod
    def _logs(sums: dict[str, float], seen: int, return_dict: bool) -> Any:
        logs = {k: v / max(seen, 1) for k, v in sums.items()} or {"loss": 0.0}
        if return_dict:
            return logs
        values = list(logs.values())
        return values[0] if len(values) == 1 else values

    def get_metrics_result(self) -> dict[str, float]:
        """The running loss and metrics since :meth:`reset_metrics` (as Keras's)."""
        return self._logs(self._sums, self._seen, True)

    def _backward(self, x: Any, y: Any) -> None:
        """Forward and backward on a batch (the gradients are in the parameters' ``.grad``); the running loss and
        metrics count it. ``x`` and ``y``: arrays, or dicts, tuples or lists of them."""
        self.module.train()
        if self._losses is None and not isinstance(x, (dict, tuple, list)) and not isinstance(y, (dict, tuple, list)):
            # An array in, an array of targets, one loss: the common case, with as little around torch as can be.
            inputs, target = self._batch(x), self._batch(y, self._array_target_dtype)
            self.optimizer.zero_grad(set_to_none=True)
            with self._autocast():
                out = self.module(inputs)
                loss = self.loss_fn(out, target)
            (loss if self.scaler is None else self.scaler.scale(loss)).backward()
            n = len(target)
            self._seen += n
            sums = self._sums
            sums["loss"] = sums.get("loss", 0.0) + float(loss.detach()) * n
            if "accuracy" in self.metrics and target.dtype in self._class_dtypes and out.dim() == target.dim() + 1:
                right = int((out.detach().argmax(dim=-1) == target).sum())
                if target.dim() > 1:  # several targets per sample (a sequence's): the share, in samples
                    right = right * n / target.numel()
                sums["accuracy"] = sums.get("accuracy", 0.0) + right
            return
        inputs, target = self._inputs(x), self._targets(y)
        self.optimizer.zero_grad(set_to_none=True)
        with self._autocast():
            out = self._forward(inputs)
            loss, parts = self._loss(out, target)
        (loss if self.scaler is None else self.scaler.scale(loss)).backward()
        n = count_rows(target)
        self._seen += n
        self._count(self._sums, n, loss, parts, map_arrays(detached, out), target)

    def _step(self) -> None:
        """The optimizer's step on the gradients in the parameters' ``.grad`` (this batch's, or the average of the
        workers'): unscaled (``"16-mixed"``: a step whose gradients are not finite is skipped and the scale
        shrinks), clipped to ``clip_grad_norm``, then stepped."""
        scaler = self.scaler
        with scaler_step(scaler):  # a step that raises is forgotten by the scaler
            if self.clip_grad_norm is not None:
                if scaler is not None:
                    scaler.unscale_(self.optimizer)
                params = [p for group in self.optimizer.param_groups for p in group["params"] if p.grad is not None]
                self._torch.nn.utils.clip_grad_norm_(params, self.clip_grad_norm)
            self.optimizer.step() if scaler is None else scaler.step(self.optimizer)
        if scaler is not None:
            scaler.update()

    def train_on_batch(self, x: Any, y: Any, return_dict: bool = False) -> Any:
        """One optimizer step on a batch; returns the running loss (and metrics) since :meth:`reset_metrics`."""
        self._backward(x, y)
        self._step()
        return self._logs(self._sums, self._seen, return_dict)

    def evaluate(
        self,
        x: Any,
        y: Any,
        batch_size: int = 32,
        verbose: int = 0,
        return_dict: bool = False,
        sample_weight: Any = None,
        **_: Any,
    ) -> Any:
        """Mean loss (and metrics) over ``x, y``, in evaluation mode without gradients. No ``sample_weight`` (as in
        training: weigh the rows in the loss function instead)."""
        if sample_weight is not None:
            raise ConfigError(
                "a ddlf.models.TorchModel takes no sample weights (evaluate's sample_weight, validation_data's "
                "third item): weigh the rows in its loss function instead"
            )
        self.module.eval()
        sums: dict[str, float] = {}
        seen = 0
        rows = count_rows(x)
        with self._torch.no_grad():
            for start in range(0, rows, batch_size):
                inputs = self._inputs(slice_rows(x, start, start + batch_size))
                target = self._targets(slice_rows(y, start, start + batch_size))
                with self._autocast():
                    out = self._forward(inputs)
                    loss, parts = self._loss(out, target)
                n = count_rows(target)
                self._count(sums, n, loss, parts, out, target)
                seen += n
        return self._logs(sums, seen, return_dict)

    def predict(self, x: Any, batch_size: int = 32, verbose: int = 0) -> Any:
        """The module's outputs on ``x``, as numpy: one array, or the dict or tuple of them the module returns
        (under mixed precision, and bfloat16 ones always, as float32)."""
        self.module.eval()
        parts = []
        with self._torch.no_grad():
            for s in range(0, count_rows(x), batch_size):
                with self._autocast():
                    out = self._forward(self._inputs(slice_rows(x, s, s + batch_size)))
                parts.append(map_arrays(lambda t: to_numpy(t, self._autocast_dtype), out))
        if not parts:
            return np.empty((0,))
        if not structured(parts[0]):
            return np.concatenate(parts)
        first = parts[0]
        if isinstance(first, dict):
            return {k: np.concatenate([p[k] for p in parts]) for k in first}
        return type(first)(np.concatenate([p[i] for p in parts]) for i in range(len(first)))

    # -- gradient averaging -------------------------------------------------------------------------------------

    def untrained_mask(self) -> list[bool]:
        """For each array of :meth:`get_weights`: True for buffers the optimizer does not train (BatchNorm's
        running statistics)."""
        trained = {id(p) for p in self.module.parameters() if p.requires_grad}
        return [id(t) not in trained for t in self._tensors()]

    # -- state beyond the weights -----------------------------------------------------------------------------

    def _optimizer_tensors(self) -> list[Any] | None:
        """The optimizer's state tensors (:func:`.torch_optimizer.state_tensors`); None before the first step."""
        return torch_optimizer.state_tensors(self.optimizer, self.scaler, self._torch)

    @property
    def optimizer_built(self) -> bool:
        """Whether the optimizer has state yet (it is created by the first step)."""
        return self._optimizer_tensors() is not None

    def get_optimizer_state(self) -> list[np.ndarray]:
        """Which parameters hold a state (a bool per parameter: one frozen from the start holds none), then copies
        of their state tensors (Adam's moments and step; the gradient scaler's scale and growth tracker under
        ``"16-mixed"``); empty before the first step."""
        tensors = self._optimizer_tensors()
        if tensors is None:
            return []
        return [np.array(torch_optimizer.held(self.optimizer), dtype=bool), *_arrays(tensors)]

    def set_optimizer_state(self, state: Sequence[np.ndarray]) -> bool:
        """Adopt ``state`` (from :meth:`get_optimizer_state`); False, and nothing changed, if it does not fit
        (another optimizer or layout). An optimizer that has not stepped yet gets its state first, as its first
        step would make it: a model fresh from ``create_model`` takes a checkpoint's or another process's state
        (:func:`.torch_optimizer.set_state`)."""
        return torch_optimizer.set_state(self.optimizer, self.scaler, self._torch, [self._tensor(s) for s in state])

    def get_rng_state(self) -> list[np.ndarray]:
        """torch's random generator states (dropout masks): the CPU's, and the GPU's when the model is on one, so a
        resumed run draws the same numbers."""
        states = [self._torch.get_rng_state().numpy().copy()]
        if self.device.type == "cuda":
            states.append(self._torch.cuda.get_rng_state(self.device).numpy().copy())
        return states

    def set_rng_state(self, state: Sequence[np.ndarray]) -> None:
        """Put back :meth:`get_rng_state` (a GPU's state only where this model is on a GPU too)."""
        if len(state) >= 1:
            self._torch.set_rng_state(self._tensor(np.asarray(state[0], dtype=np.uint8)))
        if len(state) >= 2 and self.device.type == "cuda":
            self._torch.cuda.set_rng_state(self._tensor(np.asarray(state[1], dtype=np.uint8)), self.device)

    # -- saving -----------------------------------------------------------------------------------------------

    def save(self, path: str) -> None:
        """Save the module's ``state_dict`` with ``torch.save`` (a compiled module's: the plain module's, whose keys
        a module built without ``torch.compile`` loads)."""
        self._torch.save(plain_module(self.module).state_dict(), path)

    save_weights = save

    def load_weights(self, path: str) -> None:
        """Load a ``state_dict`` written by :meth:`save` onto this model's device, wherever it was saved."""
        plain_module(self.module).load_state_dict(self._torch.load(path, weights_only=True, map_location=self.device))

    def __repr__(self) -> str:
        name = type(plain_module(self.module)).__name__
        if plain_module(self.module) is not self.module:
            name = f"compiled {name}"
        extra = "" if self.device.type == "cpu" else f", {self.device}"
        extra += "" if self.precision == "32-true" else f", {self.precision}"
        return f"TorchModel({name}, {type(self.optimizer).__name__}, {self.count_params():,} params{extra})"
