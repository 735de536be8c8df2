"""Several hosts on one machine, for real: Linux network namespaces joined by veth pairs to a bridge.

Each :class:`VirtualNetwork` builds, all inside namespaces of its own (nothing is added to the machine's own
network namespace):

* a *switch* namespace holding a bridge;
* one namespace per host (``hosts[i]``, address ``10.77.0.(11+i)``) and one for the master (``10.77.0.2``), each
  with ``lo`` and an ``eth0`` that is one end of a veth pair whose other end is a port of the bridge.

Links can be shaped and broken while programs run: :meth:`VirtualNetwork.shape` caps a host's bandwidth (a
``tbf`` qdisc on both ends of its veth), :meth:`VirtualNetwork.link` takes its link down or up, and
:meth:`VirtualNetwork.drop` drops a share of its packets at random (nftables ``numgen random``). Added latency
would be ``tc netem``'s job, but kernels built without ``sch_netem`` (this project's CI machines among them)
refuse it, so :class:`DelayRelay` (run in the master's namespace) adds a fixed one-way delay to every byte of
the master's connections instead, on top of the real veth path.

Tear-down is complete even when the caller fails: :meth:`VirtualNetwork.close` (also run by ``with``, at
interpreter exit, and for networks of dead owners by :func:`remove_stale`) kills every process in the
namespaces and deletes them, which removes the veths and the bridge with them.

Needs root (or CAP_NET_ADMIN and CAP_SYS_ADMIN) and iproute2; :func:`available` says whether this machine can.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import signal
import subprocess
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

SUBNET = "10.77.0"
PREFIX = "ddlfnet"


@dataclass
class Host:
    """One namespace: its name, address, and the bridge-side end of its link."""

    name: str
    ns: str
    ip: str
    port: str  # the veth end in the switch namespace
    procs: list[subprocess.Popen[Any]] = field(default_factory=list)


def _sh(argv: list[str], check: bool) -> subprocess.CompletedProcess[str]:
    done = subprocess.run(argv, capture_output=True, text=True)
    if check and done.returncode != 0:
        raise RuntimeError(f"{' '.join(argv)}: {done.stderr.strip() or f'exit status {done.returncode}'}")
    return done


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    return _sh(["ip", *args], check)


def _in(ns: str, *argv: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    return _sh(["ip", "netns", "exec", ns, *argv], check)


def available() -> tuple[bool, str]:
    """Whether network namespaces can be made here, and why not."""
    if os.geteuid() != 0:
        return False, "needs root (network namespaces and veth pairs)"
    probe = f"{PREFIX}-probe-{os.getpid()}"
    try:
        made = _ip("netns", "add", probe, check=False)
    except FileNotFoundError:
        return False, "iproute2 (the ip command) is not installed"
    if made.returncode != 0:
        return False, f"ip netns add failed: {made.stderr.strip()}"
    _ip("netns", "del", probe, check=False)
    return True, ""


def _namespaces() -> list[str]:
    out = _ip("netns", "list", check=False).stdout
    return [line.split()[0] for line in out.splitlines() if line.strip()]


def remove_stale() -> list[str]:
    """Delete the namespaces of networks whose owning process is gone (a test killed before its tear-down)."""
    removed = []
    for ns in _namespaces():
        parts = ns.split("-")
        if len(parts) < 3 or parts[0] != PREFIX or not parts[1].isdigit():
            continue
        if not os.path.exists(f"/proc/{parts[1]}"):
            _kill_namespace(ns)
            removed.append(ns)
    return removed


def _kill_namespace(ns: str) -> None:
    pids = _ip("netns", "pids", ns, check=False).stdout.split()
    for pid in pids:
        with contextlib.suppress(ProcessLookupError, ValueError):
            os.kill(int(pid), signal.SIGKILL)
    _ip("netns", "del", ns, check=False)


class VirtualNetwork:
    """``n_hosts`` hosts and a master on one bridge. Use as a context manager."""

    _serial = 0

    def __init__(self, n_hosts: int) -> None:
        if not 1 <= n_hosts <= 200:
            raise ValueError("between 1 and 200 hosts")
        VirtualNetwork._serial += 1
        self.id = f"{PREFIX}-{os.getpid()}-{VirtualNetwork._serial}"
        self.switch = f"{self.id}-sw"
        self.master = Host("master", f"{self.id}-m", f"{SUBNET}.2", "pm")
        self.hosts = [Host(f"host{i}", f"{self.id}-h{i}", f"{SUBNET}.{11 + i}", f"ph{i}") for i in range(n_hosts)]
        self._built = False
        self._closed = False

    # -- life cycle -------------------------------------------------------------------------------------

    def __enter__(self) -> VirtualNetwork:
        self.build()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def build(self) -> None:
        remove_stale()
        atexit.register(self.close)
        self._built = True
        try:
            _ip("netns", "add", self.switch)
            _in(self.switch, "ip", "link", "set", "lo", "up")
            _in(self.switch, "ip", "link", "add", "br0", "type", "bridge")
            _in(self.switch, "ip", "link", "set", "br0", "up")
            for k, host in enumerate([self.master, *self.hosts]):
                _ip("netns", "add", host.ns)
                _in(host.ns, "ip", "link", "set", "lo", "up")
                tmp_a, tmp_b = f"dv{os.getpid() % 10**6}a{k}", f"dv{os.getpid() % 10**6}b{k}"
                _ip("link", "add", tmp_a, "type", "veth", "peer", "name", tmp_b)
                _ip("link", "set", tmp_a, "netns", host.ns)
                _ip("link", "set", tmp_b, "netns", self.switch)
                _in(host.ns, "ip", "link", "set", tmp_a, "name", "eth0")
                _in(host.ns, "ip", "addr", "add", f"{host.ip}/24", "dev", "eth0")
                _in(host.ns, "ip", "link", "set", "eth0", "up")
                _in(self.switch, "ip", "link", "set", tmp_b, "name", host.port)
                _in(self.switch, "ip", "link", "set", "dev", host.port, "master", "br0")
                _in(self.switch, "ip", "link", "set", host.port, "up")
        except BaseException:
            self.close()
            raise

    def close(self) -> None:
        """Stop every process started in the network and delete its namespaces (veths and bridge go with
        them). Safe to call twice."""
        if self._closed or not self._built:
            return
        self._closed = True
        for host in [self.master, *self.hosts]:
            for p in host.procs:
                if p.poll() is None:
                    with contextlib.suppress(ProcessLookupError):
                        p.terminate()
            deadline = time.monotonic() + 3
            for p in host.procs:
                with contextlib.suppress(subprocess.TimeoutExpired):
                    p.wait(max(0.0, deadline - time.monotonic()))
                if p.poll() is None:
                    p.kill()
                    p.wait()
        for ns in [h.ns for h in (self.master, *self.hosts)] + [self.switch]:
            _kill_namespace(ns)
        with contextlib.suppress(ValueError):
            atexit.unregister(self.close)

    def leftovers(self) -> list[str]:
        """Namespaces of this network that still exist (empty after :meth:`close`)."""
        return [ns for ns in _namespaces() if ns.startswith(self.id + "-")]

    # -- running programs ------------------------------------------------------------------------------

    def popen(self, host: Host, argv: Sequence[str], **kwargs: Any) -> subprocess.Popen[Any]:
        """Start ``argv`` in ``host``'s namespace; it is stopped by :meth:`close`."""
        p = subprocess.Popen(["ip", "netns", "exec", host.ns, *argv], **kwargs)
        host.procs.append(p)
        return p

    def run(self, host: Host, argv: Sequence[str], timeout: float = 600, **kwargs: Any) -> subprocess.CompletedProcess:
        """Run ``argv`` to completion in ``host``'s namespace."""
        kwargs.setdefault("capture_output", True)
        kwargs.setdefault("text", True)
        return subprocess.run(["ip", "netns", "exec", host.ns, *argv], timeout=timeout, **kwargs)

    # -- shaping and faults ----------------------------------------------------------------------------

    def shape(self, host: Host, rate_mbit: float | None) -> None:
        """Cap ``host``'s link at ``rate_mbit`` megabits per second in each direction (None: uncapped)."""
        for ns, dev in ((host.ns, "eth0"), (self.switch, host.port)):
            _in(ns, "tc", "qdisc", "del", "dev", dev, "root", check=False)
            if rate_mbit is not None:
                # A bucket of 1 ms of traffic (at least 64 KiB) and up to 50 ms of queue: smooth at Gbit rates.
                burst = max(64 * 1024, int(rate_mbit * 1e6 / 8 / 1000))
                _in(ns, "tc", "qdisc", "add", "dev", dev, "root", "tbf", "rate", f"{rate_mbit}mbit",
                    "burst", str(burst), "latency", "50ms")  # fmt: skip

    def link(self, host: Host, up: bool) -> None:
        """Take ``host``'s link down (both ends lose carrier, as when a cable is pulled) or bring it up."""
        _in(self.switch, "ip", "link", "set", host.port, "up" if up else "down")

    def drop(self, host: Host, percent: float) -> None:
        """Drop ``percent`` % of the TCP packets ``host`` receives and sends, at random (0: stop dropping)."""
        _in(host.ns, "nft", "delete", "table", "inet", "ddlf_drop", check=False)
        if percent <= 0:
            return
        cutoff = str(max(1, round(percent * 100)))  # numgen over 10,000: hundredths of a percent
        _in(host.ns, "nft", "add", "table", "inet", "ddlf_drop")
        for chain, hook in (("rx", "input"), ("tx", "output")):
            _in(host.ns, "nft", "add", "chain", "inet", "ddlf_drop", chain,
                f"{{ type filter hook {hook} priority 0; }}")  # fmt: skip
            _in(host.ns, "nft", "add", "rule", "inet", "ddlf_drop", chain, "meta", "l4proto", "tcp",
                "numgen", "random", "mod", "10000", "<", cutoff, "drop")  # fmt: skip


def start_workers(
    net: VirtualNetwork,
    workdir: str,
    *,
    token: str,
    port: int = 7070,
    tls: tuple[str, str] | None = None,
    threads: int = 1,
    extra: Sequence[str] = (),
    hosts: Sequence[Host] | None = None,
) -> list[str]:
    """Start a ``ddlf-worker`` on each host (``HOST_IP:port``), wait until all listen, return their addresses.
    ``tls``: ``(cert.pem, key.pem)`` paths. Logs go to ``workdir/<host>.log``."""
    import sys

    env = {**os.environ, "DDLF_TOKEN": token}
    started = []
    for host in hosts if hosts is not None else net.hosts:
        ready = os.path.join(workdir, f"{host.name}.ready")
        with contextlib.suppress(FileNotFoundError):
            os.unlink(ready)
        argv = [sys.executable, "-m", "ddlf.worker", "--listen", f"{host.ip}:{port}", "--ready-file", ready,
                "--threads", str(threads), *extra]  # fmt: skip
        if tls:
            argv += ["--tls-cert", tls[0], "--tls-key", tls[1]]
        log = open(os.path.join(workdir, f"{host.name}.log"), "ab")  # noqa: SIM115 - owned by the process
        proc = net.popen(host, argv, env=env, stdout=log, stderr=subprocess.STDOUT)
        log.close()
        started.append((host, ready, proc))
    deadline = time.monotonic() + 60
    for host, ready, proc in started:
        while not os.path.exists(ready):
            if proc.poll() is not None:
                raise RuntimeError(f"the worker on {host.name} exited; see {workdir}/{host.name}.log")
            if time.monotonic() > deadline:
                raise TimeoutError(f"the worker on {host.name} did not start within 60 s")
            time.sleep(0.05)
    return [f"{host.ip}:{port}" for host, _, _ in started]


def start_sshd(net: VirtualNetwork, host: Host, workdir: str) -> list[str]:
    """Run an OpenSSH server on ``host``'s address (port 22) that accepts root with a key made in ``workdir``.
    Returns the ssh options a client needs (``-i KEY`` and no host-key prompts). Needs Debian's
    openssh-server."""
    sshd = "/usr/sbin/sshd"
    if not os.path.exists(sshd):
        raise FileNotFoundError("no /usr/sbin/sshd (Debian: apt-get install openssh-server)")
    os.makedirs("/run/sshd", exist_ok=True)  # sshd's privilege-separation directory
    key = os.path.join(workdir, "id_ed25519")
    if not os.path.exists(key):
        _sh(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", key], True)
        with open(key + ".pub") as src, open(os.path.join(workdir, "authorized_keys"), "w") as dst:
            dst.write(src.read())
    host_key = os.path.join(workdir, f"host-{host.name}")
    if not os.path.exists(host_key):
        _sh(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", host_key], True)
    config = os.path.join(workdir, f"sshd-{host.name}.conf")
    with open(config, "w") as f:
        f.write(
            f"ListenAddress {host.ip}\nPort 22\nHostKey {host_key}\nPidFile {workdir}/sshd-{host.name}.pid\n"
            f"AuthorizedKeysFile {workdir}/authorized_keys\nPermitRootLogin prohibit-password\n"
            "PasswordAuthentication no\nKbdInteractiveAuthentication no\nUsePAM no\nStrictModes no\n"
        )
    net.popen(host, [sshd, "-D", "-e", "-f", config], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 10
    while _in(host.ns, "ss", "-ltn", "sport = :22", check=False).stdout.count(host.ip) == 0:
        if time.monotonic() > deadline:
            raise TimeoutError(f"sshd on {host.name} did not start")
        time.sleep(0.05)
    return ["-i", key, "-o", "StrictHostKeyChecking=no", "-o", "UserKnownHostsFile=/dev/null", "-o", "LogLevel=ERROR"]
