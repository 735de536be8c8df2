"""Exhaustion: a checkpoint written to a full disk fails clearly and leaves the previous one intact; floods of
connections and of requests degrade (refusals, queues) without the daemon dying."""

from __future__ import annotations

import asyncio
import os
import socket
import subprocess
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import pytest

import ddlf
from ddlf.errors import CheckpointError
from ddlf.training import checkpoint

from ..conftest import Daemon
from .apps import SmallMnist


@pytest.fixture
def small_tmpfs(tmp_path: Path) -> Iterator[Callable[[int], Path]]:
    """Mounts a tmpfs of a given size in ``tmp_path`` (root only); unmounted after the test."""
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root")
    mnt = tmp_path / "small-disk"
    mnt.mkdir()
    mounted: list[Path] = []

    def mount(size: int) -> Path:
        done = subprocess.run(
            ["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(mnt)], capture_output=True, text=True
        )
        if done.returncode != 0:
            pytest.skip(f"cannot mount a tmpfs here: {done.stderr.strip()}")
        mounted.append(mnt)
        return mnt

    yield mount
    for m in mounted:
        subprocess.run(["umount", "-l", str(m)], check=False)


def test_checkpoint_on_a_full_disk_fails_clearly_and_keeps_the_previous(
    cluster: ddlf.Cluster, tmp_path: Path, small_tmpfs: Callable[[int], Path]
) -> None:
    kw = {"batch_size": 64, "verbose": 0, "strategy": ddlf.ModelAveraging(every=10)}
    # How large one checkpoint of this run is (one epoch), on an ordinary disk.
    probe = SmallMnist(cluster)
    probe.train(epochs=1, run=ddlf.RunConfig(seed=5, checkpoint_dir=tmp_path / "probe"), **kw)
    size = checkpoint.path_in(tmp_path / "probe").stat().st_size
    # Room for one checkpoint and a half: epoch 1's fits; epoch 2's temporary file beside it does not.
    disk = small_tmpfs(int(size * 1.5) // 4096 * 4096 + 4096)
    app = SmallMnist(cluster)
    with pytest.raises(CheckpointError) as info:
        app.train(epochs=3, run=ddlf.RunConfig(seed=5, checkpoint_dir=disk), **kw)
    err = info.value
    assert isinstance(err, OSError) and isinstance(err, ddlf.errors.DdlfError)
    assert err.errno == 28  # ENOSPC
    assert "epoch 2" in str(err) and "previous checkpoint there is intact" in str(err) and "resume=True" in str(err)
    # The previous checkpoint is whole and readable; no partial file is left holding the space.
    saved = checkpoint.load(disk)
    assert saved is not None and saved["epochs_done"] == 1
    assert sorted(p.name for p in disk.iterdir()) == [checkpoint.FILENAME]
    # The workers keep serving, and the run resumes from that checkpoint once there is room.
    room = tmp_path / "room"
    room.mkdir()
    (room / checkpoint.FILENAME).write_bytes((disk / checkpoint.FILENAME).read_bytes())
    resumed = SmallMnist(cluster)
    h = resumed.train(epochs=3, run=ddlf.RunConfig(seed=5, checkpoint_dir=room, resume=True), **kw)
    assert len(h.history["loss"]) == 3 and np.isfinite(h.history["loss"]).all()
    assert checkpoint.load(room)["epochs_done"] == 3


@pytest.mark.fresh_daemons("a daemon started with --max-connections")
def test_connection_flood_is_refused_and_the_daemon_serves() -> None:
    d = Daemon("--max-connections", "64", "--handshake-timeout", "1")
    try:
        with ddlf.Cluster([d.address], token=d.token) as c:
            host, port = d.address.rsplit(":", 1)
            flood = []
            for _ in range(500):  # connect and say nothing: held open until refused or timed out
                s = socket.create_connection((host, int(port)), timeout=5)
                flood.append(s)
            try:
                # The master connected before the flood keeps working through it.
                assert c.run(lambda: "still here") == ["still here"]
                # Past the limit the daemon closes connections at once; the silent ones in the limit after the
                # handshake deadline.
                closed = 0
                deadline = time.monotonic() + 10
                for s in flood:
                    s.settimeout(max(0.01, deadline - time.monotonic()))
                    try:
                        closed += s.recv(1) == b""
                    except ConnectionResetError:
                        closed += 1
                    except TimeoutError:
                        pass
                assert closed >= 500 - 64, closed
            finally:
                for s in flood:
                    s.close()
            status = c.status()[0]
            assert status["connections_refused"] >= 500 - 64
        assert d.proc.poll() is None
        # Once the flood is gone, new masters connect as usual.
        assert ddlf.Cluster([d.address], token=d.token).run(lambda: 2) == [2]
    finally:
        d.stop()


def _echo(i: int, payload: bytes) -> tuple[int, int]:
    return i, len(payload)


@pytest.mark.fresh_daemons("its memory is measured: a daemon without the earlier tests' imports")
def test_request_flood_from_an_authenticated_master_queues() -> None:
    d = Daemon()
    try:
        with ddlf.Cluster([d.address], token=d.token) as c:
            c.add_function(_echo, "echo")

            async def flood() -> list[list[tuple[int, int]]]:
                return await asyncio.gather(*(c.run_async("echo", i, b"x" * 10_000) for i in range(3000)))

            results = asyncio.run(flood())
            assert [r[0] for r in results] == [(i, 10_000) for i in range(3000)]
            status = c.status()[0]
            assert status["rss_bytes"] < 1 << 30  # queued requests are not held in copies without bound
        assert d.proc.poll() is None
    finally:
        d.stop()
