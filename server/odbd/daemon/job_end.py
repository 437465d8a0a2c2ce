"""When a daemon may end its job, as pure decisions over what its rank queues say.

The rule (README, docs/faults.md): the job ends when every local rank took the job's end
(RankQueue.took_job_end). There is no fixed grace: a rank whose trainer is attached is waited
for however slow its steps are. Only two things cut the wait short:
- a rank that is not attached past --attach-timeout (counted from the moment the daemon was
  ready if it never attached, else from its detach) fails the job, naming the rank;
- a stop (SIGTERM/SIGINT, or a failure being announced) waits only for ranks that are
  attached, and at most until its deadline; nobody can take a detached rank's steps.
Whatever is still undelivered then is dropped, and the daemon says how much, for which ranks.
"""

from __future__ import annotations

import enum
from collections.abc import Iterable
from dataclasses import dataclass

from odbd.serve.rank_queue import RankQueue


@dataclass(frozen=True, slots=True)
class RankPresence:
    """One local rank's facts at one moment (from its RankQueue)."""

    rank: int
    attached: bool
    took_job_end: bool
    absent_s: float  # since it detached, or since the daemon was ready; 0.0 while attached
    ever_attached: bool
    undelivered_steps: int
    first_undelivered: tuple[int, int] | None  # (epoch, step)

    def describe(self) -> str:
        """e.g. 'rank 1: 12 steps from epoch 0 step 40 undelivered, not attached for 3 s'."""
        if self.took_job_end:
            return f"rank {self.rank}: took the job's end"
        if self.undelivered_steps:
            epoch, step = self.first_undelivered or (0, 0)
            steps = f"{self.undelivered_steps} steps from epoch {epoch} step {step} undelivered"
        else:
            steps = "every step delivered, the job's end not yet taken"
        if self.attached:
            where = "attached"
        elif self.ever_attached:
            where = f"detached {self.absent_s:.0f} s ago"
        else:
            where = f"never attached ({self.absent_s:.0f} s)"
        return f"rank {self.rank}: {steps}, {where}"


def presences(queues: Iterable[RankQueue], *, ready_s: float, now_s: float) -> list[RankPresence]:
    """What each queue says now; `ready_s` is when the daemon could first serve trainers."""
    out = []
    for q in queues:
        since = q.detached_at_s if q.detached_at_s is not None else ready_s
        out.append(
            RankPresence(
                rank=q.rank,
                attached=q.attached,
                took_job_end=q.took_job_end,
                absent_s=0.0 if q.attached else max(now_s - since, 0.0),
                ever_attached=q.ever_attached,
                undelivered_steps=q.queued_steps(),
                first_undelivered=q.first_undelivered(),
            )
        )
    return out


def overdue_ranks(ranks: Iterable[RankPresence], attach_timeout_s: float) -> list[RankPresence]:
    """Ranks absent past --attach-timeout that still owe the job something."""
    return [
        r for r in ranks if not r.attached and not r.took_job_end and r.absent_s >= attach_timeout_s
    ]


def attach_failure(overdue: list[RankPresence], attach_timeout_s: float) -> str:
    """The job's failure reason for ranks absent past the attach deadline (one line)."""
    never = [r.rank for r in overdue if not r.ever_attached]
    left = [r.rank for r in overdue if r.ever_attached]
    parts = []
    if never:
        parts.append(f"{_ranks(never)} never attached")
    if left:
        parts.append(f"{_ranks(left)} detached and did not come back")
    steps = sum(r.undelivered_steps for r in overdue)
    return (
        f"{' and '.join(parts)} within --attach-timeout {attach_timeout_s:g} s ({steps} steps "
        "undelivered); the job cannot end with every step trained. Start every local rank's "
        "trainer against this daemon's socket, or raise --attach-timeout (ODBD_ATTACH_TIMEOUT) "
        "if loading the model takes longer"
    )


class Outcome(enum.Enum):
    WAIT = "wait"  # some rank still has to take the job's end
    DONE = "done"  # every local rank took it
    STOP = "stop"  # a stop's wait is over: end now, dropping what is undelivered
    FAIL = "fail"  # a rank is absent past --attach-timeout


@dataclass(frozen=True, slots=True)
class EndVerdict:
    outcome: Outcome
    reason: str = ""  # FAIL: the job's failure; WAIT: what is waited for
    dropped: tuple[RankPresence, ...] = ()  # STOP/FAIL: ranks that did not take the end


def end_verdict(
    ranks: list[RankPresence],
    *,
    attach_timeout_s: float,
    stopping: bool = False,
    stop_overdue: bool = False,
) -> EndVerdict:
    """Whether the end of the job may come now (see the module docstring for the rule); asked
    once the job's end is queued (every step planned).

    `stopping`: a signal or a failure ends the job early; `stop_overdue`: its deadline passed.
    A rank whose trainer left after taking every step owes nothing: it is not waited for.
    """
    pending = tuple(r for r in ranks if not r.took_job_end and not _left_after_all(r))
    if not pending:
        return EndVerdict(Outcome.DONE)
    if stopping:
        if stop_overdue or not any(r.attached for r in pending):
            return EndVerdict(Outcome.STOP, dropped=pending)
        waiting = [r for r in pending if r.attached]
        return EndVerdict(Outcome.WAIT, reason=_waiting(waiting), dropped=())
    overdue = overdue_ranks(pending, attach_timeout_s)
    if overdue:
        return EndVerdict(Outcome.FAIL, attach_failure(overdue, attach_timeout_s), pending)
    return EndVerdict(Outcome.WAIT, reason=_waiting(list(pending)))


def dropped_summary(dropped: Iterable[RankPresence]) -> str:
    """'125 steps undelivered: rank 0: ..., rank 1: ...' (empty when nothing was dropped)."""
    owed = [r for r in dropped if r.undelivered_steps]
    if not owed:
        return ""
    total = sum(r.undelivered_steps for r in owed)
    return f"{total} steps undelivered: " + "; ".join(r.describe() for r in owed)


def _left_after_all(rank: RankPresence) -> bool:
    return rank.ever_attached and not rank.attached and rank.undelivered_steps == 0


def _waiting(ranks: list[RankPresence]) -> str:
    return "; ".join(r.describe() for r in ranks)


def _ranks(ranks: list[int]) -> str:
    return ("rank " if len(ranks) == 1 else "ranks ") + ", ".join(map(str, ranks))
