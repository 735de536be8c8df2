"""A worker's requests and its background preload (``ddlf-worker --preload``): requests that decode or run the
master's code wait for the preload, the others do not, and a preload that hangs is waited for only so long. No
daemons: the executor is driven directly."""

from __future__ import annotations

import threading
import time

import pytest

from ddlf import serialization
from ddlf.worker import executor
from ddlf.worker.executor import OPS, Executor


def _handle(ex: Executor, op: str, name: str, value: object) -> tuple:
    data, bufs = serialization.dumps(value)
    return ex.handle(OPS[op], name, "", data, [b.raw() for b in bufs])


def _preloading() -> tuple[Executor, threading.Event]:
    ex = Executor(preload=["some_module"])
    ex._preloaded = threading.Event()  # as on_listening leaves it while the preload thread imports
    return ex, ex._preloaded


def test_a_request_that_runs_code_waits_for_the_preload_and_listing_does_not() -> None:
    ex, done = _preloading()
    assert _handle(ex, "LIST_VARS", "", None)[0] == 0  # answered at once
    threading.Timer(0.3, done.set).start()
    assert _handle(ex, "EXEC", "", "x = 1")[0] == 0
    assert done.is_set()  # it ran once the preload was done, not before
    assert ex.namespace["x"] == 1
    assert _handle(ex, "SET_VAR", "v", 2)[0] == 0  # the preload is done: nothing to wait for


def test_a_preload_that_hangs_is_waited_for_once_then_requests_go_on(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(executor, "PRELOAD_WAIT", 3.0)
    ex, never_set = _preloading()
    t0 = time.monotonic()
    assert _handle(ex, "EXEC", "", "y = 2")[0] == 0  # served after the bound, not refused
    assert time.monotonic() - t0 >= 2.9  # it did wait (a lower bound holds however loaded the machine is)
    assert not never_set.is_set() and ex._preloaded is None  # gave up on it: no second wait
    monkeypatch.setattr(executor, "PRELOAD_WAIT", 3600.0)  # a second wait would hang the test, not pass it
    assert _handle(ex, "EXEC", "", "z = 3")[0] == 0
    assert (ex.namespace["y"], ex.namespace["z"]) == (2, 3)


def test_the_preload_thread_sets_its_event_even_when_an_import_fails(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(executor, "freeze_heap", lambda: None)  # not this test process's heap
    done = threading.Event()
    executor._preload(["no_such_module_for_ddlf_preload"], done)
    assert done.is_set()
