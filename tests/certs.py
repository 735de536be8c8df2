"""Certificates made by the tests themselves with the system ``openssl``: a CA, a server certificate for
127.0.0.1/localhost signed by it, an expired one, and an unrelated CA."""

from __future__ import annotations

import subprocess
from pathlib import Path

CA_CONFIG = """[ ca ]
default_ca = CA_default
[ CA_default ]
database = index.txt
new_certs_dir = .
serial = serial
default_md = sha256
policy = policy_any
[ policy_any ]
commonName = supplied
"""


def _run(cwd: Path, *args: str) -> None:
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True)


def make_certs(directory: Path, ips: tuple[str, ...] = ()) -> dict[str, Path]:
    """A CA, a server certificate for 127.0.0.1, localhost and ``ips``, another CA and an expired certificate."""
    d = Path(directory)
    d.mkdir(parents=True, exist_ok=True)
    _run(d, "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", "ca.key", "-out", "ca.pem", "-days", "2",
         "-subj", "/CN=ddlf-test-ca")  # fmt: skip
    _run(d, "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", "other-ca.key", "-out", "other-ca.pem",
         "-days", "2", "-subj", "/CN=someone-else")  # fmt: skip
    _run(d, "req", "-newkey", "rsa:2048", "-nodes", "-keyout", "server.key", "-out", "server.csr",
         "-subj", "/CN=localhost")  # fmt: skip
    sans = ",".join(["IP:127.0.0.1", "DNS:localhost", *(f"IP:{ip}" for ip in ips)])
    (d / "ext").write_text(f"subjectAltName={sans}\n")
    _run(d, "x509", "-req", "-in", "server.csr", "-CA", "ca.pem", "-CAkey", "ca.key", "-CAcreateserial",
         "-out", "server.pem", "-days", "1", "-extfile", "ext")  # fmt: skip
    (d / "index.txt").write_text("")
    (d / "serial").write_text("01\n")
    (d / "ca.cnf").write_text(CA_CONFIG)
    _run(d, "ca", "-batch", "-config", "ca.cnf", "-cert", "ca.pem", "-keyfile", "ca.key", "-in", "server.csr",
         "-out", "expired.pem", "-startdate", "20200101000000Z", "-enddate", "20200102000000Z",
         "-extfile", "ext")  # fmt: skip
    return {name: d / f"{name}.pem" for name in ("ca", "other-ca", "server", "expired")} | {"key": d / "server.key"}
