"""Which Keras backend a process uses: the user's choice, the installed ones, and the master's on its workers;
clearing what a backend keeps between scripts (:func:`clear_sessions`, for a worker's reset); and a worker's build
of a replica without sampling initial weights the master's overwrite (:func:`initial_weights_unsampled`)."""

from __future__ import annotations

import contextlib
import os
import sys
import threading
import weakref
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

from ..errors import FrameworkClash

KERAS_BACKENDS = ("tensorflow", "jax", "torch")
"""Keras backends in ddlf's order of preference when the user has not chosen: the order ``python -m benchmarks
backends`` measures for ddlf training on CPU (the figures are in BENCHMARKS.md, *Keras backends on CPU*)."""


def users_keras_backend() -> str | None:
    """The Keras backend the user chose: ``KERAS_BACKEND``, else the ``backend`` of ``$KERAS_HOME/keras.json``
    (default ``~/.keras/keras.json``), else None. A file saying ``"tensorflow"`` does not count: Keras writes
    that file itself, with that default, the first time it is imported (and TensorFlow is ddlf's first choice
    anyway when it is installed)."""
    chosen = os.environ.get("KERAS_BACKEND")
    if chosen:
        return chosen
    home = os.environ.get("KERAS_HOME") or os.path.join(os.path.expanduser("~"), ".keras")
    try:
        import json

        with open(os.path.join(home, "keras.json")) as f:
            backend = json.load(f).get("backend")
    except (OSError, ValueError, AttributeError):
        return None
    return backend if isinstance(backend, str) and backend and backend != "tensorflow" else None


def installed_keras_backends() -> list[str]:
    """The :data:`KERAS_BACKENDS` whose framework (a module of the same name) is installed, in that order."""
    from .loading import installed

    return [name for name in KERAS_BACKENDS if installed(name)]


def installed_keras_backend() -> str:
    """The first of :data:`KERAS_BACKENDS` whose framework is installed (``jax`` when none is)."""
    return (installed_keras_backends() or ["jax"])[0]


def _loaded_keras_backend() -> str | None:
    """The backend of this process's Keras if Keras is loaded (or being loaded by another thread: importing waits
    until it is complete), else None."""
    import importlib
    import sys

    if "keras" not in sys.modules:
        return None
    return str(importlib.import_module("keras").backend.backend())


def keras_backend_default() -> str:
    """Choose Keras's backend for this process unless the user did (``KERAS_BACKEND`` or ``keras.json`` always
    win): the fastest installed one (:data:`KERAS_BACKENDS`). Called when a training run or a worker starts,
    never at import. Returns the backend in effect."""
    chosen = users_keras_backend()
    if chosen is None:
        chosen = installed_keras_backend()
        os.environ["KERAS_BACKEND"] = chosen
    return chosen


def keras_backend_in_use() -> str:
    """This process's Keras backend: Keras's own answer once it is imported, else what it will pick."""
    return _loaded_keras_backend() or keras_backend_default()


def follow_keras_backend(master: str | None) -> None:
    """On a worker, before a training run builds its model: run the master's Keras backend. Keras cannot change
    backend once imported, so a worker that already runs another one refuses with what to do."""
    if not master:
        return
    mine = _loaded_keras_backend()
    if mine is None:
        os.environ["KERAS_BACKEND"] = master
    elif mine != master:
        raise FrameworkClash(
            f"this worker runs Keras on {mine!r} (loaded already) but the master runs {master!r}: a process keeps "
            f"its first backend, so start this worker with KERAS_BACKEND={master} (or the master with "
            f"KERAS_BACKEND={mine})"
        )


_UNLOADED_TENSORFLOW = threading.RLock()  # reentrant: a serializing function may call another


@contextlib.contextmanager
def tensorflow_left_unloaded() -> Iterator[None]:
    """While Keras seeds or serializes for ddlf (``keras.utils.set_random_seed``, ``get_config``,
    ``get_compile_config``): Keras asks whether TensorFlow is *available* there, to seed ``tf.data`` or recognise
    TensorFlow objects, and asking imports it (2-3 s and hundreds of MB) whatever the backend. On another backend,
    with TensorFlow not loaded, nothing TensorFlow can be in play, so it answers "not available" without the
    import. Elsewhere, and with any other Keras, it changes nothing."""
    keras = sys.modules.get("keras")
    if keras is None or "tensorflow" in sys.modules or keras.backend.backend() == "tensorflow":
        yield
        return
    try:
        from keras.src.utils import module_utils
    except ImportError:
        yield
        return
    lazy = getattr(module_utils, "tensorflow", None)
    if lazy is None or not hasattr(type(lazy), "available") or "_available" not in vars(lazy):
        yield  # (read on the instance, the property would import it)
        return
    with _UNLOADED_TENSORFLOW:
        before = lazy._available
        if before is None:
            lazy._available = False
        try:
            yield
        finally:
            if before is None and lazy._available is False:
                lazy._available = None  # asked again later (a user's tf.data): Keras imports it then


_F = TypeVar("_F", bound=Callable[..., Any])


def keeps_tensorflow_unloaded(fn: _F) -> _F:
    """``fn`` run within :func:`tensorflow_left_unloaded` (it reads a Keras model's configuration)."""
    import functools

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        with tensorflow_left_unloaded():
            return fn(*args, **kwargs)

    return wrapper  # type: ignore[return-value]


def clear_sessions() -> None:
    """Keras' session (without its own garbage collection: the caller collects once) and JAX's compiled functions
    (which ``clear_session`` does not reach), in so far as they are loaded: for a worker's reset
    (:mod:`ddlf.worker.reset`)."""
    keras = sys.modules.get("keras")
    if keras is not None:
        try:
            keras.utils.clear_session(free_memory=False)
        except TypeError:  # an older Keras 3: no free_memory, it always collects
            keras.utils.clear_session()
    jax = sys.modules.get("jax")
    if jax is not None and hasattr(jax, "clear_caches"):
        jax.clear_caches()  # the compiled steps of the scripts before


_unsampled = threading.local()
"""Per thread: ``build`` (the innermost :func:`initial_weights_unsampled` block's :class:`UnsampledBuild`, None
outside one), ``initializing`` (a variable's initializer runs) and ``drew`` (it drew, and got zeros)."""
_install_lock = threading.Lock()


class UnsampledBuild:
    """What :func:`initial_weights_unsampled` left unsampled: the variables whose initializer drew zeros."""

    def __init__(self) -> None:
        self.zeroed: list[tuple[Any, Any]] = []  # (weak reference to the variable, its initializer)

    def sample_outside(self, model: Any) -> int:
        """Sample now the variables left unsampled that ``model``'s weights do not include (a variable the app's
        code keeps beside the model, a frozen network captured by a loss): the master's weights will not overwrite
        them. Returns how many."""
        covered = {id(v) for v in getattr(model, "weights", ())}
        n = 0
        for ref, initializer in self.zeroed:
            variable = ref()
            if variable is not None and id(variable) not in covered:
                variable.assign(initializer(variable.shape, dtype=variable.dtype))
                n += 1
        self.zeroed.clear()
        return n


def _install_unsampling() -> None:
    """Once per process: wrappers around the JAX backend's random draws and its variables' initialization, which
    act only in a thread inside :func:`initial_weights_unsampled` (nothing is restored, so an exception anywhere
    cannot leave them active)."""
    from keras.src.backend.jax import core
    from keras.src.backend.jax import random as jax_random

    with _install_lock:
        if getattr(core.Variable, "_ddlf_unsampled", False):
            return
        initialize = core.Variable._initialize_with_initializer

        def in_initializer(self: Any, initializer: Any) -> None:
            build = getattr(_unsampled, "build", None)
            if build is None:
                initialize(self, initializer)
                return
            outer = getattr(_unsampled, "initializing", False), getattr(_unsampled, "drew", False)
            _unsampled.initializing, _unsampled.drew = True, False
            try:
                initialize(self, initializer)
                if _unsampled.drew:
                    build.zeroed.append((weakref.ref(self), initializer))
            finally:
                _unsampled.initializing, _unsampled.drew = outer

        def unsampled(sample: Callable[..., Any]) -> Callable[..., Any]:
            def draw(shape: Any, *args: Any, dtype: Any = None, seed: Any = None, **kwargs: Any) -> Any:
                if args or not getattr(_unsampled, "initializing", False):
                    return sample(shape, *args, dtype=dtype, seed=seed, **kwargs)
                import jax
                import keras
                import numpy as np

                jax_random.jax_draw_seed(seed)  # the seed stream moves on as the sample would have moved it
                _unsampled.drew = True
                return jax.device_put(np.zeros(tuple(shape), dtype=jax.numpy.dtype(dtype or keras.config.floatx())))

            return draw

        for name in ("uniform", "normal", "truncated_normal"):
            setattr(jax_random, name, unsampled(getattr(jax_random, name)))
        core.Variable._initialize_with_initializer = in_initializer
        core.Variable._ddlf_unsampled = True


@contextlib.contextmanager
def initial_weights_unsampled() -> Iterator[UnsampledBuild]:
    """While a worker builds its replica of the master's model (``create_model()``, and the build on a first
    batch): on JAX, the random initial values of the variables Keras creates in this thread are not sampled,
    zeros instead. Each run starts every replica from the master's weights, so what is sampled here is
    overwritten before any use, and on JAX each shape's sampler is a compilation (``jit(_uniform)``, 0.5-1 s on a
    2-core machine: most of a small model's set-up). The seed of each draw is still drawn, so every later random
    draw (dropout, the worker's own seed stream) is what it would have been. Only a variable's initializer is
    affected: a random tensor the app's code draws is sampled as always; a variable outside the model's weights
    is sampled after the build (:meth:`UnsampledBuild.sample_outside`, which the caller calls with the model).
    Other backends, and other threads, sample as usual."""
    build = UnsampledBuild()
    keras = sys.modules.get("keras")
    if keras is None or keras.backend.backend() != "jax":
        yield build
        return
    _install_unsampling()
    outer = getattr(_unsampled, "build", None)
    _unsampled.build = build
    try:
        yield build
    finally:
        _unsampled.build = outer
