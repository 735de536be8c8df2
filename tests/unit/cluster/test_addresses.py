"""A worker address is checked before anything connects: pure logic, no daemons."""

from __future__ import annotations

import pytest

import ddlf
from ddlf.settings import is_address


@pytest.mark.parametrize("bad", ["127.0.0.1", "localhost:", ":7070", "host:port", "host:0", "host:70000", 7070])
def test_an_address_without_a_port_is_refused_before_connecting(bad: object) -> None:
    """``Cluster(["127.0.0.1"])`` said "Connection refused", as if a daemon were down; the port was missing."""
    assert not is_address(bad)
    with pytest.raises(ddlf.ConfigError, match=r'worker addresses must be "host:port"'):
        ddlf.Cluster(["127.0.0.1:7070", bad])  # type: ignore[list-item]


def test_host_and_port_pass() -> None:
    assert all(is_address(a) for a in ("127.0.0.1:7070", "node-3.cluster:1", "[::1]:65535"))
