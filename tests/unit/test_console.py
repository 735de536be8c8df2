"""Frameworks' start-up notices kept off stderr (ddlf.frameworks.console), without daemons or frameworks."""

from __future__ import annotations

import logging
import os
import threading

import pytest

from ddlf.frameworks import console

# What TensorFlow 2.21 writes to fd 2 while it imports (cut from a real run), with other writers' lines between.
PREAMBLE = b"WARNING: All log messages before absl::InitializeLog() is called are written to STDERR\n"
ONEDNN = (
    b"I0000 00:00:1795602627.030730    8895 port.cc:153] oneDNN custom operations are on. You may see slightly "
    b"different numerical results due to floating-point round-off errors from different computation orders. To turn "
    b"them off, set the environment variable `TF_ENABLE_ONEDNN_OPTS=0`.\n"
)
CPU_GUARD = (
    b"I0000 00:00:1795602627.111515    8895 cpu_feature_guard.cc:227] This TensorFlow binary is optimized to use "
    b"available CPU instructions in performance-critical operations.\n"
    b"To enable the following instructions: AVX2 AVX512F FMA, in other operations, rebuild TensorFlow with the "
    b"appropriate compiler flags.\n"
)
DAEMON_WARNING = b"2026-11-25T10:34:31.481474Z  WARN worker: a daemon's own warning\n"
USER_WARNING = b"/work/app.py:14: UserWarning: the user's warning\n  warnings.warn('the user's warning')\n"
GLOG_ERROR = b"E0101 12:00:00.000001    77 cuda_driver.cc:152] failed call to cuInit: UNKNOWN ERROR (303)\n"
GLOG_WARNING = b"W0101 12:00:00.000001    77 numa.cc:9] could not open file to read NUMA node\n"


def test_notices_are_told_from_everything_else() -> None:
    data = (
        PREAMBLE
        + ONEDNN
        + DAEMON_WARNING
        + CPU_GUARD
        + USER_WARNING
        + GLOG_WARNING
        + b"a user's print\n"
        + PREAMBLE
        + ONEDNN
        + GLOG_ERROR
        + b"Traceback (most recent call last):\n"
        + CPU_GUARD
        + b"progress 50%\r"  # a line not finished yet: never held back
    )
    kept, notices = console.split_notices(data)
    assert kept == (
        DAEMON_WARNING
        + USER_WARNING
        + b"a user's print\n"
        + GLOG_ERROR  # errors always show
        + b"Traceback (most recent call last):\n"
        + b"progress 50%\r"
    )
    assert len(notices) == 9  # 2 preambles, 2 oneDNN, 2 two-line cpu_feature_guard, 1 warning
    assert notices[0] == PREAMBLE.decode().rstrip("\n")
    assert notices[3].startswith("To enable the following instructions")
    assert console.split_notices(b"") == (b"", [])
    assert console.split_notices(b"plain\n\nlines\n") == (b"plain\n\nlines\n", [])


def test_quiet_start_keeps_notices_off_fd_2_and_logs_them(
    capfd: pytest.CaptureFixture[str], caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("DDLF_LOG", raising=False)
    caplog.set_level(logging.INFO, logger="ddlf.frameworks")
    os.write(2, b"before\n")
    with console.quiet_start():
        os.write(2, PREAMBLE + ONEDNN)
        with console.quiet_start():  # nested (or another thread's): stderr comes back when the last one ends
            os.write(2, b"kept, in order\n")
        os.write(2, CPU_GUARD)
        # another thread writing meanwhile (a daemon's network thread): held back, then written out
        t = threading.Thread(target=os.write, args=(2, DAEMON_WARNING))
        t.start()
        t.join()
    os.write(2, b"after\n")
    assert capfd.readouterr().err == "before\nkept, in order\n" + DAEMON_WARNING.decode() + "after\n"
    logged = [r.getMessage() for r in caplog.records if r.name == "ddlf.frameworks"]
    assert len(logged) == 4 and "oneDNN" in logged[1] and logged[3].startswith("To enable")
    assert all(r.levelno == logging.INFO for r in caplog.records)


def test_quiet_start_restores_stderr_when_the_import_fails(
    capfd: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("DDLF_LOG", raising=False)
    with pytest.raises(ImportError), console.quiet_start():
        os.write(2, ONEDNN + b"why it failed\n")
        raise ImportError("no such framework")
    os.write(2, b"after\n")
    assert capfd.readouterr().err == "why it failed\nafter\n"


@pytest.mark.parametrize("setting", ["debug", "trace", "info,ddlf_worker=debug"])
def test_ddlf_log_debug_shows_everything(
    setting: str, capfd: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("DDLF_LOG", setting)
    assert console.framework_logs_shown()
    with console.quiet_start():
        os.write(2, PREAMBLE + ONEDNN)
    assert capfd.readouterr().err == (PREAMBLE + ONEDNN).decode()
    monkeypatch.setenv("DDLF_LOG", "warn")
    assert not console.framework_logs_shown()
