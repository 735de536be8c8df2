"""The ``ddlf`` command: ``ddlf worker`` (the daemon), ``ddlf status`` (a table of workers), ``ddlf logs`` (a
worker's recent log lines), ``ddlf stacks`` (every worker's Python stacks), ``ddlf reset`` (workers back to their
starting state), ``ddlf up`` / ``ddlf down`` (start / stop a cluster.toml's workers over SSH), ``ddlf demo`` (the
README's local MNIST run). The benchmarks run from a checkout: ``python -m benchmarks NAME``."""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from collections.abc import Sequence
from typing import Any

from ..cluster import cluster_file as cluster_config
from ..errors import DdlfError
from .status_table import status_rows, table


def _targets(args: argparse.Namespace, command: str) -> tuple[list[str], dict[str, Any]] | None:
    """Worker addresses and connection settings from the command line and/or ``--config``."""
    if args.config:
        cfg = cluster_config.load(args.config)
        addresses = cfg.workers + list(args.addresses)
        kw = cfg.cluster_kwargs()
        for key in ("connect_timeout", "timeout"):
            kw.pop(key, None)
        return addresses, kw
    if not args.addresses:
        print(f"ddlf {command}: give worker addresses or --config cluster.toml", file=sys.stderr)
        return None
    return list(args.addresses), {"token": os.environ.get("DDLF_TOKEN") or None}


def _cmd_status(args: argparse.Namespace) -> int:
    found = _targets(args, "status")
    if found is None:
        return 2
    addresses, kw = found
    rows = status_rows(addresses, kw, args.timeout)
    print(table(rows))
    return 1 if any("error" in r for r in rows) else 0


def _cmd_logs(args: argparse.Namespace) -> int:
    """Print each worker's last lines (headed by its address when there are several)."""
    from ..cluster.cluster import Cluster

    if args.lines < 0:
        print(f"ddlf logs: -n must be 0 (all) or more, not {args.lines}", file=sys.stderr)
        return 2
    found = _targets(args, "logs")
    if found is None:
        return 2
    addresses, kw = found
    failed = False
    for address in addresses:
        if len(addresses) > 1:
            print(f"==> {address} <==")
        try:
            with Cluster([address], connect_timeout=args.timeout, timeout=args.timeout, **kw) as c:
                print("\n".join(c.logs(0, args.lines, timeout=args.timeout)))
        except DdlfError as exc:
            print(f"ddlf logs: {address}: {getattr(exc, 'reason', None) or exc}", file=sys.stderr)
            failed = True
    return 1 if failed else 0


def format_stacks(report: dict[str, Any]) -> str:
    """One worker's answer to ``ddlf stacks`` as text: a header line, what its interpreter thread serves, then
    every Python thread's stack."""
    who = report.get("name") or report["address"]
    head = f"==> {who} ({report['address']}, {report['hostname']}, pid {report['pid']}) <=="
    running = report.get("running")
    serving = f"serving {running} for {report['running_for_s']:.1f} s" if running else "idle"
    serving += f"; {report['queue_depth']} queued"
    if report.get("runs"):
        serving += "; runs: " + ", ".join(report["runs"])
    for call in report.get("collectives") or []:
        serving += f"\ncollective: {call}"
    body = report.get("python") or f"(no Python stacks: {report.get('error')})"
    return f"{head}\n{serving}\n{body.rstrip()}"


def _cmd_stacks(args: argparse.Namespace) -> int:
    """Print every worker's Python stacks (all threads) and what its interpreter thread serves."""
    from ..cluster.cluster import Cluster

    found = _targets(args, "stacks")
    if found is None:
        return 2
    addresses, kw = found
    failed = False
    for address in addresses:  # one connection each: a worker that does not answer does not hide the others
        try:
            with Cluster([address], connect_timeout=args.timeout, timeout=args.timeout, **kw) as c:
                print(format_stacks(c.stacks(timeout=args.timeout)[0]))
        except DdlfError as exc:
            print(f"ddlf stacks: {address}: {getattr(exc, 'reason', None) or exc}", file=sys.stderr)
            failed = True
        sys.stdout.flush()
    return 1 if failed else 0


def _cmd_reset(args: argparse.Namespace) -> int:
    """Reset every worker (``Cluster.reset``): print what each dropped."""
    from ..cluster.cluster import Cluster

    found = _targets(args, "reset")
    if found is None:
        return 2
    addresses, kw = found
    try:
        with Cluster(addresses, timeout=args.timeout, **kw) as cluster:
            dropped = cluster.reset(force=args.force)
    except DdlfError as exc:
        print(f"ddlf reset: {exc}", file=sys.stderr)
        return 1
    for address, d in zip(addresses, dropped):
        training = d.get("training") or {}
        print(
            f"{address}: reset ({len(training.get('runs', []))} runs torn down, {training.get('warm_models', 0)} "
            f"warm models, {len(d.get('datasets', []))} datasets, {len(d.get('modules', []))} modules, "
            f"{d.get('variables', 0)} variables, {d.get('functions', 0)} functions dropped)"
        )
    return 0


def _cmd_demo(rest: list[str]) -> int:
    script = os.path.join(os.getcwd(), "examples", "mnist_sync.py")
    if not os.path.exists(script):
        print("ddlf demo: run it from the ddlf repository (it needs examples/ and examples/data)", file=sys.stderr)
        return 2
    return subprocess.call([sys.executable, script, *(rest[1:] if rest[:1] == ["--"] else rest)])


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``ddlf``."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["worker"]:
        from ..worker.main import run as run_worker

        run_worker(argv[1:], prog="ddlf worker")
    if argv[:1] == ["demo"]:  # every option is the example's (argparse's REMAINDER drops those after a subcommand)
        return _cmd_demo(argv[1:])
    p = argparse.ArgumentParser(prog="ddlf", description=__doc__)
    sub = p.add_subparsers(dest="command", required=True)
    sub.add_parser("worker", help="run a worker daemon (same as ddlf-worker; see ddlf worker --help)")
    st = sub.add_parser("status", help="a table of workers: version, uptime, memory, what they hold and run")
    st.add_argument("addresses", nargs="*", help="HOST:PORT of each worker (the token: DDLF_TOKEN)")
    st.add_argument("--config", help="a cluster.toml listing the workers (and token file, TLS)")
    st.add_argument("--timeout", type=float, default=3.0, help="seconds allowed per worker (default 3)")
    lg = sub.add_parser("logs", help="a worker daemon's recent log lines (requests with their ids, errors)")
    lg.add_argument("addresses", nargs="*", help="HOST:PORT of each worker (the token: DDLF_TOKEN)")
    lg.add_argument("--config", help="a cluster.toml listing the workers (and token file, TLS)")
    lg.add_argument("-n", "--lines", type=int, default=100, help="how many of the last lines (0: all kept)")
    lg.add_argument("--timeout", type=float, default=3.0, help="seconds allowed per worker (default 3)")
    sk = sub.add_parser(
        "stacks", help="every worker's Python stacks (all threads) and what it serves, even when it is stuck"
    )
    sk.add_argument("addresses", nargs="*", help="HOST:PORT of each worker (the token: DDLF_TOKEN)")
    sk.add_argument("--config", help="a cluster.toml listing the workers (and token file, TLS)")
    sk.add_argument("--timeout", type=float, default=2.0, help="seconds allowed per worker (default 2)")
    rs = sub.add_parser(
        "reset", help="every worker back to the state it started in (runs, datasets, modules, variables), no restart"
    )
    rs.add_argument("addresses", nargs="*", help="HOST:PORT of each worker (the token: DDLF_TOKEN)")
    rs.add_argument("--config", help="a cluster.toml listing the workers (and token file, TLS)")
    rs.add_argument("--force", action="store_true", help="tear down the training runs they serve too")
    rs.add_argument("--timeout", type=float, default=60.0, help="seconds allowed per worker (default 60)")
    upp = sub.add_parser("up", help="start the workers of a cluster.toml over ssh, check versions, show status")
    upp.add_argument("config", help="cluster.toml (workers, token_file, [launch] ssh settings); written with --slurm")
    upp.add_argument(
        "--slurm",
        action="store_true",
        help="inside a Slurm allocation: start a worker per task with srun, write the cluster.toml and keep the "
        "workers until stopped (Ctrl-C, SIGTERM)",
    )
    upp.add_argument("--timeout", type=float, default=30.0, help="seconds for ssh and for workers to answer")
    dn = sub.add_parser("down", help="stop the workers of a cluster.toml")
    dn.add_argument("config", help="cluster.toml")
    dn.add_argument("--timeout", type=float, default=10.0, help="seconds allowed per worker")
    demo = sub.add_parser("demo", help="train the paper's CNN on MNIST with 2 local workers")
    demo.add_argument("rest", nargs=argparse.REMAINDER, help="options for examples/mnist_sync.py")
    args = p.parse_args(argv)
    try:
        if args.command == "status":
            return _cmd_status(args)
        if args.command == "logs":
            return _cmd_logs(args)
        if args.command == "stacks":
            return _cmd_stacks(args)
        if args.command == "reset":
            return _cmd_reset(args)
        if args.command == "up" and args.slurm:
            from . import launch

            try:
                return launch.up_slurm(args.config, timeout=max(args.timeout, 120.0))
            except DdlfError as exc:
                print(f"ddlf up --slurm: {exc}", file=sys.stderr)
                return 1
        if args.command in ("up", "down"):
            from . import launch

            cfg = cluster_config.load(args.config)
            try:
                return (launch.up if args.command == "up" else launch.down)(cfg, timeout=args.timeout)
            except launch.LaunchError as exc:
                print(f"ddlf {args.command}: {exc}", file=sys.stderr)
                return 1
        return _cmd_demo(args.rest)
    except cluster_config.ConfigError as exc:
        print(f"ddlf: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
