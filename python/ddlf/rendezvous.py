"""How workers that a scheduler started tell the master where they listen (``Cluster.from_slurm``): the
contract both programs import (the worker reports, the master listens), like ``ring_spec``.

A worker started by ``srun`` binds a free port (``--listen 0.0.0.0:0``: two jobs on one node never collide), then
connects to the master's rendezvous port and sends one line of JSON: its rank, that port, its name and host, and
an HMAC of them under the job's token, so only a worker holding the token can enlist. The master takes the
address the connection came from (the worker's address on the route to the master, with no name service needed)
and the reported port. Both sides of the exchange live here.
"""

from __future__ import annotations

import contextlib
import hashlib
import hmac
import json
import socket
import time
from dataclasses import dataclass

from .errors import LaunchError

#: Bytes a worker's report may take (one short JSON line).
MAX_REPORT = 4096


@dataclass(frozen=True)
class Enlisted:
    """A worker that reported in: its rank (``SLURM_PROCID``), the address to reach it, its name and host."""

    rank: int
    address: str
    name: str
    hostname: str


def _mac(token: str, rank: int, port: int, name: str) -> str:
    return hmac.new(token.encode(), f"{rank}:{port}:{name}".encode(), hashlib.sha256).hexdigest()


def report(master: str, token: str, rank: int, port: int, name: str, timeout: float = 30.0) -> None:
    """The worker's side: tell the master at ``master`` (``host:port``) that rank ``rank`` listens on ``port``."""
    host, _, service = master.rpartition(":")
    line = json.dumps(
        {
            "rank": rank,
            "port": port,
            "name": name,
            "hostname": socket.gethostname(),
            "mac": _mac(token, rank, port, name),
        }
    )
    deadline = time.monotonic() + timeout
    while True:  # the master may still be opening its port
        try:
            with socket.create_connection((host.strip("[]"), int(service)), timeout=5.0) as s:
                s.sendall(line.encode() + b"\n")
                s.shutdown(socket.SHUT_WR)
                s.recv(16)  # the master closes once it has read the line
            return
        except OSError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.2)


class Rendezvous:
    """The master's side: a listening socket on a free port, and :meth:`wait` for ``n`` workers' reports."""

    def __init__(self, token: str, host: str = "0.0.0.0") -> None:
        self.token = token
        self._sock = socket.create_server((host, 0))
        self.port: int = self._sock.getsockname()[1]
        self.refused = 0

    def close(self) -> None:
        self._sock.close()

    def __enter__(self) -> Rendezvous:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def wait(self, n: int, timeout: float, alive: object = None) -> list[Enlisted]:
        """The ``n`` workers, by rank. ``alive``: a callable returning an error message once waiting is pointless
        (the launcher exited), else None. Raises :class:`~ddlf.errors.LaunchError` on timeout."""
        found: dict[int, Enlisted] = {}
        deadline = time.monotonic() + timeout
        self._sock.settimeout(0.25)
        while len(found) < n:
            if time.monotonic() > deadline:
                missing = sorted(set(range(n)) - set(found))
                raise LaunchError(
                    f"{len(found)} of {n} workers reported within {timeout:.0f} s (missing ranks {missing[:10]}); "
                    f"{self.refused} reports refused (bad token or malformed)"
                )
            if callable(alive) and (why := alive()):
                raise LaunchError(f"the workers' launcher ended before all reported ({len(found)} of {n}): {why}")
            try:
                conn, peer = self._sock.accept()
            except TimeoutError:
                continue
            with conn:
                got = self._read(conn, peer[0])
                if got is None or not 0 <= got.rank < n:
                    self.refused += 1
                    continue
                found[got.rank] = got
        return [found[r] for r in range(n)]

    def _read(self, conn: socket.socket, peer_ip: str) -> Enlisted | None:
        conn.settimeout(5.0)
        data = b""
        with contextlib.suppress(OSError):
            while len(data) < MAX_REPORT and not data.endswith(b"\n"):
                chunk = conn.recv(MAX_REPORT)
                if not chunk:
                    break
                data += chunk
        try:
            msg = json.loads(data)
            rank, port, name = int(msg["rank"]), int(msg["port"]), str(msg["name"])
            mac = str(msg["mac"])
        except (ValueError, KeyError, TypeError):
            return None
        if not (0 < port < 65536 and hmac.compare_digest(mac, _mac(self.token, rank, port, name))):
            return None
        host = f"[{peer_ip}]" if ":" in peer_ip else peer_ip
        return Enlisted(rank, f"{host}:{port}", name, str(msg.get("hostname", "")))
