"""Dataset loaders for ``load_dataset`` (run on the workers): ``ddlf.datasets.mnist(...)`` and the others of
:mod:`ddlf.data`, which holds them."""

from __future__ import annotations

from .data import *  # noqa: F403 - the public loaders, listed in data.__all__
from .data import __all__ as __all__
