"""`odbd --migrate auto|off` and --link-gbps: what the daemon refuses, and what it shares with
its peers (the fingerprint: every daemon must run the same exchanges per round)."""

from __future__ import annotations

from pathlib import Path

import pytest

from odbd.config import DaemonConfig
from odbd.errors import ConfigError
from odbd.planner.config import Balance
from odbd.world import World


def config(**fields: object) -> DaemonConfig:
    return DaemonConfig(world=World(2, 2), dataset_size=8, **fields)  # type: ignore[arg-type]


def test_migrate_is_off_by_default_and_auto_reaches_the_planner_and_the_fingerprint() -> None:
    off, on = config(), config(migrate=True)
    assert not off.planner(8).migrate and on.planner(8).migrate
    assert "migrate" not in off.fingerprint(8)
    assert on.fingerprint(8)["migrate"] == "auto" and on.fingerprint(8)["link_gbps"] == "8.0"


@pytest.mark.parametrize(
    ("fields", "fix"),
    [
        ({"balance": Balance.RANK}, "use --balance node with it"),
        ({"link_gbps": 0.0}, "--link-gbps must be > 0"),
    ],
)
def test_migrate_auto_refuses_what_it_cannot_do_with_the_fix(
    fields: dict[str, object], fix: str
) -> None:
    with pytest.raises(ConfigError, match=fix):
        config(migrate=True, **fields)


def test_migrate_auto_runs_with_a_state_dir() -> None:
    """A restart with moves is exact (NodeState.release_held), so the pair is no longer refused."""
    assert config(migrate=True, state_dir=Path("/tmp/x")).migrate
