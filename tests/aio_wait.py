"""Waiting, in an async test, for a condition that the event loop's own tasks bring about."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

_POLL_S = 0.005


async def until(condition: Callable[[], object], what: str, timeout_s: float = 10.0) -> None:
    """Polls `condition` on the running loop (the streams under test run on it) and fails
    naming `what` once `timeout_s` passed without it."""
    deadline_s = asyncio.get_running_loop().time() + timeout_s
    while not condition():
        assert asyncio.get_running_loop().time() < deadline_s, f"timed out waiting for {what}"
        await asyncio.sleep(_POLL_S)
