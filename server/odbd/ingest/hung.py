"""Producers hung inside `dataset[i]`: how long each has held one view key in its lane header.

A producer writes the view key it is making into its lane's header before `dataset[i]` and
clears it after (`Lanes.in_flight`). The daemon reads every lane's header at each lease sweep;
a key seen continuously for `--lease-timeout` seconds is a sample its producer is stuck in. Lease
expiry alone cannot fix that: it re-leased the sample to the next producer, which got stuck too,
until no producer was left and the job waited forever saying producers were "making samples".
A supervised worker stuck this way is killed, which counts as a death with that sample in flight
(re-leased once, quarantined at the second), as a crash in `dataset[i]` does.

Pure: `track` and `hung` take the headers and the clock, and return plain values.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class InFlight:
    key: int  # the view key in the producer's lane header
    since_s: float  # loop time when this key was first seen there


def track(
    previous: Mapping[int, InFlight], headers: Mapping[int, int | None], now_s: float
) -> dict[int, InFlight]:
    """producer -> the key it makes and since when, from this sweep's lane headers
    (`headers`: producer -> key, None between samples). A key that changed starts anew."""
    tracked: dict[int, InFlight] = {}
    for producer, key in headers.items():
        if key is None:
            continue
        before = previous.get(producer)
        tracked[producer] = before if before and before.key == key else InFlight(key, now_s)
    return tracked


def hung(tracked: Mapping[int, InFlight], now_s: float, limit_s: float) -> dict[int, InFlight]:
    """The producers that have held one key for `limit_s` or longer."""
    return {p: f for p, f in tracked.items() if now_s - f.since_s >= limit_s}
