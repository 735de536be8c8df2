"""Models that are not Keras models: :class:`TorchModel` wraps a ``torch.nn.Module`` (lives in
:mod:`ddlf.frameworks.torch_model`)."""

from __future__ import annotations

from .frameworks.torch_model import TorchModel

__all__ = ["TorchModel"]
