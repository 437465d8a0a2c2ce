"""Rewinds on a running daemon: a trainer that loads a checkpoint older than what it already
took gets those steps again, with the same samples in the same steps (issue 23).

Every rank queue keeps the steps it handed out (`StepHistory`: the serialized StepBatch and
the epoch-end markers, not the samples' shared memory, which is freed on Delivered as always).
A resume point inside that history is a rewind: the steps from it on leave the history, their
samples are made again by id (`dataset[i]` is deterministic by contract) through the same
producers and leases as any sample, under view keys of their own (negative, odbd.daemon.remake:
they never meet the sampler's ledger), and once every sample is back the steps go to the front
of the rank's queue with their new shared-memory locations and nothing else changed. Until
then the queue sends nothing (`RankQueue.gated`).

Why no round-protocol message: rounds plan steps ahead of every rank, and a rewound step is one
the rounds planned already, identical on every node; ranks that load the same checkpoint resume
at the same step on every node, and each daemon replays its own ranks' history. The planning
state (epochs, quota, journal) is untouched, so a daemon that dies after a rewind still
restarts exactly from --state-dir.

This module holds the pure parts: `decide_resume`, `StepHistory`, `fresh_node_failure`;
`odbd.daemon.remake.Rewinder` keeps the rewinds in progress and does their I/O.
"""

from __future__ import annotations

import enum
from collections import deque
from dataclasses import dataclass

from odbd.daemon.trained import StepCounts

DEFAULT_REWIND_STEPS = 4096

Position = tuple[int, int]  # (epoch, step): the first step not yet trained
# (epoch, step, event, counts): a handed-out item; a step's counts go back to the rank's
# trained totals when it is sent again (None for markers and for steps planned without them)
HistoryItem = tuple[int, int, object, StepCounts | None]


def is_before(epoch: int, step: int, resume: Position) -> bool:
    """Whether a queue item (a step, or an epoch's end marker with step -1) comes before
    `resume` (RankQueue.skip_before's rule: a marker belongs to its epoch's end)."""
    if step >= 0:
        return (epoch, step) < resume
    return epoch < resume[0]


class Verdict(enum.Enum):
    CONTINUE = "continue"  # at or after the first step not handed out: skip to it
    REWIND = "rewind"  # inside the history: send those steps again
    REFUSE = "refuse"


@dataclass(frozen=True, slots=True)
class ResumeDecision:
    verdict: Verdict
    reason: str = ""  # REFUSE: the refusal's message (what happened, what next, the fix)


def decide_resume(
    *,
    rank: int,
    node: int,
    resume: Position,
    last_delivered: Position | None,
    floor: Position,
    ever_sent: bool,
    from_journal: bool,
    history_steps: int,
) -> ResumeDecision:
    """What a running daemon does with `rank`'s resume point (pure).

    `floor`: the earliest resume point the rank's history can serve (steps before it were
    dropped past --rewind-steps, or precede the point a --state-dir restart resumed at).
    `ever_sent`: this daemon process handed the rank at least one step. A daemon that never
    did, and was not restarted from a journal, did not serve the checkpoint's steps: it was
    started afresh, and resuming there would train its own first steps' samples a second time.
    """
    at = f"epoch {resume[0]} step {resume[1]}"
    if resume < floor:
        why = (
            f"it restarted from its --state-dir journal at epoch {floor[0]} step {floor[1]}"
            if from_journal and not ever_sent
            else f"it keeps the last {history_steps} steps of each rank (--rewind-steps) and "
            f"the oldest it still has is epoch {floor[0]} step {floor[1]}"
        )
        return ResumeDecision(
            Verdict.REFUSE,
            f"rank {rank} resumes at {at}, but node {node}'s daemon cannot send the steps from "
            f"there again: {why}. Nothing was trained. Resume from a newer checkpoint; to keep "
            "older resume points, run the daemons with a larger --rewind-steps (about 200 "
            "bytes plus 28 per sample for each rank-step kept)",
        )
    if last_delivered is not None and resume <= last_delivered:
        return ResumeDecision(Verdict.REWIND)
    if not ever_sent and not from_journal and resume > (0, 0):
        return ResumeDecision(
            Verdict.REFUSE,
            f"rank {rank} resumes at {at}, but node {node}'s daemon has handed it no step "
            "since it started: that daemon was started again without --state-dir, so it does "
            "not know which samples the checkpoint's steps held, and resuming there would "
            "train samples twice and skip others. Nothing was trained. Restart every daemon of "
            "the job with the same flags and --state-dir (they rebuild the job from their "
            "journals), or start the job afresh without load_state_dict / "
            "resume_from_checkpoint",
        )
    return ResumeDecision(Verdict.CONTINUE)


class StepHistory:
    """The items a rank queue handed out (delivered or skipped), oldest first, at most
    `limit` steps (markers ride along); their shared memory is already freed."""

    def __init__(self, limit: int = DEFAULT_REWIND_STEPS) -> None:
        self.limit = limit
        self._items: deque[HistoryItem] = deque()
        self._num_steps = 0
        self.floor: Position = (0, 0)

    def __len__(self) -> int:
        return len(self._items)

    @property
    def num_steps(self) -> int:
        return self._num_steps

    def add(self, epoch: int, step: int, event: object, counts: StepCounts | None = None) -> None:
        self._items.append((epoch, step, event, counts))
        if step >= 0:
            self._num_steps += 1
        while self._num_steps > self.limit:
            self._drop_oldest()

    def _drop_oldest(self) -> None:
        epoch, step, _, _ = self._items.popleft()
        if step >= 0:
            self._num_steps -= 1
            self.floor = max(self.floor, (epoch, step + 1))
        else:  # an epoch's end: the next resume point is the next epoch's first step
            self.floor = max(self.floor, (epoch + 1, 0))

    def take_from(self, resume: Position) -> list[HistoryItem]:
        """Removes and returns the items from `resume` on (oldest first)."""
        taken: list[HistoryItem] = []
        while self._items and not is_before(self._items[-1][0], self._items[-1][1], resume):
            taken.append(self._items.pop())
        taken.reverse()
        self._num_steps -= sum(1 for _, step, _, _ in taken if step >= 0)
        return taken

    def put_back(self, items: list[HistoryItem]) -> None:
        """A rewind that was not completed: its items are history again."""
        self._items.extend(items)
        self._num_steps += sum(1 for _, step, _, _ in items if step >= 0)

    def last_step(self) -> Position | None:
        for epoch, step, _, _ in reversed(self._items):
            if step >= 0:
                return epoch, step
        return None

    def epoch_global_samples(self, epoch: int) -> int:
        """The job's samples (every rank) in `epoch`'s steps still held: after take_from,
        those the trainer trained before its resume point (as far as the history reaches)."""
        return sum(
            c.global_samples for e, step, _, c in self._items if e == epoch and step >= 0 and c
        )


def fresh_node_failure(fresh: list[int], points: dict[int, Position | None]) -> str:
    """Why a job whose nodes disagree on resuming fails, when some started afresh: the nodes
    restarted from --state-dir resume at the trainers' checkpoint, the others have no journal,
    so they cannot know what the steps before it held."""
    resumed = {node: point for node, point in points.items() if point is not None}
    epoch, step = next(iter(resumed.values()))
    names = ", ".join(str(node) for node in fresh)
    return (
        f"node{'s' if len(fresh) > 1 else ''} {names} started afresh, without a --state-dir "
        f"journal, while node{'s' if len(resumed) > 1 else ''} "
        f"{', '.join(str(n) for n in resumed)} resume{'' if len(resumed) > 1 else 's'} from "
        f"{'their journals' if len(resumed) > 1 else 'its journal'} at epoch {epoch} step "
        f"{step} (the trainers' checkpoint): node {names} lost the job's state, so the job "
        "cannot resume exactly and stops rather than train samples twice. Restart every "
        "daemon of the job with the same flags and --state-dir (its own journal on each "
        "node), or start the job afresh on every node without load_state_dict"
    )
