"""The planned-vs-trained fields of `odbd status` (admin.proto StatusReply, RankStatus), from
the daemon's stats: plain dicts of field values, so the snapshot stays one constructor call."""

from __future__ import annotations

from typing import Any

from odbd.daemon.trained import RankTrained, slowest
from odbd.metrics.stats import DaemonStats


def trained_fields(r: RankTrained) -> dict[str, int]:
    """One rank's RankStatus fields: what its trainer took."""
    return dict(
        delivered_samples=r.samples,
        delivered_loss_tokens=r.loss_tokens,
        delivered_real_tokens=r.real_tokens,
        delivered_padded_tokens=r.padded_tokens,
        trained_epoch=r.epoch,
        trained_epoch_steps=r.epoch_steps,
        epochs_trained=r.epochs_trained,
    )


def progress_fields(s: DaemonStats, now_s: float) -> dict[str, Any]:
    """The StatusReply fields: the planner's position, the slowest local rank's, the rate."""
    trained = s.trained
    behind = slowest(trained.ranks.values())
    rate = trained.rate.rate(now_s)
    fields: dict[str, Any] = dict(
        planned_epoch=s.planned_epoch,
        planned_epoch_steps=s.planned_epoch_steps,
        planned_epoch_steps_exact=s.planned_epoch_steps_exact,
        planned_epoch_steps_so_far=s.planned_epoch_steps_so_far,
        planned_steps=s.global_steps,
        epochs_trained=min((r.epochs_trained for r in trained.ranks.values()), default=0),
        trained_samples_per_s=rate.samples_per_s,
        trained_tokens_per_s=rate.tokens_per_s,
        rate_window_s=trained.rate.window_s,
    )
    if behind is not None and behind.last_step is not None:
        fields.update(
            trained_epoch=behind.epoch,
            trained_epoch_steps=behind.epoch_steps,
            trained_epoch_samples=behind.epoch_global_samples,
            trained_epoch_planned_steps=s.exact_epoch_steps.get(behind.epoch, 0),
        )
    return fields
