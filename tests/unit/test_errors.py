"""The error model without daemons: the extension's error classes map to ddlf.errors, several workers' errors
become one exception that is still catchable as their class."""

from __future__ import annotations

import sys

import pytest

import ddlf
from ddlf import _ddlf
from ddlf.errors import _CLASSES, WorkerErrorGroup, WorkerErrors, group, raise_for

if sys.version_info >= (3, 11):
    from builtins import ExceptionGroup
else:  # the backport ddlf depends on there
    from exceptiongroup import ExceptionGroup


def test_every_error_class_of_the_extension_has_its_python_class() -> None:
    members = [getattr(_ddlf.ErrorClass, n) for n in dir(_ddlf.ErrorClass) if not n.startswith("_")]
    members = [m for m in members if isinstance(m, _ddlf.ErrorClass)]
    assert len(members) == 13
    for m in members:
        cls = _CLASSES[m]
        assert issubclass(cls, ddlf.DdlfError)
        assert cls.__name__ in ddlf.errors.__all__


def test_one_error_is_raised_as_itself() -> None:
    e = ddlf.RemoteError("boom", worker_id=1)
    assert group([e]) is e
    with pytest.raises(ddlf.RemoteError) as info:
        raise_for([1, e])
    assert info.value is e
    assert raise_for([1, 2]) == [1, 2]


def test_several_remote_errors_are_an_exception_group_of_their_class() -> None:
    errs = [ddlf.RemoteError("a", worker_id=0, remote_type="X"), ddlf.RemoteError("b", worker_id=1)]
    g = group(errs)
    assert isinstance(g, ExceptionGroup) and isinstance(g, WorkerErrorGroup) and isinstance(g, WorkerErrors)
    assert isinstance(g, ddlf.RemoteError) and isinstance(g, ddlf.DdlfError)
    assert list(g.exceptions) == errs
    assert g.worker_id == 0 and g.remote_type == "X"  # the first worker's attributes
    assert "2 workers failed" in str(g) and "a" in str(g)
    # what `except* ddlf.RemoteError` does: every worker's error matches, nothing is left
    caught, left = g.split(ddlf.RemoteError)
    assert caught is not None and list(caught.exceptions) == errs and left is None
    # split keeps the class (a condition on attributes sees the group first: it carries the first worker's)
    match, rest = g.split(lambda e: e is errs[0])
    assert isinstance(match, ddlf.RemoteError) and list(match.exceptions) == errs[:1]
    assert rest is not None and list(rest.exceptions) == errs[1:]


def test_mixed_errors_group_under_their_common_class() -> None:
    g = group([ddlf.RemoteError("a"), ddlf.NotFoundError("b")])
    assert isinstance(g, WorkerErrorGroup) and not isinstance(g, ddlf.RemoteError)
    assert isinstance(g, ddlf.DdlfError)


def test_connection_errors_stay_catchable_as_their_class() -> None:
    # OSError subclasses cannot also be ExceptionGroups: they raise their common class with .exceptions.
    errs = [ddlf.DeadlineExceeded("a", worker_id=0), ddlf.DeadlineExceeded("b", worker_id=1)]
    g = group(errs)
    assert isinstance(g, ddlf.DeadlineExceeded) and isinstance(g, TimeoutError) and isinstance(g, WorkerErrors)
    assert list(g.exceptions) == errs and g.worker_id == 0
    g = group([ddlf.DeadlineExceeded("a"), ddlf.WorkerUnavailable("b")])
    assert type(g).__mro__[1] is ddlf.WorkerUnavailable


def test_a_remote_traceback_gets_the_source_lines_its_worker_lacked(tmp_path) -> None:
    script = tmp_path / "train.py"
    script.write_text("def step(worker):\n    return 1 / worker.zero\n")
    remote = (
        "Traceback (most recent call last):\n"
        f'  File "{script}", line 2, in step\n'
        '  File "/elsewhere/helpers.py", line 7, in shown\n'
        "    already_shown()\n"
        '  File "/not/on/this/host.py", line 3, in gone\n'
        "ZeroDivisionError: division by zero\n"
    )
    err = ddlf.RemoteError("worker 0 raised", remote_type="ZeroDivisionError", remote_traceback=remote)
    assert err.remote_traceback == (
        "Traceback (most recent call last):\n"
        f'  File "{script}", line 2, in step\n'
        "    return 1 / worker.zero\n"
        '  File "/elsewhere/helpers.py", line 7, in shown\n'
        "    already_shown()\n"
        '  File "/not/on/this/host.py", line 3, in gone\n'
        "ZeroDivisionError: division by zero\n"
    )
    assert "return 1 / worker.zero" in str(err)


def test_ddlfs_own_errors_raised_on_a_worker_come_back_as_their_class_too() -> None:
    """A ``DatasetError`` a worker raised is a ``RemoteError`` and a ``DatasetError`` (so a ``ValueError``):
    ``except ddlf.DatasetError`` catches it as the docs say. Other types, ddlf's errors with constructors of their
    own and ``OSError``-based ones stay plain ``RemoteError``\\ s; all pickle and group as before."""
    import pickle

    from ddlf.errors import RemoteError, group

    def remote(remote_type: str) -> RemoteError:
        return RemoteError(
            f"worker 0 (a:1) raised {remote_type}: bad",
            address="a:1",
            worker_id=0,
            remote_type=remote_type,
            remote_message="bad",
            remote_traceback="",
            request_id=7,
            kind="user",
        )

    e = remote("ddlf.errors.DatasetError")
    assert isinstance(e, ddlf.DatasetError) and isinstance(e, ValueError) and isinstance(e, RemoteError)
    assert type(e).__name__ == "RemoteDatasetError" and e.raised("DatasetError") and e.request_id == 7
    again = pickle.loads(pickle.dumps(e))
    assert type(again) is type(e) and again.remote_message == "bad" and again.worker_id == 0
    both = group([e, again])
    assert isinstance(both, ddlf.DatasetError) and isinstance(both, RemoteError) and len(both.exceptions) == 2
    assert isinstance(remote("ddlf.errors.RingBusy"), ddlf.TooManyRuns)
    for plain in ("builtins.ValueError", "ddlf.errors.CheckpointError", "ddlf.errors.DdlfError", "other.DatasetError"):
        assert type(remote(plain)) is RemoteError, plain
