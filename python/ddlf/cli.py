"""The ``ddlf`` command: ``ddlf worker`` (the daemon), ``ddlf status`` (a table of workers), ``ddlf logs`` (a
worker's recent log lines), ``ddlf up`` / ``ddlf down`` (start / stop a cluster.toml's workers over SSH),
``ddlf demo`` (the README's local MNIST run) and ``ddlf bench`` (the benchmarks)."""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from collections.abc import Sequence
from typing import Any

from . import config as cluster_config
from .errors import DdlfError


def _size(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} GiB"


def _status_rows(addresses: list[str], kw: dict[str, Any], timeout: float) -> list[dict[str, Any]]:
    """One row per address: what the daemon says about itself, or why it could not be asked. Each worker is
    asked on its own connection, so a dead one never hides (or delays) the others."""
    from .cluster import Cluster
    from .datasets import _remote_describe

    rows: list[dict[str, Any]] = []
    for i, address in enumerate(addresses):
        row: dict[str, Any] = {"id": i, "address": address}
        try:
            c = Cluster([address], connect_timeout=timeout, timeout=timeout, **kw)
        except DdlfError as exc:
            row["error"] = getattr(exc, "reason", None) or str(exc)
            rows.append(row)
            continue
        try:
            st = c.status(timeout=timeout)[0]
            row.update(st)
            if st["running"]:
                row["contents"] = f"busy: {st['running']}"  # its Python is taken; do not queue behind it
            else:
                v, f, d = c.variables()[0], c.functions()[0], c.call(_remote_describe)[0]
                row["contents"] = f"{len(v)} vars, {len(f)} fns, " + (
                    ", ".join(f"{ds['key']} ({_size(ds['nbytes'])})" for ds in d) or "no datasets"
                )
        except DdlfError as exc:
            row["error"] = getattr(exc, "reason", None) or str(exc)
        finally:
            c.close()
        rows.append(row)
    return rows


def _table(rows: list[dict[str, Any]]) -> str:
    head = ["id", "address", "version", "uptime", "memory", "running", "contents"]
    lines = []
    for r in rows:
        if "error" in r:
            lines.append([str(r["id"]), r["address"], "-", "-", "-", "DOWN", r["error"][:70]])
            continue
        up = r["uptime_s"]
        lines.append(
            [
                str(r["id"]),
                r["address"],
                r["version"],
                f"{up / 3600:.1f} h" if up >= 3600 else f"{up:.0f} s",
                _size(r["rss_bytes"]),
                f"{r['running']} ({r['running_for_s']:.0f} s)" if r["running"] else "idle",
                r.get("contents", ""),
            ]
        )
    widths = [max(len(h), *(len(line[k]) for line in lines)) for k, h in enumerate(head)]
    fmt = "  ".join(f"{{:<{w}}}" for w in widths)
    return "\n".join([fmt.format(*head), *(fmt.format(*line) for line in lines)])


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
    rows = _status_rows(addresses, kw, args.timeout)
    print(_table(rows))
    return 1 if any("error" in r for r in rows) else 0


def _cmd_logs(args: argparse.Namespace) -> int:
    """Print each worker's last lines (headed by its address when there are several)."""
    from .cluster import Cluster

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


def _cmd_demo(args: argparse.Namespace) -> int:
    script = os.path.join(os.getcwd(), "examples", "mnist_sync.py")
    if not os.path.exists(script):
        print("ddlf demo: run it from the ddlf repository (it needs examples/ and examples/data)", file=sys.stderr)
        return 2
    return subprocess.call([sys.executable, script, *args.rest])


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``ddlf``."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["worker"]:
        from .worker import main as worker_main

        return worker_main(argv[1:])
    if argv[:1] == ["bench"]:
        from .bench.__main__ import BENCHMARKS

        if len(argv) < 2 or argv[1] not in BENCHMARKS:
            print(f"usage: ddlf bench {{{','.join(BENCHMARKS)}}} [options]", file=sys.stderr)
            return 2
        import importlib

        importlib.import_module(BENCHMARKS[argv[1]]).main(argv[2:])
        return 0
    p = argparse.ArgumentParser(prog="ddlf", description=__doc__)
    sub = p.add_subparsers(dest="command", required=True)
    sub.add_parser("worker", help="run a worker daemon (same as ddlf-worker; see ddlf worker --help)")
    st = sub.add_parser("status", help="a table of workers: version, uptime, memory, what they hold and run")
    st.add_argument("addresses", nargs="*", help="HOST:PORT of each worker")
    st.add_argument("--config", help="a cluster.toml listing the workers (and token file, TLS)")
    st.add_argument("--timeout", type=float, default=3.0, help="seconds allowed per worker (default 3)")
    lg = sub.add_parser("logs", help="a worker daemon's recent log lines (requests with their ids, errors)")
    lg.add_argument("addresses", nargs="*", help="HOST:PORT of each worker")
    lg.add_argument("--config", help="a cluster.toml listing the workers (and token file, TLS)")
    lg.add_argument("-n", "--lines", type=int, default=100, help="how many of the last lines (0: all kept)")
    lg.add_argument("--timeout", type=float, default=3.0, help="seconds allowed per worker (default 3)")
    upp = sub.add_parser("up", help="start the workers of a cluster.toml over ssh, check versions, show status")
    upp.add_argument("config", help="cluster.toml (workers, token_file, [launch] ssh settings)")
    upp.add_argument("--timeout", type=float, default=30.0, help="seconds for ssh and for workers to answer")
    dn = sub.add_parser("down", help="stop the workers of a cluster.toml")
    dn.add_argument("config", help="cluster.toml")
    dn.add_argument("--timeout", type=float, default=10.0, help="seconds allowed per worker")
    demo = sub.add_parser("demo", help="train the paper's CNN on MNIST with 2 local workers")
    demo.add_argument("rest", nargs=argparse.REMAINDER, help="options for examples/mnist_sync.py")
    sub.add_parser("bench", help="run a benchmark (ddlf bench {rpc,tensor,data,train,faults})")
    args = p.parse_args(argv)
    try:
        if args.command == "status":
            return _cmd_status(args)
        if args.command == "logs":
            return _cmd_logs(args)
        if args.command in ("up", "down"):
            from . import launch

            cfg = cluster_config.load(args.config)
            try:
                return (launch.up if args.command == "up" else launch.down)(cfg, timeout=args.timeout)
            except launch.LaunchError as exc:
                print(f"ddlf {args.command}: {exc}", file=sys.stderr)
                return 1
        return _cmd_demo(args)
    except cluster_config.ConfigError as exc:
        print(f"ddlf: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
