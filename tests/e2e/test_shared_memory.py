"""The same-machine fast path: values through pooled /dev/shm segments (reused, never overwritten while held,
removed at exit); workers that see another /dev/shm (as a container on the same kernel does) are detected at
connect and use TCP; a full /dev/shm falls back to the socket."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

import numpy as np
import pytest

import ddlf

from ..conftest import wait_until

BIG = 40_000_000  # floats: 160 MB
MB8 = 2_000_000  # floats: 8 MB, above the 1 MiB pool threshold


def ddlf_files() -> set[str]:
    return {f for f in os.listdir("/dev/shm") if f.startswith("ddlf-")}


def files_of(pid: str) -> list[str]:
    """The shared-memory files that process ``pid`` wrote."""
    return sorted(f for f in ddlf_files() if f.split("-")[1] == pid)


def run_script(code: str) -> str:
    """Run ``code`` in a fresh interpreter; its standard output (it must succeed)."""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    return out.stdout


pytestmark = pytest.mark.skipif(not os.path.isdir("/dev/shm"), reason="needs /dev/shm")


@pytest.fixture(scope="module")
def shm_cluster():
    with ddlf.Cluster.local(2, threads=1, shared_memory=True) as c:
        yield c


def test_large_values_go_through_shared_memory(shm_cluster: ddlf.Cluster) -> None:
    cluster = shm_cluster
    assert all(i["shared_memory"] for i in cluster.worker_info())
    w = [np.arange(BIG // 4, dtype=np.float32) + i for i in range(4)]
    cluster.set("big", w)
    totals = cluster.run(lambda worker: [float(a[-1]) for a in worker.vars["big"]])
    assert totals == [[BIG // 4 - 1.0 + i for i in range(4)]] * 2
    back = cluster.run_on(1, lambda worker: worker.vars["big"])
    assert all(np.array_equal(a, b) for a, b in zip(back, w))
    assert not back[0].flags.writeable  # a view of the worker's segment: copy it to write
    cluster.delete("big")


def test_segments_are_reused_and_never_overwritten_while_held(shm_cluster: ddlf.Cluster) -> None:
    cluster = shm_cluster
    first = np.full(MB8, 1.0, dtype=np.float32)
    cluster.set("held", first)  # each worker keeps a view of this segment
    for k in range(6):
        cluster.set("scratch", np.full(MB8, float(k), dtype=np.float32))
    assert cluster.run(lambda worker: float(worker.vars["held"].sum())) == [float(MB8)] * 2
    segments, _ = ddlf._ddlf.shared_memory_usage()
    assert segments <= 3  # "held"'s segment, and the scratch values' reused ones
    # A reply the master keeps is not overwritten by the worker's next replies.
    kept = cluster.run_on(0, lambda x: x, np.full(MB8, 7.0, dtype=np.float32))
    for k in range(4):
        cluster.run_on(0, lambda x: x, np.full(MB8, float(k), dtype=np.float32))
    assert float(kept.min()) == float(kept.max()) == 7.0
    # Workers may write to what they receive only after copying it.
    out = cluster.run_on(0, lambda x: (x.flags.writeable, float((x.copy() + 1).sum())), first)
    assert out == (False, 2.0 * MB8)
    cluster.delete("held")
    cluster.delete("scratch")


def test_no_segment_outlives_its_processes() -> None:
    code = (
        "import os, numpy as np, ddlf\n"
        "with ddlf.Cluster.local(2, threads=1, shared_memory=True) as c:\n"
        "    a = np.ones(2_000_000, dtype=np.float32)\n"
        "    back = c.run(lambda x: x * 2, a)\n"
        "    assert float(back[1].sum()) == 4_000_000.0\n"
        "    print(os.getpid(), *[i['pid'] for i in c.worker_info()])\n"
    )
    pids = run_script(code).split()
    assert len(pids) == 3
    assert [f for pid in pids for f in files_of(pid)] == []


def test_segments_of_a_killed_master_are_swept_by_the_next_one() -> None:
    # The master sends 8 MB values through its pool, reports its pid, then is killed with SIGKILL: no exit code runs.
    code = (
        "import os, sys, time, numpy as np, ddlf\n"
        "c = ddlf.Cluster.local(1, threads=1, shared_memory=True)\n"
        "c.set('v', np.ones(2_000_000, dtype=np.float32))\n"
        "print(os.getpid(), flush=True)\n"
        "time.sleep(600)\n"
    )
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None
        pid = proc.stdout.readline().strip()
        assert pid.isdigit()
        left = files_of(pid)
        assert left, "the master's segment should exist while it runs"
    finally:
        proc.kill()
        proc.wait()
    assert files_of(pid) == left  # SIGKILL: nothing removed them
    # The next master's first segment removes them first; its own segment serves its transfer.
    code = (
        "import os, numpy as np, ddlf\n"
        "with ddlf.Cluster.local(1, threads=1, shared_memory=True) as c:\n"
        "    c.set('v', np.ones(2_000_000, dtype=np.float32))\n"
        "    mine = [f for f in os.listdir('/dev/shm') if f.startswith(f'ddlf-{os.getpid()}-')]\n"
        "    print(len(mine), float(c.get('v')[0].sum()))\n"
    )
    assert run_script(code).split() == ["1", "2000000.0"]
    assert not files_of(pid)


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
