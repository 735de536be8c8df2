"""Where a :class:`~ddlf.models.TorchModel` trains and in what precision: its device (``"auto"`` or explicit) and
the precisions it takes."""

from __future__ import annotations

import collections
import contextlib
import os
from collections.abc import Iterator
from typing import Any

from ..errors import ConfigError

PRECISIONS = ("32-true", "bf16-mixed", "16-mixed")
"""What :class:`TorchModel`'s ``precision`` takes (Lightning's names): float32 throughout; the forward pass and
the loss under ``torch.autocast`` in bfloat16 or float16, the weights, gradients and optimizer in float32
(float16 with a gradient scaler)."""


def resolve_device(torch: Any, device: Any, module: Any) -> Any:
    """The ``torch.device`` a :class:`TorchModel` trains on. ``"auto"``: where the module already is if that is not
    the CPU, else the process's first GPU (a worker started with ``--gpu N`` or by ``Cluster.local(gpus=...)`` sees
    only its own), else the CPU. An explicit device must exist here."""
    if device == "auto":
        placed = {p.device for p in module.parameters()} - {torch.device("cpu")}
        if len(placed) > 1:
            raise ConfigError(
                f"TorchModel: the module's parameters are on {len(placed)} devices ({sorted(map(str, placed))}); "
                "a replica trains on one: put the module on one device, or pass device= to move it there"
            )
        if placed:
            return placed.pop()
        return torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
    try:
        chosen = device if isinstance(device, torch.device) else torch.device(device)
    except (RuntimeError, TypeError, ValueError) as exc:
        raise ConfigError(f"TorchModel: device {device!r} is not a torch device ('auto', 'cpu', 'cuda:0')") from exc
    if chosen.type == "cuda":
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if count == 0 or (chosen.index is not None and chosen.index >= count):
            visible = os.environ.get("CUDA_VISIBLE_DEVICES")
            raise ConfigError(
                f"TorchModel: device {str(chosen)!r} is not available in this process: torch sees {count} CUDA "
                f"device(s) (CUDA_VISIBLE_DEVICES={visible!r}); use device='auto' to train on the worker's GPU where "
                "it has one and on the CPU elsewhere"
            )
    elif chosen.type == "mps" and not torch.backends.mps.is_available():
        raise ConfigError("TorchModel: device 'mps' is not available in this process; use device='auto'")
    return chosen


@contextlib.contextmanager
def scaler_step(scaler: Any) -> Iterator[None]:
    """Around a step's unscale and step: if they raise, the gradient scaler forgets this step's "unscaled" and
    "stepped" records (what ``GradScaler.update()`` resets), so that the next step on the model (a later run on a
    warm model) is not refused for this one's failure; the scale itself stays. ``None``: no scaler."""
    try:
        yield
    except BaseException:
        # torch's private names: were they to change, the step's own error still surfaces (not an AttributeError).
        with contextlib.suppress(ImportError, AttributeError):
            from torch.amp import grad_scaler

            if scaler is not None:
                scaler._per_optimizer_states = collections.defaultdict(grad_scaler._refresh_per_optimizer_state)
        raise
