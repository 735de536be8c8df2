"""A real Slurm cluster on one machine: ``slurmctld`` and one ``slurmd`` per host, each in its own network namespace.

Built on :class:`benchmarks.netns.VirtualNetwork`: the controller runs in the network's master namespace
(``ctl``, 10.77.0.2), host ``i`` runs ``slurmd -N node<i>`` at 10.77.0.(11+i). Each daemon also has its own UTS
namespace, so ``hostname`` on a node says ``node<i>``, and its own ``/etc/hosts`` (``ip netns exec`` mounts
``/etc/netns/<ns>/hosts`` over it), so node names resolve on every node as on a real cluster. A private ``munged``
authenticates them (its socket is a file: reachable from every namespace). Nothing is installed or changed
outside the run's directory and ``/etc/netns/<its namespaces>``; :meth:`SlurmCluster.close` removes both and stops
every daemon, jobs included.

Clients (``sbatch``, ``squeue``, ``scontrol``) run in the controller's namespace with ``SLURM_CONF`` pointing at
the run's ``slurm.conf`` (:meth:`SlurmCluster.client`). Jobs run as root, on the shared file system.

Needs root, iproute2, ``unshare`` and Debian's ``slurmctld``, ``slurmd``, ``slurm-client`` and ``munge``
(``scripts/install-system.sh``); :func:`available` says whether this machine can.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import time
from pathlib import Path
from typing import Any

from . import netns

BINARIES = ("slurmctld", "slurmd", "sbatch", "squeue", "scontrol", "munged")


def _which(name: str) -> str | None:
    return shutil.which(name) or next(
        (p for p in (f"/usr/sbin/{name}", f"/usr/bin/{name}") if os.access(p, os.X_OK)), None
    )


def available() -> tuple[bool, str]:
    """Whether a Slurm cluster can be built here, and why not."""
    ok, why = netns.available()
    if not ok:
        return ok, why
    missing = [b for b in BINARIES if _which(b) is None]
    if missing:
        return False, f"Slurm is not installed (missing {', '.join(missing)}): scripts/install-system.sh installs it"
    if _which("unshare") is None:
        return False, "unshare (util-linux) is not installed"
    return True, ""


class SlurmCluster:
    """``nodes`` Slurm nodes with ``cpus`` CPUs each, in a directory of their own. Use as a context manager."""

    def __init__(self, work: str | os.PathLike[str], nodes: int = 2, cpus: int = 2, kill_wait: int = 30) -> None:
        self.work = Path(work).resolve()
        self.net = netns.VirtualNetwork(nodes)
        self.nodes = [f"node{i}" for i in range(nodes)]
        self.cpus = cpus
        self.kill_wait = kill_wait
        self.conf = self.work / "slurm.conf"
        self._munged: subprocess.Popen[Any] | None = None
        self._etc: list[Path] = []

    # -- life cycle -------------------------------------------------------------------------------------

    def __enter__(self) -> SlurmCluster:
        try:
            self.start()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def start(self, timeout: float = 60.0) -> None:
        self.work.mkdir(parents=True, exist_ok=True)
        os.chmod(self.work, 0o755)  # munged refuses a socket directory others can write to
        for sub in ("state", "spool", "log", "munge"):
            (self.work / sub).mkdir(exist_ok=True)
        self.net.build()
        self._start_munge()
        self._write_config()
        self._write_hosts()
        ctl = self.net.master
        self._daemon(ctl, "ctl", ["slurmctld", "-D", "-i", "-f", str(self.conf)], "slurmctld")
        for name, host in zip(self.nodes, self.net.hosts):
            self._daemon(host, name, ["slurmd", "-D", "-N", name, "-f", str(self.conf)], f"slurmd-{name}")
        self.wait_idle(timeout)

    def close(self) -> None:
        """Stop the daemons (and every job process: they live in the namespaces), remove the namespaces' files."""
        self.net.close()
        if self._munged is not None and self._munged.poll() is None:
            self._munged.terminate()
            with contextlib.suppress(subprocess.TimeoutExpired):
                self._munged.wait(5)
            if self._munged.poll() is None:
                self._munged.kill()
        for d in self._etc:
            shutil.rmtree(d, ignore_errors=True)
        self._etc.clear()

    # -- using it --------------------------------------------------------------------------------------

    def client(self, argv: list[str], timeout: float = 60, **kwargs: Any) -> subprocess.CompletedProcess[str]:
        """Run a Slurm client command (``sbatch``, ``scontrol``, ...) in the controller's namespace."""
        env = {**os.environ, "SLURM_CONF": str(self.conf), **kwargs.pop("env", {})}
        return self.net.run(self.net.master, argv, timeout=timeout, env=env, **kwargs)

    def sbatch(self, argv: list[str], cwd: str | os.PathLike[str], env: dict[str, str] | None = None) -> int:
        """Submit a batch job; returns its id."""
        done = self.client(["sbatch", "--parsable", *argv], cwd=str(cwd), env=env or {})
        if done.returncode != 0:
            raise RuntimeError(f"sbatch failed: {done.stderr.strip()}")
        return int(done.stdout.strip().split(";")[0])

    def job(self, job_id: int) -> dict[str, str]:
        """``scontrol show job``'s fields (JobState, Restarts, ExitCode, NodeList, ...)."""
        out = self.client(["scontrol", "-o", "show", "job", str(job_id)]).stdout
        fields: dict[str, str] = {}
        for part in out.split():
            key, _, value = part.partition("=")
            fields.setdefault(key, value)
        return fields

    def wait_job(self, job_id: int, timeout: float, until: tuple[str, ...] = ("COMPLETED", "FAILED")) -> str:
        """Wait until the job reaches a state in ``until`` (or any end state); returns the state."""
        ends = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "PREEMPTED", *until}
        deadline = time.monotonic() + timeout
        state = ""
        while time.monotonic() < deadline:
            state = self.job(job_id).get("JobState", "")
            if state in ends:
                return state
            time.sleep(0.5)
        raise TimeoutError(f"job {job_id} still {state or 'unknown'} after {timeout:.0f} s\n{self.logs()}")

    def wait_idle(self, timeout: float) -> None:
        """Wait until every node is up and idle."""
        deadline = time.monotonic() + timeout
        out = ""
        while time.monotonic() < deadline:
            done = self.client(["sinfo", "-h", "-N", "-o", "%N %t"])
            out = done.stdout
            states = dict(line.split() for line in out.splitlines() if line.strip())
            if len(states) == len(self.nodes) and all(s == "idle" for s in states.values()):
                return
            time.sleep(0.5)
        raise TimeoutError(f"Slurm nodes not idle after {timeout:.0f} s: {out.strip()!r}\n{self.logs()}")

    def logs(self, tail: int = 30) -> str:
        """The daemons' last log lines, for failure messages."""
        parts = []
        for f in sorted((self.work / "log").glob("*.log")):
            lines = f.read_text(errors="replace").splitlines()[-tail:]
            parts.append(f"--- {f.name}\n" + "\n".join(lines))
        return "\n".join(parts)

    # -- building it -----------------------------------------------------------------------------------

    def _start_munge(self) -> None:
        m = self.work / "munge"
        key = m / "munge.key"
        key.write_bytes(os.urandom(1024))
        os.chmod(key, 0o400)
        os.chmod(m, 0o700)
        self.munge_socket = m / "munge.socket"
        self._munged = subprocess.Popen(
            [
                _which("munged") or "munged",
                "--foreground",
                "--force",
                f"--socket={self.munge_socket}",
                f"--key-file={key}",
                f"--pid-file={m / 'munged.pid'}",
                f"--log-file={self.work / 'log' / 'munged.log'}",
                f"--seed-file={m / 'munged.seed'}",
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        deadline = time.monotonic() + 10
        while not self.munge_socket.exists():
            if self._munged.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"munged did not start:\n{self.logs()}")
            time.sleep(0.05)

    def _write_config(self) -> None:
        w = self.work
        lines = [
            "ClusterName=ddlftest",
            f"SlurmctldHost=ctl({self.net.master.ip})",
            "SlurmUser=root",
            "SlurmdUser=root",
            "AuthType=auth/munge",
            "CredType=cred/munge",
            f"AuthInfo=socket={self.munge_socket}",
            f"StateSaveLocation={w / 'state'}",
            f"SlurmdSpoolDir={w / 'spool'}/%n",
            f"SlurmctldPidFile={w / 'slurmctld.pid'}",
            f"SlurmdPidFile={w / 'spool'}/slurmd-%n.pid",
            f"SlurmctldLogFile={w / 'log' / 'slurmctld.log'}",
            f"SlurmdLogFile={w / 'log'}/slurmd-%n.log",
            "SlurmctldPort=6817",
            "SlurmdPort=6818",
            "ProctrackType=proctrack/linuxproc",
            "TaskPlugin=task/none",
            "JobAcctGatherType=jobacct_gather/none",
            "AccountingStorageType=accounting_storage/none",
            "JobCompType=jobcomp/none",
            "SelectType=select/cons_tres",
            "SelectTypeParameters=CR_CPU",
            "SchedulerType=sched/backfill",
            "SlurmdParameters=config_overrides",
            "MpiDefault=none",
            "ReturnToService=2",
            "JobRequeue=1",
            f"KillWait={self.kill_wait}",
            "MinJobAge=300",
            "InactiveLimit=0",
            "SlurmctldTimeout=30",
            "SlurmdTimeout=30",
            "Waittime=0",
            "SchedulerParameters=sched_interval=1,defer_batch=0",
            "MessageTimeout=20",
        ]
        for name, host in zip(self.nodes, self.net.hosts):
            lines.append(f"NodeName={name} NodeAddr={host.ip} NodeHostname={name} CPUs={self.cpus} State=UNKNOWN")
        lines.append(f"PartitionName=test Nodes={','.join(self.nodes)} Default=YES MaxTime=INFINITE State=UP")
        self.conf.write_text("\n".join(lines) + "\n")
        for name in self.nodes:
            (w / "spool" / name).mkdir(exist_ok=True)

    def _write_hosts(self) -> None:
        names = [f"{self.net.master.ip} ctl"] + [f"{h.ip} {n}" for n, h in zip(self.nodes, self.net.hosts)]
        text = "127.0.0.1 localhost\n" + "\n".join(names) + "\n"
        for host, own in [(self.net.master, "ctl"), *zip(self.net.hosts, self.nodes)]:
            d = Path("/etc/netns") / host.ns
            d.mkdir(parents=True, exist_ok=True)
            (d / "hosts").write_text(text)
            (d / "hostname").write_text(own + "\n")
            self._etc.append(d)

    def _daemon(self, host: netns.Host, hostname: str, argv: list[str], log: str) -> None:
        # Its own UTS namespace: `hostname` on this node says its Slurm name (slurmctld checks SlurmctldHost).
        # `ip netns exec` mounted a sysfs of the namespace's own over /sys, without the cgroup hierarchies slurmd
        # looks for at start (it uses none of them: proctrack/linuxproc, task/none): a v1 hierarchy is mounted.
        script = (
            "mount -t tmpfs cgroup_root /sys/fs/cgroup && mkdir /sys/fs/cgroup/freezer /sys/fs/cgroup/systemd && "
            "mount -t cgroup -o freezer cgroup /sys/fs/cgroup/freezer && "
            "mount -t cgroup -o none,name=systemd cgroup /sys/fs/cgroup/systemd; "
            f"hostname {hostname} && exec {' '.join(argv)}"
        )
        out = open(self.work / "log" / f"{log}.out", "w")  # noqa: SIM115 - the process keeps it
        self.net.popen(
            host,
            ["unshare", "--uts", "sh", "-c", script],
            stdout=out,
            stderr=subprocess.STDOUT,
            env={**os.environ, "SLURM_CONF": str(self.conf)},
        )
