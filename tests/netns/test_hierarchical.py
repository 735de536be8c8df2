"""Hierarchical all-reduce across namespace hosts: 2 hosts x 2 workers (own IPs, a bridge between them). The
workers of a host sum through shared memory, one per host joins the ring between hosts; results equal the flat
ring's and numpy's, and training with it learns what the master exchange learns. Needs root and iproute2."""

from __future__ import annotations

import json
import os
import sys

import pytest
from benchmarks import netns

CAN, WHY = netns.available()
pytestmark = [pytest.mark.netns, pytest.mark.slow, pytest.mark.skipif(not CAN, reason=WHY)]
MASTER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "multihost_master.py")
TOKEN = "hierarchical-token"

CHECK = """
import json, sys
import numpy as np
import ddlf

addresses = json.loads(sys.argv[1])
rng = np.random.default_rng(3)
values = [[rng.standard_normal(n).astype(np.float32) for n in (1, 7, 100_003)] for _ in addresses]
out = {}
with ddlf.Cluster(addresses, token=sys.argv[2]) as c:
    plan = c.ring()
    out["hierarchical"] = plan.hierarchical
    out["specs"] = [
        {
            "rank": (s := plan.spec(w)).rank,
            "addresses": list(s.addresses),
            "local_index": s.local.index if s.local else None,
            "local_addresses": list(s.local.addresses) if s.local else None,
            "total": s.local.total if s.local else None,
        }
        for w in range(len(addresses))
    ]
    for mode in (True, False):
        c.scatter("v", values)
        c.allreduce("v", "mean", hierarchical=mode)
        got = c.get("v")
        want = [np.mean([np.float64(v[j]) for v in values], axis=0) for j in range(3)]
        out[str(mode)] = {
            "max_error": max(float(np.max(np.abs(g[j] - want[j]))) for g in got for j in range(3)),
            "same_bits": all(g[j].tobytes() == got[0][j].tobytes() for g in got for j in range(3)),
        }
print(json.dumps(out))
"""


@pytest.fixture(scope="module")
def hosts(tmp_path_factory: pytest.TempPathFactory):
    """2 hosts with 2 workers each (ports 7070 and 7071), and the master's namespace."""
    work = tmp_path_factory.mktemp("hierarchical")
    with netns.VirtualNetwork(2) as net:
        first = netns.start_workers(net, str(work), token=TOKEN, port=7070)
        second = netns.start_workers(net, str(work), token=TOKEN, port=7071)
        yield net, [first[0], second[0], first[1], second[1]]


def test_two_hosts_of_two_reduce_through_shared_memory_and_one_ring_between_hosts(hosts) -> None:
    net, addresses = hosts
    done = net.run(net.master, [sys.executable, "-c", CHECK, json.dumps(addresses), TOKEN], timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    out = json.loads(done.stdout.strip().splitlines()[-1])
    assert out["hierarchical"] is True  # two workers per host: on by default
    # Hosts' leaders form the ring; each worker's local group is its host's two workers.
    ips = [a.rsplit(":", 1)[0] for a in addresses]
    for w, spec in enumerate(out["specs"]):
        assert spec["addresses"] == [addresses[0], addresses[2]]
        assert [a.rsplit(":", 1)[0] for a in spec["local_addresses"]] == [ips[w]] * 2
        assert spec["total"] == 4
    assert sorted((s["rank"], s["local_index"]) for s in out["specs"]) == [(0, 0), (0, 1), (1, 0), (1, 1)]
    for mode in ("True", "False"):
        assert out[mode]["same_bits"], out
        assert out[mode]["max_error"] < 1e-6, out


def test_training_with_the_hierarchical_ring_learns_as_the_master_exchange_does(hosts) -> None:
    net, addresses = hosts

    def train(**args) -> dict:
        spec = {"addresses": addresses, "token": TOKEN, "mode": "sync", "epochs": 2, **args}
        done = net.run(net.master, [sys.executable, MASTER, json.dumps(spec)], timeout=300)
        assert done.returncode == 0, done.stderr[-3000:]
        return json.loads(done.stdout.strip().splitlines()[-1])

    ring = train(exchange="allreduce")  # hierarchical: two workers per host
    master = train(exchange="master")
    assert ring["samples"] == master["samples"] == 2 * 6000
    assert ring["events"] == [{"event": "exchange"}]
    # 4 workers x 1,500 rows a round, 2 epochs: learned (chance is 0.10), and the same model as the master's
    # exchange to float32 rounding (the two differ only in the order of the sums).
    assert ring["accuracy"] > 0.70 and abs(ring["accuracy"] - master["accuracy"]) < 0.005, (ring, master)
    assert ring["master_bytes"] < master["master_bytes"] / 4
