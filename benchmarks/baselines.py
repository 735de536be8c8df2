"""Floors measured next to ddlf: a raw Python TCP socket echo on loopback, run in a separate process; optionally
with both ends busy-polling before they block (what ddlf's direct lanes do), for a like-for-like floor."""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import os
import socket
import struct
import time
from typing import Any

_HDR = struct.Struct("!Q")


def _recv_exact(sock: socket.socket, n: int, buf: bytearray | None = None) -> memoryview:
    view = memoryview(buf) if buf is not None else memoryview(bytearray(n))
    got = 0
    while got < n:
        r = sock.recv_into(view[got:], n - got)
        if r == 0:
            raise ConnectionError("peer closed")
        got += r
    return view[:n]


def _spin_until_readable(sock: socket.socket, spin: float) -> None:
    """Poll ``sock`` without blocking for up to ``spin`` seconds (yielding the CPU between polls)."""
    if spin <= 0:
        return
    end = time.perf_counter() + spin
    while True:
        try:
            sock.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT)
            return  # data, or the end of the stream: the blocking read takes it from here
        except BlockingIOError:
            if time.perf_counter() >= end:
                return
            os.sched_yield()


def _echo_server(port_q: Any, spin: float = 0.0) -> None:
    srv = socket.socket()
    srv.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    srv.bind(("127.0.0.1", 0))
    srv.listen(1)
    port_q.put(srv.getsockname()[1])
    conn, _ = srv.accept()
    conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    buf = bytearray(1 << 20)
    try:
        while True:
            _spin_until_readable(conn, spin)
            (n,) = _HDR.unpack(_recv_exact(conn, _HDR.size))
            if n == 0:
                break
            if n > len(buf):
                buf = bytearray(n)
            data = _recv_exact(conn, n, buf)
            conn.sendall(_HDR.pack(n))
            conn.sendall(data)
    except ConnectionError:
        pass
    finally:
        conn.close()
        srv.close()


class RawEcho:
    """A length-prefixed echo server in another process, and a client socket to it. ``spin_us``: both ends poll
    without blocking for up to that many microseconds before each blocking read."""

    def __init__(self, spin_us: float = 0.0) -> None:
        ctx = mp.get_context("spawn")
        q = ctx.Queue()
        self.spin = spin_us / 1e6
        self.proc = ctx.Process(target=_echo_server, args=(q, self.spin), daemon=True)
        self.proc.start()
        port = q.get(timeout=30)
        self.sock = socket.create_connection(("127.0.0.1", port))
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self._buf = bytearray(1 << 20)

    def round_trip_buffer(self, payload: memoryview, into: bytearray) -> float:
        """Send a large buffer and read it back into ``into`` (no copies in Python); returns seconds."""
        t0 = time.perf_counter()
        self.sock.sendall(_HDR.pack(payload.nbytes))
        self.sock.sendall(payload)
        (n,) = _HDR.unpack(_recv_exact(self.sock, _HDR.size))
        _recv_exact(self.sock, n, into)
        return time.perf_counter() - t0

    def round_trip(self, payload: bytes) -> float:
        """Send payload, read it back; returns seconds."""
        t0 = time.perf_counter()
        self.sock.sendall(_HDR.pack(len(payload)) + payload)
        _spin_until_readable(self.sock, self.spin)
        (n,) = _HDR.unpack(_recv_exact(self.sock, _HDR.size))
        _recv_exact(self.sock, n, self._buf if n <= len(self._buf) else None)
        return time.perf_counter() - t0

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self.sock.sendall(_HDR.pack(0))
        self.sock.close()
        self.proc.join(5)
