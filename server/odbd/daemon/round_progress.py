"""The numbers a round's steps carry, from global facts only (the same on every daemon):
each step's epoch and number, the --max-updates cap, StepBatch.progress; and the counters
behind them restored from the journal when a job restarts."""

from __future__ import annotations

import dataclasses
import logging

import numpy as np

from odbclient.wire.odbd.v1 import trainer_pb2
from odbd.daemon.journal import JournalStep, ResumeState
from odbd.daemon.round_base import RoundLoopState
from odbd.planner.config import Align
from odbd.planner.estimate import round_estimates
from odbd.planner.progress import (
    JobShape,
    ProgressColumns,
    StepFactsColumns,
    capped_job_progress,
    steps_progress,
)
from odbd.planner.types import NodeRoundPlan

log = logging.getLogger("odbd.round")


class RoundProgress(RoundLoopState):
    """Step numbers, epochs and progress of a round's steps, and their restore on restart."""

    def restore(self, resume: ResumeState, update: int = 0) -> None:
        """Continues a restarted job at the trainers' resume point (journal.replay's result);
        `update` is the index of the first update not trained (the trainers' state_dict)."""
        self.updates.restore(resume.epoch, update)
        local = set(self.queues)
        trained = [k for s in resume.trained_steps for r, keys in enumerate(s.keys_by_rank)
                   if r in local for k in keys.tolist()]  # fmt: skip
        trained_keys = np.asarray(trained, dtype=np.int64)
        self.state.restore(
            trained_keys,
            np.asarray(resume.rejected_keys, dtype=np.int64),
            resume.epoch,
            np.asarray(resume.moved_keys, dtype=np.int64),
        )
        # --migrate auto: views of other nodes this node's ranks trained before the resume
        # point, for round 0's moves exchange (their home nodes hold them back till then)
        self.foreign_trained = np.unique(trained_keys[~self.state.is_home(trained_keys)])
        for s in resume.trained_steps:
            self.steps_in_epoch[s.epoch] = max(self.steps_in_epoch[s.epoch], s.step + 1)
            self.quota_consumed += s.global_samples
            self.epoch_emitted[s.epoch] += s.global_samples
            if s.epoch == resume.epoch:
                self.tally.steps += 1
                self.tally.samples += s.global_samples
                self._restore_identities(s)
        self.steps_in_epoch[resume.epoch] = resume.step
        if not self.config.join:
            self.quota_consumed += sum(resume.rejected.values())
        self.stats.epochs_done = resume.epoch if self.config.join else 0
        self.resume = (resume.epoch, resume.step)
        self.round_seed_base = resume.incarnation * 1_000_000_000
        self.updates_done = self._updates_before(resume.epoch, update)

    def _restore_identities(self, step: JournalStep) -> None:
        """A trained step's identities, as the round's result gave them to every daemon; a
        journal from before they were recorded holds this node's ranks' views only."""
        if step.identities is not None:
            self.tally.identities.fold(*step.identities)
            return
        source = self.split.source
        assert source is not None
        local = source.of_steps([np.concatenate(step.keys_by_rank)])
        self.tally.identities.fold(*local.of_step(0))

    def _updates_before(self, epoch: int, update: int) -> int:
        """--max-updates after a restart: the updates trained before the resume point. Exact
        without windows (a step is an update) and with --accumulate K (an epoch of n steps is
        ceil(n / K) updates, its last one short); with --tokens-per-update (or --align updates,
        whose updates may span more than K steps) the earlier epochs' updates are counted as if
        of K = the mean steps per update of the resume epoch."""
        if not self.state.planner.windows:
            return sum(self.steps_in_epoch.values())
        k = max(self.config.accumulate, 1)
        sized_by_plan = self.config.tokens_per_update or self.config.align is Align.UPDATES
        if sized_by_plan and update:
            k = max(round(self.steps_in_epoch[epoch] / update), 1)
        earlier = sum(-(-n // k) for e, n in self.steps_in_epoch.items() if e < epoch)
        return earlier + update

    def _number_steps(self, step_epochs: list[int]) -> list[int]:
        """Step index within its epoch, identical on every rank and daemon."""
        numbers = []
        for epoch in step_epochs:
            numbers.append(self.steps_in_epoch[epoch])
            self.steps_in_epoch[epoch] += 1
        return numbers

    def _step_epochs(self, plan: NodeRoundPlan) -> list[int]:
        limit = self._steps_within_cap(plan)
        if self.config.join:
            return [self.state.epoch] * min(plan.num_steps, limit)
        per_step = plan.global_num_samples.tolist()
        n = max(self.state.dataset_size, 1)
        quota = self.config.epochs * self.state.dataset_size if self.config.epochs else None
        epochs: list[int] = []
        for count in per_step:
            if quota is not None and self.quota_consumed >= quota:
                break
            if len(epochs) >= limit:
                break
            epochs.append(self.quota_consumed // n)
            self.quota_consumed += count
        return epochs

    def _steps_within_cap(self, plan: NodeRoundPlan) -> int:
        """How many of the round's steps --max-updates lets run: up to the step that ends the
        job's last update (then `capped`), else all. An update ends at every step without
        windows, else at each window's last step (the same on every daemon)."""
        if not self.config.max_updates:
            return plan.num_steps
        ends = [True] * plan.num_steps
        if self.state.planner.windows:
            ends = [False] * plan.num_steps
            for end in plan.windows.ends.tolist():
                ends[int(end) - 1] = True
        left = self.config.max_updates - self.updates_done
        done = 0
        for i, end in enumerate(ends):
            done += end
            if done >= left:
                self.capped = True
                self.updates_done += done
                return i + 1
        self.updates_done += done
        return plan.num_steps

    def _capped_progress(
        self,
        progress: ProgressColumns,
        updates: list[trainer_pb2.Update | None],
        steps_before: int,
    ) -> ProgressColumns:
        """--max-updates: the job's fraction and step count are exact from the first step."""
        kept = len(progress.job_fraction)
        ends = [u is None or u.end for u in updates]
        done_before = self.updates_done - sum(ends)  # _steps_within_cap counted this round
        shares = [1.0 if u is None else (u.step_in_update + 1) / u.num_steps for u in updates]
        fraction, steps = capped_job_progress(
            self.config.max_updates, done_before, steps_before, ends[:kept], shares[:kept]
        )
        return dataclasses.replace(progress, job_fraction=fraction, job_steps_estimate=steps)

    def _plan_progress(
        self,
        plan: NodeRoundPlan,
        quota_before: int,
        step_epochs: list[int],
        step_numbers: list[int],
    ) -> ProgressColumns:
        """Each kept step's StepBatch.progress, from global facts only (the same on every
        daemon): non-join counts the epoch's views by the sample quota (rejections included,
        the step reaching the epoch's share is its last); join by the epoch's emitted and
        rejected samples (the flush round's last step is the epoch's last)."""
        n = self.state.dataset_size
        job = JobShape(dataset_size=n, epochs=self.config.epochs)
        assert self.tally.rejected is not None
        rejected = sum(self.tally.rejected.values())  # join: of the epoch being planned
        quota = quota_before
        facts = StepFactsColumns([], [], [], [], [], [], [])
        # Python ints, once per round: the properties sum a (T, world) array on every access.
        global_samples = plan.global_num_samples.tolist()
        global_tokens = plan.global_num_tokens.tolist()
        mean_tokens = self._mean_tokens(plan)
        self.planned_samples += sum(global_samples[: len(step_epochs)])
        self.planned_tokens += sum(global_tokens[: len(step_epochs)])
        steps_before: dict[int, int] = {}  # epoch -> steps of the epochs before it
        join, final_step = self.config.join, len(step_epochs) - 1 if plan.final else -1
        for i, epoch in enumerate(step_epochs):
            if epoch not in steps_before:
                steps_before[epoch] = sum(c for e, c in self.steps_in_epoch.items() if e < epoch)
            samples = global_samples[i]
            emitted = self.epoch_emitted[epoch] = self.epoch_emitted[epoch] + samples
            tokens = self.epoch_tokens[epoch] = self.epoch_tokens[epoch] + global_tokens[i]
            quota += samples
            if join:
                facts.consumed.append(emitted + rejected)
                facts.last.append(i == final_step)
            else:
                facts.consumed.append(quota - epoch * n)
                facts.last.append(quota >= (epoch + 1) * n)
            facts.emitted.append(emitted)
            facts.tokens.append(tokens)
            facts.steps_before_epoch.append(steps_before[epoch])
            facts.mean_tokens.append(mean_tokens)
            facts.token_floor.append(self.token_floor.get(epoch, 0.0))
        facts.epoch.extend(step_epochs)
        facts.step.extend(step_numbers)
        progress = steps_progress(job, facts)
        for epoch, fraction in zip(step_epochs, progress.epoch_token_fraction, strict=True):
            self.token_floor[epoch] = fraction  # the last step of each epoch in the round wins
        # One estimate per round and epoch, held while near (planner/estimate.py).
        settled = round_estimates(job, facts, progress, self.held_estimates)
        self.held_estimates = settled.held
        return settled.progress

    def _mean_tokens(self, plan: NodeRoundPlan) -> float:
        """Loss tokens per sample over every sample ingested so far, as every daemon sees it:
        those of the steps planned before this round and those every unit's buffer held this
        round (emitted now or recirculated; the hub's sum, `offered`). Ingested in sampler
        order, so unbiased by which samples the planner picks first (planner/progress.py);
        0.0 before any sample."""
        samples = self.planned_samples + self.offered[0]
        tokens = self.planned_tokens + self.offered[1]
        return tokens / samples if samples else 0.0
