"""What ddlf forgets of TensorFlow's process-wide custom-gradient registry (``ddlf.frameworks.tensorflow_graphs``),
on a stand-in for TensorFlow's module: the real registry is exercised by ``tests/e2e/test_reset.py``."""

from __future__ import annotations

import sys
import types

import pytest

from ddlf.frameworks.tensorflow_graphs import custom_gradients, forget_custom_gradients


@pytest.fixture
def registry(monkeypatch: pytest.MonkeyPatch) -> dict[str, object]:
    entries: dict[str, object] = {"MatMul": "builtin", "CustomGradient-1": "user's, before the runs"}
    ops = types.ModuleType("tensorflow.python.framework.ops")
    ops._gradient_registry = types.SimpleNamespace(_registry=entries)  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "tensorflow.python.framework.ops", ops)
    return entries


def test_the_registrations_made_since_a_snapshot_are_forgotten_and_the_others_kept(registry) -> None:
    before = custom_gradients()
    assert before == {"CustomGradient-1"}
    registry["CustomGradient-7"] = "a run's trace"
    registry["CustomGradient-9"] = "another"
    assert forget_custom_gradients(keep=before) == 2
    assert registry == {"MatMul": "builtin", "CustomGradient-1": "user's, before the runs"}


def test_a_reset_forgets_every_custom_gradient_and_no_built_in_one(registry) -> None:
    registry["CustomGradient-7"] = "a run's trace"
    assert forget_custom_gradients() == 2
    assert registry == {"MatMul": "builtin"}


def test_nothing_to_forget_without_tensorflow_or_its_registry(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "tensorflow.python.framework.ops", None)
    assert custom_gradients() == set()
    assert forget_custom_gradients() == 0
    moved = types.ModuleType("tensorflow.python.framework.ops")  # a TensorFlow that keeps it elsewhere
    monkeypatch.setitem(sys.modules, "tensorflow.python.framework.ops", moved)
    assert forget_custom_gradients() == 0
