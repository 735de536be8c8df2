"""The same-machine fast path: large values through /dev/shm files, cleaned up; workers that see another
/dev/shm (as a container on the same kernel does) are detected at connect and use TCP."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

import numpy as np
import pytest

import ddlf

from .conftest import wait_until

BIG = 40_000_000  # floats: 160 MB, above the 32 MiB threshold


def ddlf_files() -> set[str]:
    return {f for f in os.listdir("/dev/shm") if f.startswith("ddlf-")}


pytestmark = pytest.mark.skipif(not os.path.isdir("/dev/shm"), reason="needs /dev/shm")


@pytest.fixture(scope="module")
def shm_cluster():
    with ddlf.Cluster.local(2, threads=1, shared_memory=True) as c:
        yield c


def test_large_values_go_through_shared_memory_and_leave_no_files(shm_cluster: ddlf.Cluster) -> None:
    cluster = shm_cluster
    assert all(i["shared_memory"] for i in cluster.worker_info())
    before = ddlf_files()
    w = [np.arange(BIG // 4, dtype=np.float32) + i for i in range(4)]
    cluster.set("big", w)
    totals = cluster.run(lambda worker: [float(a[-1]) for a in worker.vars["big"]])
    assert totals == [[BIG // 4 - 1.0 + i for i in range(4)]] * 2
    back = cluster.run_on(1, lambda worker: worker.vars["big"])
    assert all(np.array_equal(a, b) for a, b in zip(back, w))
    assert ddlf_files() == before
    cluster.delete("big")


def test_tcp_only_cluster_moves_the_same_values(shm_cluster: ddlf.Cluster) -> None:
    tcp = ddlf.Cluster(shm_cluster.addresses, shm_cluster.token)  # the default: no shared memory
    assert not any(i["shared_memory"] for i in tcp.worker_info())
    a = np.ones(BIG // 2, dtype=np.float32)
    assert tcp.run(lambda x: float(x.sum()), a) == [BIG / 2] * 2
    tcp.close()


@pytest.mark.skipif(shutil.which("unshare") is None or os.geteuid() != 0, reason="needs unshare and root")
def test_worker_with_a_private_dev_shm_falls_back_to_tcp(tmp_path) -> None:
    ready = tmp_path / "addr"
    env = dict(os.environ, DDLF_TOKEN="container-token")
    script = (
        "mount -t tmpfs tmpfs /dev/shm && exec "
        f"{sys.executable} -m ddlf.worker --listen 127.0.0.1:0 --ready-file {ready}"
    )
    proc = subprocess.Popen(["unshare", "-m", "sh", "-c", script], env=env)
    try:
        if not wait_until(ready.exists, 30):
            pytest.skip("cannot start a worker in its own mount namespace here")
        c = ddlf.Cluster([ready.read_text().strip()], "container-token", shared_memory=True)
        # Same kernel (same boot id), but the worker cannot see our /dev/shm: detected at connect.
        assert not c.worker_info()[0]["shared_memory"]
        a = np.full(BIG, 2.0, dtype=np.float32)
        assert c.run(lambda x: float(x.sum()), a) == [2.0 * BIG]
        assert c.run(lambda x: x, a)[0][:3].tolist() == [2.0, 2.0, 2.0]  # a large reply comes back over TCP
        c.close()
    finally:
        proc.terminate()
        proc.wait(10)


@pytest.mark.skipif(shutil.which("unshare") is None or os.geteuid() != 0, reason="needs unshare and root")
def test_a_full_dev_shm_falls_back_to_the_socket_both_ways() -> None:
    # A master and its workers sharing a 1 MB /dev/shm (Docker's default is 64 MB): the probe succeeds, the
    # 160 MB value and its echo do not fit, and both directions go over TCP instead of failing.
    code = (
        "import numpy as np, ddlf\n"
        "with ddlf.Cluster.local(1, threads=1, shared_memory=True) as c:\n"
        "    assert c.worker_info()[0]['shared_memory']\n"
        f"    a = np.full({BIG}, 3.0, dtype=np.float32)\n"
        "    back = c.run(lambda x: x, a)[0]\n"
        "    print('ok', float(back[-1]), back.shape[0])\n"
    )
    script = f'mount -t tmpfs -o size=1m tmpfs /dev/shm && exec {sys.executable} -c "{code}"'
    out = subprocess.run(["unshare", "-m", "sh", "-c", script], capture_output=True, text=True, timeout=120)
    if "mount" in out.stderr and out.returncode != 0:
        pytest.skip("cannot mount a private /dev/shm here")
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.strip() == f"ok 3.0 {BIG}"
