"""Seeding every framework a run uses (Python, numpy, Keras, torch), and telling whether a run uses torch."""

from __future__ import annotations

import random
import sys
from contextlib import nullcontext
from typing import Any

import numpy as np

from .console import quiet_start
from .keras_backend import keras_backend_in_use, tensorflow_left_unloaded


def set_random_seed(seed: int, *, torch: bool | None = None) -> bool:
    """Seed Python's, numpy's and Keras's generators, and torch's when torch is loaded (a TorchModel's dropout).
    Keras is left unloaded by a PyTorch run in a process that has not imported it, and TensorFlow by a run on
    another Keras backend in a process that has not loaded it.

    ``torch``: whether this process trains with PyTorch (a ``TorchModel``, or Keras on its torch backend); by
    default, whether the script has imported torch already or Keras runs on torch. Returns False where Keras was
    left unloaded: if what runs next loads it, Keras' import draws from Python's generator after the seeding (see
    :func:`keras_loaded_since`)."""
    random.seed(seed)
    np.random.seed(seed % 2**32)
    if torch is None:
        torch = uses_torch()
    if torch:
        from .loading import load_torch_compiler_first

        # keras.utils.set_random_seed imports TensorFlow whenever it is installed (to seed tf.data), whatever the
        # backend: where torch and triton are installed too, torch's compiler must be in first (frameworks.loading).
        # Only then: it costs 3.3 s and about 900 MB of mappings, which a Keras run on TensorFlow does not need.
        load_torch_compiler_first()
    if torch and "keras" not in sys.modules and keras_backend_in_use() != "torch":
        # A PyTorch run (a TorchModel) in a process without Keras: importing Keras here would load TensorFlow, 4-5
        # CPU-seconds and hundreds of MB, for nothing. Keras imported later still draws its default seeds from
        # Python's generator, seeded above, but its import draws from it too: the caller seeds again if it loads.
        _seed_torch(seed)
        return False
    # Keras imports its backend, and keras.utils.set_random_seed TensorFlow: their start-up notices stay off the
    # console (frameworks.console).
    with quiet_start() if "tensorflow" not in sys.modules or "keras" not in sys.modules else nullcontext():
        try:
            import keras
        except ImportError:  # a torch-only installation
            pass
        else:
            _seed_keras(keras, seed)
    _seed_torch(seed)
    return True


def keras_loaded_since(seeded: bool) -> bool:
    """Whether Keras was loaded after a :func:`set_random_seed` that left it unloaded (``seeded``: what it
    returned): its import drew from Python's generator, so what was drawn after it (a Keras model's initial
    weights) is not what the seed gives once Keras is loaded; the caller seeds again and draws again."""
    return not seeded and "keras" in sys.modules


def _seed_keras(keras: Any, seed: int) -> None:
    """``keras.utils.set_random_seed``, without the import of TensorFlow it makes (to seed ``tf.data``) on another
    backend where TensorFlow is not loaded (:func:`~.keras_backend.tensorflow_left_unloaded`): 2-3 s on the master
    and on every worker of a first ``train()`` on JAX, for nothing (TensorFlow, if a later step loads it, is not
    seeded by the run)."""
    with tensorflow_left_unloaded():
        keras.utils.set_random_seed(seed)


def _seed_torch(seed: int) -> None:
    loaded = sys.modules.get("torch")
    if loaded is not None:
        loaded.manual_seed(seed)


def uses_torch(model: Any = None) -> bool:
    """Whether a run trains with PyTorch: Keras runs on its torch backend, or ``model`` is a ``TorchModel``; before
    the model is built (``model=None``), as far as can be told: the script imported torch (a ``TorchModel``'s
    module is defined with it)."""
    from .torch_model import TorchModel

    if keras_backend_in_use() == "torch":
        return True
    return isinstance(model, TorchModel) if model is not None else "torch" in sys.modules
