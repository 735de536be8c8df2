"""The host's one copy of a dataset (ddlf.data.node_store), without daemons: in a temporary root."""

from __future__ import annotations

import errno
import os
import threading
import time

import numpy as np
import pytest

from ddlf.data import node_store
from ddlf.data.store import DatasetStore


@pytest.fixture(autouse=True)
def store_root(tmp_path, monkeypatch) -> str:
    monkeypatch.setenv("DDLF_NODE_STORE", str(tmp_path))
    return os.path.join(str(tmp_path), f"ddlf-datasets-{os.getuid()}")


class Loader:
    """A loader that counts its calls (by value: the same counter object behind every copy of it)."""

    def __init__(self, seed: int = 0, delay: float = 0.0) -> None:
        self.seed, self.delay, self.calls = seed, delay, 0

    def __call__(self):
        self.calls += 1
        time.sleep(self.delay)
        rng = np.random.default_rng(self.seed)
        return rng.standard_normal((100, 7)).astype(np.float32), rng.integers(0, 10, 100).astype(np.int64)

    def __reduce__(self):  # the digest depends on what it loads, not on how often it was called
        return (Loader, (self.seed,))


def test_the_first_load_writes_the_host_copy_and_the_next_maps_it(store_root: str) -> None:
    loader = Loader()
    x, y = loader()
    first, hold = node_store.load("mnist", loader)
    assert hold is not None and loader.calls == 2
    again, hold2 = node_store.load("mnist", loader)
    assert loader.calls == 2  # mapped, not loaded
    for a, b, want in zip(first, again, (x, y)):
        assert isinstance(a, np.memmap) and not a.flags.writeable
        np.testing.assert_array_equal(a, want)
        np.testing.assert_array_equal(b, want)
        assert a.dtype == want.dtype
    assert isinstance(first, tuple)
    assert os.listdir(store_root) and all(
        n.endswith(".lock") or os.path.isfile(os.path.join(store_root, n, "manifest.json"))
        for n in os.listdir(store_root)
    )
    assert oct(os.stat(store_root).st_mode & 0o777) == "0o700"
    hold.release(remove=True)
    assert os.path.isdir(hold.path)  # the other hold keeps it
    assert hold2 is not None and hold2.release(remove=True)
    assert not os.path.exists(hold2.path) and not os.path.exists(hold2.path + ".lock")


@pytest.mark.parametrize(
    "value",
    [
        np.arange(10, dtype=np.uint8),
        [np.zeros((3, 2), np.float64), np.ones(3, np.bool_)],
        {"x": np.arange(6, dtype=np.int32).reshape(3, 2), "y": np.array([1 + 2j, 3, 4], np.complex64)},
        (np.arange(12, dtype=np.float32).reshape(3, 4)[:, ::2],),  # not contiguous: written contiguous
    ],
)
def test_arrays_lists_and_dicts_come_back_as_they_went(value) -> None:
    got, hold = node_store.load("k", lambda: value)
    want_type = np.ndarray if isinstance(value, np.ndarray) else type(value)
    assert hold is not None and isinstance(got, want_type) and (want_type is np.ndarray or type(got) is want_type)
    items = value.items() if isinstance(value, dict) else enumerate([value] if isinstance(value, np.ndarray) else value)
    for k, want in items:
        have = got[k] if not isinstance(value, np.ndarray) else got
        np.testing.assert_array_equal(have, want)
        assert have.dtype == want.dtype and have.shape == want.shape
    hold.release(remove=True)


@pytest.mark.parametrize(
    "value",
    [
        np.array(["a", object()], dtype=object),  # objects: kept in the process
        {1: np.zeros(3)},  # keys that are not names
        ["not an array"],
        42,
    ],
)
def test_values_that_are_not_plain_arrays_stay_in_the_process(value, store_root: str) -> None:
    got, hold = node_store.load("odd", lambda: value)
    assert hold is None and got is value
    assert not [n for n in os.listdir(store_root) if not n.endswith(".lock")]


def test_a_memory_mapped_file_is_shared_already_and_not_copied(tmp_path) -> None:
    np.save(tmp_path / "a.npy", np.arange(5))
    mapped = np.load(tmp_path / "a.npy", mmap_mode="r")
    got, hold = node_store.load("npy", lambda: mapped)
    assert hold is None and got is mapped


def test_another_loader_under_the_same_key_is_another_entry() -> None:
    a, b = Loader(seed=1), Loader(seed=2)
    va, ha = node_store.load("same", a)
    vb, hb = node_store.load("same", b)
    assert ha is not None and hb is not None and ha.path != hb.path
    assert not np.array_equal(va[0], vb[0]) and a.calls == b.calls == 1


def test_workers_loading_at_once_load_once_and_all_map_the_result() -> None:
    loader = Loader(delay=0.3)
    results: list = [None] * 4

    def one(i: int) -> None:
        results[i] = node_store.load("race", loader)

    threads = [threading.Thread(target=one, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert loader.calls == 1  # the others waited on the lock, then mapped what the first wrote
    for value, hold in results:
        assert hold is not None
        np.testing.assert_array_equal(value[0], results[0][0][0])
    removed = [hold.release(remove=True) for _, hold in results]
    assert removed == [False, False, False, True]  # the last one out removes it


def test_two_workers_that_both_find_no_entry_do_not_wait_on_each_other(monkeypatch) -> None:
    # Both hold the entry's lock (shared) before either creates it: the one that creates must not need the
    # other's hold to go (it never goes: that worker waits to map what this one writes).
    both_held = threading.Barrier(2)
    real = node_store._lock

    def lock(path: str, how: int) -> int:
        fd = real(path, how)
        if not path.endswith(".init.lock"):
            both_held.wait(timeout=10)
        return fd

    monkeypatch.setattr(node_store, "_lock", lock)
    loader = Loader(delay=0.1)
    results: list = []
    threads = [threading.Thread(target=lambda: results.append(node_store.load("both", loader))) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=20)
    assert not any(t.is_alive() for t in threads), "deadlocked"
    assert loader.calls == 1 and len(results) == 2 and all(hold is not None for _, hold in results)
    for _, hold in results:
        hold.release(remove=True)


def test_a_loader_that_fails_leaves_nothing_and_the_next_load_runs(store_root: str) -> None:
    def broken():
        raise RuntimeError("disk on fire")

    with pytest.raises(RuntimeError, match="disk on fire"):
        node_store.load("fails", broken)
    assert not [n for n in os.listdir(store_root) if not n.endswith(".lock")]
    value, hold = node_store.load("fails", Loader())  # the lock was let go
    assert hold is not None and len(value[0]) == 100


def test_a_full_store_keeps_the_loaded_value_in_the_process(monkeypatch, store_root: str) -> None:
    def full(value, final):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(node_store, "_write", full)
    loader = Loader()
    value, hold = node_store.load("full", loader)
    assert hold is None and loader.calls == 1 and not isinstance(value[0], np.memmap)
    assert value[0].shape == (100, 7)


def test_a_store_directory_others_can_write_to_is_not_used(store_root: str) -> None:
    os.makedirs(store_root, exist_ok=True)
    os.chmod(store_root, 0o777)  # another user could plant arrays here
    loader = Loader()
    value, hold = node_store.load("planted", loader)
    assert hold is None and loader.calls == 1 and value[0].shape == (100, 7)


def test_off_keeps_every_dataset_in_its_process(monkeypatch) -> None:
    monkeypatch.setenv("DDLF_NODE_STORE", "off")
    assert node_store.root() is None
    value, hold = node_store.load("off", Loader())
    assert hold is None and not isinstance(value[0], np.memmap)


def test_sweep_removes_only_entries_nobody_holds() -> None:
    _, held = node_store.load("held", Loader(seed=1))
    _, let_go = node_store.load("let-go", Loader(seed=2))
    assert held is not None and let_go is not None
    let_go.release(remove=False)  # a worker killed: its entry stays for the next one to map
    assert os.path.isdir(let_go.path)
    assert node_store.sweep() == [let_go.path]
    assert os.path.isdir(held.path) and not os.path.exists(let_go.path)
    held.release(remove=True)


def test_the_worker_store_shares_loads_drops_and_closes() -> None:
    store, other = DatasetStore(), DatasetStore()  # two workers of one host
    loader = Loader()
    item, cached = store.get_or_load("ds", loader)
    item2, _ = other.get_or_load("ds", loader)
    assert not cached and loader.calls == 1
    assert item.describe()["node_shared"] and item.describe()["memory_mapped"] and item.describe()["rows"] == 100
    path = item.hold.path
    assert store.drop("ds") and os.path.isdir(path)  # the other worker still maps it
    np.testing.assert_array_equal(item2.value[1], loader()[1])
    other.close()
    assert not os.path.exists(path)
    put = store.put("pushed", (np.zeros((4, 2)), np.ones(4)))
    assert not put.describe()["node_shared"]  # values sent by the master stay in the worker
    with pytest.raises(ValueError, match=r"different numbers of rows \(x: 3, y: 4\)"):
        store.get_or_load("ragged", lambda: (np.zeros(3), np.zeros(4)))
    assert not [n for n in os.listdir(os.path.dirname(path)) if not n.endswith(".lock")]  # let go after the error
