"""The replay log, reply decoding, settings and training types, without daemons."""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

import numpy as np
import pytest

import ddlf
from ddlf import serialization
from ddlf.cluster.calls import decode
from ddlf.cluster.recovery import ReplayLog, broken
from ddlf.frameworks.keras_backend import follow_keras_backend, installed_keras_backend, keras_backend_default
from ddlf.settings import MAX_LANE_SPIN_US, check_lane_spin_us, check_seconds, read_pem
from ddlf.training.messages import WorkerResult
from ddlf.training.policy import FailurePolicy
from ddlf.training.run import weighted_logs


def test_the_replay_log_keeps_push_order_and_moves_repushes_last() -> None:
    log = ReplayLog()
    log.record("module", "m", {"m.py": b""})
    log.record("fn", "f", ("d1", b""))
    log.record("exec", "", "import m")
    log.record("fn", "f", ("d2", b""))  # pushed again: now after the exec that may depend on it
    log.record("var", "__ddlf_weights", [1])  # training's own values are not replayed
    assert [k[0] for k in log.entries] == ["module", "exec", "fn"]
    assert log.entries[("fn", "f")] == ("d2", b"")


def test_variables_on_some_workers_replay_only_there() -> None:
    log = ReplayLog()
    log.record("var", "x", "all")
    log.record_on("x", {"a:1": "only-a"})
    assert log.variable_for(log.entries[("var", "x")], "a:1") == "only-a"
    assert log.variable_for(log.entries[("var", "x")], "b:1") == "all"
    log.forget_on("x", {"a:1"})  # deleted on a: a restarted a must not get it back, b keeps it
    assert log.variable_for(log.entries[("var", "x")], "a:1") is None
    assert log.variable_for(log.entries[("var", "x")], "b:1") == "all"
    log.forget_on("x", {None})  # type: ignore[arg-type]
    assert ("var", "x") not in log.entries


def test_clean_keeps_datasets() -> None:
    log = ReplayLog()
    log.record("dataset", "d", ("put", 1))
    log.record("var", "v", 1)
    log.record("exec", "", "x = 1")
    log.clean()
    assert list(log.entries) == [("dataset", "d")]


@dataclass
class FakeReply:
    worker: int = 0
    pickle: bytes | None = None
    buffers: list[Any] | None = None
    error: BaseException | None = None


def test_decode_returns_values_and_exceptions_without_raising() -> None:
    pickle, bufs = serialization.dumps({"a": np.arange(3)})
    value = decode(FakeReply(pickle=pickle, buffers=[b.raw() for b in bufs]), ["h:0"])
    assert (value["a"] == np.arange(3)).all()
    err = ddlf.RemoteError("x")
    assert decode(FakeReply(error=err), ["h:0"]) is err
    bad = decode(FakeReply(worker=3, pickle=b"\x80\x05garbage", buffers=[]), lambda: ["h:0", "h:1", "h:2", "h:3"])
    assert isinstance(bad, ddlf.SerializationError) and bad.worker_id == 3 and bad.address == "h:3"


def test_only_broken_connections_count_as_lost() -> None:
    assert broken(ddlf.WorkerUnavailable("x"))
    assert not broken(ddlf.DeadlineExceeded("x"))
    assert not broken(ddlf.WorkerRestarted("x"))
    assert not broken(ddlf.RemoteError("x"))


def test_settings_are_checked_where_they_enter() -> None:
    assert check_lane_spin_us(0) == 0 and check_lane_spin_us(MAX_LANE_SPIN_US) == MAX_LANE_SPIN_US
    for bad in (-1, MAX_LANE_SPIN_US + 1, 1.5, True, "10", None):
        with pytest.raises(ValueError, match="lane_spin_us"):
            check_lane_spin_us(bad)
    assert check_seconds(2, "timeout") == 2.0
    for bad in (0, -1, float("inf"), float("nan"), "1", True):
        with pytest.raises(ValueError, match="timeout"):
            check_seconds(bad, "timeout")
    assert read_pem(b"PEM", "ca") == b"PEM" and read_pem(None, "ca") is None
    with pytest.raises(ValueError, match="cannot read tls_ca"):
        read_pem("/nonexistent/ca.pem", "tls_ca")


def test_a_users_keras_backend_wins(monkeypatch: pytest.MonkeyPatch, tmp_path) -> None:
    monkeypatch.setenv("KERAS_HOME", str(tmp_path))  # no keras.json there yet
    monkeypatch.setenv("KERAS_BACKEND", "torch")
    assert keras_backend_default() == "torch"
    assert os.environ["KERAS_BACKEND"] == "torch"
    monkeypatch.delenv("KERAS_BACKEND")
    # Nothing chosen: the fastest installed backend, in the benchmark's order.
    assert keras_backend_default() == installed_keras_backend() == os.environ["KERAS_BACKEND"]
    monkeypatch.delenv("KERAS_BACKEND")
    (tmp_path / "keras.json").write_text('{"backend": "jax", "floatx": "float32"}')
    assert keras_backend_default() == "jax"  # keras.json is the user's choice too
    assert "KERAS_BACKEND" not in os.environ  # Keras reads the file itself
    # The file Keras writes by itself on first import names its own default: not a choice.
    (tmp_path / "keras.json").write_text('{"backend": "tensorflow", "floatx": "float32"}')
    assert keras_backend_default() == installed_keras_backend()


def test_installed_backend_follows_the_preference_order(monkeypatch: pytest.MonkeyPatch) -> None:
    import importlib.util

    present = {"jax", "torch"}
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: object() if name in present else None)
    assert installed_keras_backend() == "jax"
    present.add("tensorflow")
    assert installed_keras_backend() == "tensorflow"
    present.clear()
    assert installed_keras_backend() == "jax"


def test_a_worker_follows_the_masters_backend_or_refuses_clearly(monkeypatch: pytest.MonkeyPatch) -> None:
    import sys
    import types

    monkeypatch.delitem(sys.modules, "keras", raising=False)
    monkeypatch.setenv("KERAS_BACKEND", "jax")
    follow_keras_backend("tensorflow")  # Keras not loaded here yet: follow
    assert os.environ["KERAS_BACKEND"] == "tensorflow"
    fake = types.ModuleType("keras")
    fake.backend = types.SimpleNamespace(backend=lambda: "jax")  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "keras", fake)
    follow_keras_backend("jax")  # the same: nothing to do
    with pytest.raises(RuntimeError, match=r"runs Keras on 'jax'.*master runs 'tensorflow'.*KERAS_BACKEND=tensorflow"):
        follow_keras_backend("tensorflow")


def test_importing_ddlf_has_no_side_effects() -> None:
    import subprocess
    import sys

    code = "import os, ddlf, ddlf.process; print(os.environ.get('KERAS_BACKEND'), ddlf.process._prepared)"
    env = {k: v for k, v in os.environ.items() if k != "KERAS_BACKEND"}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, check=True)
    assert out.stdout.split() == ["None", "False"]


def _seeding_in_a_fresh_interpreter(prelude: str, call: str, backend: str = "tensorflow") -> list[str]:
    """Run ``prelude``, then ``call`` (a seeding), in a fresh interpreter on Keras's ``backend``; returns which of
    torch, torch's compiler and TensorFlow are loaded after it, in that order."""
    import subprocess
    import sys

    code = (
        f"import sys\n{prelude}\nfrom ddlf.frameworks.seeding import set_random_seed\n{call}\n"
        "print(*(m in sys.modules for m in ('torch', 'torch._dynamo', 'tensorflow')))"
    )
    env = {**os.environ, "KERAS_BACKEND": backend, "TF_CPP_MIN_LOG_LEVEL": "3"}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, check=True)
    return out.stdout.split()


def test_a_keras_run_on_tensorflow_does_not_load_torch() -> None:
    pytest.importorskip("tensorflow")
    # Seeding a Keras run loads TensorFlow; torch stays out (importing its compiler costs 3.3 s and ~900 MB of
    # mappings per process where torch and triton are installed beside TensorFlow).
    assert _seeding_in_a_fresh_interpreter("", "set_random_seed(1)") == ["False", "False", "True"]
    assert _seeding_in_a_fresh_interpreter("", "set_random_seed(1, torch=False)") == ["False", "False", "True"]


def test_a_torch_run_loads_torchs_compiler_before_tensorflow() -> None:
    pytest.importorskip("tensorflow")
    pytest.importorskip("torch")
    from ddlf.frameworks.loading import clash_possible

    compiler = "True" if clash_possible() else "False"
    # Keras on torch: torch's compiler first (TensorFlow may come later), and Keras seeded without loading
    # TensorFlow (keras.utils.set_random_seed alone would, to seed tf.data).
    assert _seeding_in_a_fresh_interpreter("import torch", "set_random_seed(1)", "torch") == ["True", compiler, "False"]
    # A script that imported torch and not Keras (a TorchModel's), or a run the master says is a torch one, in a
    # process without Keras: Keras, and TensorFlow with it, stay out.
    assert _seeding_in_a_fresh_interpreter("import torch", "set_random_seed(1)") == ["True", compiler, "False"]
    assert _seeding_in_a_fresh_interpreter("", "set_random_seed(1, torch=True)") == [compiler, compiler, "False"]


JAX_RUN_WITHOUT_TENSORFLOW = """
import random, sys
import numpy as np
import keras
from ddlf.frameworks import model_spec
from ddlf.frameworks.seeding import set_random_seed
from ddlf.training.replica import warm

def draws():
    return [random.random(), float(np.random.rand()), keras.random.uniform((2,)).tolist()]

set_random_seed(3)
ours = draws()
model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(2)])
model.compile(optimizer=keras.optimizers.Adam(1e-3), loss="mse")
spec = model_spec.describe(model)
assert model_spec.apply(model, spec) == [] and model_spec.differs(model, spec) is None
assert warm.fingerprint(model) is not None and model_spec.signature(model)
print("tensorflow loaded:", "tensorflow" in sys.modules)
keras.utils.set_random_seed(3)  # Keras' own (loads TensorFlow to seed tf.data): the same draws
print("same draws:", draws() == ours, "tensorflow loaded:", "tensorflow" in sys.modules)
"""


def test_a_keras_run_on_jax_seeds_and_reads_its_model_without_loading_tensorflow() -> None:
    """keras.utils.set_random_seed and Keras' serialization (get_config, get_compile_config) ask whether TensorFlow is
    available, which imports it: 2-3 s on the master and on each worker of a first train() on JAX. ddlf's seeding,
    model spec and warm models leave it unloaded, and seed as Keras does."""
    pytest.importorskip("jax")
    pytest.importorskip("tensorflow")
    import subprocess
    import sys

    env = {**os.environ, "KERAS_BACKEND": "jax", "TF_CPP_MIN_LOG_LEVEL": "3"}
    out = subprocess.run(
        [sys.executable, "-c", JAX_RUN_WITHOUT_TENSORFLOW], capture_output=True, text=True, env=env, timeout=300
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.splitlines() == ["tensorflow loaded: False", "same draws: True tensorflow loaded: True"]


def test_the_failure_policy_decides_by_kind() -> None:
    default = FailurePolicy()
    assert default.decide(ddlf.WorkerUnavailable("x")) == "continue"
    assert default.decide(ddlf.RemoteError("x")) == "raise"
    strict = FailurePolicy(lost_worker="raise", remote_error="continue")
    assert strict.decide(ddlf.DeadlineExceeded("x")) == "raise" and strict.decide(ValueError()) == "continue"
    with pytest.raises(ValueError, match="lost_worker"):
        FailurePolicy(lost_worker="retry")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="FailurePolicy"):
        ddlf.RunConfig(failure_policy="raise")  # type: ignore[arg-type]


def test_worker_results_and_their_logs() -> None:
    reply = {"samples": 30, "weights": [], "compute_seconds": 1, "data_wait_seconds": 0.5, "logs": {"loss": 1.0}}
    a = WorkerResult.from_reply(0, reply)
    b = WorkerResult.from_reply(1, {**reply, "samples": 10, "logs": {"loss": 3.0, "acc": 0.5}})
    assert a.optimizer_state is None and a.compute_seconds == 1.0
    logs = weighted_logs([a, b])
    assert logs["loss"] == pytest.approx(1.5) and logs["acc"] == pytest.approx(0.125)
