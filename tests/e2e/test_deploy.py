"""Deployment files: the Kubernetes manifests (validated against the Kubernetes API schemas, and consistent
with ``Cluster.from_kubernetes``) and the Slurm batch script (run for real with stand-ins for ``srun`` and
``scontrol`` that start its tasks on this machine)."""

from __future__ import annotations

import os
import socket
import stat
import subprocess
import sys
from pathlib import Path

import pytest

import ddlf
from ddlf.cluster.cluster_file import kubernetes_addresses, load

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
# Stand-in for srun: run the command once per task slot, on this machine, with Slurm's task variables.
while [[ "$1" == --* ]]; do shift; done
pids=()
for node in $STUB_NODES; do
  for ((i = 0; i < ${SLURM_NTASKS_PER_NODE:-1}; i++)); do
    SLURM_LOCALID=$i SLURMD_NODENAME=$node "$@" &
    pids+=($!)
  done
done
trap 'kill "${pids[@]}" 2>/dev/null' TERM
wait
"""
STUB_SCONTROL = """#!/bin/bash
# Stand-in for `scontrol show hostnames`: the nodes of the stub allocation.
for n in $STUB_NODES; do echo "$n"; done
"""
MASTER = """import os, ddlf
with ddlf.Cluster.from_config(os.environ["DDLF_CLUSTER_CONFIG"]) as c:
    print("ids", c.run(lambda worker: worker.id), "names", sorted(s["address"] for s in c.status()))
"""


def _free_port_pair() -> int:
    for _ in range(50):
        with socket.socket() as a:
            a.bind(("127.0.0.1", 0))
            port = a.getsockname()[1]
        with socket.socket() as b:
            try:
                b.bind(("127.0.0.1", port + 1))
                return port
            except OSError:
                continue
    raise RuntimeError("no two consecutive free ports")


def test_slurm_batch_script_starts_workers_runs_the_master_and_stops(tmp_path: Path) -> None:
    stubs = tmp_path / "bin"
    stubs.mkdir()
    for name, text in (("srun", STUB_SRUN), ("scontrol", STUB_SCONTROL)):
        (stubs / name).write_text(text)
        (stubs / name).chmod(stat.S_IRWXU)
    (tmp_path / "train.py").write_text(MASTER)
    port = _free_port_pair()
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
        "DDLF_PORT": str(port),
        "DDLF_RUN_DIR": str(run_dir),
    }
    env.pop("DDLF_TOKEN", None)
    done = subprocess.run(
        ["bash", str(SBATCH), str(tmp_path / "train.py")], env=env, capture_output=True, text=True, timeout=180
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert "ids [0, 1]" in done.stdout
    cfg = load(run_dir / "cluster.toml")
    assert cfg.workers == [f"localhost:{port}", f"localhost:{port + 1}"]
    assert len(cfg.token() or "") == 48 and (run_dir / "token").stat().st_mode & 0o077 == 0

    # The job's exit stopped its workers.
    def closed(p: int) -> bool:
        with socket.socket() as s:
            return s.connect_ex(("127.0.0.1", p)) != 0

    assert wait_until(lambda: closed(port) and closed(port + 1), 15)
