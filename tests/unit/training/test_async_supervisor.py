"""The asynchronous epoch's supervisor (``ddlf.training.asynchronous._supervise``), with stand-in workers (no
daemons): an epoch ends as soon as its last chunk is in, not at the supervisor's next look (a fixed 0.2 s wait
was the floor of every asynchronous epoch, which trains a small model in less, issue 37), and a chunk that went back
to the queue is taken up at once."""

from __future__ import annotations

import threading
import time
import types
from collections import deque

import numpy as np

from ddlf.training import asynchronous
from ddlf.training.asynchronous import _Epoch, _supervise


class _Members:
    def live(self) -> list[int]:
        return [0, 1]


def _epoch(chunks: int) -> _Epoch:
    order = np.arange(chunks * 4)
    return _Epoch(0, deque((order[i : i + 4], None) for i in range(0, len(order), 4)), rows=len(order))


def _run(ep: _Epoch, work) -> float:
    cluster = types.SimpleNamespace(addresses=["w0", "w1"])
    cfg = types.SimpleNamespace(run=types.SimpleNamespace(rejoin_timeout=60.0))
    t0 = time.monotonic()
    _supervise(cluster, _Members(), ep, work, threading.Lock(), {"error": None}, cfg, lambda: False)
    return time.monotonic() - t0


def _take(ep: _Epoch, lock: threading.Lock):
    """The next chunk, counted in flight (as the async loop's worker threads take them)."""
    with lock:
        item = ep.take(0)
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
