"""GPU plumbing, tested on CPU: one worker per GPU, each seeing only its own; status shows each worker's device.
(What a GPU trains like is measured where one is lent: BENCHMARKS.md.)"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

import ddlf
from ddlf.devices import choose_gpus, parse_gpus


def _visible() -> str | None:
    return os.environ.get("CUDA_VISIBLE_DEVICES")


@pytest.mark.fresh_daemons("daemons started with --gpu")
def test_one_worker_per_listed_gpu_each_seeing_only_its_own() -> None:
    with ddlf.Cluster.local(gpus=[0, 3], preload=None) as cluster:
        assert len(cluster) == 2
        assert cluster.run(_visible) == ["0", "3"]


@pytest.mark.fresh_daemons("daemons started with --gpu")
def test_auto_takes_the_gpus_this_process_may_use(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "2,5,7")
    with ddlf.Cluster.local(gpus="auto", preload=None) as cluster:
        assert cluster.run(_visible) == ["2", "5", "7"]


@pytest.mark.fresh_daemons("Cluster.local's refusals are under test")
def test_bad_gpu_choices_are_refused_before_anything_starts(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    with pytest.raises(ValueError, match="found no GPU"):
        ddlf.Cluster.local(gpus="auto")
    with pytest.raises(ValueError, match="one worker per GPU"):
        ddlf.Cluster.local(3, gpus=[0, 1])
    with pytest.raises(ValueError, match="twice"):
        choose_gpus([1, 1])
    with pytest.raises(ValueError, match='"auto"'):
        choose_gpus("all")
    with pytest.raises(ValueError, match="at least 1"):
        ddlf.Cluster.local(0)
    assert parse_gpus("0, 2") == ["0", "2"] and parse_gpus("") == [] and parse_gpus("1,-1,2") == ["1"]


@pytest.mark.fresh_daemons("a daemon started with --gpu")
def test_worker_gpu_flag_and_status_show_the_device() -> None:
    from ddlf.cli.status_table import status_rows, table

    with ddlf.Cluster.local(1, preload=None, worker_args=["--gpu", "none"]) as cluster:
        assert cluster.run(_visible) == [""]
        rows = status_rows(cluster.addresses, {"token": cluster.token}, 5.0)
        assert rows[0]["device"] == "cpu"
        assert "device" in table(rows).splitlines()[0]


def test_a_bad_gpu_flag_is_refused_before_the_daemon_starts() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "ddlf.worker", "--gpu", "first", "--listen", "127.0.0.1:0"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 2 and "--gpu takes GPU indices" in out.stderr


@pytest.mark.fresh_daemons("a daemon started with a preload that fails")
def test_a_preload_that_fails_is_logged_and_the_daemon_serves() -> None:
    with ddlf.Cluster.local(1, preload="no_such_module_for_ddlf") as cluster:
        # A request that runs code waits for the preload (ddlf.worker.executor), which logs its failure first.
        assert cluster.run(lambda: "serving") == ["serving"]
        logs = cluster.logs(0, 0)
        assert any("preloading no_such_module_for_ddlf failed" in line for line in logs), logs


def test_ddlf_worker_help_documents_gpu() -> None:
    out = subprocess.run([sys.executable, "-m", "ddlf.worker", "--help"], capture_output=True, text=True, timeout=60)
    assert "--gpu" in out.stdout and "CUDA_VISIBLE_DEVICES" in out.stdout
