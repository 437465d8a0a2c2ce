"""Whether the trainers' ODBClient.end_job() calls end the job, as pure decisions.

Every rank of the world calls end_job() at the same step (its own loop decided: early
stopping, its own step cap). Each daemon learns its local ranks' end points (the first step a
rank did not train) from their streams and every other node's from the round offers, so
every daemon decides alike from the same requests:
- every rank asked, at one point: the job ends there (steps planned from it on are dropped,
  not lost, and every daemon exits 0);
- two ranks asked at different points: the job fails at once, naming them (a rank that ends
  while another trains on leaves that one hanging in its next DDP collective);
- some ranks have not asked: wait, at most --end-timeout from the first request this daemon
  saw, then fail naming the ranks that did not.
"""

from __future__ import annotations

import enum
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

Point = tuple[int, int]  # (epoch, step): the first step a rank did not train


class EndOutcome(enum.Enum):
    NONE = "none"  # no rank asked
    WAIT = "wait"  # some ranks asked, not all
    END = "end"  # every rank asked, at one point
    FAIL = "fail"  # ranks asked at different points


@dataclass(frozen=True, slots=True)
class EndDecision:
    outcome: EndOutcome
    point: Point | None = None  # END: where the job ends
    reason: str = ""  # END: the JobEnd reason; FAIL: the failure


def end_decision(ranks: Iterable[int], requests: Mapping[int, Point]) -> EndDecision:
    """What the end points known so far decide for the job of `ranks` (every rank of the
    world, or only a node's own once no round can carry the others' any more)."""
    wanted = sorted(ranks)
    if not requests:
        return EndDecision(EndOutcome.NONE)
    points = sorted(set(requests.values()))
    if len(points) > 1:
        by_point = "; ".join(
            f"{_ranks(r for r, p in requests.items() if p == point)} at {_where(point)}"
            for point in points
        )
        return EndDecision(
            EndOutcome.FAIL,
            reason=(
                f"the ranks called ODBClient.end_job() at different steps ({by_point}): a "
                "rank that ends while another trains on leaves that one hanging in its next "
                "collective, so the job stops here. Call end_job() on every rank after the "
                "same batch, from a decision every rank shares (e.g. all-reduce the "
                "early-stopping flag)"
            ),
        )
    if any(rank not in requests for rank in wanted):
        return EndDecision(EndOutcome.WAIT, point=points[0])
    return EndDecision(
        EndOutcome.END,
        point=points[0],
        reason=f"every rank called end_job() at {_where(points[0])}",
    )


def missing_failure(
    ranks: Iterable[int], requests: Mapping[int, Point], timeout_s: float, nodes: Mapping[int, int]
) -> str:
    """The job's failure once --end-timeout passed with some ranks not having called end_job();
    `nodes` maps a rank to its node (for a multi-node job's message)."""
    missing = [r for r in sorted(ranks) if r not in requests]
    asked = sorted(requests)
    point = next(iter(requests.values()))
    on_nodes = sorted({nodes[r] for r in missing})
    where = f" (node{'s' if len(on_nodes) > 1 else ''} {', '.join(map(str, on_nodes))})"
    return (
        f"{_ranks(missing)}{where if len(set(nodes.values())) > 1 else ''} did not call "
        f"ODBClient.end_job() within --end-timeout {timeout_s:g} s of {_ranks(asked)} "
        f"calling it at {_where(point)}; the job stops. Call end_job() on every rank at the "
        "same step (a rank that stops alone leaves the others hanging in their next "
        "collective), or raise --end-timeout if a rank does slow work (a checkpoint) first"
    )


def _where(point: Point) -> str:
    return f"epoch {point[0]} step {point[1]}"


def _ranks(ranks: Iterable[int]) -> str:
    items = sorted(ranks)
    return ("rank " if len(items) == 1 else "ranks ") + ", ".join(map(str, items))
