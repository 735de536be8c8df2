"""``cluster.toml`` (``ddlf.cluster.cluster_file``) without daemons: what it gives ``ddlf.Cluster``, and a clear
``ConfigError`` naming the file and line for every mistake."""

from __future__ import annotations

from pathlib import Path

import pytest

import ddlf
from ddlf.cluster.cluster_file import load


def _write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "cluster.toml"
    path.write_text(text)
    return path


def test_a_full_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "token").write_text("s3cret\n")
    path = _write(
        tmp_path,
        'workers = ["node1:7070", "10.0.0.2:7071"]\n'
        'token_file = "token"\ntls_ca = "ca.pem"\ntls_domain = "ddlf.internal"\n'
        "timeout = 600\nheartbeat_timeout = 10.5\n"
        '[launch]\nssh_user = "ml"\nworker_args = ["--threads", "8"]\n',
    )
    cfg = load(path)
    assert cfg.workers == ["node1:7070", "10.0.0.2:7071"]
    assert cfg.token_file == (tmp_path / "token").resolve() and cfg.tls_ca == (tmp_path / "ca.pem").resolve()
    assert cfg.launch.ssh_user == "ml" and cfg.launch.worker_args == ["--threads", "8"]
    assert cfg.launch.python == "python3"  # the default
    kw = cfg.cluster_kwargs()
    assert kw == {
        "token": "s3cret",
        "timeout": 600.0,
        "heartbeat_timeout": 10.5,
        "tls_ca": cfg.tls_ca,
        "tls_domain": "ddlf.internal",
    }


def test_the_token_comes_from_the_environment_without_a_token_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("DDLF_TOKEN", "from-env")
    assert load(_write(tmp_path, 'workers = ["h:1"]\n')).token() == "from-env"
    monkeypatch.delenv("DDLF_TOKEN")
    assert load(_write(tmp_path, 'workers = ["h:1"]\n')).token() is None


@pytest.mark.parametrize(
    ("text", "match"),
    [
        ("workers = [", r"cluster\.toml"),  # not TOML: the parser's line and column
        ("timeout = 5\n", "no 'workers' list"),
        ("workers = []\n", r"line 1: workers: expected a non-empty list"),
        ('workers = ["h:1"]\nworkers_typo = 1\n', "line 2: workers_typo: unknown setting"),
        ('workers = ["nohost"]\n', "'nohost' is not \"host:port\""),
        ('workers = ["h:99999"]\n', 'is not "host:port"'),
        ('workers = ["h:1"]\n\ntimeout = -1\n', "line 3: timeout: expected a positive number"),
        ('workers = ["h:1"]\ntimeout = true\n', "timeout: expected a positive number"),
        ('workers = ["h:1"]\ntls_ca = 5\n', "tls_ca: expected a path"),
        ('workers = ["h:1"]\nlaunch = 3\n', "launch: expected a table"),
        ('workers = ["h:1"]\n[launch]\nsshuser = "x"\n', "unknown \\[launch\\] setting"),
        ('workers = ["h:1"]\n[launch]\nworker_args = "--threads 8"\n', "expected a list of strings"),
        ('workers = ["h:1"]\ntls_domain = 1\n', "tls_domain: expected a host name"),
    ],
)
def test_every_mistake_is_a_config_error_naming_the_file(tmp_path: Path, text: str, match: str) -> None:
    path = _write(tmp_path, text)
    with pytest.raises(ddlf.ConfigError, match=match) as info:
        load(path)
    assert str(path) in str(info.value)
    assert isinstance(info.value, ddlf.DdlfError) and isinstance(info.value, ValueError)


def test_a_missing_file_or_token_file_is_a_config_error(tmp_path: Path) -> None:
    with pytest.raises(ddlf.ConfigError, match="cannot read"):
        load(tmp_path / "absent.toml")
    cfg = load(_write(tmp_path, 'workers = ["h:1"]\ntoken_file = "absent"\n'))
    with pytest.raises(ddlf.ConfigError, match="cannot read token_file"):
        cfg.token()
    (tmp_path / "empty").write_text("  \n")
    with pytest.raises(ddlf.ConfigError, match="is empty"):
        load(_write(tmp_path, 'workers = ["h:1"]\ntoken_file = "empty"\n')).token()
