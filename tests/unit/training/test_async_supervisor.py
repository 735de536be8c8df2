"""The asynchronous epoch's supervisor (``ddlf.training.asynchronous._supervise``), with stand-in workers (no
daemons): an epoch ends as soon as its last chunk is in, not at the supervisor's next look (a fixed 0.2 s wait
was the floor of every asynchronous epoch, which trains a small model in less, issue 37), and a chunk that went back
to the queue is taken up at once."""

from __future__ import annotations

import itertools
import threading
import time
import types
from collections import deque

import numpy as np

from ddlf.training import asynchronous
from ddlf.training.asynchronous import _Epoch, _supervise


class _Members:
    def __init__(self, live: list[int]) -> None:
        self._live = live

    def live(self) -> list[int]:
        return list(self._live)


def _epoch(chunks: int) -> _Epoch:
    order = np.arange(chunks * 4)
    return _Epoch(0, deque((order[i : i + 4], None) for i in range(0, len(order), 4)), rows=len(order))


def _run(ep: _Epoch, work, live: tuple[int, ...] = (0, 1)) -> float:
    cluster = types.SimpleNamespace(addresses=["w0", "w1"])
    cfg = types.SimpleNamespace(run=types.SimpleNamespace(rejoin_timeout=60.0))
    t0 = time.monotonic()
    _supervise(cluster, _Members(list(live)), ep, work, threading.Lock(), {"error": None}, cfg, lambda: False)
    return time.monotonic() - t0


def _take(ep: _Epoch, lock: threading.Lock, w: int = 0):
    """The next chunk for worker ``w``, counted in flight (as the async loop's worker threads take them)."""
    with lock:
        item = ep.take(w)
        if item is not None:
            ep.in_flight += 1
        return item


def test_the_epoch_ends_when_its_last_chunk_is_in_not_at_the_next_look(monkeypatch) -> None:
    monkeypatch.setattr(asynchronous, "SUPERVISE_EVERY", 30.0)  # a look at the cluster every 30 s
    ep = _epoch(6)
    lock = threading.Lock()

    def work(address: str, ep: _Epoch) -> None:
        while (item := _take(ep, lock)) is not None:
            time.sleep(0.01)  # training the chunk
            with lock:
                ep.in_flight -= 1
                ep.done += len(item[0])

    assert _run(ep, work) < 10.0
    assert ep.done == 24 and ep.remaining() == 0


def test_a_chunk_put_back_after_the_other_worker_finished_is_trained_at_once(monkeypatch) -> None:
    monkeypatch.setattr(asynchronous, "SUPERVISE_EVERY", 30.0)
    ep = _epoch(4)
    lock = threading.Lock()
    failed = threading.Event()
    trained: list[str] = []

    def work(address: str, ep: _Epoch) -> None:
        while (item := _take(ep, lock)) is not None:
            chunk, _, queue = item
            if address == "w1" and not failed.is_set():
                time.sleep(0.3)  # the other worker takes the rest meanwhile and ends
                with lock:
                    ep.in_flight -= 1
                    queue.appendleft((chunk, None))  # lost: back to the queue, its thread ends
                    ep.pushed_back = True
                failed.set()
                return
            time.sleep(0.05)
            with lock:
                ep.in_flight -= 1
                ep.done += len(chunk)
                trained.append(address)

    assert _run(ep, work) < 10.0
    assert failed.is_set() and ep.done == 16 and len(trained) == 4


def test_a_worker_whose_shard_is_done_waits_for_the_others_without_spinning(monkeypatch) -> None:
    """Sharded: a worker whose own shard is trained has nothing to take while the others still train theirs; its
    thread is not started again and again until they finish."""
    monkeypatch.setattr(asynchronous, "SUPERVISE_EVERY", 0.05)
    order = np.arange(8)
    own = {0: deque([(order[:4], 0)]), 1: deque([(order[4:6], 1), (order[6:], 1)])}
    ep = _Epoch(0, deque(), own, shard_of={0: 0, 1: 1})
    lock = threading.Lock()
    calls = {"w0": 0, "w1": 0}

    def work(address: str, ep: _Epoch) -> bool:
        calls[address] += 1
        w = int(address[1])
        while (item := _take(ep, lock, w)) is not None:
            time.sleep(0.01 if w == 0 else 0.4)  # worker 1 is slow
            with lock:
                ep.in_flight -= 1
                ep.done += len(item[0])
        return False

    _run(ep, work)
    assert ep.done == 8
    assert calls == {"w0": 1, "w1": 1}


def test_a_failed_call_is_retried_at_the_next_look_not_at_once(monkeypatch) -> None:
    monkeypatch.setattr(asynchronous, "SUPERVISE_EVERY", 0.2)
    ep = _epoch(1)
    lock = threading.Lock()
    starts: list[float] = []

    def work(address: str, ep: _Epoch) -> bool:
        starts.append(time.monotonic())
        item = _take(ep, lock)
        if item is None:
            return False
        with lock:
            ep.in_flight -= 1
            if len(starts) < 3:  # a remote error the failure policy lets pass: the chunk goes back
                item[2].appendleft((item[0], None))
                return True
            ep.done += len(item[0])
        return False

    _run(ep, work, live=(1,))
    assert ep.done == 4 and len(starts) == 3
    assert min(b - a for a, b in itertools.pairwise(starts)) >= 0.15  # no retry in a tight loop
