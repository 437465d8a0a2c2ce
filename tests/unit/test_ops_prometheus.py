"""ops/prometheus/: promtool accepts the rules and the scrape config; the alert unit tests pass."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

OPS = Path(__file__).resolve().parents[2] / "ops" / "prometheus"
PROMTOOL = shutil.which("promtool")
needs_promtool = pytest.mark.skipif(
    PROMTOOL is None, reason="no `promtool`: `apt-get install -y prometheus` (.ci/run does)"
)


def promtool(*args: str) -> subprocess.CompletedProcess[str]:
    assert PROMTOOL is not None
    return subprocess.run([PROMTOOL, *args], capture_output=True, text=True, timeout=60, cwd=OPS)


@needs_promtool
def test_promtool_check_rules_accepts_the_alert_rules():
    result = promtool("check", "rules", "odbd-alerts.yml")
    assert result.returncode == 0, result.stdout + result.stderr
    assert "SUCCESS: 10 rules found" in result.stdout


@needs_promtool
def test_promtool_rule_unit_tests_fire_the_alerts_as_documented():
    result = promtool("test", "rules", "odbd-alerts.test.yml")
    assert result.returncode == 0, result.stdout + result.stderr


@needs_promtool
def test_promtool_check_config_accepts_the_scrape_example():
    result = promtool("check", "config", "prometheus.yml")
    assert result.returncode == 0, result.stdout + result.stderr


def test_every_alert_has_severity_summary_and_description():
    import yaml

    groups = yaml.safe_load((OPS / "odbd-alerts.yml").read_text())["groups"]
    rules = [rule for group in groups for rule in group["rules"]]
    assert {r["alert"] for r in rules} >= {
        "OdbdRoundsStalled",
        "OdbdRoundsSlow",
        "OdbdStragglerPeer",
        "OdbdTrainerOverlapLow",
        "OdbdIngestStalledShmFull",
        "OdbdSamplesRejected",
        "OdbdQuotaNotProgressing",
    }
    for rule in rules:
        assert rule["labels"]["severity"] in ("warning", "critical"), rule["alert"]
        assert rule["annotations"]["summary"] and rule["annotations"]["description"]
