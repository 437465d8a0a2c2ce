"""Protected by default (issue 29): a multi-node daemon on the network must authenticate peers."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from odbd.cli import apply_environment, config_from_args, daemon_parser, run_daemon_command
from odbd.exposure import is_loopback, unprotected_reason

REPO = Path(__file__).resolve().parents[2]
PUBLIC = ["--peers", "10.0.0.1:7070,10.0.0.2:7070", "--listen", "0.0.0.0:7070"]


@pytest.mark.parametrize(
    ("address", "loopback"),
    [
        ("127.0.0.1:7070", True),
        ("127.8.9.10:1", True),
        ("[::1]:7070", True),
        ("localhost:7070", True),
        ("LOCALHOST:1", True),
        ("0.0.0.0:7070", False),
        ("[::]:7070", False),
        ("10.0.0.1:7070", False),
        ("odbd-train-0.odbd-train:7070", False),  # names are never resolved: network
        ("[::ffff:10.0.0.1]:7070", False),
    ],
)
def test_loopback_addresses(address: str, loopback: bool) -> None:
    assert is_loopback(address) is loopback


def _reason(**overrides: object) -> str | None:
    fields: dict[str, object] = {
        "num_nodes": 2,
        "node_rank": 0,
        "listen": "0.0.0.0:7070",
        "peers": ("10.0.0.1:7070", "10.0.0.2:7070"),
        "has_token": False,
        "has_tls": False,
        "insecure": False,
    }
    fields.update(overrides)
    return unprotected_reason(**fields)  # type: ignore[arg-type]


def test_an_exposed_unauthenticated_job_is_refused_and_each_remedy_lifts_it() -> None:
    reason = _reason()
    assert reason is not None and "listens on 0.0.0.0:7070" in reason
    for flag in ("--job-token-file", "--tls-cert", "--tls-key", "--tls-ca", "--insecure"):
        assert flag in reason
    assert _reason(has_token=True) is None
    assert _reason(has_tls=True) is None
    assert _reason(insecure=True) is None
    assert _reason(num_nodes=1, peers=()) is None  # nothing to join
    loopback = ("127.0.0.1:7070", "127.0.0.1:7071")
    assert _reason(listen="127.0.0.1:7070", peers=loopback) is None  # odbd demo, tests
    # A spoke listening on loopback still talks to a hub on the network.
    spoke = _reason(node_rank=1, listen="127.0.0.1:0")
    assert spoke is not None and "talks to 10.0.0.1:7070" in spoke


def test_the_daemon_exits_2_with_one_line(tmp_path, capsys, monkeypatch) -> None:
    import odbd.daemon.app

    monkeypatch.setattr(odbd.daemon.app, "run_daemon", lambda *a: pytest.fail("it started"))
    argv = ["--world", "2", "--nproc-per-node", "1", "--node-rank", "0", *PUBLIC]
    argv += ["--dataset-size", "5", "--socket", str(tmp_path / "s.sock")]
    assert run_daemon_command(argv, {}) == 2
    err = capsys.readouterr().err
    assert err.startswith("odbd: error: node 0 of a 2-node job listens on 0.0.0.0:7070")
    assert err.count("\n") == 1 and "--insecure" in err, err


@pytest.mark.parametrize(
    ("extra", "environ"),
    [(["--insecure"], {}), ([], {"ODBD_INSECURE": "true"}), (["--job-token-file", "{t}"], {})],
)
def test_insecure_or_a_token_lets_it_start(tmp_path, extra, environ) -> None:
    token = tmp_path / "token"
    token.write_text("s3cret-0123456789abcdef\n")
    argv = ["--world", "2", "--nproc-per-node", "1", "--node-rank", "0", *PUBLIC]
    argv += ["--dataset-size", "5", "--socket", str(tmp_path / "s.sock")]
    argv += [a.replace("{t}", str(token)) for a in extra]
    parser = daemon_parser()
    apply_environment(parser, environ)
    config = config_from_args(parser.parse_args(argv), environ)
    assert config.insecure or config.job_token


@pytest.mark.timeout(60)
def test_the_real_command_refuses_0_0_0_0_without_token_or_tls(tmp_path) -> None:
    """The must-show of issue 29, as an operator runs it: exit 2, one line, nothing left."""
    argv = [sys.executable, "-m", "odbd", "--world", "2", "--nproc-per-node", "1"]
    argv += ["--node-rank", "0", *PUBLIC, "--dataset-size", "5"]
    argv += ["--socket", str(tmp_path / "s.sock"), "--job-id", f"exposed{os.getpid()}"]
    env = dict(os.environ, PYTHONPATH=f"{REPO / 'server'}:{REPO / 'client'}")
    proc = subprocess.run(argv, capture_output=True, text=True, env=env, timeout=50)
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.count("\n") == 1 and "--job-token-file" in proc.stderr, proc.stderr
    assert "Traceback" not in proc.stderr and not (tmp_path / "s.sock").exists()
