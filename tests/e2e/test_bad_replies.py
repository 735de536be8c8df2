"""Workers that send back bad training replies (buggy user code, or a compromised host): each reply is refused by
the master before it is merged, the worker is named in a warning and in ``history.events``, the round goes on
with the other worker, the result stays finite and learns, and the misbehaving worker keeps serving."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest

import ddlf

from ..conftest import MNIST_DIR, Daemon
from .apps import SmallMnist


def _corrupt(mode: str, reply: Any) -> Any:
    """What a misbehaving worker returns in place of its real training reply."""
    r = dict(reply)
    w = list(r["weights"])
    if mode == "count":
        r["weights"] = w[:-1]
    elif mode == "shape":
        r["weights"] = [np.zeros((3, 3), np.float32), *w[1:]]
    elif mode == "dtype":
        r["weights"] = [a.astype(np.float64) for a in w]
    elif mode == "oversized":  # a reply 64 times the model's size
        r["weights"] = [np.zeros(a.size * 64, np.float32) for a in w]
    elif mode == "nan":
        w[0] = w[0].copy()
        w[0].flat[0] = np.nan
        r["weights"] = w
    elif mode == "inf":
        r["weights"] = [np.full_like(a, np.inf) for a in w]
    elif mode == "samples":
        r["samples"] = 10**9
    elif mode == "lists":
        r["weights"] = [a.tolist() for a in w]
    elif mode == "garbage":
        return "not a reply"
    return r


def _misbehave(mode: str | None) -> None:
    """On the worker: wrap its training chunk so its replies are corrupted in ``mode`` (``None``: behave)."""
    import ddlf.training.replica as remote

    if not hasattr(remote, "_honest_train_chunk"):
        honest = remote.train_chunk

        def train_chunk(worker: Any, *args: Any, **kwargs: Any) -> Any:  # "worker" first: the daemon passes it
            out = honest(worker, *args, **kwargs)
            mode = getattr(remote, "_misbehaving", None)
            return _corrupt(mode, out) if mode else out

        remote._honest_train_chunk = honest  # type: ignore[attr-defined]
        remote.train_chunk = train_chunk
    remote._misbehaving = mode  # type: ignore[attr-defined]


@pytest.fixture(scope="module")
def pair() -> Iterator[ddlf.Cluster]:
    """Two fresh daemons; worker 1's training chunk is wrapped before anything calls it."""
    daemons = [Daemon(), Daemon()]
    try:
        with ddlf.Cluster([d.address for d in daemons], token=daemons[0].token) as c:
            c.call(_misbehave, (None,), workers=[1])
            yield c
    finally:
        for d in daemons:
            d.stop()


@pytest.fixture(scope="module")
def mnist_test_split() -> tuple[np.ndarray, np.ndarray]:
    _, (xt, yt) = ddlf.datasets.mnist(MNIST_DIR)
    return xt[:2000], yt[:2000]


def _refused(h: ddlf.History) -> list[dict[str, Any]]:
    return [e for e in h.events if e["event"] == "reply_refused"]


@pytest.mark.parametrize("mode", ["count", "shape", "dtype", "oversized", "nan", "inf", "samples", "lists", "garbage"])
def test_a_bad_sync_reply_is_refused_and_training_goes_on(pair: ddlf.Cluster, mnist_test_split: Any, mode: str) -> None:
    pair.call(_misbehave, (mode,), workers=[1])
    try:
        app = SmallMnist(pair)
        with pytest.warns(RuntimeWarning, match="worker 1 sent"):
            h = app.train(epochs=2, batch_size=32, verbose=0, strategy=ddlf.ModelAveraging(every=20))
    finally:
        pair.call(_misbehave, (None,), workers=[1])
    refused = _refused(h)
    assert refused and all(e["worker"] == 1 for e in refused), h.events
    want = "NonFiniteUpdate" if mode in ("nan", "inf") else "BadWorkerReply"
    assert {e["error"] for e in refused} == {want}
    # Only worker 0's replies were merged: finite weights that learned (worker 0 alone trains half the rows).
    assert all(np.isfinite(w).all() for w in app.model.get_weights())
    assert app.evaluate(*mnist_test_split)[1] > 0.7
    assert sum(s.samples for s in h.stats if s.worker == 0) > 0
    assert pair.run(lambda: "serving") == ["serving", "serving"]


def test_nonfinite_raise_stops_the_run(pair: ddlf.Cluster) -> None:
    pair.call(_misbehave, ("nan",), workers=[1])
    try:
        with pytest.raises(ddlf.NonFiniteUpdate, match="worker 1 sent non-finite") as info:
            SmallMnist(pair).train(
                epochs=1,
                batch_size=32,
                verbose=0,
                strategy=ddlf.ModelAveraging(),  # replies with weights (gradient averaging's carry none)
                run=ddlf.RunConfig(nonfinite="raise"),
            )
        assert info.value.worker_id == 1
    finally:
        pair.call(_misbehave, (None,), workers=[1])
    assert pair.run(ddlf.training.replica.runs) == [[], []]  # torn down on both workers
    with pytest.raises(ValueError, match="nonfinite"):
        SmallMnist(pair).train(epochs=1, verbose=0, run=ddlf.RunConfig(nonfinite="ignore"))


@pytest.mark.parametrize("mode", ["shape", "nan"])
def test_a_bad_async_reply_is_refused_too(pair: ddlf.Cluster, mnist_test_split: Any, mode: str) -> None:
    pair.call(_misbehave, (mode,), workers=[1])
    try:
        app = SmallMnist(pair)
        with pytest.warns(RuntimeWarning, match="worker 1 sent"):
            h = app.train(epochs=2, batch_size=32, verbose=0, strategy=ddlf.Asynchronous())
    finally:
        pair.call(_misbehave, (None,), workers=[1])
    assert _refused(h) and all(e["worker"] == 1 for e in _refused(h))
    assert all(np.isfinite(w).all() for w in app.model.get_weights())
    assert app.evaluate(*mnist_test_split)[1] > 0.7


def test_a_well_behaved_run_refuses_nothing(pair: ddlf.Cluster) -> None:
    h = SmallMnist(pair).train(epochs=1, batch_size=32, verbose=0, strategy=ddlf.ModelAveraging(every=20))
    assert not _refused(h)
