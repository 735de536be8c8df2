"""The worker daemon command: ``ddlf-worker --listen HOST:PORT``.

The network side (gRPC, heartbeats, status) runs on Rust threads; this process's main thread runs the
functions that masters push, one request at a time, in arrival order.
"""

from __future__ import annotations

import argparse
import atexit
import contextlib
import ctypes
import gc
import logging
import os
import signal
import sys
import threading
from collections.abc import Callable, Sequence
from typing import NoReturn

from .. import _ddlf
from ..errors import ConfigError, WorkerStartError
from ..frameworks.keras_backend import keras_backend_default
from ..frameworks.loading import guard_torch_compiler
from ..process import die_with_parent, in_effect, mark_worker_daemon, prepare_process, thread_env
from ..settings import MAX_LANE_SPIN_US, check_lane_spin_us, module_list
from .drain import DEFAULT_SECONDS as DEFAULT_DRAIN_SECONDS
from .drain import Drain, Draining
from .executor import Executor

DEFAULT_LISTEN = "127.0.0.1:7070"


def _positive_seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = float("nan")
    if not value > 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"a positive number of seconds, got {text!r}")
    return value


def _seconds_or_zero(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = float("nan")
    if not value >= 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"a number of seconds, 0 or more, got {text!r}")
    return value


def _at_least_one(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"a whole number of at least 1, got {text!r}")
    return value


def _memory_size(text: str) -> int:
    from .memory_budget import parse_size

    try:
        return parse_size(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _spin_us(text: str) -> int:
    try:
        return check_lane_spin_us(int(text))
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"whole microseconds from 0 to {MAX_LANE_SPIN_US}, got {text!r}") from exc


def _parser(prog: str = "ddlf-worker") -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog=prog,
        description="Run a ddlf worker daemon. Logs go to stderr; set DDLF_LOG=debug for one line per request.",
    )
    p.add_argument("--listen", default=DEFAULT_LISTEN, help=f"address to serve on (default {DEFAULT_LISTEN})")
    p.add_argument(
        "--token-file",
        help="file holding the shared token (default: the DDLF_TOKEN environment variable, if set)",
    )
    p.add_argument(
        "--insecure",
        action="store_true",
        help="allow a non-loopback address without a token (anyone who can reach it can run code)",
    )
    p.add_argument("--name", default=None, help="a name for this worker in logs and status")
    p.add_argument(
        "--max-message-size",
        type=int,
        default=None,
        help="largest request accepted, in bytes (default 2 GiB)",
    )
    p.add_argument(
        "--threads",
        type=int,
        default=None,
        help="threads for math libraries (BLAS, XLA, torch); set it when several workers share a machine",
    )
    p.add_argument("--network-threads", type=int, default=1, help="threads of the network runtime (default 1)")
    p.add_argument("--tls-cert", default=None, help="serve TLS with this certificate chain (PEM); needs --tls-key")
    p.add_argument("--tls-key", default=None, help="the private key (PEM) of --tls-cert")
    p.add_argument(
        "--max-connections",
        type=int,
        default=None,
        help="connections open at once, a master's direct lane and ping lane included (three per master); more are "
        "refused and logged (default 1024)",
    )
    p.add_argument(
        "--handshake-timeout",
        type=_positive_seconds,
        default=None,
        help="seconds a new connection may take to open with a valid preface (default 10)",
    )
    p.add_argument(
        "--lane-spin-us",
        type=_spin_us,
        default=None,
        help="microseconds the interpreter thread spins for the next direct-lane request before it sleeps "
        "(default: DDLF_LANE_SPIN_US, else 100; 0 sleeps at once)",
    )
    p.add_argument(
        "--keepalive",
        type=_positive_seconds,
        nargs=2,
        metavar=("INTERVAL", "TIMEOUT"),
        default=None,
        help="seconds between HTTP/2 keepalive pings to each master, and how long one may go unanswered before "
        "the connection is closed (default 10 20)",
    )
    p.add_argument(
        "--max-runs",
        type=_at_least_one,
        default=4,
        help="training runs this worker serves at once (from several masters, or one master's concurrent "
        "trainings); a run past it is refused with an error naming the runs holding the worker (default 4: "
        "each run keeps its own model and optimizer in this process's memory)",
    )
    p.add_argument(
        "--run-idle-timeout",
        type=_positive_seconds,
        default=600.0,
        metavar="SECONDS",
        help="a training run without a request for this long (its master died without tearing it down) is "
        "evicted when a new run needs its place (default 600)",
    )
    p.add_argument(
        "--preload",
        default=os.environ.get("DDLF_PRELOAD", ""),
        metavar="MODULES",
        help="comma-separated modules to import in the background once the daemon listens, so a training run "
        "finds them loaded (e.g. 'keras': Keras and its backend, KERAS_BACKEND or ddlf's default; default: "
        "DDLF_PRELOAD, else none)",
    )
    p.add_argument(
        "--max-memory",
        type=_memory_size,
        default=None,
        metavar="SIZE",
        help="resident memory this worker may hold, e.g. 4G or 512Mi: a set, call, dataset or upload that would "
        "pass it is refused (a call that passes it while it runs is stopped) with MemoryBudgetExceeded, and the "
        "worker keeps serving (default: no budget)",
    )
    p.add_argument(
        "--gpu",
        default=None,
        metavar="IDS",
        help="the GPU(s) this daemon may use, e.g. 0 or 0,1 (sets CUDA_VISIBLE_DEVICES before any framework "
        "loads); 'none': no GPU. Default: whatever the environment allows",
    )
    p.add_argument(
        "--rendezvous",
        default=None,
        metavar="HOST:PORT",
        help="once listening, report this worker's port to the master waiting there, with an HMAC under the token "
        "(Cluster.from_slurm starts workers so; default: DDLF_RENDEZVOUS, a port on SLURM_LAUNCH_NODE_IPADDR)",
    )
    p.add_argument(
        "--drain-seconds",
        type=_seconds_or_zero,
        default=DEFAULT_DRAIN_SECONDS,
        metavar="SECONDS",
        help="on SIGTERM while a training run is set up here, interrupt the call in flight, refuse new rounds and "
        "keep answering the master (which reads the last round's weights for its checkpoint) until its runs are "
        f"torn down or this many seconds pass, then exit (default {DEFAULT_DRAIN_SECONDS:.0f}; 0: exit at once)",
    )
    p.add_argument("--ready-file", default=None, help=argparse.SUPPRESS)
    return p


def _read_token(path: str | None) -> str | None:
    if path:
        try:
            with open(path) as f:
                token = f.read().strip()
        except OSError as exc:
            raise ConfigError(f"cannot read --token-file: {exc}") from exc
        if not token:
            raise ConfigError(f"the token file {path} is empty")
        return token
    token = os.environ.get("DDLF_TOKEN", "").strip()
    return token or None


def _raise_system_exit(signum: int, frame: object) -> None:
    raise SystemExit(0)


def main(argv: Sequence[str] | None = None, prog: str = "ddlf-worker") -> int:
    """Entry point of ``ddlf-worker`` (``prog``: the command's name in its help, ``ddlf worker`` from ``ddlf``)."""
    die_with_parent()  # local workers (Cluster.local) never outlive their master
    mark_worker_daemon()  # it starts no daemons of its own (Cluster.local refuses here)
    args = _parser(prog).parse_args(argv)
    if args.gpu is not None:
        from ..devices import check_gpu_ids

        try:
            visible = check_gpu_ids(args.gpu)
        except ValueError as exc:
            print(f"ddlf-worker: {exc}", file=sys.stderr)
            return 2
        # Before any framework loads (the preload included): they read it once, when they initialise CUDA.
        os.environ["CUDA_VISIBLE_DEVICES"] = visible
    keras_backend_default()
    guard_torch_compiler()  # user code loading torch's compiler after TensorFlow: an error, not an abort
    prepare_process()
    from . import services

    services.configure(max_runs=args.max_runs, idle_seconds=args.run_idle_timeout)
    try:
        token = _read_token(args.token_file)
    except ConfigError as exc:
        print(f"ddlf-worker: {exc}", file=sys.stderr)
        return 2
    if args.threads and not in_effect(args.threads):
        # numpy's BLAS is already loaded (this module imports ddlf): caps only work from the start, so start over
        # with them in the environment. Cluster.local sets them up front and never pays for this.
        env = {**os.environ, **thread_env(args.threads)}
        os.execve(
            sys.executable, [sys.executable, "-m", "ddlf.worker", *(argv if argv is not None else sys.argv[1:])], env
        )
    if bool(args.tls_cert) != bool(args.tls_key):
        print("ddlf-worker: --tls-cert and --tls-key go together", file=sys.stderr)
        return 2
    try:
        tls_cert = open(args.tls_cert, "rb").read() if args.tls_cert else None  # noqa: SIM115
        tls_key = open(args.tls_key, "rb").read() if args.tls_key else None  # noqa: SIM115
    except OSError as exc:
        print(f"ddlf-worker: cannot read the TLS files: {exc}", file=sys.stderr)
        return 2
    _ddlf.init_logging("info")
    _log_python_through_tracing()
    signal.signal(signal.SIGTERM, _raise_system_exit)
    preload = module_list(args.preload)
    if "keras" in preload or "tensorflow" in preload:
        from ..frameworks.loading import load_compiler_llvm_first

        # Before serving, on this thread: a TorchModel run on this daemon must still be able to load torch's
        # compiler once TensorFlow is in (frameworks.loading); in a background thread it would race the requests.
        load_compiler_llvm_first()
    try:
        report_to = _rendezvous_target(args.rendezvous)
    except ConfigError as exc:
        print(f"ddlf-worker: {exc}", file=sys.stderr)
        return 2
    if report_to is not None and not token:
        print("ddlf-worker: --rendezvous needs the token (DDLF_TOKEN or --token-file)", file=sys.stderr)
        return 2
    if report_to is not None and args.name is None:
        args.name = f"{os.environ.get('SLURMD_NODENAME', 'worker')}-{os.environ.get('SLURM_LOCALID', '0')}"
    executor = Executor(
        ready_file=args.ready_file,
        preload=preload,
        max_memory=args.max_memory,
        on_ready=_reporter(report_to, token or "", args.name or "") if report_to else None,
    )
    # From here a SIGTERM lets the masters read what this worker holds before it exits (drain.py).
    signal.signal(
        signal.SIGTERM,
        Drain(args.drain_seconds, serving=lambda: bool(executor.runs)).on_signal,
    )
    try:
        _ddlf.serve_worker(
            executor,
            args.listen,
            token=token,
            insecure=args.insecure,
            max_message_size=args.max_message_size,
            name=args.name,
            network_threads=args.network_threads,
            tls_cert=tls_cert,
            tls_key=tls_key,
            max_connections=args.max_connections,
            handshake_timeout=args.handshake_timeout,
            lane_spin_us=args.lane_spin_us,
            keepalive=tuple(args.keepalive) if args.keepalive else None,
        )
    except WorkerStartError as exc:
        print(f"ddlf-worker: {exc}", file=sys.stderr)
        return 2
    except (KeyboardInterrupt, SystemExit, Draining):
        return 0
    finally:
        for s in (signal.SIGTERM, signal.SIGINT):  # stopping already: a second signal must not cut the clean-up
            signal.signal(s, signal.SIG_IGN)
        executor.release()  # first: the user's objects may still use what close() removes
        executor.close()
        _let_go_of_datasets()
    return 0


def run(argv: Sequence[str] | None = None, prog: str = "ddlf-worker") -> NoReturn:
    """The ``ddlf-worker`` command and ``python -m ddlf.worker``: :func:`main`, then :func:`exit_quickly`."""
    exit_quickly(main(argv, prog))


def exit_quickly(code: int) -> NoReturn:
    """End the daemon's process without the interpreter's finalization, which takes 1.0-1.2 s once TensorFlow
    is loaded (module teardown and the frameworks' static destructors; every ``Cluster.local`` close waited for
    it). What that finalization does that matters is done first, in its order: :func:`main` has released the
    user's variables, functions and namespace and the worker's files; here non-daemon threads are joined (and
    thread pools' queued work done), a full garbage collection runs the ``__del__`` of what the release left in
    cycles (buffered files are flushed), the ``atexit`` handlers run (``logging`` flushes among them), and
    Python's and C's standard streams are flushed."""
    shutdown_threads = getattr(threading, "_shutdown", None)  # what finalization calls first
    if shutdown_threads is not None:
        shutdown_threads()
    gc.collect()  # as finalization's own collection, the heap frozen after the preload (freeze_heap) left out
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(OSError, ValueError):  # closed, or the reader went away: nothing more to say
            stream.flush()
    with contextlib.suppress(OSError, AttributeError):  # what native code printed (libc's buffers)
        ctypes.CDLL(None).fflush(None)
    os._exit(code)


def _rendezvous_target(given: str | None) -> str | None:
    """Where to report this worker's port: ``--rendezvous``, else ``DDLF_RENDEZVOUS`` (``HOST:PORT``, or a port on
    the node that ran srun, ``SLURM_LAUNCH_NODE_IPADDR``: the master's, with ``Cluster.from_slurm``)."""
    target = given or os.environ.get("DDLF_RENDEZVOUS")
    if not target:
        return None
    if target.isdigit():
        host = os.environ.get("SLURM_LAUNCH_NODE_IPADDR")
        if not host:
            raise ConfigError("DDLF_RENDEZVOUS is a port, but SLURM_LAUNCH_NODE_IPADDR is not set")
        target = f"{host}:{target}"
    return target


def _reporter(target: str, token: str, name: str) -> Callable[[str], None]:
    """Report the bound port to the master at ``target`` (in the background: serving starts meanwhile)."""

    def report_port(address: str) -> None:
        from ..rendezvous import report

        port = int(address.rpartition(":")[2])
        rank = int(os.environ.get("SLURM_PROCID", "0"))

        def run() -> None:
            try:
                report(target, token, rank, port, name)
            except OSError as exc:
                logging.getLogger("ddlf.worker").error("could not report to the master at %s: %s", target, exc)

        threading.Thread(target=run, name="ddlf-rendezvous", daemon=True).start()

    return report_port


def _let_go_of_datasets() -> None:
    """A clean exit: this worker's holds on the host's dataset copies go, and copies nobody holds are removed."""
    from ..data.store import STORE

    try:
        STORE.close()
    except Exception as exc:  # exiting anyway: a copy left behind is reused or swept by the next worker
        logging.getLogger("ddlf.worker").warning("datasets not released at exit: %s", exc)


class _TracingHandler(logging.Handler):
    """Python ``logging`` records go where the daemon's own lines go: stderr and the in-memory log that
    ``cluster.logs()`` reads, inside the span of the request being served (its id and function)."""

    def emit(self, record: logging.LogRecord) -> None:
        try:
            _ddlf.log_record(record.levelno, record.name, self.format(record))
        except Exception:  # logging must never break user code
            self.handleError(record)


def _log_python_through_tracing() -> None:
    root = logging.getLogger()
    root.addHandler(_TracingHandler())
    level = os.environ.get("DDLF_PY_LOG", "INFO").upper()
    root.setLevel(getattr(logging, level, logging.INFO))


if __name__ == "__main__":
    run()
