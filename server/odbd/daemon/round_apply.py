"""Step 3 of a round: apply the plan. This node's ranks get their steps (StepBatches cut from
step_columns), recirculated and not-run samples return to the buffers, the round goes to the
--state-dir journal before any step is queued, /metrics counts it, and the epochs it finishes
end (round_ending)."""

from __future__ import annotations

import json
import logging

import numpy as np

from odbclient.shm import read_meta
from odbclient.wire.odbd.v1 import trainer_pb2
from odbd.daemon import split_round
from odbd.daemon.round_ending import RoundEnding
from odbd.daemon.round_progress import RoundProgress
from odbd.daemon.step_columns import EmittedColumns, StepColumns, progress_messages
from odbd.daemon.trained import StepCounts
from odbd.planner.config import Collate
from odbd.planner.progress import (
    ProgressColumns,
)
from odbd.planner.types import NodeRoundPlan, SampleTable, UnitPlan
from odbd.planner.update_align import rank_runs
from odbd.serve.rank_queue import QueuedItem

log = logging.getLogger("odbd.round")


class RoundApplying(RoundProgress, RoundEnding):
    """Step 3 of a round: this node's share of the plan becomes queued StepBatches."""

    def _apply(
        self, plan: NodeRoundPlan, rejected: dict[str, int], extras: split_round.RoundExtras
    ) -> None:
        quota_before = self.quota_consumed
        step_epochs = self._step_epochs(plan)
        kept = len(step_epochs)
        steps_before = sum(self.steps_in_epoch.values())
        step_numbers = self._number_steps(step_epochs)
        updates = self.updates.of_round(plan, step_epochs, self.round_index)
        progress = self._plan_progress(plan, quota_before, step_epochs, step_numbers)
        if self.config.max_updates:
            progress = self._capped_progress(progress, updates, steps_before)
        if self.journal is not None:
            self._journal_round(plan, step_epochs, step_numbers, rejected, extras)
        for unit in plan.units:  # this node's units only
            self._queue_unit(plan, unit, step_epochs, step_numbers, progress, updates)
        self._record_steps(plan, kept, extras)
        self.stats.record_planned(
            step_epochs, step_numbers, progress.epoch_steps_estimate, progress.epoch_steps_exact
        )
        self._advance_epochs(plan, step_epochs, extras.step_identities())
        if self.capped:
            self._end_job(f"--max-updates {self.config.max_updates} reached")

    def _record_round(self, plan: NodeRoundPlan, extras: split_round.RoundExtras) -> None:
        """Round facts for /metrics; every daemon records the same global numbers."""
        s = self.stats
        s.rounds += 1
        record = self.split.last_round
        if record is not None:
            s.round_duration.observe(record.duration_s)
            s.last_peer[record.last_node] += 1
        s.splits += extras.splits
        s.recirculated += extras.offered_samples - int(plan.global_num_samples.sum())
        if self.done:
            return  # keep the last epoch's final progress (set by _end_epoch) on display
        s.epoch = self.state.epoch
        s.epoch_samples = self.tally.samples
        s.epoch_identities = self.tally.num_seen

    def _record_steps(
        self, plan: NodeRoundPlan, kept: int, extras: split_round.RoundExtras
    ) -> None:
        stats, s = plan.stats, self.stats
        world = self.state.planner.world.world_size
        s.global_steps += kept
        s.step_max_work += float(extras.step_max_work[:kept].sum())  # every rank's: the hub's
        s.step_mean_work += float(extras.step_sum_work[:kept].sum()) / world
        s.global_samples += int(plan.global_num_samples[:kept].sum())
        s.global_tokens += int(plan.global_num_tokens[:kept].sum())
        # --align updates: a rank's skipped slots are queued and delivered (steps) but never
        # run, so they are no fillers (idle_steps)
        runs = rank_runs(plan)[:kept]
        for rank in self.queues:
            rs, column = s.rank(rank), rank - self._first_rank
            samples = stats.num_samples[:kept, column]
            rs.steps += kept
            rs.idle_steps += int(((samples == 0) & runs[:, column]).sum())
            rs.samples += int(samples.sum())
            rs.real_tokens += int(stats.real_tokens[:kept, column].sum())
            rs.padded_tokens += int(stats.padded_tokens[:kept, column].sum())
            rs.loss_tokens += int(stats.num_tokens[:kept, column].sum())

    def _journal_round(
        self,
        plan: NodeRoundPlan,
        step_epochs: list[int],
        step_numbers: list[int],
        rejected: dict[str, int],
        extras: split_round.RoundExtras,
    ) -> None:
        """Appends what this round hands to trainers, before any of it is queued: this node's
        ranks' samples (the journal's per-rank counts are 0 for the other nodes' ranks, whose
        samples only their own journal holds), and every node's identities per step (the
        hub's), so a restart counts the epoch's identities as the others do."""
        assert self.journal is not None
        kept = len(step_epochs)
        g = self.state.planner.ranks_per_unit
        parts = [
            u.emitted.views[int(u.slot_offsets[k * g]) : int(u.slot_offsets[(k + 1) * g])]
            for k in range(kept)
            for u in plan.units
        ]
        keys = np.concatenate(parts) if parts else np.zeros(0, dtype=np.int64)
        per_step = plan.global_num_samples[:kept].tolist()
        counts = np.zeros((kept, self.state.planner.world.world_size), dtype=np.int64)
        local = plan.stats.num_samples.shape[1]
        counts[:, self._first_rank : self._first_rank + local] = plan.stats.num_samples[:kept]
        steps = [[e, n, c] for e, n, c in zip(step_epochs, step_numbers, per_step, strict=True)]
        self.journal.append_round(
            self.round_seed_base + self.round_index,
            steps,
            keys,
            counts,
            self.state.take_rejected_keys(),
            rejected,
            [list(extras.step_identities().of_step(i)) for i in range(kept)],
        )

    def _queue_unit(
        self,
        plan: NodeRoundPlan,
        unit: UnitPlan,
        step_epochs: list[int],
        step_numbers: list[int],
        progress: ProgressColumns,
        updates: list[trainer_pb2.Update | None],
    ) -> None:
        g = self.state.planner.ranks_per_unit
        ranks = self.state.planner.unit_ranks(unit.unit)
        kept = len(step_epochs)
        end = int(unit.slot_offsets[kept * g])
        emitted = EmittedColumns.gather(self.state, self.lanes, unit.emitted.views[:end])
        self.state.mark_emitted(unit.emitted.views[:end])  # after the gather: it may drop them
        self._count_oversized(unit.emitted.take(slice(0, end)))  # views of the columns
        tail = unit.emitted.take(slice(end, None))  # past the quota: not run
        self.state.return_samples(unit.unit, unit.leftover.concat(tail))
        progress_by_step = progress_messages(progress)  # one per step, every rank
        facts = StepColumns.of(plan, unit, kept * g)
        first = self._first_rank  # plan.stats' column of a rank is its rank less this
        patch_weight = self.cost.model.p  # once per round: the model is refit between rounds
        bounds = unit.slot_offsets.tolist()
        for local_rank, rank in enumerate(ranks):
            items = []
            for step in range(kept):
                s = step * g + local_rank
                items.append(self._step_item(
                    facts, emitted, step, rank, rank - first, s, slice(bounds[s], bounds[s + 1]),
                    step_epochs[step], step_numbers[step], progress_by_step[step],
                    self.updates.of_rank(updates[step], plan, step, rank - first), patch_weight,
                ))  # fmt: skip
            self.free(self.queues[rank].push(items))

    def _count_oversized(self, emitted: SampleTable) -> None:
        """Counts emitted samples over the token or patch budget; warns once per budget.

        Grouping gives such a sample a group of its own, so it trains, but its step exceeds
        the budget the operator sized memory for."""
        budget, max_patches = self.config.token_budget, self.config.max_patches
        long = emitted.lengths > budget
        many = emitted.patches > max_patches if max_patches else np.zeros_like(long)
        if not self._warned_long and long.any():
            self._warned_long = True
            i = int(np.flatnonzero(long)[0])
            log.warning(
                "sample %d has %d tokens, more than --token-budget %d: it is trained alone in "
                "its own group, whose %s exceeds the budget (shown once; "
                "odbd_oversized_samples_total counts them all); raise --token-budget or "
                "truncate samples in preprocessing",
                int(self.state.identities_of(emitted.views[i : i + 1])[0]),
                int(emitted.lengths[i]),
                budget,
                "token count" if self.config.collate is Collate.PACKED else "padded area",
            )
        if not self._warned_many and many.any():
            self._warned_many = True
            i = int(np.flatnonzero(many)[0])
            log.warning(
                "sample %d has %d patches, more than --max-patches %d: it is trained alone in "
                "its own group (shown once; odbd_oversized_samples_total counts them all); "
                "raise --max-patches or resize its images in preprocessing",
                int(self.state.identities_of(emitted.views[i : i + 1])[0]),
                int(emitted.patches[i]),
                max_patches,
            )
        self.stats.oversized_samples += int((long | many).sum())

    def _step_item(
        self,
        facts: StepColumns,
        emitted: EmittedColumns,
        step: int,
        rank: int,
        column: int,
        slot: int,
        rows: slice,
        epoch: int,
        number: int,
        progress: trainer_pb2.Progress,
        update: trainer_pb2.Update | None,
        patch_weight: float,
    ) -> QueuedItem:
        idle = rows.stop <= rows.start
        # Patches enter the fit as p token-equivalents each (the planner's own weight, the
        # cost model's p), so the learned model keeps the vision share fixed and fits the
        # scale of the whole step.
        linear = facts.padded_tokens[step][column] + patch_weight * facts.slot_patches[slot]
        self.cost.expect(rank, epoch, number, linear, facts.slot_sum_sq[slot])
        if not idle and not self.filler_schema:
            self._learn_schema(
                (int(emitted.segments[rows.start]), int(emitted.offsets[rows.start])),
                int(emitted.locations.nbytes[rows.start]),
            )
        batch = trainer_pb2.StepBatch(
            epoch=epoch,
            step=number,
            is_idle=idle,
            loss_scale=facts.loss_scale[step][column],
            num_samples=facts.num_samples[step][column],
            num_tokens=facts.num_tokens[step][column],
            global_num_samples=facts.global_num_samples[step],
            global_num_tokens=facts.global_num_tokens[step],
            sample_ids=emitted.sample_ids_bytes[rows.start * 8 : rows.stop * 8],
            segments=emitted.segments_bytes[rows.start * 4 : rows.stop * 4],
            offsets=emitted.offsets_bytes[rows.start * 8 : rows.stop * 8],
            nbytes=emitted.nbytes_bytes[rows.start * 8 : rows.stop * 8],
            filler_schema=self.filler_schema if idle else "",
            progress=progress,
        )
        if update is not None:
            batch.update.CopyFrom(update)
        freed = [emitted.locations.take(rows)] if not idle else []
        counts = StepCounts(
            samples=facts.num_samples[step][column],
            loss_tokens=facts.num_tokens[step][column],
            real_tokens=facts.real_tokens[step][column],
            padded_tokens=facts.padded_tokens[step][column],
            global_samples=facts.global_num_samples[step],
            epoch_last=progress.epoch_steps_exact and number + 1 == progress.epoch_steps_estimate,
        )
        return QueuedItem(epoch, number, batch.SerializeToString(), freed, counts)

    def _learn_schema(self, where: tuple[int, int], nbytes: int) -> None:
        meta = read_meta(self.read_sample(where[0], where[1], nbytes))
        fields = [
            [f.name, f.dtype, [] if len(f.shape) == 1 else list(f.shape)] for f in meta.fields
        ]
        self.filler_schema = json.dumps(fields)
