"""The ``*_async`` twins of ``Cluster``'s blocking methods are written out (``ddlf.cluster.aio.AsyncVerbs``) so that
type checkers see them: each stays alike its method, and none is missing."""

from __future__ import annotations

import inspect

from ddlf import Cluster

TWINS = [name.removesuffix("_async") for name in dir(Cluster) if name.endswith("_async")]


def test_every_verb_that_talks_to_the_workers_has_an_awaitable_twin() -> None:
    verbs = {"set", "scatter", "get", "delete", "variables", "add_function", "remove_function", "functions", "run"}
    verbs |= {"run_on", "run_each", "allreduce", "call", "exec", "upload_module", "clean", "reset", "load_dataset"}
    verbs |= {"put_dataset", "datasets", "drop_dataset", "ping", "status", "shutdown"}
    assert set(TWINS) == verbs


def test_each_twin_is_a_coroutine_with_its_methods_parameters_and_return() -> None:
    for name in TWINS:
        method, twin = getattr(Cluster, name), getattr(Cluster, f"{name}_async")
        assert inspect.iscoroutinefunction(twin), name
        assert inspect.signature(twin) == inspect.signature(method), name
        assert f"ddlf.Cluster.{name}`" in (twin.__doc__ or ""), name
