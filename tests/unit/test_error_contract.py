"""ddlf's error contract (``ddlf.errors``): every exception the package raises is a ``DdlfError`` (and also the
built-in a Python user would catch), every warning a ``DdlfWarning``, and every warning class it exports is issued
somewhere. Checked on the package's source and classes, without daemons."""

from __future__ import annotations

import ast
import builtins
import importlib
import pickle
import pkgutil
import subprocess
import sys
import warnings
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

import ddlf
from ddlf import errors

PACKAGE = Path(ddlf.__file__).parent

ALLOWED_RAISES: dict[tuple[str, str], tuple[int, str]] = {
    ("training/app.py", "NotImplementedError"): (
        3,
        "IApp.load_dataset, create_model and load_shard: methods an app overrides (load_shard only when sharded)",
    ),
    ("training/callbacks.py", "ImportError"): (
        1,
        "TensorBoard() with neither tensorboardX nor torch installed: a missing optional dependency, what code "
        "probing optional features catches",
    ),
    ("data/node_store.py", "PermissionError"): (
        1,
        "an unsafe node-store directory: load() catches it with mkdir's and lstat's own OSErrors, logs it and keeps "
        "the dataset in the worker; it never leaves the module",
    ),
    ("worker/drain.py", "SystemExit"): (2, "the daemon exits on a repeated SIGTERM, or on one with nothing to drain"),
    ("worker/main.py", "SystemExit"): (1, "the daemon's SIGTERM handler before it serves: exit as Python's default"),
    ("cli/launch.py", "KeyboardInterrupt"): (1, "SIGTERM ends `ddlf up --slurm` the way Ctrl-C does"),
    ("errors.py", "AttributeError"): (
        1,
        "the module's __getattr__ (RemoteDatasetError and its kind, by name): Python's protocol for a name a module "
        "lacks, which hasattr and pickle expect",
    ),
}
"""The deliberate bare built-in raises: (file under python/ddlf, exception) -> (how many, why)."""

ALLOWED_CLASSES = {
    "ddlf.worker.drain.Draining": "a BaseException, as SystemExit is, so that user code's `except Exception` "
    "cannot swallow the stop it interrupts a call with; the executor answers it itself",
}
"""Exception classes defined in the package that are deliberately not DdlfErrors: qualified name -> why."""

BUILTIN_EXCEPTIONS = {
    name for name, value in vars(builtins).items() if isinstance(value, type) and issubclass(value, BaseException)
}


def _sources() -> list[tuple[str, ast.Module]]:
    return [
        (path.relative_to(PACKAGE).as_posix(), ast.parse(path.read_text(), str(path)))
        for path in sorted(PACKAGE.rglob("*.py"))
    ]


def _rebound(tree: ast.Module) -> set[str]:
    """Names a module binds itself (imports, classes, functions, assignments): not the built-ins there."""
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            names.update((a.asname or a.name).split(".")[0] for a in node.names)
        elif isinstance(node, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            names.add(node.name)
        elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            names.add(node.id)
    return names


def _builtin_exception(node: ast.expr, shadowed: set[str]) -> str | None:
    """The built-in exception class ``node`` names (``ValueError``, ``builtins.ValueError``), if it does."""
    if isinstance(node, ast.Name) and node.id in BUILTIN_EXCEPTIONS and node.id not in shadowed:
        return node.id
    if (
        isinstance(node, ast.Attribute)
        and isinstance(node.value, ast.Name)
        and node.value.id == "builtins"
        and node.attr in BUILTIN_EXCEPTIONS
    ):
        return node.attr
    return None


def bare_raises() -> dict[tuple[str, str], list[int]]:
    """Every ``raise`` of a built-in exception (``raise ValueError(...)``, ``raise KeyError``) and every built-in
    exception made to be raised later (``exc = TypeError(...)``), by (file, exception): their lines."""
    found: dict[tuple[str, str], list[int]] = {}
    for rel, tree in _sources():
        shadowed = _rebound(tree)
        for node in ast.walk(tree):
            made = None
            if isinstance(node, ast.Raise) and node.exc is not None and not isinstance(node.exc, ast.Call):
                made = _builtin_exception(node.exc, shadowed)
            elif isinstance(node, ast.Call):
                made = _builtin_exception(node.func, shadowed)
            if made is not None:
                found.setdefault((rel, made), []).append(node.lineno)
    return found


def test_ddlf_raises_no_bare_builtin_exception_but_the_allowed_few() -> None:
    found = bare_raises()
    unexpected = [
        f"python/ddlf/{rel}:{line}: {name}"
        for (rel, name), lines in sorted(found.items())
        for line in sorted(lines)
        if (rel, name) not in ALLOWED_RAISES
    ]
    assert not unexpected, (
        "raise a ddlf.errors class instead (ConfigError for a value, ConfigTypeError for a type, NotFoundError "
        "for a missing name, OutOfRangeError for an index, InvalidStateError for a wrong state):\n"
        + "\n".join(unexpected)
    )
    counts = {key: len(found.get(key, [])) for key in ALLOWED_RAISES}
    assert counts == {key: n for key, (n, _) in ALLOWED_RAISES.items()}, "update ALLOWED_RAISES (and its reasons)"
    assert sum(counts.values()) <= 10
    assert all(reason for _, reason in ALLOWED_RAISES.values())


def test_the_scan_sees_what_it_must_refuse() -> None:
    tree = ast.parse(
        "from concurrent.futures import TimeoutError\n"
        "def f(x):\n"
        "    if x:\n"
        "        raise ValueError('no')\n"
        "    exc = builtins.KeyError('k')\n"
        "    raise TimeoutError('not the built-in here')\n"
        "    raise IndexError\n"
    )
    shadowed = _rebound(tree)
    seen = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Raise) and node.exc is not None and not isinstance(node.exc, ast.Call):
            seen.append(_builtin_exception(node.exc, shadowed))
        elif isinstance(node, ast.Call):
            seen.append(_builtin_exception(node.func, shadowed))
    assert sorted(s for s in seen if s) == ["IndexError", "KeyError", "ValueError"]


def _package_classes() -> list[type]:
    for info in pkgutil.walk_packages(ddlf.__path__, "ddlf."):
        if not info.name.endswith("__main__"):
            importlib.import_module(info.name)
    classes = []
    for name, module in list(sys.modules.items()):
        if name == "ddlf" or name.startswith("ddlf."):
            classes += [
                v for v in vars(module).values() if isinstance(v, type) and v.__module__ == name and v not in classes
            ]
    return classes


def test_every_exception_class_is_a_ddlf_error_and_every_warning_a_ddlf_warning() -> None:
    classes = _package_classes()
    found = [c for c in classes if issubclass(c, BaseException)]
    assert errors.NotFoundError in found and errors.ConfigWarning in found  # the walk saw the package
    wrong = []
    for cls in found:
        name = f"{cls.__module__}.{cls.__qualname__}"
        if issubclass(cls, Warning):
            if not issubclass(cls, errors.DdlfWarning):
                wrong.append(f"{name} is a Warning but not a DdlfWarning")
        elif not issubclass(cls, errors.DdlfError) and name not in ALLOWED_CLASSES:
            wrong.append(f"{name} is not a DdlfError")
    assert not wrong, "\n".join(wrong)
    assert set(ALLOWED_CLASSES) <= {f"{c.__module__}.{c.__qualname__}" for c in found}
    # one root for each: DdlfError and DdlfWarning derive from nothing of ddlf's
    assert errors.DdlfError.__bases__ == (Exception,) and errors.DdlfWarning.__bases__ == (Warning,)


def _warning_classes() -> list[str]:
    return [
        name
        for name in errors.__all__
        if isinstance(getattr(errors, name), type)
        and issubclass(getattr(errors, name), Warning)
        and getattr(errors, name) is not errors.DdlfWarning
    ]


def test_every_exported_warning_class_is_issued_somewhere() -> None:
    """Issued: passed to a call (``warnings.warn(msg, Category)``, ``category=Category``, or a helper that warns
    with its argument, as ``TrainingRun._warn``) outside errors.py."""
    passed: set[str] = set()
    for rel, tree in _sources():
        if rel == "errors.py":
            continue
        for node in ast.walk(tree):
            if isinstance(node, ast.Call):
                args = [*node.args, *(k.value for k in node.keywords)]
                passed.update(a.id for a in args if isinstance(a, ast.Name))
    never = [name for name in _warning_classes() if name not in passed]
    assert not never, f"exported but never issued: {never}"
    for name in _warning_classes():
        assert name in ddlf.__all__ and getattr(ddlf, name) is getattr(errors, name)


# -- the classes ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("cls", "builtin"),
    [
        (ddlf.ConfigError, ValueError),
        (ddlf.ConfigTypeError, TypeError),
        (ddlf.ConfigTypeError, ddlf.ConfigError),
        (ddlf.NotFoundError, KeyError),
        (ddlf.NotFoundError, LookupError),
        (ddlf.OutOfRangeError, IndexError),
        (ddlf.InvalidStateError, RuntimeError),
        (ddlf.CollectiveError, RuntimeError),
        (ddlf.FrameworkClash, RuntimeError),
        (ddlf.DatasetError, ValueError),
        (ddlf.ModelMismatchError, ValueError),
    ],
)
def test_each_class_is_also_the_builtin_users_catch(cls: type, builtin: type) -> None:
    assert issubclass(cls, ddlf.DdlfError) and issubclass(cls, builtin)
    assert cls.__doc__ and cls.__name__ in errors.__all__ and getattr(ddlf, cls.__name__) is cls


def test_a_not_found_error_reads_as_written_not_quoted_as_a_key_error() -> None:
    e = ddlf.NotFoundError("no variable named 'x' on this worker", worker_id=1, name="x")
    assert str(e) == "no variable named 'x' on this worker"
    with pytest.raises(KeyError, match=r"^no variable named 'x' on this worker$"):
        raise e


def _instances() -> list[BaseException]:
    made: list[BaseException] = []
    for name in errors.__all__:
        cls = getattr(errors, name)
        if not isinstance(cls, type) or not issubclass(cls, BaseException) or issubclass(cls, Warning):
            continue
        if cls is errors.CheckpointError:
            made.append(cls(28, "No space left on device", "/ckpt/run.ckpt"))
        elif cls is errors.Preempted:
            made.append(cls("SIGTERM: stopped", signal="SIGTERM", checkpoint="/ckpt/run.ckpt", requeued=True))
        elif cls is errors.WorkerErrorGroup:
            made.append(cls("2 workers failed", [ddlf.RemoteError("a"), ddlf.NotFoundError("b")]))
        else:
            made.append(cls(f"{name} happened", worker_id=1, address="127.0.0.1:7070"))
    return made


@pytest.mark.parametrize("exc", _instances(), ids=lambda e: type(e).__name__)
def test_every_error_class_survives_pickling(exc: BaseException) -> None:
    """A worker's exception is pickled to the master (and a sweep's trial errors to wherever its result goes)."""
    back = pickle.loads(pickle.dumps(exc))
    assert type(back) is type(exc) and str(back) == str(exc)
    assert {k: v for k, v in vars(back).items() if k != "exceptions"} == {
        k: v for k, v in vars(exc).items() if k != "exceptions"
    }


# -- `except ddlf.DdlfError` catches each area's errors ---------------------------------------------------------


@pytest.mark.parametrize(
    ("call", "builtin"),
    [
        (lambda: ddlf.RunConfig(nonfinite="ignore"), ValueError),  # an invalid option
        (lambda: ddlf.ModelAveraging(every=0), ValueError),
        (lambda: ddlf.RunConfig(seed="0"), TypeError),  # a wrong type
        (lambda: ddlf.TrainConfig(epochs=1, batch_size=8, strategy="sync"), TypeError),
        (lambda: ddlf.RunConfig(workers=[-1]), IndexError),
        (lambda: ddlf.ops.axpy_([np.zeros(2)], [], 1.0), ValueError),  # an argument that does not fit
        (lambda: __import__("ddlf.worker.memory_budget", fromlist=["x"]).parse_size("lots"), ValueError),
    ],
)
def test_except_ddlf_error_catches_what_ddlf_refuses(call, builtin: type) -> None:
    with pytest.raises(ddlf.DdlfError) as caught:
        call()
    assert isinstance(caught.value, builtin)


def test_a_missing_dataset_on_a_worker_is_a_not_found_error() -> None:
    from ddlf.data.store import DatasetStore

    with pytest.raises(ddlf.NotFoundError, match="no dataset 'mnist' on this worker") as caught:
        DatasetStore().get("mnist")
    assert isinstance(caught.value, KeyError)


def test_a_missing_training_run_on_a_worker_is_a_not_found_error() -> None:
    from ddlf.training.replica.registry import Sessions

    with pytest.raises(ddlf.NotFoundError, match="training run abc is not set up on this worker"):
        Sessions().get("abc")


def test_a_worker_on_another_keras_backend_is_a_framework_clash(monkeypatch) -> None:
    from ddlf.frameworks import keras_backend

    monkeypatch.setattr(keras_backend, "_loaded_keras_backend", lambda: "jax")
    with pytest.raises(ddlf.FrameworkClash, match="runs Keras on 'jax'"):
        keras_backend.follow_keras_backend("tensorflow")


def test_a_stepper_without_buckets_refuses_backward() -> None:
    from ddlf.training.replica.steppers import Stepper

    class NoBuckets(Stepper):
        def gradients(self, x, y, sw=None):
            return []

        def apply(self, gradients):
            pass

        def end(self):
            return {}

        def zeros(self):
            return []

        def build_optimizer(self):
            pass

        def set_learning_rate_factor(self, factor):
            pass

        def set_trainable(self, values):
            pass

    with pytest.raises(ddlf.InvalidStateError, match="backward"):
        NoBuckets().backward(None, None)
    with pytest.raises(TypeError, match="abstract"):
        Stepper()  # type: ignore[abstract]


def test_the_worker_daemon_refuses_a_bad_token_file_as_its_other_options(tmp_path) -> None:
    """Its message on stderr and exit status 2, as for ``--gpu`` or ``--tls-cert`` alone (no traceback)."""
    empty = tmp_path / "token"
    empty.write_text("\n")
    for path, said in [(empty, f"the token file {empty} is empty"), (tmp_path / "none", "cannot read --token-file")]:
        done = subprocess.run(
            [sys.executable, "-m", "ddlf.worker", "--listen", "127.0.0.1:0", "--token-file", str(path)],
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert done.returncode == 2, done.stderr
        assert f"ddlf-worker: {said}" in done.stderr and "Traceback" not in done.stderr


# -- ConfigWarning --------------------------------------------------------------------------------------------


def _warns(app: object, cfg: ddlf.TrainConfig, validating: bool, initial_epoch: int = 0) -> list[str]:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        ddlf.IApp._warn_suspicious(app, cfg, validating, initial_epoch)  # type: ignore[arg-type]
    assert all(w.category is ddlf.ConfigWarning for w in caught)
    return [str(w.message) for w in caught]


WHOLE = SimpleNamespace(sharded=False, cluster=[0, 1])
SHARDED = SimpleNamespace(sharded=True, cluster=[0, 1])


def test_config_warning_when_validation_freq_names_no_epoch_of_the_run() -> None:
    late = ddlf.TrainConfig(epochs=3, batch_size=8, validation_freq=5)
    assert _warns(WHOLE, late, validating=True) == [
        "validation_freq=5 validates after none of this run's epochs (1 to 3): the run has no val_* logs"
    ]
    listed = ddlf.TrainConfig(epochs=4, batch_size=8, validation_freq=[1, 2])
    assert "validation_freq=(1, 2)" in _warns(WHOLE, listed, validating=True, initial_epoch=2)[0]
    assert _warns(WHOLE, late, validating=False) == []  # nothing to validate: the option is moot
    assert _warns(WHOLE, ddlf.TrainConfig(epochs=5, batch_size=8, validation_freq=5), validating=True) == []
    assert _warns(WHOLE, ddlf.TrainConfig(epochs=0, batch_size=8, validation_freq=5), validating=True) == []


def test_config_warning_when_shards_would_never_rotate() -> None:
    def cfg(epochs: int, k: int | None) -> ddlf.TrainConfig:
        return ddlf.TrainConfig(epochs=epochs, batch_size=8, data=ddlf.DataConfig(rotate_shards_every=k))

    assert _warns(SHARDED, cfg(2, 2), validating=False) == [
        "DataConfig.rotate_shards_every=2 with epochs=2: the shards never rotate in this run (each worker trains "
        "on its own shard only)"
    ]
    assert _warns(SHARDED, cfg(3, 2), validating=False) == []  # rotates after epoch 2
    assert _warns(SHARDED, cfg(2, None), validating=False) == []
    assert _warns(SimpleNamespace(sharded=True, cluster=[0]), cfg(1, 2), validating=False) == []  # one shard
