"""``adapter_for``: one adapter per model, and the cache of them never keeps a model alive (a daemon serving
hundreds of runs held every model it had trained: its value, the adapter, held its weak key)."""

from __future__ import annotations

import gc
import weakref

import pytest

from ddlf.errors import InvalidStateError
from ddlf.frameworks.adapter import adapter_for


def _keras_model() -> object:
    keras = pytest.importorskip("keras")
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(2)])
    model.compile(optimizer="adam", loss="mse")
    return model


def _torch_model() -> object:
    torch = pytest.importorskip("torch")
    from ddlf.models import TorchModel

    net = torch.nn.Linear(4, 2)
    return TorchModel(net, lambda p: torch.optim.SGD(p, lr=0.1), torch.nn.MSELoss())


@pytest.mark.parametrize("build", [_keras_model, _torch_model], ids=["keras", "torch"])
def test_one_adapter_per_model_that_does_not_keep_it_alive(build: object) -> None:
    model = build()  # type: ignore[operator]
    adapter = adapter_for(model)
    assert adapter_for(model) is adapter
    assert adapter.model is model
    ref = weakref.ref(model)
    del model
    gc.collect()
    assert ref() is None
    with pytest.raises(InvalidStateError, match="adapter_for"):
        _ = adapter.model
