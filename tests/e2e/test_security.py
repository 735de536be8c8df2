"""Strangers knock: wrong or missing tokens, TLS mismatches, bad certificates, garbage on the port, too many
connections. Each is refused, a function with a side effect is proven never to have run, and the daemon keeps
serving its real master."""

from __future__ import annotations

import os
import socket
import time
from pathlib import Path

import pytest

import ddlf

from ..certs import make_certs
from ..conftest import Daemon


@pytest.fixture(scope="module")
def certs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    return make_certs(tmp_path_factory.mktemp("certs"))


def _touch(path: str) -> str:
    open(path, "w").close()
    return path


def _never_ran(marker: str) -> bool:
    time.sleep(0.2)  # anything queued would have run by now
    return not os.path.exists(marker)


@pytest.fixture(scope="module")
def tls_daemon(certs: dict[str, Path]):
    """A daemon serving TLS, shared by the module's tests (none of them stops it)."""
    d = Daemon("--tls-cert", str(certs["server"]), "--tls-key", str(certs["key"]))
    yield d
    d.stop()


def test_tls_master_runs_code_on_a_tls_daemon(tls_daemon: Daemon, certs: dict[str, Path], tmp_path: Path) -> None:
    with ddlf.Cluster([tls_daemon.address], token=tls_daemon.token, tls_ca=certs["ca"]) as c:
        assert c.run(lambda: 6 * 7) == [42]
        assert c.worker_info()[0]["direct_lane"] is False  # TLS daemons speak gRPC only
        assert c.worker_info()[0]["ping_lane"] is False
        assert c.ping()[0] > 0  # over gRPC
        marker = c.run(_touch, str(tmp_path / "ran"))[0]
        assert os.path.exists(marker)


def test_plaintext_master_is_refused_by_a_tls_daemon(tls_daemon: Daemon, certs: dict[str, Path]) -> None:
    with pytest.raises(ddlf.WorkerUnavailable):
        ddlf.Cluster([tls_daemon.address], token=tls_daemon.token, connect_timeout=3)
    # The real (TLS) master is unaffected.
    with ddlf.Cluster([tls_daemon.address], token=tls_daemon.token, tls_ca=certs["ca"]) as c:
        assert c.run(lambda: 1) == [1]
        assert c.status()[0]["connections_refused"] >= 1


@pytest.mark.fresh_daemons("daemons serving TLS with this test's certificates")
def test_untrusted_and_expired_certificates_are_refused(certs: dict[str, Path], tmp_path: Path) -> None:
    # A master that trusts another CA refuses the daemon's certificate.
    good = Daemon("--tls-cert", str(certs["server"]), "--tls-key", str(certs["key"]))
    expired = Daemon("--tls-cert", str(certs["expired"]), "--tls-key", str(certs["key"]))
    try:
        with pytest.raises(ddlf.WorkerUnavailable, match=r"(?i)certificate|unknown|issuer"):
            ddlf.Cluster([good.address], token=good.token, tls_ca=certs["other-ca"], connect_timeout=3)
        with pytest.raises(ddlf.WorkerUnavailable, match=r"(?i)certificate|expired"):
            ddlf.Cluster([expired.address], token=expired.token, tls_ca=certs["ca"], connect_timeout=3)
    finally:
        good.stop()
        expired.stop()


def test_tls_master_to_a_plaintext_daemon_is_refused(daemon: Daemon, certs: dict[str, Path], tmp_path: Path) -> None:
    with pytest.raises(ddlf.WorkerUnavailable):
        ddlf.Cluster([daemon.address], token=daemon.token, tls_ca=certs["ca"], connect_timeout=3)
    with ddlf.Cluster([daemon.address], token=daemon.token) as c:
        assert c.status()[0]["connections_refused"] >= 1


@pytest.mark.parametrize("token", ["wrong-token", None])
def test_wrong_or_missing_token_never_runs_the_function(daemon: Daemon, tmp_path: Path, token: str | None) -> None:
    marker = str(tmp_path / "side-effect")
    with ddlf.Cluster([daemon.address], token=daemon.token) as owner:
        owner.add_function(_touch, "touch")
    # Connecting runs a context call, which is refused before any of the stranger's code could be named.
    with pytest.raises(ddlf.AuthenticationError), ddlf.Cluster([daemon.address], token=token) as stranger:
        stranger.run("touch", marker)
    assert _never_ran(marker)
    with ddlf.Cluster([daemon.address], token=daemon.token) as owner:
        assert owner.run(lambda: "still serving") == ["still serving"]
        assert owner.status()[0]["requests_rejected"] >= 1


def _garbage(address: str, payload: bytes) -> bool:
    """Send ``payload`` and report whether the daemon closed the connection within 3 s without answering."""
    host, port = address.rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=3) as s:
        if payload:
            s.sendall(payload)
        try:
            return s.recv(64) == b""  # closed, nothing answered
        except ConnectionResetError:
            return True  # closed with unread bytes pending: the kernel resets instead
        except TimeoutError:
            return False


@pytest.mark.fresh_daemons("the daemon's log is read")
def test_garbage_on_the_port_is_refused_logged_and_the_daemon_keeps_serving() -> None:
    d = Daemon("--handshake-timeout", "0.5")
    try:
        with ddlf.Cluster([d.address], token=d.token) as c:
            payloads = [
                os.urandom(64),
                b"GET / HTTP/1.1\r\nHost: x\r\n\r\n",
                bytes([0x16, 0x03, 0x01, 0x00, 0x2F, 0x01, 0x00, 0x00, 0x2B, 0x03, 0x03]) + os.urandom(32),
                b"PRI * HTTP/2.0\r\n",  # half a preface, then silence
                b"",  # a half-open connection that sends nothing
            ]
            for p in payloads:
                assert _garbage(d.address, p), p
                assert c.run(lambda: "ok") == ["ok"]
            assert c.status()[0]["connections_refused"] == len(payloads)
    finally:
        d.stop()
    log = d.proc.stderr.read().decode()
    assert log.count("connection refused") == len(payloads), log
    for reason in ("HTTP/1 request", "TLS handshake on a plaintext port", "sent nothing valid", "unrecognised"):
        assert reason in log, reason


@pytest.mark.fresh_daemons("a daemon started with --max-connections")
def test_connections_over_the_limit_are_refused() -> None:
    d = Daemon("--max-connections", "6")  # two masters, each with its gRPC connection, direct lane and ping lane
    try:
        a = ddlf.Cluster([d.address], token=d.token)
        b = ddlf.Cluster([d.address], token=d.token)
        with pytest.raises(ddlf.WorkerUnavailable):
            ddlf.Cluster([d.address], token=d.token, connect_timeout=3)
        assert a.run(lambda: 1) == [1] and b.run(lambda: 2) == [2]
        b.close()
        a.close()
    finally:
        d.stop()


@pytest.mark.fresh_daemons("a daemon started with --max-message-size")
def test_oversized_request_is_refused_and_nothing_runs(tmp_path: Path) -> None:
    d = Daemon("--max-message-size", "100000")
    marker = str(tmp_path / "big")
    try:
        with ddlf.Cluster([d.address], token=d.token) as c:
            c.add_function(_touch, "touch")
            with pytest.raises(ddlf.RequestRejected, match="exceeds the limit"):
                c.run("touch", marker, b"x" * 200_000)
            assert _never_ran(marker)
            assert c.run("touch", marker) == [marker]
    finally:
        d.stop()


@pytest.mark.fresh_daemons("daemons that refuse to start are under test")
def test_a_daemon_with_an_unusable_certificate_refuses_to_start(tmp_path: Path, certs: dict[str, Path]) -> None:
    bad = tmp_path / "bad.pem"
    bad.write_text("not a certificate")
    with pytest.raises(RuntimeError, match="invalid TLS certificate or key"):
        Daemon("--tls-cert", str(bad), "--tls-key", str(certs["key"]))
    with pytest.raises(RuntimeError, match="--tls-cert and --tls-key go together"):
        Daemon("--tls-cert", str(certs["server"]))
