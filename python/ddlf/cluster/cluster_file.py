"""``cluster.toml``: where the workers are and how to reach them, for ``ddlf.Cluster.from_config`` and the
``ddlf`` command.

```toml
workers = ["node1:7070", "node2:7070"]   # required
token_file = "/etc/ddlf/token"            # optional (else DDLF_TOKEN)
tls_ca = "ca.pem"                         # optional: talk TLS, trusting this CA
tls_domain = "ddlf.internal"              # optional
connect_timeout = 10.0                    # seconds
timeout = 600.0                           # default per-call deadline
heartbeat_interval = 2.0
heartbeat_timeout = 10.0

[launch]                                  # optional: how `ddlf up` starts workers over SSH
ssh_user = "ml"                           # default: your user name
ssh_options = ["-i", "~/.ssh/ddlf"]       # extra arguments for the system ssh
python = "/opt/ddlf/venv/bin/python"      # the interpreter with ddlf on the hosts (default: python3)
worker_args = ["--threads", "8"]          # extra ddlf-worker arguments (TLS: --tls-cert/--tls-key on the hosts)
log_dir = "/tmp"                          # where each worker's log goes on its host
```

Relative paths are relative to the file. Every mistake is reported with the file and the line it is on.
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..errors import ConfigError, DdlfError
from ..settings import is_address

if sys.version_info >= (3, 11):
    import tomllib
else:  # the same parser, from PyPI (a dependency on 3.10 only)
    import tomli as tomllib


_NUMBERS = ("connect_timeout", "timeout", "heartbeat_interval", "heartbeat_timeout")
_PATHS = ("token_file", "tls_ca")
_KNOWN = ("workers", "tls_domain", "launch", *_NUMBERS, *_PATHS)
_LAUNCH = {"ssh_user": str, "ssh_options": list, "python": str, "worker_args": list, "log_dir": str}


@dataclass
class LaunchConfig:
    """The ``[launch]`` table: how ``ddlf up`` starts workers on their hosts over SSH."""

    ssh_user: str | None = None
    ssh_options: list[str] = field(default_factory=list)
    python: str = "python3"
    worker_args: list[str] = field(default_factory=list)
    log_dir: str = "/tmp"


@dataclass
class ClusterConfig:
    """A parsed ``cluster.toml``."""

    workers: list[str]
    token_file: Path | None = None
    tls_ca: Path | None = None
    tls_domain: str | None = None
    options: dict[str, float] = field(default_factory=dict)
    path: Path | None = None
    launch: LaunchConfig = field(default_factory=LaunchConfig)

    def token(self) -> str | None:
        """The token from ``token_file``, else the ``DDLF_TOKEN`` environment variable."""
        if self.token_file is None:
            return os.environ.get("DDLF_TOKEN") or None
        try:
            token = self.token_file.read_text().strip()
        except OSError as exc:
            raise ConfigError(f"{self.path}: cannot read token_file {self.token_file}: {exc.strerror}") from exc
        if not token:
            raise ConfigError(f"{self.path}: token_file {self.token_file} is empty")
        return token

    def cluster_kwargs(self) -> dict[str, Any]:
        """Keyword arguments for :class:`ddlf.Cluster`."""
        kw: dict[str, Any] = {"token": self.token(), **self.options}
        if self.tls_ca is not None:
            kw["tls_ca"] = self.tls_ca
        if self.tls_domain is not None:
            kw["tls_domain"] = self.tls_domain
        return kw


def _line_of(text: str, key: str) -> int:
    for n, line in enumerate(text.splitlines(), 1):
        if line.split("=", 1)[0].strip() == key:
            return n
    return 1


def load(path: str | os.PathLike[str]) -> ClusterConfig:
    """Read and check a cluster file."""
    p = Path(path)
    try:
        text = p.read_text()
    except OSError as exc:
        raise ConfigError(f"{p}: cannot read: {exc.strerror}") from exc
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"{p}: {exc}") from exc  # tomllib's message says "(at line N, column M)"

    def bad(key: str, why: str) -> ConfigError:
        return ConfigError(f"{p}, line {_line_of(text, key)}: {key}: {why}")

    for key in data:
        if key not in _KNOWN:
            raise bad(key, f"unknown setting (known: {', '.join(_KNOWN)})")
    workers = data.get("workers")
    if workers is None:
        raise ConfigError(f"{p}: no 'workers' list (workers = [\"host:port\", ...])")
    if not isinstance(workers, list) or not workers or not all(isinstance(w, str) for w in workers):
        raise bad("workers", 'expected a non-empty list of "host:port" strings')
    for w in workers:
        if not is_address(w):
            raise bad("workers", f'{w!r} is not "host:port"')
    options: dict[str, float] = {}
    for key in _NUMBERS:
        if key in data:
            v = data[key]
            if isinstance(v, bool) or not isinstance(v, (int, float)) or v <= 0:
                raise bad(key, f"expected a positive number of seconds, got {v!r}")
            options[key] = float(v)
    paths: dict[str, Path | None] = {}
    for key in _PATHS:
        v = data.get(key)
        if v is not None and not isinstance(v, str):
            raise bad(key, f"expected a path, got {v!r}")
        paths[key] = (p.parent / v).resolve() if v else None
    launch = data.get("launch", {})
    if not isinstance(launch, dict):
        raise bad("launch", "expected a table: [launch]")
    for key, v in launch.items():
        kind = _LAUNCH.get(key)
        if kind is None:
            raise bad(key, f"unknown [launch] setting (known: {', '.join(_LAUNCH)})")
        if not isinstance(v, kind) or (kind is list and not all(isinstance(x, str) for x in v)):
            raise bad(key, "expected " + ("a list of strings" if kind is list else "a string") + f", got {v!r}")
    domain = data.get("tls_domain")
    if domain is not None and not isinstance(domain, str):
        raise bad("tls_domain", f"expected a host name, got {domain!r}")
    return ClusterConfig(
        workers=list(workers),
        token_file=paths["token_file"],
        tls_ca=paths["tls_ca"],
        tls_domain=domain,
        options=options,
        path=p,
        launch=LaunchConfig(**launch),
    )


SERVICE_ACCOUNT_NAMESPACE = "/var/run/secrets/kubernetes.io/serviceaccount/namespace"


def kubernetes_addresses(
    service: str,
    namespace: str | None = None,
    replicas: int | None = None,
    *,
    port: int = 7070,
    statefulset: str | None = None,
    cluster_domain: str = "cluster.local",
    resolve: Any = None,
) -> list[str]:
    """The stable addresses of a StatefulSet's pods behind a headless Service (see ``Cluster.from_kubernetes``).
    With ``replicas=None``, pods ``0, 1, ...`` are counted while their names resolve (``resolve``: a function
    of a host name that raises ``OSError`` when it does not, ``socket.gethostbyname`` by default)."""
    import socket

    if namespace is None:
        namespace = os.environ.get("DDLF_K8S_NAMESPACE")
    if namespace is None:
        try:
            namespace = Path(SERVICE_ACCOUNT_NAMESPACE).read_text().strip() or "default"
        except OSError:
            namespace = "default"
    if replicas is not None and replicas < 1:
        raise ConfigError(f"replicas must be at least 1, got {replicas}")
    sts = statefulset or service

    def host(i: int) -> str:
        return f"{sts}-{i}.{service}.{namespace}.svc.{cluster_domain}"

    if replicas is None:
        resolve = resolve or socket.gethostbyname
        replicas = 0
        while True:
            try:
                resolve(host(replicas))
            except OSError:
                break
            replicas += 1
        if replicas == 0:
            raise DdlfError(f"no pod of {sts} resolves as {host(0)}: is the StatefulSet running in {namespace!r}?")
    return [f"{host(i)}:{port}" for i in range(replicas)]
