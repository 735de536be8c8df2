"""The network simulation pieces that need no namespaces: the delay relay (netem's stand-in) and the
projection model of ``benchmarks.project``."""

from __future__ import annotations

import socket
import subprocess
import sys

import pytest
from benchmarks import project

import ddlf

from ..conftest import Daemon


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_relay_adds_its_delay_each_way_and_keeps_the_bytes(daemon: Daemon) -> None:
    port = _free_port()
    relay = subprocess.Popen(
        [sys.executable, "-m", "benchmarks.relay", "--delay-ms", "25", f"127.0.0.1:{port}={daemon.address}"],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert relay.stdout is not None and relay.stdout.readline().strip() == "ready"
        direct = ddlf.Cluster([daemon.address], token=daemon.token)
        delayed = ddlf.Cluster([f"127.0.0.1:{port}"], token=daemon.token)
        try:
            rtt_direct = min(direct.ping()[0] for _ in range(5))
            rtt_delayed = min(delayed.ping()[0] for _ in range(5))
            assert 0.050 <= rtt_delayed < 0.050 + rtt_direct + 0.040  # 2 x 25 ms, plus a little
            import numpy as np

            a = np.arange(3_000_000, dtype=np.float32)  # 12 MB through the relay and back, intact
            delayed.set("a", a)
            assert np.array_equal(delayed.get("a")[0], a)
        finally:
            direct.close()
            delayed.close()
    finally:
        relay.terminate()
        relay.wait(10)


def test_relay_rejects_a_malformed_pair() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "benchmarks.relay", "--delay-ms", "1", "127.0.0.1:1"], capture_output=True, text=True
    )
    assert out.returncode == 2 and "LISTEN=TARGET" in out.stderr


def _measured(workers: int, compute: float, eff: float, gbits: float = 1.0, size: float = 10e6) -> dict:
    comm = workers * 2 * size * 8 / (gbits * 1e9 * eff)
    return {"workers": workers, "wall": compute + comm, "compute": compute, "bytes_down": size, "bytes_up": size}


def test_projection_calibrates_and_predicts_its_own_model() -> None:
    scaling = [_measured(2, 0.1, 0.8), _measured(4, 0.2, 0.8), _measured(6, 0.3, 0.8)]
    assert project.calibrate(scaling) == pytest.approx(0.8)
    for row in project.check(scaling):
        assert row["predicted"] == pytest.approx(row["measured"])


def test_projection_communication_per_epoch_is_flat_in_workers() -> None:
    kw = {"gbits": 10, "samples": 1_000_000, "batch_seconds": 0.0, "down": 20e6, "up": 20e6, "efficiency": 1.0}
    # Compute-free: every cluster size pays the same communication per epoch (n copies per round, 1/n rounds).
    epochs = [project.epoch_seconds(n, **kw) for n in (8, 64, 512)]
    # (up to the last, partly filled round: 6.1 rounds of 512 workers are 7 rounds)
    assert epochs[0] == pytest.approx(epochs[1], rel=0.01) and epochs[2] / epochs[0] < 1.2
    # Compute shrinks as 1/n on top of it; compression of the upload lowers the floor.
    with_compute = [project.epoch_seconds(n, **{**kw, "batch_seconds": 0.02}) for n in (8, 64)]
    assert with_compute[0] > with_compute[1] > epochs[1]
    # (a projection, not a clock: the model's communication is linear in the bytes each way)
    compressed = project.epoch_seconds(64, **{**kw, "up": 0.2e6})
    assert compressed == pytest.approx(epochs[1] * (20e6 + 0.2e6) / (20e6 + 20e6))
