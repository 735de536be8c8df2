"""ddlf under a real Slurm: ``slurmctld`` and a ``slurmd`` per host in network namespaces (``benchmarks.slurm``),
jobs submitted with ``sbatch`` through ``deploy/slurm/ddlf.sbatch``, the master starting its workers with
``Cluster.from_slurm()``; two jobs side by side on the same nodes; ``scontrol requeue`` (SIGTERM to every process of
the job) and a real one-minute time limit (Slurm's warning, SIGUSR1 to the batch shell) each resumed from the
checkpoint of the last round.

Needs root, network namespaces and Debian's Slurm (``scripts/install-system.sh``): skipped with the reason where
root or namespaces are missing; in CI a missing Slurm fails."""

from __future__ import annotations

import contextlib
import json
import os
import sys
import time
from pathlib import Path

import pytest
from benchmarks import slurm

REPO = Path(__file__).resolve().parents[2]
SBATCH = REPO / "deploy" / "slurm" / "ddlf.sbatch"
JOB = REPO / "tests" / "slurm" / "slurm_job.py"
CAN, WHY = slurm.available()
if not CAN and os.environ.get("CI") and "Slurm is not installed" in WHY:
    raise RuntimeError(f"CI must have Slurm: {WHY}")
pytestmark = [pytest.mark.slurm, pytest.mark.slow, pytest.mark.skipif(not CAN, reason=WHY)]
ROWS = 6000  # tests/slurm/slurm_job.py's SlurmMnist


@pytest.fixture(scope="module")
def slurm_cluster(tmp_path_factory: pytest.TempPathFactory):
    """3 Slurm nodes with 4 CPUs each (more than this machine has: only the scheduler's accounting sees them)."""
    with slurm.SlurmCluster(tmp_path_factory.mktemp("slurm"), nodes=3, cpus=4) as c:
        yield c


def _submit(cluster: slurm.SlurmCluster, tmp: Path, name: str, args: list[str], **env: str) -> tuple[int, Path]:
    out = tmp / f"{name}.json"
    environment = {
        "DDLF_PYTHON": sys.executable,
        "DDLF_RUN_DIR": str(tmp / f"{name}-run"),
        "PATH": os.path.dirname(sys.executable) + ":" + os.environ["PATH"],
        **env,
    }
    job = cluster.sbatch(
        [
            f"--job-name={name}",
            "--cpus-per-task=1",
            f"--output={tmp / name}-%j.log",
            *args,
            str(SBATCH),
            str(JOB),
            str(out),
        ],
        cwd=tmp,
        env=environment,
    )
    return job, out


def _records(out: Path) -> list[dict]:
    return [json.loads(line) for line in out.read_text().splitlines()] if out.exists() else []


def _finish(cluster: slurm.SlurmCluster, job: int, tmp: Path, name: str, timeout: float = 300) -> str:
    state = cluster.wait_job(job, timeout)
    if state != "COMPLETED":
        logs = "\n".join(p.read_text(errors="replace")[-3000:] for p in sorted(tmp.glob(f"{name}*.log")))
        raise AssertionError(f"job {job} ended {state}:\n{logs}\n{cluster.logs()}")
    return state


def test_sbatch_trains_across_three_nodes_with_from_slurm(slurm_cluster: slurm.SlurmCluster, tmp_path: Path) -> None:
    # token= is a Cluster argument like the others: the job's workers take it (instead of one made for the job).
    job, out = _submit(slurm_cluster, tmp_path, "three", ["--nodes=3", "--ntasks-per-node=1"], TOKEN="users-own")
    _finish(slurm_cluster, job, tmp_path, "three")
    [record] = _records(out)
    assert record["token"] == "users-own"
    assert record["status"] == "done" and record["epochs"] == 2 and record["samples"] == 2 * ROWS
    assert [h for h, _ in record["workers"]] == ["node0", "node1", "node2"]  # one worker per node, rank order
    assert [a.rsplit(":", 1)[0] for a in record["addresses"]] == ["10.77.0.11", "10.77.0.12", "10.77.0.13"]
    assert record["accuracy"] > 0.8, record
    # The workers' logs are in the run directory, one per task, and the step ended with the master.
    assert len(list((tmp_path / "three-run").glob("worker-*.log"))) == 3
    assert slurm_cluster.job(job)["ExitCode"] == "0:0"


def test_two_jobs_on_the_same_nodes_with_two_tasks_per_node(slurm_cluster: slurm.SlurmCluster, tmp_path: Path) -> None:
    """Free ports, a token per job: two masters whose workers share nodes never meet."""
    a, out_a = _submit(slurm_cluster, tmp_path, "pairs", ["--nodes=2", "--ntasks-per-node=2", "--nodelist=node0,node1"])
    b, out_b = _submit(
        slurm_cluster, tmp_path, "beside", ["--nodes=2", "--ntasks-per-node=1", "--nodelist=node0,node1"]
    )
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:  # both run at once (the nodes have the CPUs for both)
        if slurm_cluster.job(a).get("JobState") == "RUNNING" and slurm_cluster.job(b).get("JobState") == "RUNNING":
            break
        time.sleep(0.5)
    else:
        pytest.fail(f"the two jobs did not run side by side: {slurm_cluster.job(a)} {slurm_cluster.job(b)}")
    _finish(slurm_cluster, a, tmp_path, "pairs")
    _finish(slurm_cluster, b, tmp_path, "beside")
    [pairs], [beside] = _records(out_a), _records(out_b)
    assert sorted(n for _, n in pairs["workers"]) == ["node0-0", "node0-1", "node1-0", "node1-1"]
    assert len(beside["workers"]) == 2
    assert len(set(pairs["addresses"]) | set(beside["addresses"])) == 6  # no address shared
    for r in (pairs, beside):
        assert r["status"] == "done" and r["samples"] == 2 * ROWS, r
    # Both learned (chance: 0.1). Four workers averaging every 10 batches take fewer steps per epoch than two, and
    # learn less in 2 epochs (0.757 in one run here, against 0.84 with 2 workers): issue 37's subject, not Slurm's.
    assert beside["accuracy"] > 0.8 and pairs["accuracy"] > 0.6, (beside, pairs)


def _start_again_at_once(
    cluster: slurm.SlurmCluster, job: int, within: float = 120, time_limit: str | None = None
) -> None:
    """Slurm holds a requeued job back for a while (its BeginTime; 2 minutes here) before it may start again; that
    is the scheduler's policy, not what is tested: the job may start as soon as it is back in the queue (and, with
    ``time_limit``, runs with that limit from then on)."""
    deadline = time.monotonic() + within

    def requeued() -> bool:
        fields = cluster.job(job)
        return fields.get("JobState") == "PENDING" and int(fields.get("Restarts") or 0) >= 1

    while not requeued() and time.monotonic() < deadline:
        time.sleep(0.5)
    assert requeued(), cluster.job(job)
    limit = [f"TimeLimit={time_limit}"] if time_limit else []
    done = cluster.client(["scontrol", "update", f"JobId={job}", "StartTime=now", *limit])
    assert done.returncode == 0, done.stderr


def _wait_for_checkpoint(ckpt: Path, timeout: float = 180) -> None:
    from ddlf.training import checkpoint

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        saved = None
        with contextlib.suppress(ValueError):  # being written
            saved = checkpoint.load(ckpt)
        if saved is not None and saved["epochs_done"] >= 1:
            return
        time.sleep(0.5)
    raise AssertionError(f"no checkpoint of an epoch in {ckpt} after {timeout:.0f} s")


@pytest.mark.parametrize("how", ["scontrol requeue", "time limit"])
def test_a_preempted_job_is_requeued_and_resumes_from_its_checkpoint(
    slurm_cluster: slurm.SlurmCluster, tmp_path: Path, how: str
) -> None:
    ckpt = tmp_path / "ckpt"
    name = "requeue" if how == "scontrol requeue" else "timed"
    if how == "scontrol requeue":
        # Preempted by SIGTERM to every process, the job runs the default strategy (gradient averaging on the
        # ring), whose last round's weights only the workers hold. 8 epochs of about a second each on two
        # workers: the signal lands while most of them are ahead.
        args, env = [], {"STRATEGY": "gradients"}
    else:
        # A real time limit: one minute, with Slurm's warning (SIGUSR1 to the batch shell, as ddlf.sbatch's
        # `--signal=B:USR1@120` asks on real limits) 40 s before it. slurmctld looks at limits every 30 s, so the
        # warning comes 20-50 s into the job; the first run's rounds are slowed (0.5 s each: 5 s an epoch, 40 s in
        # all) so that it is still training then, and would run past its limit. Model averaging on the ring.
        args, env = ["--time=1", "--signal=B:USR1@40"], {"STRATEGY": "weights", "ROUND_SLEEP": "0.5"}
    job, out = _submit(
        slurm_cluster,
        tmp_path,
        name,
        ["--nodes=2", "--ntasks-per-node=1", *args],
        EPOCHS="8",
        EVERY="5",
        CKPT=str(ckpt),
        **env,
    )
    if how == "scontrol requeue":
        # What preemption with requeue does: SIGTERM to every process of the job (workers too), SIGKILL after
        # KillWait, the job back in the queue.
        _wait_for_checkpoint(ckpt)
        done = slurm_cluster.client(["scontrol", "requeue", str(job)])
        assert done.returncode == 0, done.stderr
        _start_again_at_once(slurm_cluster, job)
    else:
        # Nothing from the test: Slurm's own warning makes the master checkpoint and requeue the job. The requeued
        # job gets the time to finish (a real limit is hours; this test's minute is for the first run).
        _start_again_at_once(slurm_cluster, job, within=240, time_limit="10")
    _finish(slurm_cluster, job, tmp_path, name, timeout=420)
    assert int(slurm_cluster.job(job)["Restarts"]) == 1
    *before, last = _records(out)
    assert last["status"] == "done" and last["restart"] == "1", last
    events = [e for e in last["events"] if e not in ("exchange", "round_abandoned", "stopping")]
    assert last["epochs"] == 8 and events[-1] == "resumed" and last["accuracy"] > 0.8, last
    # The master always ends as preempted: with `scontrol requeue` the workers get SIGTERM too and may stop their
    # round before the master's own signal arrives, and it waits for that signal before calling them failed
    # (training/preemption.py; before, this test's master died of its signal about half of the time).
    [first] = before
    assert first["status"] == "preempted" and first["requeued"] == (how != "scontrol requeue"), first
    if how == "time limit":  # the warning, well before the limit ended the job
        # Stopped by the warning (SIGUSR1), not ended by the limit: the master saved, and the job was requeued.
        assert first["preempted"].startswith("SIGUSR1: training stopped after"), first
    # The preemption's own checkpoint, every time: the workers signalled with SIGTERM drain (ddlf.worker.drain)
    # and answer for the last merged round (before, they exited and the run fell back to its last epoch).
    assert "no new checkpoint" not in first["preempted"], first
    assert events[-2:] == ["preempted", "resumed"], last
    # At most the round in flight is lost (2 workers x 5 batches x 64 rows), nothing trained twice.
    assert 8 * ROWS - 2 * 5 * 64 <= last["samples"] <= 8 * ROWS, last


def test_a_time_limit_warning_before_train_is_kept_and_the_job_requeued_from_its_start(
    slurm_cluster: slurm.SlurmCluster, tmp_path: Path
) -> None:
    """Slurm's warning (SIGUSR1) may come while the script still loads its data: its default action ended the
    master there, with nothing saved and the job not requeued. Cluster.from_slurm keeps it for train()."""
    ckpt = tmp_path / "ckpt"
    job, out = _submit(
        slurm_cluster,
        tmp_path,
        "early",
        ["--nodes=2", "--ntasks-per-node=1"],
        EPOCHS="2",
        EVERY="5",
        CKPT=str(ckpt),
        BEFORE_TRAIN="10",
    )
    started = Path(str(out) + ".started")
    deadline = time.monotonic() + 180
    while not started.exists() and time.monotonic() < deadline:
        time.sleep(0.2)
    assert started.exists(), "the job's master did not start its workers"
    done = slurm_cluster.client(["scancel", "--batch", "--signal=USR1", str(job)])
    assert done.returncode == 0, done.stderr
    _start_again_at_once(slurm_cluster, job)
    _finish(slurm_cluster, job, tmp_path, "early", timeout=420)
    assert int(slurm_cluster.job(job)["Restarts"]) == 1
    first, last = _records(out)
    assert first["status"] == "preempted" and first["requeued"], first
    assert first["preempted"].startswith("SIGUSR1: training stopped after 0 epochs and 0 rows"), first
    assert last["status"] == "done" and last["restart"] == "1" and last["epochs"] == 2, last
    assert last["events"][-2:] == ["preempted", "resumed"], last
    # The first run stopped before its first round, with a checkpoint of where it started: the requeued run
    # trains the 2 epochs, nothing twice.
    assert last["samples"] == 2 * ROWS, last


def test_ddlf_up_slurm_serves_several_scripts_in_one_allocation(
    slurm_cluster: slurm.SlurmCluster, tmp_path: Path
) -> None:
    """`ddlf up --slurm cluster.toml` inside an allocation: workers for scripts that connect with from_config, kept
    between them (a variable set by one script is read by the next), stopped by SIGTERM."""
    py = sys.executable
    connect = f"import ddlf, socket; c = ddlf.Cluster.from_config('{tmp_path}/cluster.toml')"
    script = f"""#!/bin/bash
{py} -m ddlf.cli up --slurm {tmp_path}/cluster.toml > {tmp_path}/up.log 2>&1 &
up=$!
for _ in $(seq 240); do [ -f {tmp_path}/cluster.toml ] && break; sleep 0.5; done
{py} -c "{connect}; c.set('x', 41); print(sorted(c.run(socket.gethostname)))"
{py} -c "{connect}; print(c.get('x'))"
kill -TERM $up
wait $up
echo "up exited $?"
"""
    (tmp_path / "job.sh").write_text(script)
    job = slurm_cluster.sbatch(
        [
            "--nodes=2",
            "--ntasks-per-node=1",
            "--cpus-per-task=1",
            f"--output={tmp_path}/job.log",
            str(tmp_path / "job.sh"),
        ],
        cwd=tmp_path,
        env={"PATH": os.path.dirname(py) + ":" + os.environ["PATH"], "DDLF_RUN_DIR": str(tmp_path / "run")},
    )
    state = slurm_cluster.wait_job(job, 300)
    log = (tmp_path / "job.log").read_text()
    assert state == "COMPLETED", log + (tmp_path / "up.log").read_text()
    assert log.splitlines()[-3:] == ["['node0', 'node1']", "[41, 41]", "up exited 0"], log
    token = Path(str(tmp_path / "cluster.token"))
    assert oct(token.stat().st_mode & 0o777) == "0o600"
    assert "workers in" in (tmp_path / "up.log").read_text()
