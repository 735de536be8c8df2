"""Workers for the Slurm allocation a script runs in: ``Cluster.from_slurm()`` and ``ddlf up --slurm``.

Inside an allocation (``sbatch``, ``salloc``) the master starts one worker daemon per task (or per GPU) with a
single ``srun`` step, never SSH. Each worker binds a free port and enlists through :mod:`ddlf.rendezvous` with the
job's token: a fresh random token per job, handed to the workers in ``srun``'s environment (readable by the job's
user and root only, never written to a shared file). The step's output goes to one log per worker under the run
directory (``DDLF_RUN_DIR``, default ``./ddlf-<job id>``). Closing the cluster stops the daemons and the step.
"""

from __future__ import annotations

import os
import re
import secrets
import shutil
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from ..errors import ConfigError, LaunchError
from ..rendezvous import Enlisted, Rendezvous

#: The environment variables a worker started by :class:`SlurmWorkers` reads (see ``ddlf.worker.main``).
RENDEZVOUS_ENV = "DDLF_RENDEZVOUS"


@dataclass(frozen=True)
class SlurmAllocation:
    """What Slurm says about the job this process runs in (its ``SLURM_*`` environment)."""

    job_id: str
    nodes: tuple[str, ...]
    tasks_per_node: tuple[int, ...]
    cpus_per_task: int | None = None
    gpus_per_node: int | None = None
    restart_count: int = 0

    @property
    def ntasks(self) -> int:
        return sum(self.tasks_per_node)

    @classmethod
    def from_environ(cls, env: Mapping[str, str] | None = None) -> SlurmAllocation:
        """Read the allocation; :class:`~ddlf.errors.LaunchError` outside one, naming what is missing."""
        env = os.environ if env is None else env
        job = env.get("SLURM_JOB_ID") or env.get("SLURM_JOBID")
        if not job:
            raise LaunchError(
                "not inside a Slurm allocation (no SLURM_JOB_ID): run the script with sbatch, or under salloc"
            )
        nodelist = env.get("SLURM_JOB_NODELIST") or env.get("SLURM_NODELIST") or ""
        nodes = tuple(expand_nodelist(nodelist))
        if not nodes:
            raise LaunchError(f"Slurm job {job}: SLURM_JOB_NODELIST is empty or missing")
        tasks = env.get("SLURM_TASKS_PER_NODE")
        if tasks:
            per_node = tuple(expand_counts(tasks))
        elif env.get("SLURM_NTASKS_PER_NODE"):
            per_node = (int(env["SLURM_NTASKS_PER_NODE"]),) * len(nodes)
        else:
            per_node = (1,) * len(nodes)
        if len(per_node) != len(nodes):
            raise LaunchError(
                f"Slurm job {job}: SLURM_TASKS_PER_NODE={tasks!r} gives {len(per_node)} nodes, "
                f"SLURM_JOB_NODELIST={nodelist!r} {len(nodes)}"
            )
        cpus = env.get("SLURM_CPUS_PER_TASK")
        gpus = env.get("SLURM_GPUS_ON_NODE") or env.get("SLURM_GPUS_PER_NODE")
        gpus_n = int(gpus.split(":")[-1]) if gpus and gpus.split(":")[-1].isdigit() else None
        return cls(
            job_id=job,
            nodes=nodes,
            tasks_per_node=per_node,
            cpus_per_task=int(cpus) if cpus and cpus.isdigit() else None,
            gpus_per_node=gpus_n,
            restart_count=int(env.get("SLURM_RESTART_COUNT", "0") or 0),
        )


def expand_nodelist(text: str) -> list[str]:
    """``node[01-03,7],gpu5`` -> ``['node01', 'node02', 'node03', 'node7', 'gpu5']`` (Slurm's host list syntax,
    as ``scontrol show hostnames`` expands it, zero padding kept)."""
    names: list[str] = []
    for item in re.findall(r"[^,\[]+(?:\[[^\]]*\][^,\[]*)*", text.strip()):
        parts = re.split(r"(\[[^\]]*\])", item)
        expansions = [""]
        for part in parts:
            if part.startswith("["):
                choices = []
                for piece in part[1:-1].split(","):
                    lo, _, hi = piece.partition("-")
                    if not lo.isdigit() or (hi and not hi.isdigit()):
                        raise LaunchError(f"cannot read the Slurm node list {text!r} at {piece!r}")
                    if hi:
                        if int(hi) < int(lo):
                            raise LaunchError(f"cannot read the Slurm node list {text!r}: range {piece!r} runs down")
                        choices += [str(i).zfill(len(lo)) for i in range(int(lo), int(hi) + 1)]
                    else:
                        choices.append(lo)
                expansions = [e + c for e in expansions for c in choices]
            else:
                expansions = [e + part for e in expansions]
        names += [e for e in expansions if e]
    return names


def expand_counts(text: str) -> list[int]:
    """``2(x3),1`` -> ``[2, 2, 2, 1]`` (``SLURM_TASKS_PER_NODE``'s syntax)."""
    counts: list[int] = []
    for piece in text.split(","):
        m = re.fullmatch(r"\s*(\d+)(?:\(x(\d+)\))?\s*", piece)
        if m is None:
            raise LaunchError(f"cannot read SLURM_TASKS_PER_NODE={text!r} at {piece!r}")
        counts += [int(m.group(1))] * int(m.group(2) or 1)
    return counts


def srun_command(
    alloc: SlurmAllocation,
    *,
    per: str = "task",
    python: str | None = None,
    log_dir: str | os.PathLike[str] | None = None,
    worker_args: Sequence[str] = (),
) -> list[str]:
    """The ``srun`` command line that starts the workers (one per task, or one per GPU with ``per="gpu"``)."""
    if per not in ("task", "gpu"):
        raise ConfigError(f"per must be 'task' or 'gpu', not {per!r}")
    cmd = ["srun", "--kill-on-bad-exit=0", "--wait=0", f"--job-name=ddlf-workers-{alloc.job_id}"]
    if per == "gpu":
        if not alloc.gpus_per_node:
            raise LaunchError(
                f"Slurm job {alloc.job_id} has no GPUs (SLURM_GPUS_ON_NODE unset): ask for them with --gpus-per-node, "
                "or start one worker per task (per='task')"
            )
        cmd += [
            f"--nodes={len(alloc.nodes)}",
            f"--ntasks={alloc.gpus_per_node * len(alloc.nodes)}",
            f"--ntasks-per-node={alloc.gpus_per_node}",
            "--gpus-per-task=1",
        ]
    else:
        cmd += [f"--nodes={len(alloc.nodes)}", f"--ntasks={alloc.ntasks}"]
    if alloc.cpus_per_task:
        cmd.append(f"--cpus-per-task={alloc.cpus_per_task}")
    if log_dir is not None:
        cmd.append(f"--output={os.path.join(os.fspath(log_dir), 'worker-%N-%t.log')}")
    cmd += [python or sys.executable, "-m", "ddlf.worker", "--listen", "0.0.0.0:0"]
    if alloc.cpus_per_task:
        cmd += ["--threads", str(alloc.cpus_per_task)]
    return cmd + list(worker_args)


class SlurmWorkers:
    """The worker daemons of one ``srun`` step, enlisted and owned by this process (``Cluster.from_slurm``)."""

    exit_grace = 20.0
    """Seconds the step gets to end after its daemons were asked to shut down (each exits its interpreter and
    frameworks; srun then reports) before :meth:`terminate` ends it."""

    def __init__(
        self,
        alloc: SlurmAllocation | None = None,
        *,
        per: str = "task",
        python: str | None = None,
        start_timeout: float = 120.0,
        worker_args: Sequence[str] = (),
        run_dir: str | os.PathLike[str] | None = None,
        token: str | None = None,
    ) -> None:
        self.alloc = alloc or SlurmAllocation.from_environ()
        if shutil.which("srun") is None:
            raise LaunchError("srun is not on PATH: Cluster.from_slurm runs inside a Slurm allocation")
        self.run_dir = Path(run_dir or os.environ.get("DDLF_RUN_DIR") or f"ddlf-{self.alloc.job_id}").resolve()
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.token = token or secrets.token_urlsafe(24)
        self.process: subprocess.Popen[bytes] | None = None
        self.workers: list[Enlisted] = []
        cmd = srun_command(self.alloc, per=per, python=python, log_dir=self.run_dir, worker_args=worker_args)
        with Rendezvous(self.token) as rendezvous:
            env = dict(os.environ)
            env["DDLF_TOKEN"] = self.token
            env[RENDEZVOUS_ENV] = str(rendezvous.port)
            env.setdefault("DDLF_LOG", "warn")
            n = int(next(a.split("=", 1)[1] for a in cmd if a.startswith("--ntasks=")))
            # Its own session: a Ctrl-C meant for the master reaches srun only through close() (srun would
            # otherwise take the first SIGINT as a request for the step's status, the second as a kill).
            self.process = subprocess.Popen(cmd, env=env, stdin=subprocess.DEVNULL, start_new_session=True)
            try:
                self.workers = rendezvous.wait(n, start_timeout, alive=self._ended)
            except BaseException:
                self.terminate()
                raise

    @property
    def addresses(self) -> list[str]:
        return [w.address for w in self.workers]

    def _ended(self) -> str | None:
        if self.process is None or self.process.poll() is None:
            return None
        logs = sorted(self.run_dir.glob("worker-*.log"))
        tail = logs[0].read_text(errors="replace")[-800:] if logs else ""
        return f"srun exited with status {self.process.returncode}; {logs[0] if logs else self.run_dir}: {tail}"

    def wait(self, timeout: float) -> bool:
        """Wait for the step to end on its own (after the daemons were asked to shut down); True if it did."""
        if self.process is None:
            return True
        try:
            self.process.wait(timeout)
            return True
        except subprocess.TimeoutExpired:
            return False

    def terminate(self) -> None:
        """End the step: SIGTERM to srun (which passes it to every task), SIGKILL after 10 s."""
        p = self.process
        if p is None or p.poll() is not None:
            return
        p.terminate()
        deadline = time.monotonic() + 10
        while p.poll() is None and time.monotonic() < deadline:
            time.sleep(0.1)
        if p.poll() is None:
            p.kill()
            p.wait()
