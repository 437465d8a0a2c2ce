"""What the trainers took, as opposed to what the planner planned.

The round loop plans up to --steps-ahead steps before any trainer takes them (a whole small
epoch at start-up), so the planner's counters (`odbd_global_steps`, the epoch being planned, its
"epoch done" line) run ahead of training by the queue. These are the delivered side: each queued
step carries its StepCounts, a rank's RankTrained adds them up when the trainer reports the step
delivered, and DeliveryRate turns the node's running totals into samples/s and tokens/s over a
recent window. `odbd status`, /metrics and the "epoch trained" log line read them.
"""

from __future__ import annotations

import bisect
from collections.abc import Iterable
from dataclasses import dataclass, field


@dataclass(frozen=True, slots=True)
class StepCounts:
    """One rank's step, as planned: what delivering it adds to the rank's trained totals."""

    samples: int  # this rank's samples (0: an idle filler)
    loss_tokens: int  # this rank's loss-bearing tokens
    real_tokens: int  # this rank's unpadded tokens
    padded_tokens: int  # this rank's tokens with padding (max length x count, or packed rows)
    global_samples: int  # the step's samples over every rank (the same on every daemon)
    epoch_last: bool  # the epoch's last step (known when it was planned)


@dataclass(slots=True)
class RankTrained:
    """One local rank's delivered steps: totals, and where its training stands."""

    steps: int = 0
    samples: int = 0
    loss_tokens: int = 0
    real_tokens: int = 0
    padded_tokens: int = 0
    epoch: int = 0  # epoch of the newest delivered step (the one being trained)
    epoch_steps: int = 0  # `epoch`'s steps up to the newest delivered (its step index + 1)
    # the job's samples, every rank, in `epoch`'s steps delivered (since this daemon started)
    epoch_global_samples: int = 0
    epochs_trained: int = 0  # epochs before the one being trained, or ended with its last step
    last_step: tuple[int, int] | None = None  # (epoch, step) delivered last
    first_epoch: int | None = None  # of the first step delivered (after a resume: not 0)

    def add(self, epoch: int, step: int, counts: StepCounts) -> None:
        if self.first_epoch is None:
            self.first_epoch = epoch
        if epoch != self.epoch:
            self.epoch, self.epoch_steps, self.epoch_global_samples = epoch, 0, 0
        # A step of epoch e: the epochs before it are trained, even one whose last step no
        # step carried (a join-mode flush round that planned nothing).
        self.epochs_trained = max(self.epochs_trained, epoch)
        self.steps += 1
        self.samples += counts.samples
        self.loss_tokens += counts.loss_tokens
        self.real_tokens += counts.real_tokens
        self.padded_tokens += counts.padded_tokens
        self.epoch_steps = step + 1
        self.epoch_global_samples += counts.global_samples
        self.last_step = (epoch, step)
        if counts.epoch_last:
            self.epochs_trained = max(self.epochs_trained, epoch + 1)

    def rewind(self, resume: tuple[int, int], last: tuple[int, int] | None, samples: int) -> None:
        """The trainer loaded a checkpoint and resumes at `resume`: the trained position goes
        back with the model, to `last` (the step before `resume` still in the rank's history,
        None if none is) with `samples` of the job in that step's epoch up to it. The totals
        (steps, samples, tokens) stay: they count deliveries, and the steps sent again add to
        them as the trainer computes them again (so samples/s stays the trainers' work rate)."""
        self.epochs_trained = min(self.epochs_trained, resume[0])
        self.last_step = last
        if last is None:
            self.epoch, self.epoch_steps, self.epoch_global_samples = resume[0], 0, 0
        else:
            self.epoch, self.epoch_steps, self.epoch_global_samples = last[0], last[1] + 1, samples


def epochs_trained(ranks: Iterable[RankTrained]) -> int:
    """Epochs every local rank trained to the end (0 with no rank)."""
    return min((r.epochs_trained for r in ranks), default=0)


def slowest(ranks: Iterable[RankTrained]) -> RankTrained | None:
    """The local rank furthest behind (the node's trained position under DDP lockstep)."""
    return min(ranks, key=lambda r: r.last_step or (-1, -1), default=None)


def padding(real_tokens: int, padded_tokens: int) -> float:
    """The share of padded tokens that are padding (0.0 before any token)."""
    return 1.0 - real_tokens / padded_tokens if padded_tokens > 0 else 0.0


RATE_WINDOW_S = 30.0


@dataclass(frozen=True, slots=True)
class Rate:
    samples_per_s: float
    tokens_per_s: float  # loss-bearing tokens


@dataclass(slots=True)
class DeliveryRate:
    """A node's delivered samples and loss tokens over time, for a rate over a recent window.

    One point per Delivered report: (time, running samples, running tokens). The first report
    also places a zero point at the time its trainer started asking for the steps it covers
    (report time minus their wait and compute), so a rate is defined from the first report on.
    Points older than the window are dropped, but the last one before it is kept: it is the
    running total at the window's start.
    """

    window_s: float = RATE_WINDOW_S
    resolution_s: float = 0.5  # a point per this much time at most (see record)
    times: list[float] = field(default_factory=list)
    samples: list[int] = field(default_factory=list)
    tokens: list[int] = field(default_factory=list)

    def record(self, now_s: float, samples: int, tokens: int, took_s: float = 0.0) -> None:
        """Running totals after a report at now_s that covered took_s of trainer time."""
        if not self.times:
            self._append(now_s - max(took_s, 0.0), 0, 0)
        if len(self.times) >= 3 and now_s - self.times[-2] < self.resolution_s:
            # the newest point moves instead: at most window / resolution points, however
            # many reports a second the trainers send (each is O(points) to trim below)
            self.times[-1], self.samples[-1], self.tokens[-1] = now_s, samples, tokens
        else:
            self._append(now_s, samples, tokens)
        cut = bisect.bisect_right(self.times, now_s - self.window_s) - 1
        if cut > 0:
            del self.times[:cut], self.samples[:cut], self.tokens[:cut]

    def _append(self, t: float, samples: int, tokens: int) -> None:
        self.times.append(t)
        self.samples.append(samples)
        self.tokens.append(tokens)

    def rate(self, now_s: float) -> Rate:
        return window_rate(self.times, self.samples, self.tokens, now_s, self.window_s)


def window_rate(
    times: list[float], samples: list[int], tokens: list[int], now_s: float, window_s: float
) -> Rate:
    """Delivered per second over the last window_s (or since the first point, if later): the
    running totals now minus those at the window's start (the last point at or before it)."""
    if not times or now_s <= times[0]:
        return Rate(0.0, 0.0)
    start = max(now_s - window_s, times[0])
    i = bisect.bisect_right(times, start) - 1
    elapsed = now_s - start
    return Rate(
        (samples[-1] - samples[i]) / elapsed,
        (tokens[-1] - tokens[i]) / elapsed,
    )


def steps_trained(epoch: int, ranks: Iterable[RankTrained]) -> int | None:
    """Steps of `epoch` the slowest local rank delivered; None when every rank trained it all."""
    counts = []
    for r in ranks:
        if r.epochs_trained > epoch:
            continue
        counts.append(r.epoch_steps if r.epoch == epoch and r.last_step is not None else 0)
    return min(counts) if counts else None


@dataclass(slots=True)
class NodeTrained:
    """This node's local ranks' RankTrained (the queues' own objects) and its delivery rate."""

    ranks: dict[int, RankTrained] = field(default_factory=dict)  # local rank -> its totals
    rate: DeliveryRate = field(default_factory=DeliveryRate)
    epochs_logged: int = 0  # epochs whose "trained" line went out

    def total(self, attr: str) -> int:
        return sum(getattr(r, attr) for r in self.ranks.values())

    def on_report(self, now_s: float, took_s: float) -> list[str]:
        """After a Delivered report (its queue's RankTrained updated): records the rate and
        returns the log line of each epoch every local rank has now trained to the end."""
        self.rate.record(now_s, self.total("samples"), self.total("loss_tokens"), took_s)
        firsts = [r.first_epoch for r in self.ranks.values()]
        if self.epochs_logged == 0 and firsts and None not in firsts:
            # resumed (--state-dir) in a later epoch: the earlier ones were trained before
            self.epochs_logged = min(e for e in firsts if e is not None)
        lines = []
        while self.epochs_logged < epochs_trained(self.ranks.values()):
            lines.append(self._trained_line(self.epochs_logged, now_s))
            self.epochs_logged += 1
        return lines

    def _trained_line(self, epoch: int, now_s: float) -> str:
        rate = self.rate.rate(now_s)
        ranks = ",".join(str(r) for r in sorted(self.ranks))
        return (
            f"epoch {epoch} trained: local ranks {ranks} took its last step; node delivered "
            f"{self.total('samples')} samples, {self.total('loss_tokens')} loss tokens so far, "
            f"{rate.samples_per_s:.1f} samples/s, {rate.tokens_per_s:.0f} tokens/s over the last "
            f"{self.rate.window_s:g} s"
        )
