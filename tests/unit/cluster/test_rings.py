"""The master's ring plans (``ddlf.cluster.rings``) without daemons: what each member is told."""

from __future__ import annotations

import pickle

import pytest

from ddlf.cluster.rings import RingPlan, host_of, shares_hosts
from ddlf.ring_spec import LocalRing, RingSpec

from ...certs import make_certs

GROUP = "0123456789abcdef0123456789abcdef"


def test_a_flat_ring_gives_each_member_its_rank_and_everyone_s_address() -> None:
    plan = RingPlan((4, 1, 7), ("a:1", "b:1", "c:1"), timeout=30.0, liveness=5.0, group=GROUP)
    spec = plan.spec(1)
    assert spec.rank == 1 and spec.addresses == ("a:1", "b:1", "c:1") and spec.group == GROUP
    assert (spec.timeout, spec.liveness, spec.streams) == (30.0, 5.0, 1)
    assert spec.tls_ca is None and spec.local is None
    with pytest.raises(ValueError):
        plan.spec(2)  # not a member


@pytest.fixture(scope="module")
def ca(tmp_path_factory: pytest.TempPathFactory) -> bytes:
    return make_certs(tmp_path_factory.mktemp("certs"))["ca"].read_bytes()


def test_a_hierarchical_ring_ranks_hosts_and_indexes_members_within_them(ca: bytes) -> None:
    plan = RingPlan((0, 1, 2, 3), ("h1:1", "h2:1", "h1:2", "h2:2"), hierarchical=True, tls=(ca, None))
    assert plan.hosts() == [[0, 2], [1, 3]]  # hosts in order of first appearance
    s2 = plan.spec(2)
    assert s2.rank == 0 and s2.local == LocalRing(1, ("h1:1", "h1:2"), 4)
    assert s2.addresses == ("h1:1", "h2:1")  # the ring between hosts: each host's first member
    assert s2.tls_ca == ca and s2.tls_domain is None
    s3 = plan.spec(3)
    assert s3.rank == 1 and s3.local is not None and s3.local.index == 1


@pytest.mark.parametrize(
    ("kw", "match"),
    [
        ({"workers": (), "addresses": ()}, "at least one worker"),
        ({"workers": (0, 1), "addresses": ("a:1",)}, "one address per worker"),
        ({"workers": (0,), "addresses": ("a:1",), "streams": 17}, "streams"),
        ({"workers": (0,), "addresses": ("a:1",), "timeout": 0.5}, "timeout"),
        ({"workers": (0,), "addresses": ("a:1",), "liveness": 0.0}, "liveness"),
    ],
)
def test_a_plan_that_cannot_work_is_refused(kw: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        RingPlan(**kw)


def test_a_spec_is_checked_once_where_it_is_made_by_the_ring_s_own_checks() -> None:
    with pytest.raises(ValueError, match="32 hex digits"):
        RingSpec("not-hex", 0, ("a:1",))
    with pytest.raises(ValueError, match="rank 2 of a ring of 2"):
        RingSpec(GROUP, 2, ("a:1", "b:1"))
    with pytest.raises(ValueError, match="at least 1 second"):
        RingSpec(GROUP, 0, ("a:1",), timeout=float("nan"))
    with pytest.raises(ValueError, match="not a place in a hierarchical ring"):
        RingSpec(GROUP, 0, ("a:1",), local=LocalRing(3, ("a:1", "a:2"), 2))
    with pytest.raises(ValueError):
        RingSpec(GROUP, 0, ("a:1",), tls_ca=b"not a certificate")
    spec = RingSpec(GROUP, 0, ("a:1",))
    assert pickle.loads(pickle.dumps(spec)) == spec  # it travels to the worker as it is


def test_hosts_are_the_host_part_of_addresses() -> None:
    assert host_of("10.0.0.1:7070") == "10.0.0.1" and host_of("[::1]:7070") == "::1"  # brackets removed
    assert shares_hosts(["a:1", "b:1", "a:2"]) and not shares_hosts(["a:1", "b:1"])
