"""The ``ddlf`` command and ``cluster.toml``."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest

import ddlf
from ddlf.cluster.cluster_file import ConfigError, load

from ..conftest import Daemon


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _ddlf(*args: str, env: dict[str, str] | None = None, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "ddlf.cli", *args], capture_output=True, text=True, timeout=timeout, env=env
    )


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ('workers = ["a:1"\nconnect_timeout = 3\n', "line 2"),  # TOML syntax: tomllib names line and column
        ('workers = ["a:1"]\n\nheartbeat_timeot = 3\n', "line 3: heartbeat_timeot: unknown setting"),
        ('timeout = 5\nworkers = ["no-port"]\n', "line 2: workers: 'no-port' is not \"host:port\""),
        ('workers = ["a:1"]\ntimeout = -1\n', "line 2: timeout: expected a positive number"),
        ("timeout = 5\n", "no 'workers' list"),
        ('workers = ["a:1"]\n[launch]\nssh_options = "-i key"\n', "line 3: ssh_options: expected a list of strings"),
        ('workers = ["a:1"]\n\n[launch]\nsudo = true\n', "line 4: sudo: unknown [launch] setting"),
        ('workers = ["a:1"]\nlaunch = 3\n', "line 2: launch: expected a table"),
    ],
)
def test_a_malformed_cluster_file_names_the_line(tmp_path: Path, text: str, expected: str) -> None:
    path = tmp_path / "cluster.toml"
    path.write_text(text)
    with pytest.raises(ConfigError, match=r"cluster\.toml") as info:
        load(path)
    assert expected in str(info.value)
    out = _ddlf("status", "--config", str(path))
    assert out.returncode == 2 and expected in out.stderr


def test_from_config_connects_with_the_token_file(daemon: Daemon, tmp_path: Path) -> None:
    (tmp_path / "token").write_text(daemon.token + "\n")
    (tmp_path / "cluster.toml").write_text(f'workers = ["{daemon.address}"]\ntoken_file = "token"\ntimeout = 30\n')
    with ddlf.Cluster.from_config(tmp_path / "cluster.toml") as c:
        assert c.timeout == 30
        assert c.run(lambda: "hi") == ["hi"]


def test_status_lists_live_workers_and_says_which_is_down(daemon: Daemon, tmp_path: Path) -> None:
    with ddlf.Cluster([daemon.address], token=daemon.token) as c:
        c.set("weights", np.zeros(10))
        c.put_dataset("numbers", np.arange(1000))
    dead = f"127.0.0.1:{_free_port()}"
    (tmp_path / "token").write_text(daemon.token)
    (tmp_path / "cluster.toml").write_text(f'workers = ["{daemon.address}", "{dead}"]\ntoken_file = "token"\n')
    out = _ddlf("status", "--config", str(tmp_path / "cluster.toml"), "--timeout", "2")
    assert out.returncode == 1, out.stderr  # one worker is down
    lines = out.stdout.strip().splitlines()
    assert lines, out.stderr
    assert lines[0].split()[:3] == ["id", "address", "version"], out.stderr
    live = next(line for line in lines if daemon.address in line)
    assert ddlf.__version__ in live and "idle" in live and "1 vars" in live and "numbers (7.8 KiB)" in live
    down = next(line for line in lines if dead in line)
    assert "DOWN" in down


def test_worker_subcommand_is_the_daemon() -> None:
    out = _ddlf("worker", "--help")
    assert out.returncode == 0 and "--tls-cert" in out.stdout
    assert out.stdout.startswith("usage: ddlf worker "), out.stdout  # its own name, not ddlf-worker's


def test_ddlf_up_without_a_token_says_so(tmp_path: Path) -> None:
    config = tmp_path / "cluster.toml"
    config.write_text('workers = ["127.0.0.1:1"]\n')
    env = {k: v for k, v in os.environ.items() if k != "DDLF_TOKEN"}
    out = _ddlf("up", str(config), env=env)
    assert out.returncode == 1 and "ddlf up needs a token" in out.stderr


def _busy_until(started: str, stop: str) -> str:
    """Busy in the worker's Python until ``stop`` exists (at most 120 s)."""
    import os
    import time

    open(started, "w").close()
    deadline = time.monotonic() + 120
    while not os.path.exists(stop) and time.monotonic() < deadline:
        time.sleep(0.01)
    return "done"


def test_status_and_stacks_answer_for_a_worker_busy_with_another_master(daemon: Daemon, tmp_path: Path) -> None:
    """``ddlf status`` and ``ddlf stacks`` connect to a worker whose Python is busy with another master's call and
    answer at once: connecting asks nothing of the worker's Python (it was told its index first, and the commands
    showed a busy worker as DOWN)."""
    started, stop = tmp_path / "started", tmp_path / "stop"
    env = {**os.environ, "DDLF_TOKEN": daemon.token or ""}
    with ddlf.Cluster([daemon.address], token=daemon.token) as other:
        result: dict[str, object] = {}
        runner = threading.Thread(
            target=lambda: result.setdefault("v", other.run_on(0, _busy_until, str(started), str(stop)))
        )
        runner.start()
        try:
            while not started.exists():
                assert runner.is_alive(), result
                time.sleep(0.02)
            status = _ddlf("status", daemon.address, "--timeout", "10", env=env)
            assert status.returncode == 0, status.stdout + status.stderr
            line = next(line for line in status.stdout.splitlines() if daemon.address in line)
            assert "DOWN" not in line and "run:_busy_until" in line, status.stdout
            stacks = _ddlf("stacks", daemon.address, "--timeout", "10", env=env)
            assert stacks.returncode == 0 and "_busy_until" in stacks.stdout, stacks.stdout + stacks.stderr
            with ddlf.Cluster([daemon.address], token=daemon.token, timeout=10) as watcher:  # a script that watches
                assert watcher.status()[0]["running"] == "run:_busy_until"
            assert runner.is_alive()  # all of it answered while the call still ran
        finally:
            stop.touch()
            runner.join(120)
    assert result["v"] == "done"


def test_ddlfs_own_functions_never_take_the_place_of_a_users(daemon: Daemon) -> None:
    """ddlf's own functions (``ddlf status`` pushes a ``describe`` of its own) live under their module's name: a
    user's function of the same name stays, and the list of functions and a reset count only the user's."""

    def describe() -> str:
        return "my own describe"

    with ddlf.Cluster([daemon.address], token=daemon.token) as c:
        c.add_function(describe)
        status = _ddlf("status", daemon.address, env={**os.environ, "DDLF_TOKEN": daemon.token or ""})
        assert status.returncode == 0 and "0 vars, 1 fns" in status.stdout, status.stdout + status.stderr
        assert c.run("describe") == ["my own describe"]
        assert c.functions() == [["describe"]]
        c.datasets()  # a ddlf function pushed from this master too
        assert c.functions() == [["describe"]]
        assert [d["functions"] for d in c.reset()] == [1]  # what ddlf status reports dropped: the user's


def test_ddlf_demo_passes_every_option_to_the_example() -> None:
    """``ddlf demo --epochs 1`` as the README writes it: argparse had refused every option after the subcommand."""
    root = Path(__file__).resolve().parents[2]
    command = [sys.executable, "-m", "ddlf.cli", "demo"]
    shown = subprocess.run([*command, "--help"], capture_output=True, text=True, timeout=120, cwd=root)
    assert shown.returncode == 0 and "--epochs" in shown.stdout and "--mode" in shown.stdout, shown.stderr
    bad = subprocess.run([*command, "--epochs", "one"], capture_output=True, text=True, timeout=120, cwd=root)
    assert bad.returncode == 2 and "mnist_sync.py: error: argument --epochs" in bad.stderr, bad.stderr


def test_status_without_the_token_says_the_worker_refused_it_and_where_the_token_comes_from(daemon: Daemon) -> None:
    """A worker that refuses the token is up: REFUSED, not DOWN, and the reason whole (it was cut at 70
    characters, before the part that says what to do)."""
    env = {k: v for k, v in os.environ.items() if k != "DDLF_TOKEN"}
    out = _ddlf("status", daemon.address, env=env)
    assert out.returncode == 1, out.stdout + out.stderr
    row, why = (line for line in out.stdout.splitlines() if daemon.address in line)
    assert "REFUSED" in row and "DOWN" not in row, out.stdout
    assert "refused authentication" in why and "DDLF_TOKEN" in why, out.stdout
