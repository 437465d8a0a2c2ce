"""Training setups that cannot run odbd `--align updates` (issue 26), refused before a step.

With --align updates each rank runs its own number of micro-steps per optimizer update and
all-reduces once, after its last one (DDP `no_sync()` on the others; ZeRO-1/2 shard only the
optimizer state or the reduced gradients, so they synchronise at the same point). FSDP
(ZeRO-3) and other sharded-parameter engines all-gather every layer's parameters in each
micro-step's forward and backward: a rank with more micro-steps than another would wait in a
collective the other never joins, and the job hangs. They need --align steps.
"""

from __future__ import annotations

from typing import Any

import torch

from odbclient.errors import ProtocolError

_FIX = (
    "restart the daemons with --align steps (the default; every rank runs every micro-step), "
    "or train with DDP or ZeRO-1/2; docs/training.md, 'Ranks aligned at updates'"
)


def per_layer_collectives(model: torch.nn.Module) -> str | None:
    """The name of the sharding that runs collectives in every micro-step, or None."""
    for module in model.modules():
        kind = type(module)
        names = {c.__name__ for c in kind.__mro__}
        if names & {"FullyShardedDataParallel", "FSDPModule"}:
            return f"FSDP ({kind.__name__})"
        if "DeepSpeedEngine" in names and _zero_stage(module) >= 3:
            return "DeepSpeed ZeRO-3"
    return None


def refuse_per_layer_collectives(model: torch.nn.Module) -> None:
    """Raises ProtocolError when `model` is sharded per layer (FSDP, DeepSpeed ZeRO-3)."""
    kind = per_layer_collectives(model)
    if kind is not None:
        raise ProtocolError(
            f"odbd runs --align updates, where ranks run different numbers of micro-steps per "
            f"optimizer update, but the model is wrapped in {kind}, which all-gathers "
            "parameters in every micro-step: the ranks would wait in collectives the others "
            f"never join. Nothing was trained; {_FIX}"
        )


def refuse_distributed_type(distributed_type: Any, zero_stage: int | None) -> None:
    """Accelerate's view of the same (its DistributedType and DeepSpeed's ZeRO stage)."""
    name = getattr(distributed_type, "name", str(distributed_type))
    if name == "FSDP" or (name == "DEEPSPEED" and (zero_stage or 0) >= 3) or name == "MEGATRON_LM":
        kind = "DeepSpeed ZeRO-3" if name == "DEEPSPEED" else name
        raise ProtocolError(
            f"odbd runs --align updates, where ranks run different numbers of micro-steps per "
            f"optimizer update, but Accelerate runs {kind}, whose collectives run in every "
            f"micro-step: the ranks would wait in collectives the others never join. Nothing "
            f"was trained; {_FIX}"
        )


def _zero_stage(engine: Any) -> int:
    try:
        return int(engine.zero_optimization_stage())
    except Exception:  # an engine without the query: assume the worst, refuse
        return 3
