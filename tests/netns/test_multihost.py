"""Multi-host runs for real on one machine: worker daemons in their own network namespaces (own IPs, joined by
veth pairs and a bridge), the master in another, token auth and TLS on; link faults and packet loss.
Needs root and iproute2 (``benchmarks.netns.available()``); CI runs as root."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from benchmarks import netns

from ..certs import make_certs
from ..conftest import pid_alive, wait_until

CAN, WHY = netns.available()
pytestmark = [pytest.mark.netns, pytest.mark.slow, pytest.mark.skipif(not CAN, reason=WHY)]
MASTER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "multihost_master.py")
TOKEN = "multi-host-token"


@pytest.fixture(scope="module")
def hosts(tmp_path_factory: pytest.TempPathFactory):
    """3 hosts with a TLS worker each, and the master's namespace."""
    work = tmp_path_factory.mktemp("multihost")
    ips = tuple(f"{netns.SUBNET}.{11 + i}" for i in range(3))
    certs = make_certs(work / "certs", ips=ips)
    with netns.VirtualNetwork(3) as net:
        addresses = netns.start_workers(
            net, str(work), token=TOKEN, tls=(str(certs["server"]), str(certs["key"])), threads=1
        )
        yield net, addresses, certs, work


def _train(net: netns.VirtualNetwork, addresses: list[str], certs, **args) -> dict:
    spec = {"addresses": addresses, "token": TOKEN, "tls_ca": str(certs["ca"]), **args}
    done = net.run(net.master, [sys.executable, MASTER, json.dumps(spec)], timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_hosts_have_their_own_addresses(hosts) -> None:
    net, addresses, certs, _ = hosts
    assert addresses == ["10.77.0.11:7070", "10.77.0.12:7070", "10.77.0.13:7070"]
    # The master's namespace reaches them only over the bridge: its own loopback has no worker.
    route = net.run(net.master, ["ip", "-4", "-o", "addr", "show", "dev", "eth0"]).stdout
    assert "10.77.0.2/24" in route
    # Plain TCP to a TLS worker is refused; so is a master without the token (the workers keep serving).
    code = (
        "import ddlf, sys\n"
        "try:\n"
        f"    ddlf.Cluster({addresses[:1]!r}, token='wrong', tls_ca={str(certs['ca'])!r}, connect_timeout=5)\n"
        "except ddlf.DdlfError as e:\n"
        "    print(type(e).__name__)\n"
    )
    out = net.run(net.master, [sys.executable, "-c", code], timeout=60)
    assert out.stdout.strip() == "AuthenticationError", out.stderr[-2000:]


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_training_across_hosts_with_tls_and_token(hosts, mode: str) -> None:
    net, addresses, certs, _ = hosts
    # Async is not bit-reproducible: one full run here ended at 79.35% after 2 epochs; 3 keep the band clear.
    epochs = {"sync": 2, "async": 3}[mode]
    out = _train(net, addresses, certs, mode=mode, epochs=epochs)
    assert sorted(ip for ips in out["worker_ips"] for ip in ips) == ["10.77.0.11", "10.77.0.12", "10.77.0.13"]
    assert out["samples"] == epochs * 6000
    assert out["events"] == []
    assert out["accuracy"] > 0.80, out


def test_allreduce_training_across_tls_hosts(hosts) -> None:
    """The ring's peer links between namespace hosts run inside TLS (the daemons admit no other), each worker
    checking its neighbour's certificate for its IP against the master's authority."""
    net, addresses, certs, _ = hosts
    ring = _train(net, addresses, certs, mode="sync", epochs=2, exchange="allreduce")
    master = _train(net, addresses, certs, mode="sync", epochs=2, exchange="master")
    assert ring["samples"] == master["samples"] == 2 * 6000
    assert ring["events"] == [{"event": "exchange"}]  # the run notes its exchange; nothing was lost or redone
    assert ring["accuracy"] > 0.80, ring
    assert abs(ring["accuracy"] - master["accuracy"]) < 0.02, (ring, master)
    # The weights went worker to worker: the master carried a fraction of what its own exchange carries.
    assert ring["master_bytes"] < master["master_bytes"] / 4, (ring["master_bytes"], master["master_bytes"])


def test_a_link_down_mid_round_then_up(hosts) -> None:
    """Pull host 2's cable after round 2 for 6 s: it is noticed by the heartbeat (no connection reset crosses
    a dead link), training goes on with the others, and host 2 rejoins once its link is back. The run stops one
    epoch after the host is back (at most 20 epochs: a host that never rejoins fails)."""
    net, addresses, certs, _ = hosts
    fault = [net.switch, net.hosts[2].port, 2, 6.0]
    out = _train(net, addresses, certs, mode="sync", epochs=20, averaging_frequency=5, link_down=fault)
    kinds = [(e["event"], e["worker"]) for e in out["events"]]
    assert ("lost", 2) in kinds and ("rejoined", 2) in kinds, out["events"]
    assert kinds.index(("lost", 2)) < kinds.index(("rejoined", 2))
    assert out["workers_in_last_epoch"] == [0, 1, 2]
    assert out["accuracy"] > 0.80


def test_packet_loss_on_a_link(hosts) -> None:
    """3% of host 1's TCP packets dropped both ways: TCP retransmits, training completes on all three."""
    net, addresses, certs, _ = hosts
    net.drop(net.hosts[1], 3.0)
    try:
        out = _train(net, addresses, certs, mode="sync", epochs=2, heartbeat_timeout=10.0)
    finally:
        net.drop(net.hosts[1], 0)
    assert out["events"] == []
    assert out["samples"] == 2 * 6000 and out["accuracy"] > 0.80


def test_teardown_is_complete_even_when_the_test_fails(tmp_path: Path) -> None:
    net = netns.VirtualNetwork(2)
    pids: list[int] = []
    with pytest.raises(RuntimeError, match="the test failed"), net:
        netns.start_workers(net, str(tmp_path), token=TOKEN)
        pids = [p.pid for h in net.hosts for p in h.procs]
        # A process started behind the harness's back: found and killed through its namespace.
        stray = subprocess.Popen(["ip", "netns", "exec", net.hosts[0].ns, "sleep", "300"])
        pids.append(stray.pid)
        assert net.leftovers()
        raise RuntimeError("the test failed")
    assert net.leftovers() == []
    assert wait_until(lambda: not any(pid_alive(p) for p in pids), 10)
    links = subprocess.run(["ip", "-o", "link"], capture_output=True, text=True).stdout
    assert "dv" not in "".join(line.split(":")[1] for line in links.splitlines())


@pytest.mark.skipif(not os.path.exists("/usr/sbin/sshd"), reason="needs openssh-server (scripts/install-system.sh)")
def test_ddlf_up_and_down_over_ssh(tmp_path: Path) -> None:
    """`ddlf up cluster.toml` from the master's namespace starts a worker on each host through its sshd, checks
    versions and shows the table; jobs run; `ddlf down` stops them."""
    with netns.VirtualNetwork(2) as net:
        options = [netns.start_sshd(net, h, str(tmp_path)) for h in net.hosts]
        ssh_options = options[0]  # the same key for both hosts
        (tmp_path / "token").write_text("up-down-token\n")
        workers = [f"{h.ip}:7071" for h in net.hosts]
        config = tmp_path / "cluster.toml"
        config.write_text(
            f'workers = {json.dumps(workers)}\ntoken_file = "token"\n\n[launch]\n'
            f"ssh_options = {json.dumps(ssh_options)}\npython = {json.dumps(sys.executable)}\n"
            f'worker_args = ["--threads", "1"]\nlog_dir = {json.dumps(str(tmp_path))}\n'
        )
        ddlf_cmd = [sys.executable, "-m", "ddlf.cli"]
        up = net.run(net.master, [*ddlf_cmd, "up", str(config)], timeout=120)
        assert up.returncode == 0, up.stdout + up.stderr
        assert "2 workers up, all ddlf" in up.stdout
        assert all(w in up.stdout for w in workers) and "DOWN" not in up.stdout
        job = (
            "import ddlf, os\n"
            f"with ddlf.Cluster.from_config({str(config)!r}) as c:\n"
            "    print(c.run(lambda worker: (worker.id, os.getpid())))\n"
        )
        ran = net.run(net.master, [sys.executable, "-c", job], timeout=60)
        assert ran.returncode == 0 and ran.stdout.startswith("[(0, "), ran.stderr[-2000:]
        down = net.run(net.master, [*ddlf_cmd, "down", str(config)], timeout=60)
        assert down.returncode == 0 and down.stdout.count(": stopped") == 2, down.stdout + down.stderr
        status = net.run(net.master, [*ddlf_cmd, "status", "--config", str(config), "--timeout", "2"], timeout=60)
        assert wait_until(
            lambda: (
                net.run(net.master, [*ddlf_cmd, "status", "--config", str(config), "--timeout", "1"]).stdout.count(
                    "DOWN"
                )
                == 2
            ),
            15,
        ), status.stdout
        # A host without sshd: a clear error naming it, nothing started.
        config.write_text(config.read_text().replace(workers[0], f"{net.master.ip}:7071"))
        bad = net.run(net.master, [*ddlf_cmd, "up", str(config), "--timeout", "10"], timeout=60)
        assert bad.returncode == 1 and f"{net.master.ip}:7071: ssh {net.master.ip} failed" in bad.stderr
