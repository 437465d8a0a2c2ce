"""ops/systemd/: `systemd-analyze verify` and its offline security score; the env file's names."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from odbd.cli import apply_environment, config_from_args, daemon_parser
from odbd.errors import ConfigError

OPS = Path(__file__).resolve().parents[2] / "ops" / "systemd"
ANALYZE = shutil.which("systemd-analyze")
needs_analyze = pytest.mark.skipif(ANALYZE is None, reason="no `systemd-analyze` (package systemd)")


def local_unit(tmp_path: Path) -> Path:
    """The unit with ExecStart and EnvironmentFile pointing at files that exist here."""
    odbd = Path(sys.executable).with_name("odbd")
    text = (OPS / "odbd.service").read_text()
    assert "ExecStart=/opt/odbd/venv/bin/odbd\n" in text
    assert "EnvironmentFile=/etc/odbd/odbd.env\n" in text
    text = text.replace("/opt/odbd/venv/bin/odbd", str(odbd))
    text = text.replace("/etc/odbd/odbd.env", str(OPS / "odbd.env.example"))
    unit = tmp_path / "odbd.service"
    unit.write_text(text)
    return unit


@needs_analyze
def test_systemd_analyze_verify_accepts_the_unit(tmp_path):
    assert ANALYZE is not None
    result = subprocess.run(
        [ANALYZE, "verify", str(local_unit(tmp_path))], capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0, result.stderr
    assert "odbd.service" not in result.stderr, result.stderr  # no warning about our unit


@needs_analyze
def test_the_unit_is_hardened(tmp_path):
    assert ANALYZE is not None
    result = subprocess.run(
        [ANALYZE, "security", "--offline=true", "--no-pager", str(local_unit(tmp_path))],
        capture_output=True,
        text=True,
        timeout=60,
    )
    line = next(x for x in result.stdout.splitlines() if "Overall exposure level" in x)
    exposure = float(line.split(":")[1].split()[0])
    assert exposure <= 2.5, result.stdout  # systemd rates <= 3.9 "OK"; stock units score ~9


def test_graceful_stop_leaves_room_for_the_drain():
    unit = dict(
        line.split("=", 1)
        for line in (OPS / "odbd.service").read_text().splitlines()
        if "=" in line and not line.startswith("#")
    )
    env = env_example()
    assert unit["KillSignal"] == "SIGTERM"
    assert float(unit["TimeoutStopSec"]) > float(env["ODBD_DRAIN_TIMEOUT"])
    assert unit["EnvironmentFile"] == "/etc/odbd/odbd.env"


def env_example() -> dict[str, str]:
    lines = (OPS / "odbd.env.example").read_text().splitlines()
    return dict(x.split("=", 1) for x in lines if x.strip() and not x.startswith("#"))


def test_every_variable_of_the_env_example_is_a_daemon_flag():
    flags = {"ODBD_" + a.dest.upper() for a in daemon_parser()._actions if a.option_strings}
    unknown = set(env_example()) - flags
    assert not unknown, f"not odbd flags: {unknown}"


def test_the_env_example_authenticates_peers_and_passes_protected_mode(tmp_path):
    """It listens on 0.0.0.0 with peers on the network: without its job token (or mTLS) odbd
    refuses to start (issue 29)."""
    env = env_example()
    assert env["ODBD_JOB_TOKEN_FILE"] and env["ODBD_LISTEN"].startswith("0.0.0.0:")
    token = tmp_path / "job-token"
    token.write_text("0123456789abcdef0123456789abcdef\n")
    env.update(ODBD_JOB_TOKEN_FILE=str(token), ODBD_SOCKET=str(tmp_path / "s.sock"))
    env.update(ODBD_STATE_DIR=str(tmp_path / "state"), ODBD_DATASET_SIZE="100")
    del env["ODBD_DATASET"]
    parser = daemon_parser()
    apply_environment(parser, env)
    assert config_from_args(parser.parse_args([]), env).job_token
    del env["ODBD_JOB_TOKEN_FILE"]
    parser = daemon_parser()
    apply_environment(parser, env)
    with pytest.raises(ConfigError, match="--job-token-file.*--tls-cert.*--insecure"):
        config_from_args(parser.parse_args([]), env)
