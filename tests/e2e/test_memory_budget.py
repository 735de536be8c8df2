"""A worker started with ``--max-memory`` refuses what would pass its budget (a ``set``, a decoded value larger than
its bytes, ``put_dataset``, a loader or a call that grows while it runs) with ``MemoryBudgetExceeded``, keeps
nothing of it, and keeps serving: the same worker then takes requests that fit."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest

import ddlf
from ddlf.errors import MemoryBudgetExceeded, RequestRejected
from ddlf.worker.memory_budget import parse_size

from ..conftest import Daemon

BUDGET_MIB = 400  # a bare worker (no Keras loaded) holds well under 100 MiB here
BIG = 60_000_000  # float64 elements: 480 MB, past the budget on its own


@pytest.fixture(scope="module")
def budgeted() -> Iterator[tuple[Daemon, ddlf.Cluster]]:
    d = Daemon("--max-memory", f"{BUDGET_MIB}Mi")
    c = ddlf.Cluster([d.address], token=d.token)
    try:
        yield d, c
    finally:
        c.close()
        d.stop()


def _rss(c: ddlf.Cluster) -> int:
    return int(c.status()[0]["rss_bytes"])


def _still_serving(d: Daemon, c: ddlf.Cluster) -> None:
    assert d.proc.poll() is None, "the worker died"
    c.set("small", np.arange(1000))
    assert int(c.get("small")[0].sum()) == 499500
    assert _rss(c) < BUDGET_MIB * 2**20


class _Expands:
    """A value of a few bytes on the wire that decodes to 480 MB (as a compressed or computed value would)."""

    def __reduce__(self) -> Any:
        return (np.ones, (BIG,))


def test_set_over_budget_refused_before_decoding(budgeted: tuple[Daemon, ddlf.Cluster]) -> None:
    d, c = budgeted
    with pytest.raises(MemoryBudgetExceeded) as info:
        c.set("big", np.zeros(BIG))
    err = info.value
    assert isinstance(err, RequestRejected) and isinstance(err, MemoryError)
    assert err.code == "memory_budget" and err.worker_id == 0
    assert "--max-memory" in str(err) and "set 'big'" in str(err)
    assert "big" not in c.variables()[0]
    _still_serving(d, c)


def test_value_larger_decoded_than_sent_is_dropped(budgeted: tuple[Daemon, ddlf.Cluster]) -> None:
    d, c = budgeted
    c.set("kept", np.arange(10))
    with pytest.raises(MemoryBudgetExceeded, match="it was not kept"):
        c.set("kept", _Expands())
    np.testing.assert_array_equal(c.get("kept")[0], np.arange(10))  # the old value stays
    with pytest.raises(MemoryBudgetExceeded):
        c.set("fresh", _Expands())
    assert "fresh" not in c.variables()[0]
    _still_serving(d, c)


def test_put_dataset_over_budget_refused(budgeted: tuple[Daemon, ddlf.Cluster]) -> None:
    d, c = budgeted
    with pytest.raises(MemoryBudgetExceeded):
        c.put_dataset("too-big", (np.zeros((BIG // 10, 10)), np.zeros(BIG // 10)))
    assert all(entry["key"] != "too-big" for entry in c.datasets()[0])
    c.put_dataset("fits", (np.zeros((100, 10), np.float32), np.zeros(100, np.int64)))
    assert [entry["key"] for entry in c.datasets()[0]].count("fits") == 1
    c.drop_dataset("fits")
    _still_serving(d, c)


def _big_loader() -> tuple[np.ndarray, np.ndarray]:
    x = np.ones((BIG // 10, 10))
    return x, np.zeros(len(x))


def test_loader_past_budget_is_stopped(budgeted: tuple[Daemon, ddlf.Cluster]) -> None:
    d, c = budgeted
    with pytest.raises(MemoryBudgetExceeded, match="passed its memory budget"):
        c.load_dataset("loaded-too-big", _big_loader)
    assert all(entry["key"] != "loaded-too-big" for entry in c.datasets()[0])
    _still_serving(d, c)


def _grow(worker: Any) -> int:
    keep = []
    while True:  # 8 MB at a time, forever: only the budget ends it
        keep.append(np.ones(1_000_000))
        worker.vars["grown"] = len(keep)


def test_call_that_grows_is_stopped_and_freed(budgeted: tuple[Daemon, ddlf.Cluster]) -> None:
    d, c = budgeted
    before = _rss(c)
    with pytest.raises(MemoryBudgetExceeded) as info:
        c.run(_grow)
    assert "while it ran" in str(info.value)
    grown = c.get("grown")[0]
    assert 10 < grown < BUDGET_MIB  # it ran until the budget, then stopped (8 MB a step)
    _still_serving(d, c)  # and what it allocated was freed
    # ... and given back to the system, not kept in the allocator's heap near the budget.
    assert _rss(c) < before + 64 * 2**20, (before, _rss(c))
    # The next call runs normally: no stale interruption is left pending for it.
    assert c.run(lambda: sum(range(100_000))) == [sum(range(100_000))]


def test_sizes_parse() -> None:
    assert parse_size("512Mi") == 512 * 2**20
    assert parse_size("2G") == 2_000_000_000
    assert parse_size("1.5GiB") == int(1.5 * 2**30)
    assert parse_size("1000") == 1000
    for bad in ("", "lots", "-1G", "0", "5X"):
        with pytest.raises(ValueError):
            parse_size(bad)


def test_bad_budget_on_the_command_line() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "ddlf.worker", "--max-memory", "plenty"], capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 2
    assert "--max-memory" in done.stderr and "not a size" in done.stderr
