"""`odbd demo` in a pipe (as in CI): progress without repeated lines, logs removed or named."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
SMALL = ["--nodes", "1", "--ranks-per-node", "1", "--num-samples", "60", "--buffer", "16"]


def run_demo(*flags: str, timeout_s: float) -> tuple[subprocess.CompletedProcess[str], Path]:
    env = dict(os.environ, PYTHONPATH=f"{REPO / 'server'}:{REPO / 'client'}")
    proc = subprocess.run(
        [sys.executable, "-m", "odbd", "demo", *SMALL, *flags],
        capture_output=True,
        text=True,
        env=env,
        timeout=timeout_s,
    )
    match = re.search(r"logs in (\S+)", proc.stdout)
    assert match, proc.stdout + proc.stderr
    return proc, Path(match.group(1))


@pytest.mark.timeout(240)
def test_a_successful_demo_prints_each_progress_line_once_and_removes_its_logs():
    proc, logs = run_demo("--seconds-per-token", "0", timeout_s=200)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    progress = [line for line in proc.stdout.splitlines() if line.startswith("[")]
    assert progress and len(progress) == len(set(progress)), proc.stdout
    assert progress[-1].startswith("[" + "#" * 30 + "] 100.0%"), proc.stdout
    assert "\r" not in proc.stdout
    assert not logs.exists(), f"{logs} was left behind"


@pytest.mark.timeout(240)
def test_a_failed_demo_keeps_its_logs_and_names_them():
    # 10 ms is too little for the trainers: the demo gives up and must say where to look.
    proc, logs = run_demo("--seconds-per-token", "0.01", "--timeout", "0.01", timeout_s=200)
    try:
        assert proc.returncode == 1, proc.stdout + proc.stderr
        assert f"odbd demo: failed; logs kept in {logs}" in proc.stdout, proc.stdout
        assert (logs / "daemon0.log").exists()
    finally:
        shutil.rmtree(logs, ignore_errors=True)
