"""Deployment files: the Kubernetes manifests (validated against the Kubernetes API schemas, and consistent
with ``Cluster.from_kubernetes``) and the Slurm batch script (run for real with stand-ins for ``srun`` and
``scontrol`` that start its tasks on this machine)."""

from __future__ import annotations

import ast
import os
import socket
import stat
import subprocess
import sys
from pathlib import Path

import pytest

import ddlf
from ddlf.cluster.cluster_file import kubernetes_addresses

from ..conftest import REPO, wait_until

K8S = Path(REPO) / "deploy" / "kubernetes"
SBATCH = Path(REPO) / "deploy" / "slurm" / "ddlf.sbatch"


def _docs(name: str) -> list[dict]:
    yaml = pytest.importorskip("yaml")
    return [d for d in yaml.safe_load_all((K8S / name).read_text()) if d]


@pytest.mark.parametrize("name", ["workers.yaml", "master-job.yaml"])
def test_manifests_validate_against_the_kubernetes_schemas(name: str) -> None:
    kv = pytest.importorskip("kubernetes_validate")
    docs = _docs(name)
    assert docs
    for doc in docs:
        kv.validate(doc, kv.latest_version(), strict=True)  # raises on any unknown or mistyped field


def test_a_broken_manifest_is_caught_by_the_validator() -> None:
    kv = pytest.importorskip("kubernetes_validate")
    sts = next(d for d in _docs("workers.yaml") if d["kind"] == "StatefulSet")
    sts["spec"]["replicas"] = "four"
    with pytest.raises(kv.ValidationError):
        kv.validate(sts, kv.latest_version(), strict=True)


def test_workers_manifest_fits_from_kubernetes() -> None:
    docs = {d["kind"]: d for d in _docs("workers.yaml")}
    svc, sts = docs["Service"], docs["StatefulSet"]
    assert svc["spec"]["clusterIP"] == "None"  # headless: per-pod DNS names
    assert sts["spec"]["serviceName"] == svc["metadata"]["name"]
    labels = sts["spec"]["template"]["metadata"]["labels"]
    assert svc["spec"]["selector"].items() <= labels.items()
    assert sts["spec"]["selector"]["matchLabels"].items() <= labels.items()
    container = sts["spec"]["template"]["spec"]["containers"][0]
    port = container["ports"][0]["containerPort"]
    assert "--listen 0.0.0.0:7070" in container["args"][0] and port == svc["spec"]["ports"][0]["port"] == 7070
    assert any(e["name"] == "DDLF_TOKEN" and "secretKeyRef" in e["valueFrom"] for e in container["env"])
    addresses = kubernetes_addresses(svc["metadata"]["name"], "ml", sts["spec"]["replicas"], port=port)
    assert addresses[0] == "ddlf-workers-0.ddlf-workers.ml.svc.cluster.local:7070"
    assert len(addresses) == sts["spec"]["replicas"]


def test_kubernetes_addresses_namespace_and_discovery(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DDLF_K8S_NAMESPACE", "team-a")
    assert kubernetes_addresses("w", replicas=2, port=9000) == [
        "w-0.w.team-a.svc.cluster.local:9000",
        "w-1.w.team-a.svc.cluster.local:9000",
    ]
    up = {"w-0.w.team-a.svc.cluster.local", "w-1.w.team-a.svc.cluster.local", "w-2.w.team-a.svc.cluster.local"}

    def resolve(name: str) -> str:
        if name not in up:
            raise OSError("no such host")
        return "10.0.0.1"

    assert len(kubernetes_addresses("w", resolve=resolve)) == 3
    with pytest.raises(ddlf.DdlfError, match="no pod of x resolves"):
        kubernetes_addresses("x", resolve=resolve)
    with pytest.raises(ValueError, match="replicas"):
        kubernetes_addresses("w", replicas=0)


STUB_SRUN = """#!/bin/bash
# Stand-in for srun (no Slurm here): run the command once per task of the stub allocation, on this machine, with
# Slurm's task variables. tests/slurm/ runs the same script against a real Slurm (root and namespaces).
while [[ "$1" == --* ]]; do shift; done
pids=()
rank=0
for node in $STUB_NODES; do
  for ((i = 0; i < ${SLURM_NTASKS_PER_NODE:-1}; i++)); do
    SLURM_PROCID=$rank SLURM_LOCALID=$i SLURMD_NODENAME=$node SLURM_LAUNCH_NODE_IPADDR=127.0.0.1 "$@" &
    pids+=($!)
    rank=$((rank + 1))
  done
done
trap 'kill "${pids[@]}" 2>/dev/null' TERM
wait
"""
MASTER = """import ddlf
with ddlf.Cluster.from_slurm() as c:
    print("ids", c.run(lambda worker: worker.id), "names", sorted(i["name"] for i in c.worker_info()))
    print("addresses", c.addresses)
"""


def test_slurm_batch_script_starts_workers_runs_the_master_and_stops(tmp_path: Path) -> None:
    """deploy/slurm/ddlf.sbatch and Cluster.from_slurm with a stand-in srun: workers on free ports, enlisted with
    the job's token, stopped when the master's script ends."""
    stubs = tmp_path / "bin"
    stubs.mkdir()
    (stubs / "srun").write_text(STUB_SRUN)
    (stubs / "srun").chmod(stat.S_IRWXU)
    (tmp_path / "train.py").write_text(MASTER)
    run_dir = tmp_path / "run"
    env = {
        **os.environ,
        "PATH": f"{stubs}:{os.environ['PATH']}",
        "STUB_NODES": "localhost",
        "SLURM_JOB_ID": "4242",
        "SLURM_JOB_NODELIST": "localhost",
        "SLURM_NTASKS_PER_NODE": "2",
        "SLURM_CPUS_PER_TASK": "1",
        "DDLF_PYTHON": sys.executable,
        "DDLF_RUN_DIR": str(run_dir),
    }
    env.pop("DDLF_TOKEN", None)
    done = subprocess.run(
        ["bash", str(SBATCH), str(tmp_path / "train.py")], env=env, capture_output=True, text=True, timeout=180
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert "ids [0, 1]" in done.stdout and "names ['localhost-0', 'localhost-1']" in done.stdout, done.stdout
    assert "the master exited with status 0" in done.stdout
    addresses = ast.literal_eval(done.stdout.split("addresses ", 1)[1].splitlines()[0])
    ports = [int(a.rsplit(":", 1)[1]) for a in addresses]
    assert len(set(ports)) == 2 and all(p > 1024 for p in ports)  # free ports, not a fixed range
    assert (run_dir.stat().st_mode & 0o077) == 0  # the run directory is the job user's only

    # The job's exit stopped its workers.
    def closed(p: int) -> bool:
        with socket.socket() as s:
            return s.connect_ex(("127.0.0.1", p)) != 0

    assert wait_until(lambda: all(closed(p) for p in ports), 15)
