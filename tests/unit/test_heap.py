"""The garbage collector's long-lived objects set aside while training runs (``ddlf.process``: ``gc.freeze``): a
full collection of the 700,000 objects a process with TensorFlow holds took 0.4-0.5 s, and fell into epochs of
0.2 s (issue 37). No daemons."""

from __future__ import annotations

import gc
import types
import weakref

import numpy as np
import pytest

from ddlf.process import freeze_heap, frozen_heap, release_heap
from ddlf.training.replica.registry import Sessions
from ddlf.training.replica.session import Session


class Node:
    other: Node


def _cycle() -> tuple[weakref.ref, Node]:
    """A cycle of two objects, garbage once the caller drops the node returned; the weak reference says whether
    it was freed."""
    a, b = Node(), Node()
    a.other, b.other = b, a
    return weakref.ref(a), a


def test_frozen_heap_sets_aside_the_objects_alive_and_gives_them_back() -> None:
    gc.unfreeze()
    kept = [object() for _ in range(100)]
    with frozen_heap():
        assert gc.get_freeze_count() >= len(kept)
        inside = [[] for _ in range(10)]  # made after the freeze: the collector still scans them
        assert all(gc.is_tracked(i) for i in inside)
    assert gc.get_freeze_count() == 0


def test_a_frozen_cycle_is_collected_after_the_release() -> None:
    gc.unfreeze()
    alive, node = _cycle()
    with frozen_heap():
        del node  # garbage now, in a cycle among frozen objects: kept while they are frozen
        gc.collect()
        assert alive() is not None
    gc.collect()
    assert alive() is None


def test_the_cycles_of_a_block_that_ends_are_freed_while_another_still_runs() -> None:
    """A sweep's trials run train() side by side: a finished trial's model must not stay frozen until the last
    trial ends."""
    gc.unfreeze()
    outer = frozen_heap()
    outer.__enter__()
    alive, node = _cycle()  # the inner trial's model, made while the outer trial runs
    with frozen_heap():  # frozen as the inner trial's train() starts
        del node  # the trial drops its model: frozen garbage
        gc.collect()
        assert alive() is not None
    assert alive() is None  # collected as the inner block ended
    assert gc.get_freeze_count() > 0  # the outer block (another trial's train()) still runs: frozen again
    outer.__exit__(None, None, None)
    assert gc.get_freeze_count() == 0


def test_releasing_a_holder_twice_or_one_never_held_changes_nothing() -> None:
    gc.unfreeze()
    token = object()
    freeze_heap(token)
    release_heap(token)
    freeze_heap(None)
    release_heap(token)  # released already: the freeze made without a holder stands
    release_heap(object())
    assert gc.get_freeze_count() > 0
    gc.unfreeze()


def test_a_run_sets_its_objects_aside_after_its_first_round_and_gives_them_back_at_teardown() -> None:
    gc.unfreeze()
    sessions = Sessions()
    session = Session(run_id="r1", app=object(), model=object(), parts=None, rows=8)  # type: ignore[arg-type]
    sessions.by_id["r1"] = session
    reply = {"samples": 8}
    assert session._settled(reply) is reply
    assert session.heap_holder is not None and gc.get_freeze_count() > 0
    gc.unfreeze()
    session._settled(reply)  # later rounds leave the collector as it is (their garbage is collected)
    assert gc.get_freeze_count() == 0
    gc.freeze()
    worker = types.SimpleNamespace(vars={"ddlf.run.r1.weights": [np.zeros(1)]})
    sessions.teardown(worker, "r1")
    assert gc.get_freeze_count() == 0 and "r1" not in sessions.by_id


def test_free_memory_goes_back_after_an_idle_while_unless_a_run_starts(monkeypatch: pytest.MonkeyPatch) -> None:
    from ddlf import process

    process.prepare_process()
    held = [bytearray(1 << 20) for _ in range(32)]  # freed into the heap the allocator policy keeps
    del held
    process.return_free_memory()  # waiting
    monkeypatch.setattr(process, "RETURN_AFTER_IDLE", 60.0)
    process.return_free_memory(wait=False)
    first = process._pending
    process.return_free_memory(wait=False)  # the second replaces the first: one pending
    second = process._pending
    assert first is not None and second is not None and second is not first
    assert first.finished.is_set()  # cancelled
    process.keep_free_memory()  # a run starts: cancelled
    second.join(timeout=10)
    assert not second.is_alive() and process._pending is None
    monkeypatch.setattr(process, "RETURN_AFTER_IDLE", 0.01)
    process.return_free_memory(wait=False)
    timer = process._pending
    assert timer is not None
    timer.join(timeout=10)
    assert timer.finished.is_set() and not timer.is_alive()
