"""The suite's own rules: deadlines follow the machine, and leaks are found and named."""

from __future__ import annotations

import subprocess
import sys
import threading

import pytest

from tests.conftest import describe_leaks, leaks_since, snapshot, wait_for_leaks
from tests.integration.harness import SLOWDOWN_ENV, poll_until, scaled, slowdown


def test_slowdown_is_at_least_the_env_floor(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(SLOWDOWN_ENV, "9")  # above the load-average cap (8): the floor wins
    assert slowdown() == 9.0
    assert scaled(2.0) == 18.0
    monkeypatch.delenv(SLOWDOWN_ENV)
    assert 1.0 <= slowdown() <= 8.0


@pytest.mark.parametrize("value", ["0.5", "fast", "nan"])
def test_slowdown_refuses_a_bad_env_value(monkeypatch: pytest.MonkeyPatch, value: str) -> None:
    monkeypatch.setenv(SLOWDOWN_ENV, value)
    with pytest.raises(ValueError, match=f"{SLOWDOWN_ENV}='{value}' is not a number >= 1"):
        slowdown()


@pytest.mark.timeout(60)
def test_a_left_thread_and_child_are_found_and_named() -> None:
    before = snapshot()
    release = threading.Event()
    thread = threading.Thread(target=release.wait, name="left-behind", daemon=True)
    thread.start()
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    expected_child = f"child process {child.pid}: {sys.executable} -c import time"
    try:
        leaks = leaks_since(before)
        assert leaks.threads == [thread] and leaks.children == [child.pid]
        # Under load the child's /proc entry was once read before its command line was
        # readable (the suite ran beside other test runs); poll instead of reading once.
        poll_until(
            lambda: expected_child in describe_leaks("t", leaks_since(before)),
            "the child's command line is readable",
        )
        message = describe_leaks("tests/x.py::test_y", leaks)
        assert message.startswith("tests/x.py::test_y left behind:")
        assert "thread 'left-behind' (daemon) running Event.wait" in message
        assert expected_child in message
    finally:
        release.set()
        child.kill()
        child.wait()
        thread.join()
    assert not wait_for_leaks(before, grace_s=5.0)
