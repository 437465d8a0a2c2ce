"""Bytes of round-protocol payloads this daemon sent and received, for /metrics.

Counted where the messages are built or read (hub.py, spoke.py): the serialized Contribution a
node sends and the RoundResult it gets back, per peer stream (a relay of the tree counts both
of its sides: its children's contributions and its own up, the results from its parent and
those it passes down); handshakes, Waiting reports and
aborts are not rounds and are not counted. The hub's own contribution never leaves its process,
so it counts neither way. One plain object per barrier, read by the metrics collector at scrape
time (an integer add on the event loop, no lock: the collector reads two ints).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(slots=True)
class RoundTraffic:
    sent: int = 0  # bytes of round messages this daemon wrote to its peer streams
    received: int = 0  # bytes of round messages it read from them


def round_work_line(traffic: RoundTraffic, rounds: int, planning_s: float) -> str:
    """The daemon's closing line on its round work: what /metrics showed last, for a job whose
    metrics nobody scraped (and for tests, which read it from the log after the daemons exit)."""
    per = max(rounds, 1)
    return (
        f"round work of this daemon: {rounds} rounds, round messages sent {traffic.sent} bytes "
        f"({traffic.sent / per:.0f} per round) and received {traffic.received} bytes "
        f"({traffic.received / per:.0f} per round), planning {1000 * planning_s / per:.2f} ms "
        "per round"
    )
