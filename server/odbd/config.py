"""Daemon settings: one frozen dataclass built from flags and ODBD_* variables (DESIGN.md 2.1)."""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from odbclient import local_trust
from odbd.errors import ConfigError
from odbd.exposure import unprotected_reason
from odbd.planner.config import (
    Align,
    Attention,
    Balance,
    Collate,
    CostModel,
    Grouping,
    LossScaling,
    PlannerConfig,
)
from odbd.planner.cost_fit import CostModelMode
from odbd.world import World

if TYPE_CHECKING:  # odbd.round imports grpc; `odbd --help` and flag errors should not wait
    from odbd.round.config import PeerTls

DEFAULT_PADS = {"labels": -100.0}
# Children per daemon in the round relay tree (odbd.round.tree.DEFAULT_FANOUT, kept here so
# `odbd --help` does not import grpc): measured in docs/bench/round.md.
DEFAULT_ROUND_FANOUT = 4


def default_socket() -> str:
    """Where trainers and producers find the daemon unless told otherwise (matches odbclient):
    odbd.sock in $XDG_RUNTIME_DIR/odbd or /tmp/odbd-$UID, a directory only this user writes."""
    return local_trust.default_socket()


def node_rank_from_environment(environ: Mapping[str, str] | None = None) -> int:
    """torchrun's NODE_RANK/GROUP_RANK, an Indexed Job's completion index, or a pod ordinal.

    The first of those variables that is set (and not blank) decides; surrounding whitespace is
    ignored, and a value that is not an index is an error rather than a silent node 0.
    """
    env = os.environ if environ is None else environ
    for key in ("NODE_RANK", "GROUP_RANK", "JOB_COMPLETION_INDEX"):
        text = env.get(key, "").strip()
        if not text:
            continue
        if not (text.isascii() and text.isdigit()):
            raise ConfigError(
                f"{key}={env[key]!r} is not a node index (an integer >= 0), so this daemon "
                f"cannot tell which node it is; fix {key} in the launcher or pass --node-rank"
            )
        return int(text)
    ordinal = re.search(r"-(\d+)$", env.get("HOSTNAME", ""))  # StatefulSet pod name-<n>
    return int(ordinal.group(1)) if ordinal else 0


@dataclass(frozen=True, kw_only=True, slots=True)
class DaemonConfig:
    """Everything one node's daemon runs with; validated at construction."""

    world: World
    node_rank: int = 0
    peers: tuple[str, ...] = ()  # node -> "host:port" of its peer listener
    listen: str = "127.0.0.1:0"
    socket: str = field(default_factory=default_socket)
    metrics_port: int | None = None  # None = no /metrics; 0 = any free port
    metrics_host: str = "127.0.0.1"  # a pod's IP (or 0.0.0.0) so Prometheus can scrape it
    health_listen: str = ""  # "HOST:PORT": grpc.health.v1 over TCP for probes; "" = socket only
    drain_timeout_s: float = 30.0  # after SIGTERM: time the trainers get to take queued steps
    # A local rank not attached this long (from start-up, or from its detach) fails the job.
    # Generous: a trainer loads its model (minutes for a large one from network storage, more
    # with torch.compile) before its first batch, and torchrun restarts take time too.
    attach_timeout_s: float = 1800.0
    dataset: str | None = None  # MODULE:FACTORY for daemon-spawned producers
    dataset_args: tuple[tuple[str, str], ...] = ()
    workers: int = 2
    dataset_size: int | None = None
    token_budget: int = 12288
    buffer: int = 1024
    seed: int = 0
    epochs: int = 1  # 0 = endless
    # Step-based job: it ends after exactly this many optimizer updates on every rank, looping
    # over epochs (each reshuffled); 0 = off. cli.py then runs the epochs endless (--epochs 0).
    max_updates: int = 0
    # Once a rank called ODBClient.end_job(), every other rank must call it within this long.
    end_timeout_s: float = 60.0
    join: bool = True
    shuffle: bool = True
    loss_scaling: LossScaling = LossScaling.EXACT
    grouping: Grouping = Grouping.MIN_TIME
    cost_model: CostModelMode = CostModelMode.AUTO  # planner/cost_fit.py, daemon/cost_learning.py
    cost_warmup: int = 64  # timed rank-steps (over every node) before the first fit
    balance: Balance = Balance.NODE
    length_key: str = "input_ids"
    labels_key: str = "labels"
    pads: tuple[tuple[str, float], ...] = tuple(DEFAULT_PADS.items())
    state_dir: Path | None = None
    job_id: str = "odbd"
    job_token: bytes = b""
    peer_tls: PeerTls | None = None  # --tls-cert/--tls-key/--tls-ca: mTLS between daemons
    insecure: bool = False  # --insecure: no peer authentication on a non-loopback address
    migrate: bool = False  # --migrate auto: cross-node moves (daemon/migration_live.py)
    link_gbps: float = 8.0  # --link-gbps: the link model's bandwidth per node and direction
    shm_size: int = 1 << 30
    lease_timeout_s: float = 60.0
    round_timeout_s: float = 300.0
    round_fanout: int = DEFAULT_ROUND_FANOUT  # children per daemon in the round relay tree
    join_timeout_s: float = 120.0
    # An epoch may lose at most this fraction of its samples to rejections (over every node)
    # before the job fails; rejections.DEFAULT_MAX_REJECT_FRACTION.
    max_reject_fraction: float = 0.01
    check_finite: bool = False  # producers reject float keys holding NaN or inf
    stall_s: float = 1.0  # no ingest progress this long with trainers nearly starved: plan anyway
    rewind_steps: int = 4096  # steps per rank kept for rewinds (daemon/rewind.py)
    steps_ahead: int = 64  # plan the next round once a local rank has at most this many queued
    accumulate: int = 1  # micro-steps per optimizer update (planner/windows.py)
    tokens_per_update: int = 0  # or: close updates at >= this many loss tokens (0 = off)
    align: Align = Align.STEPS  # --align updates: ranks wait once per update (update_align.py)
    collate: Collate = Collate.PADDED  # batch form; packed: a group's budget is sum of lengths
    attention: Attention = Attention.AUTO  # what a packed row's attention costs (cost model)
    concat: tuple[str, ...] = ()  # keys joined along their first dimension (pixel_values...)
    max_patches: int = 0  # a group's vision patches; 0 = no patch budget
    patch_key: str | None = None  # patch count = this key's first dimension
    patch_count_key: str | None = None  # or: the integer value of this key

    @property
    def patch_source(self) -> tuple[str, str]:
        """(patch_key, patch_count_key) the producers count patches with ("" = unset)."""
        if self.patch_count_key:
            return "", self.patch_count_key
        return self.patch_key or (self.concat[0] if self.concat else ""), ""

    def __post_init__(self) -> None:
        nodes = self.world.num_nodes
        if self.migrate and self.balance is not Balance.NODE:
            raise ConfigError(
                "--migrate auto moves samples between nodes' pooled buffers, and --balance "
                f"{self.balance.value} keeps per-rank buffers; use --balance node with it, or "
                "--migrate off"
            )
        if self.migrate and not self.link_gbps > 0:
            raise ConfigError(
                f"--link-gbps must be > 0, got {self.link_gbps:g}; pass each node's bandwidth "
                "in Gb/s (or --migrate off)"
            )
        if not 0 <= self.node_rank < nodes:
            raise ConfigError(
                f"node rank {self.node_rank} is outside 0..{nodes - 1} for world "
                f"{self.world.world_size} with {self.world.ranks_per_node} ranks per node; "
                "pass --node-rank or set NODE_RANK"
            )
        if nodes > 1 and len(self.peers) != nodes:
            raise ConfigError(
                f"{nodes} nodes need --peers with {nodes} addresses in node-rank order, "
                f"got {len(self.peers)}"
            )
        exposed = unprotected_reason(
            num_nodes=nodes,
            node_rank=self.node_rank,
            listen=self.listen,
            peers=self.peers,
            has_token=bool(self.job_token),
            has_tls=self.peer_tls is not None,
            insecure=self.insecure,
        )
        if exposed is not None:
            raise ConfigError(exposed)
        if (self.dataset is None) == (self.dataset_size is None):
            raise ConfigError(
                "pass exactly one of --dataset MODULE:FACTORY (daemon-spawned producers) or "
                "--dataset-size N (external producers connect to the socket)"
            )
        if self.dataset_size is not None and self.dataset_size < 1:
            raise ConfigError(
                f"--dataset-size must be >= 1, got {self.dataset_size}: an empty dataset trains "
                "nothing; pass the dataset's len()"
            )
        if not 0.0 <= self.max_reject_fraction <= 1.0:
            raise ConfigError(
                f"--max-reject-fraction must be in 0..1, got {self.max_reject_fraction:g} "
                "(0 fails on the first rejection, 1 never fails on rejections)"
            )
        if self.steps_ahead < 1:
            raise ConfigError(
                f"--steps-ahead must be >= 1, got {self.steps_ahead}: with 0 the next round is "
                "planned only once a rank ran dry, so every round boundary stalls the trainers"
            )
        if self.epochs < 0:
            raise ConfigError(f"--epochs must be >= 0 (0 = endless), got {self.epochs}")
        if self.cost_warmup < 3:
            raise ConfigError(
                f"--cost-warmup must be >= 3 timed steps (the fit has 3 coefficients), got "
                f"{self.cost_warmup}"
            )
        if self.attention is not Attention.AUTO and self.collate is not Collate.PACKED:
            raise ConfigError(
                f"--attention {self.attention.value} prices packed rows, but batches are "
                f"--collate {self.collate.value}; pass --collate packed, or drop --attention "
                "(padded rows pay their padded area whatever the kernel)"
            )
        if self.max_updates < 0:
            raise ConfigError(f"--max-updates must be >= 0 (0 = off), got {self.max_updates}")
        if self.max_updates and self.epochs:
            raise ConfigError(
                f"--max-updates {self.max_updates} ends the job by updates, looping over as many "
                f"epochs as it needs, but --epochs is {self.epochs}: run it with --epochs 0"
            )
        if not self.end_timeout_s > 0:
            raise ConfigError(f"--end-timeout must be > 0 seconds, got {self.end_timeout_s}")
        if self.workers < 0:
            raise ConfigError(f"--workers must be >= 0, got {self.workers}")
        if self.dataset is not None and self.workers == 0:
            raise ConfigError(
                "--workers 0 with --dataset spawns no producer, so no sample would ever arrive; "
                "pass --workers K >= 1, or --dataset-size N and start producers yourself"
            )
        if self.drain_timeout_s < 0:
            raise ConfigError(f"--drain-timeout must be >= 0 seconds, got {self.drain_timeout_s}")
        if not self.attach_timeout_s > 0:
            raise ConfigError(
                f"--attach-timeout must be > 0 seconds, got {self.attach_timeout_s}; it bounds "
                "how long a rank's trainer may stay away before the job fails"
            )
        if self.shm_size < (1 << 20):
            raise ConfigError(f"--shm-size must be at least 1 MiB, got {self.shm_size} bytes")
        if not self.join and (self.accumulate > 1 or self.tokens_per_update > 0):
            raise ConfigError(
                "--accumulate and --tokens-per-update need join mode: a --no-join epoch ends "
                "mid-round, which would cut an optimizer update in two; drop --no-join"
            )
        self._check_batch_form()
        self.planner(0)  # validates budget and buffer with the planner's own messages

    def _check_batch_form(self) -> None:
        if self.patch_key and self.patch_count_key:
            raise ConfigError(
                f"--patch-key {self.patch_key} and --patch-count-key {self.patch_count_key} both "
                "count a sample's patches; pass one of them"
            )
        if self.max_patches > 0 and self.patch_source == ("", ""):
            raise ConfigError(
                f"--max-patches {self.max_patches} needs a patch count per sample: pass "
                "--patch-key KEY (its first dimension), --patch-count-key KEY (its value) or "
                "--concat KEY (the first one counts)"
            )
        reserved = {self.length_key, self.labels_key} & set(self.concat)
        if reserved:
            raise ConfigError(
                f"--concat {sorted(reserved)[0]} names the length or labels key, which are "
                "padded (or packed) per sample; concatenate other keys, e.g. pixel_values"
            )
        if len(set(self.concat)) != len(self.concat):
            raise ConfigError(f"--concat names a key twice: {list(self.concat)}")

    def planner(self, dataset_size: int) -> PlannerConfig:
        del dataset_size  # the planner does not depend on N; kept for a future bound
        return PlannerConfig(
            world=self.world,
            token_budget=self.token_budget,
            buffer_size=self.buffer,
            grouping=self.grouping,
            balance=self.balance,
            loss_scaling=self.loss_scaling,
            seed=self.seed,
            accumulate=self.accumulate,
            tokens_per_update=self.tokens_per_update,
            align=self.align,
            collate=self.collate,
            max_patches=self.max_patches,
            attention=self.attention,
            cost=CostModel(
                dense_rows=self.collate is Collate.PACKED and self.attention is Attention.DENSE
            ),
            migrate=self.migrate,
        )

    @property
    def local_ranks(self) -> range:
        return self.world.ranks_of(self.node_rank)

    def fingerprint(self, dataset_size: int) -> dict[str, str]:
        """Settings every daemon of the job must share (compared at the peer handshake)."""
        return {
            "world": str(self.world.world_size),
            "ranks_per_node": str(self.world.ranks_per_node),
            "token_budget": str(self.token_budget),
            "buffer": str(self.buffer),
            "seed": str(self.seed),
            "epochs": str(self.epochs),
            "join": str(self.join).lower(),
            "shuffle": str(self.shuffle).lower(),
            "grouping": self.grouping.value,
            "balance": self.balance.value,
            "loss_scaling": self.loss_scaling.value,
            # Plans depend on the model; a release without the flag planned with the fixed one.
            **({"cost_model": self.cost_model.value} if self.cost_model.value != "fixed" else {}),
            **({"cost_warmup": str(self.cost_warmup)} if self.cost_warmup != 64 else {}),
            "dataset_size": str(dataset_size),
            # Only when set: every daemon must run the same exchanges per round.
            **({"migrate": "auto", "link_gbps": repr(self.link_gbps)} if self.migrate else {}),
            "length_key": self.length_key,
            # Only when set (as below): every daemon must fail a job at the same count.
            **(
                {"max_reject_fraction": repr(self.max_reject_fraction)}
                if self.max_reject_fraction != 0.01
                else {}
            ),
            **({"check_finite": "true"} if self.check_finite else {}),
            # Only when set: daemons (and journals) of a release without updates still match
            # a job that does not use them, and refuse one that does.
            **({"accumulate": str(self.accumulate)} if self.accumulate != 1 else {}),
            **({"max_updates": str(self.max_updates)} if self.max_updates else {}),
            **(
                {"tokens_per_update": str(self.tokens_per_update)} if self.tokens_per_update else {}
            ),
            # Issue 26, likewise: update alignment permutes every round's slots.
            **({"align": self.align.value} if self.align is not Align.STEPS else {}),
            # Issue 13, likewise only when set: the batch form and the patch budget change plans
            # (budgets, costs) and what every trainer must be able to take.
            **({"collate": self.collate.value} if self.collate is not Collate.PADDED else {}),
            **({"attention": self.attention.value} if self.attention is not Attention.AUTO else {}),
            **({"concat": ",".join(self.concat)} if self.concat else {}),
            **(self._patch_fingerprint() if self.max_patches else {}),
        }

    def _patch_fingerprint(self) -> dict[str, str]:
        key, count_key = self.patch_source
        return {
            "max_patches": str(self.max_patches),
            "patch_source": f"count:{count_key}" if count_key else f"key:{key}",
        }
