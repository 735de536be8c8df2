"""``ddlf up`` / ``ddlf down``: start and stop the workers of a ``cluster.toml`` over SSH.

``up`` logs into each worker's host with the system ``ssh`` (your keys, agent and ``~/.ssh/config`` apply; the
``[launch]`` table adds a user, options, the remote interpreter and daemon arguments), starts
``python -m ddlf.worker --listen HOST:PORT`` there in the background with its log in ``log_dir``, hands it the
token on standard input (never on a command line, where ``ps`` would show it), waits until every daemon
answers, checks that every one runs this master's ddlf version, and prints the status table. ``down`` asks each
daemon to shut down over the RPC connection (the token is the authority, not SSH).
"""

from __future__ import annotations

import shlex
import subprocess
import sys
import time
from typing import TextIO

from .. import __version__
from ..cluster.cluster_file import ClusterConfig
from ..errors import DdlfError, LaunchError


def _ssh_argv(cfg: ClusterConfig, host: str, command: str) -> list[str]:
    target = f"{cfg.launch.ssh_user}@{host}" if cfg.launch.ssh_user else host
    return ["ssh", "-o", "BatchMode=yes", *cfg.launch.ssh_options, target, command]


def _start_command(cfg: ClusterConfig, address: str) -> str:
    host, _, port = address.rpartition(":")
    log = f"{cfg.launch.log_dir.rstrip('/')}/ddlf-worker-{host.strip('[]')}-{port}.log"
    argv = [cfg.launch.python, "-m", "ddlf.worker", "--listen", address, *cfg.launch.worker_args]
    # The token is read in the foreground (a background job's stdin is /dev/null), then only the daemon goes to
    # the background, detached from the SSH session.
    return (
        "IFS= read -r DDLF_TOKEN || exit 3; export DDLF_TOKEN; "
        f"nohup {' '.join(shlex.quote(a) for a in argv)} > {shlex.quote(log)} 2>&1 < /dev/null & echo $!"
    )


def up(cfg: ClusterConfig, *, timeout: float = 30.0, out: TextIO = sys.stdout) -> int:
    """Start every worker of ``cfg`` on its host; returns a process exit code (0: all up, same version)."""
    from .status_table import status_rows, table

    token = cfg.token()
    if not token:
        raise LaunchError(f"{cfg.path}: ddlf up needs a token (token_file = ..., or DDLF_TOKEN)")
    started: dict[str, str] = {}
    for address in cfg.workers:
        host = address.rpartition(":")[0].strip("[]")
        try:
            done = subprocess.run(
                _ssh_argv(cfg, host, _start_command(cfg, address)),
                input=token + "\n",
                capture_output=True,
                text=True,
                timeout=timeout,
            )
        except subprocess.TimeoutExpired:
            raise LaunchError(f"{address}: ssh {host} did not return within {timeout:.0f} s") from None
        if done.returncode != 0:
            raise LaunchError(f"{address}: ssh {host} failed ({done.returncode}): {done.stderr.strip()[-500:]}")
        started[address] = done.stdout.strip().splitlines()[-1] if done.stdout.strip() else "?"
        print(f"started {address} (pid {started[address]} on {host})", file=out)
    kw = cfg.cluster_kwargs()
    for key in ("connect_timeout", "timeout"):
        kw.pop(key, None)
    deadline = time.monotonic() + timeout
    while True:
        rows = status_rows(cfg.workers, kw, 3.0)
        down = [r for r in rows if "error" in r]
        if not down or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    print(table(rows), file=out)
    if down:
        print(f"ddlf up: {len(down)} worker(s) did not come up: see their logs in {cfg.launch.log_dir}", file=out)
        return 1
    versions = {r["address"]: r["version"] for r in rows}
    wrong = {a: v for a, v in versions.items() if v != __version__}
    if wrong:
        listing = ", ".join(f"{a} runs {v}" for a, v in wrong.items())
        print(f"ddlf up: version mismatch with this master ({__version__}): {listing}", file=out)
        return 1
    print(f"ddlf up: {len(rows)} workers up, all ddlf {__version__}", file=out)
    return 0


def down(cfg: ClusterConfig, *, timeout: float = 10.0, out: TextIO = sys.stdout) -> int:
    """Ask every worker of ``cfg`` to shut down; returns 0 when all were reached."""
    from ..cluster.cluster import Cluster

    kw = cfg.cluster_kwargs()
    for key in ("connect_timeout", "timeout"):
        kw.pop(key, None)
    failed = 0
    for address in cfg.workers:
        try:
            c = Cluster([address], connect_timeout=timeout, timeout=timeout, **kw)
        except DdlfError as exc:
            print(f"{address}: not reachable ({getattr(exc, 'reason', None) or exc})", file=out)
            failed += 1
            continue
        try:
            c.shutdown(timeout=timeout)
            print(f"{address}: stopped", file=out)
        except DdlfError as exc:
            print(f"{address}: shutdown failed ({exc})", file=out)
            failed += 1
        finally:
            c.close()
    return 1 if failed else 0


def up_slurm(path: str, *, timeout: float = 120.0, out: TextIO = sys.stdout) -> int:
    """``ddlf up --slurm cluster.toml``: inside a Slurm allocation, start a worker per task with ``srun``
    (:class:`ddlf.cluster.slurm.SlurmWorkers`), write ``cluster.toml`` (and the job's token beside it, mode 0600)
    for scripts that connect with ``Cluster.from_config``, and keep the workers until SIGTERM or Ctrl-C."""
    import os
    import signal
    from pathlib import Path

    from ..cluster.cluster import Cluster
    from ..cluster.slurm import SlurmWorkers
    from .status_table import status_rows, table

    target = Path(path).resolve()
    workers = SlurmWorkers(start_timeout=timeout)
    try:
        token_file = target.with_name(target.stem + ".token")
        fd = os.open(token_file, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(workers.token + "\n")
        listed = ", ".join(f'"{a}"' for a in workers.addresses)
        tmp = target.with_name(f".{target.name}.tmp")
        tmp.write_text(
            f"# written by `ddlf up --slurm` for Slurm job {workers.alloc.job_id}\n"
            f'workers = [{listed}]\ntoken_file = "{token_file}"\n'
        )
        os.replace(tmp, target)
        print(table(status_rows(workers.addresses, {"token": workers.token}, 5.0)), file=out)
        print(f"ddlf up --slurm: {len(workers.addresses)} workers in {target}; Ctrl-C or SIGTERM stops them", file=out)
        out.flush()
        signal.signal(signal.SIGTERM, _stop)
        try:
            while workers.process is not None and workers.process.poll() is None:
                time.sleep(0.5)
            print("ddlf up --slurm: the workers' step ended", file=sys.stderr)
            return 1
        except KeyboardInterrupt:
            with Cluster(workers.addresses, workers.token, _local=workers):
                pass  # closing it shuts the daemons down and ends the step
            return 0
    finally:
        workers.terminate()


def _stop(signum: int, frame: object) -> None:
    """SIGTERM ends ``ddlf up --slurm`` as Ctrl-C does: the workers are shut down."""
    raise KeyboardInterrupt
