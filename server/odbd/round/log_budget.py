"""How many lines of one kind the log may take: a stranger must not be able to flood it (pure).

The first `burst` events of each `window_s` are logged; the rest are only counted, and the
next logged line says how many were left out, so nothing is hidden, only summarised.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(slots=True)
class LogBudget:
    burst: int = 5
    window_s: float = 10.0
    _window_start: float = float("-inf")
    _logged: int = 0
    _suppressed: int = 0

    def admit(self, now: float) -> tuple[bool, int]:
        """(log this event?, how many events were not logged since the last logged one)."""
        if now - self._window_start >= self.window_s:
            self._window_start, self._logged = now, 0
        if self._logged >= self.burst:
            self._suppressed += 1
            return False, 0
        self._logged += 1
        suppressed, self._suppressed = self._suppressed, 0
        return True, suppressed
