"""The master side of the multi-host tests, run inside the master's network namespace:

    python tests/multihost_master.py '{"addresses": [...], "token": ..., "tls_ca": ..., "mode": "sync", ...}'

Trains a small dense model on MNIST across the hosts and prints one JSON line with the outcome. Optional faults,
done from here so they land mid-training: ``link_down`` = ``[switch_ns, port, at_round, seconds]`` takes a host's
link down when that round ends and brings it up ``seconds`` later.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading

import ddlf

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
from tests.conftest import MNIST_DIR
from tests.e2e.apps import SmallMnist


class HostsMnist(SmallMnist):
    """The tests' small dense model, on the first 6,000 MNIST images."""

    dataset_key = "mnist-multihost"
    rows = 6000


class LinkFault(ddlf.callbacks.Callback):
    """Take a link down at the end of a round, and up again some seconds later. No epoch starts while the link is
    down (the others train on meanwhile, within the epoch), and once it is back the run goes on until the host has
    rejoined and trained one whole epoch, then stops (the run's ``epochs`` bound it): whether and when the host
    rejoins is then up to ddlf, not to how fast this machine trains the epochs left."""

    def __init__(self, switch_ns: str, port: str, at_round: int, seconds: float) -> None:
        self.cmd = ["ip", "netns", "exec", switch_ns, "ip", "link", "set", port]
        self.at_round, self.seconds = at_round, seconds
        self.fired = False
        self.up = threading.Event()
        self.back_from: int | None = None  # the first epoch that began with the host rejoined

    def on_round_end(self, round: int, logs=None) -> None:
        if round == self.at_round and not self.fired:
            self.fired = True
            subprocess.run([*self.cmd, "down"], check=True)
            threading.Timer(self.seconds, self._up).start()

    def _up(self) -> None:
        subprocess.run([*self.cmd, "up"], check=True)
        self.up.set()

    def on_epoch_begin(self, epoch: int, logs=None) -> None:
        if not self.fired:
            return
        self.up.wait(60)
        rejoined = any(e["event"] in ("rejoined", "restarted") for e in self.app.cluster.events)
        if self.back_from is None and rejoined:
            self.back_from = epoch

    def on_epoch_end(self, epoch: int, logs=None) -> None:
        if self.back_from is not None and epoch >= self.back_from:
            self.app.stop_training = True


def main() -> None:
    args = json.loads(sys.argv[1])
    cluster = ddlf.Cluster(
        args["addresses"],
        token=args["token"],
        tls_ca=args.get("tls_ca"),
        heartbeat_interval=0.5,
        heartbeat_timeout=args.get("heartbeat_timeout", 3.0),
    )
    callbacks = [LinkFault(*args["link_down"])] if args.get("link_down") else []
    with cluster:
        hosts = cluster.run(lambda worker: os.uname().nodename)  # same kernel: one machine, distinct namespaces
        ips = cluster.call(_own_addresses)
        app = HostsMnist(cluster)
        (_, _), (xt, yt) = ddlf.datasets.mnist(MNIST_DIR)
        every = args.get("averaging_frequency", 10)
        strategy: ddlf.ModelAveraging | ddlf.Asynchronous
        if args["mode"] == "async":
            strategy = ddlf.Asynchronous(chunk=every, staleness=ddlf.DynSGD())
        elif args.get("exchange", "master") == "allreduce":
            strategy = ddlf.ModelAveraging(every=every, exchange=ddlf.Ring(hierarchical=args.get("hierarchical")))
        else:
            strategy = ddlf.ModelAveraging(every=every)
        h = app.train(
            epochs=args.get("epochs", 2),
            batch_size=32,
            strategy=strategy,
            verbose=0,
            callbacks=callbacks,
            run=ddlf.RunConfig(rejoin_timeout=30),
        )
        _, acc = app.evaluate(xt[:2000], yt[:2000])
        print(
            json.dumps(
                {
                    "accuracy": float(acc),
                    "samples": sum(s.samples for s in h.stats),
                    "events": [{k: v for k, v in e.items() if k in ("event", "worker", "address")} for e in h.events],
                    "workers_in_last_epoch": sorted(
                        {s.worker for s in h.stats if s.epoch == h.epoch[-1] and s.samples}
                    ),
                    "hosts": hosts,
                    "worker_ips": ips,
                    "status": [s["address"] for s in cluster.status()],
                    "master_bytes": sum(s.bytes_sent + s.bytes_received for s in h.stats),
                }
            )
        )


def _own_addresses() -> list[str]:
    """The IPv4 addresses of the namespace the worker runs in (not 127.0.0.1)."""
    out = subprocess.run(["ip", "-4", "-o", "addr", "show", "dev", "eth0"], capture_output=True, text=True).stdout
    return [line.split()[3].split("/")[0] for line in out.splitlines()]


if __name__ == "__main__":
    main()
