"""odbd against the batchers users pick instead, on a tiny Hugging Face Llama (issue 27).

Driven by `test_bench_training.py::test_training_vs_user_baselines` (`make bench-training`).
Every run is one epoch of `training_text.TextTokens` (BPE tokenizer trained on the spot) on a
random-weight tiny `LlamaForCausalLM` (sdpa, float32), 1 node x W gloo ranks on CPU, through
`training_hf_rank`; only the data path differs (see `training_batchers` for the algorithms).

1. Sweep: each baseline's knob at world 2, one run each; the best samples/s is its setting.
2. Measure: every path at its setting, at world 2 and 4, `REPEATS` rounds, each round running
   every path once in turn (alternated), so load drifts hit every path alike; medians.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from odbd.demo.cluster import LocalCluster
from tests.bench.training_hf_rank import ModelSize
from tests.bench.training_text import TextTokens
from tests.integration.ddp_launch import Reports, data_flags, launch_ranks, odbd_cluster

RANK_MODULE = "tests.bench.training_hf_rank"
DATA_FILE = Path(__file__).with_name("training_text.py")


@dataclass(frozen=True)
class Setup:
    data: dict[str, object] = field(default_factory=lambda: {"size": 2048, "seed": 0})
    model: ModelSize = ModelSize()
    token_budget: int = 2048
    buffer: int = 64
    worlds: tuple[int, ...] = (2, 4)
    repeats: int = 3
    timeout_s: float = 900.0

    def model_args(self) -> list[str]:
        return [f"--model-{k}={v}" for k, v in vars(self.model).items()]


@dataclass(frozen=True)
class Path_:
    """One data path at one setting."""

    name: str  # the table's row name
    setting: str  # the knob's value, as shown
    args: tuple[str, ...] = ()  # training_hf_rank flags
    daemon_args: tuple[str, ...] = ()  # odbd only
    odbd: bool = False


def sweep_paths(setup: Setup) -> dict[str, list[Path_]]:
    """Per baseline, the settings tried at world 2."""
    budget = ("--token-budget", str(setup.token_budget))

    def batch(name: str, loader: str, sizes: Sequence[int], *extra: str) -> list[Path_]:
        return [
            Path_(name, f"batch {b}", ("--loader", loader, "--batch-size", str(b), *extra))
            for b in sizes
        ]

    return {
        "fixed": batch("DataLoader fixed batch", "fixed", (4, 16)),
        "grouped": batch("HF group_by_length", "grouped", (4, 8, 16)),
        "flatten": batch("HF DataCollatorWithFlattening", "fixed", (4, 8, 16), "--flatten"),
        "bucketed": [
            Path_(
                "token-budget buckets (Lhotse-style)",
                f"{n} buckets",
                ("--loader", "bucketed", "--buckets", str(n), *budget),
            )
            for n in (4, 8)
        ],  # fmt: skip
        "balanced": [
            Path_(
                "cosmos-rl-style load-balanced",
                f"pool {p}",
                ("--loader", "balanced", "--pool", str(p), *budget),
            )
            for p in (32, 128)
        ],  # fmt: skip
    }


def odbd_paths(setup: Setup) -> list[Path_]:
    common = ("--token-budget", str(setup.token_budget), "--buffer", str(setup.buffer))
    return [
        Path_("odbd padded", f"budget {setup.token_budget}", ("--loader", "odbd"),
              common, odbd=True),
        Path_("odbd --collate packed", f"budget {setup.token_budget}", ("--loader", "odbd"),
              (*common, "--collate", "packed"), odbd=True),
    ]  # fmt: skip


@dataclass(frozen=True)
class Run:
    path: Path_
    world: int
    loop_s: float
    samples: int
    distinct: int
    steps: int  # the most any rank took
    real_tokens: int
    padded_tokens: int
    peak_tokens: int  # the largest rank-step row area (memory)
    token_idle: float  # mean over steps of 1 - mean/max of the ranks' padded tokens
    time_idle: float  # the same for the ranks' forward seconds
    wait_s: float  # rank 0's seconds waiting for its batches inside the loop
    first_wait_s: float  # of which for its first batch
    steady_samples: int  # samples after every rank's first step
    steady_s: float  # from the end of the first step (earliest rank) to the last (latest rank)

    @property
    def samples_per_s(self) -> float:
        return self.samples / self.loop_s

    @property
    def steady_per_s(self) -> float:
        """Samples/s after the first step: without the data path's start (odbd's first round)."""
        return self.steady_samples / self.steady_s if self.steady_s > 0 else float("nan")

    @property
    def tokens_per_s(self) -> float:
        return self.real_tokens / self.loop_s

    @property
    def padding(self) -> float:
        return 1.0 - self.real_tokens / self.padded_tokens


def idle_share(per_step: list[list[float]]) -> float:
    """Mean over steps of the share of the slowest rank's work the average rank lacks."""
    shares = [1.0 - (sum(w) / len(w)) / max(w) for w in per_step if max(w) > 0]
    return float(np.mean(shares)) if shares else 0.0


def summarize(path: Path_, world: int, reports: Reports, lengths: np.ndarray) -> Run:
    done = reports.done(0)
    assert done, f"{path.name} ({path.setting}), world {world}: rank 0 did not finish"
    steps = [reports.steps(rank) for rank in range(world)]
    ids = [i for rank_steps in steps for r in rank_steps for i in r["ids"]]
    count = max(len(s) for s in steps)

    def work(key: str) -> list[list[float]]:
        table = []
        for k in range(count):
            row = []
            for rank_steps in steps:
                rec = rank_steps[k] if k < len(rank_steps) else None
                row.append(0.0 if rec is None or rec["idle"] else float(rec[key]))
            table.append(row)
        return table

    return Run(
        path=path, world=world, loop_s=float(done["loop_s"]), samples=len(ids),
        distinct=len(set(ids)), steps=count, real_tokens=int(lengths[ids].sum()),
        padded_tokens=sum(r["padded"] for s in steps for r in s),
        peak_tokens=max(r["padded"] for s in steps for r in s),
        token_idle=idle_share(work("padded")), time_idle=idle_share(work("forward_s")),
        wait_s=sum(r.get("wait_s", 0.0) for r in steps[0]),
        first_wait_s=steps[0][0].get("wait_s", 0.0) if steps[0] else 0.0,
        steady_samples=sum(len(r["ids"]) for s in steps for r in s[1:]),
        steady_s=max(s[-1].get("end_s", 0.0) for s in steps if s)
        - min(s[0].get("end_s", 0.0) for s in steps if s),
    )  # fmt: skip


class RankPool:
    """W trainer ranks started once, then given run after run (`training_hf_rank --schedule`).

    Each order is a JSON file the ranks' rank 0 waits for; a run is over when every rank has
    written its closing record. Start-up (importing torch and transformers: tens of seconds per
    rank on a loaded 2-core machine) is thus paid once per world size, not once per run.
    """

    def __init__(self, setup: Setup, world: int, root: Path) -> None:
        self.setup, self.world, self.root = setup, world, root
        self.schedule = root / "schedule"
        self.schedule.mkdir(parents=True)
        self.orders = 0
        self.ranks = launch_ranks(
            world=world, nproc_per_node=world, out_dir=root,
            trainer_args=["--schedule", str(self.schedule)], module=RANK_MODULE,
        )  # fmt: skip

    def _order(self, flags: list[str] | None) -> None:
        path = self.schedule / f"order{self.orders}.json"
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(flags))
        tmp.rename(path)  # rank 0 polls for the name: it never sees a half-written order
        self.orders += 1

    def _wait_done(self, out_dir: Path) -> Reports:
        deadline = time.monotonic() + self.setup.timeout_s
        while True:
            reports = Reports.read(out_dir, self.world) if out_dir.exists() else None
            if reports and all(reports.done(rank) for rank in range(self.world)):
                return reports
            dead = [p.returncode for p in self.ranks.processes if p.poll() is not None]
            if dead or time.monotonic() > deadline:
                raise AssertionError(
                    f"run {out_dir.name}: ranks exited {dead} or did not finish within "
                    f"{self.setup.timeout_s:.0f} s\n{self.ranks.logs()}"
                )
            time.sleep(0.05)

    def run(self, path: Path_, out_dir: Path) -> Reports:
        flags = ["--out-dir", str(out_dir), *path.args, *self.setup.model_args(),
                 *data_flags(self.setup.data)]  # fmt: skip
        if not path.odbd:
            self._order(flags)
            return self._wait_done(out_dir)
        cluster: LocalCluster = odbd_cluster(
            nodes=1, ranks_per_node=self.world, data=self.setup.data,
            daemon_args=list(path.daemon_args), dataset_file=DATA_FILE,
        )  # fmt: skip
        try:
            cluster.start()
            cluster.wait_sockets(self.setup.timeout_s)  # the daemon's start is outside the loop
            self._order([*flags, "--socket", cluster.sockets[0]])
            reports = self._wait_done(out_dir)
            codes = cluster.wait(60.0)
            assert codes == [0], f"odbd exited {codes}\n{cluster.log(0)}"
        finally:
            cluster.stop()
        return reports

    def close(self) -> None:
        if all(p.poll() is None for p in self.ranks.processes):
            self._order(None)
        codes = self.ranks.wait(60.0)  # kills what is left after the deadline
        assert codes == [0] * self.world, f"ranks exited {codes}\n{self.ranks.logs()}"


@dataclass
class Measurement:
    setup: Setup
    chosen: dict[str, Path_]  # baseline key -> its best setting
    sweep: list[Run]
    runs: list[Run]  # every measured run

    def median(self, path: Path_, world: int) -> Run:
        """The run with the median samples/s of this path at this world."""
        mine = sorted(
            (r for r in self.runs if r.path == path and r.world == world),
            key=lambda r: r.samples_per_s,
        )
        return mine[(len(mine) - 1) // 2]

    def spread(self, path: Path_, world: int) -> tuple[float, float]:
        rates = [r.samples_per_s for r in self.runs if r.path == path and r.world == world]
        return min(rates), max(rates)


def measure(setup: Setup, tmp: Path, log: Callable[[str], None] = print) -> Measurement:
    lengths = TextTokens(**setup.data).lengths  # type: ignore[arg-type]
    pools = {world: RankPool(setup, world, tmp / f"world{world}") for world in setup.worlds}
    counter = iter(range(1_000_000))

    def one(path: Path_, world: int) -> Run:
        reports = pools[world].run(path, tmp / f"run{next(counter)}")
        run = summarize(path, world, reports, lengths)
        assert run.distinct == run.samples == len(lengths), run  # each sample exactly once
        log(f"  {path.name} [{path.setting}] world {world}: {run.samples_per_s:,.1f} samples/s, "
            f"{run.steps} steps, padding {100 * run.padding:.1f} %")  # fmt: skip
        return run

    try:
        sweep: list[Run] = []
        chosen: dict[str, Path_] = {}
        for key, options in sweep_paths(setup).items():
            tried = [one(p, min(setup.worlds)) for p in options]
            sweep += tried
            chosen[key] = max(tried, key=lambda r: r.samples_per_s).path
        paths = [*chosen.values(), *odbd_paths(setup)]
        runs: list[Run] = []
        for _ in range(setup.repeats):
            for world in setup.worlds:
                for path in paths:
                    runs.append(one(path, world))
    except BaseException:
        for pool in pools.values():
            pool.ranks.wait(0.01)  # kills them: a failed run leaves no rank behind
        raise
    for pool in pools.values():
        pool.close()
    return Measurement(setup, chosen, sweep, runs)


# --- the report ---------------------------------------------------------------------------------


def table(m: Measurement, world: int) -> list[str]:
    odbd_padded, odbd_packed = odbd_paths(m.setup)
    base = {p: m.median(p, world) for p in [*m.chosen.values(), odbd_padded, odbd_packed]}
    lines = [
        f"World {world} (1 node x {world} gloo ranks), medians of {m.setup.repeats}:",
        "",
        "| data path | setting | steps/rank | samples/s (min-max) | after step 1 | tokens/s "
        "| padding "
        "| peak row tokens | idle share tokens / fwd time | batch wait s (first) "
        "| odbd padded vs it | odbd packed vs it |",
        "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for path, run in base.items():
        low, high = m.spread(path, world)
        lines.append(
            f"| {path.name} | {path.setting} | {run.steps} "
            f"| {run.samples_per_s:,.0f} ({low:,.0f}-{high:,.0f}) | {run.steady_per_s:,.0f} "
            f"| {run.tokens_per_s:,.0f} "
            f"| {100 * run.padding:.1f} % | {run.peak_tokens:,} "
            f"| {100 * run.token_idle:.0f} % / {100 * run.time_idle:.0f} % "
            f"| {run.wait_s:.2f} ({run.first_wait_s:.2f}) "
            f"| {base[odbd_padded].samples_per_s / run.samples_per_s:.2f}x "
            f"| {base[odbd_packed].samples_per_s / run.samples_per_s:.2f}x |"
        )
    return lines


def sweep_table(m: Measurement) -> list[str]:
    lines = [
        f"Sweep (world {min(m.setup.worlds)}, one run each; the best is used above):",
        "",
        "| baseline | setting | samples/s | steps/rank | padding |",
        "| --- | --- | ---: | ---: | ---: |",
    ]
    for r in m.sweep:
        best = " (best)" if r.path in m.chosen.values() else ""
        lines.append(
            f"| {r.path.name} | {r.path.setting}{best} | {r.samples_per_s:,.0f} | {r.steps} "
            f"| {100 * r.padding:.1f} % |"
        )
    return lines


def ratio(m: Measurement, world: int, odbd_name: str, key: str, steady: bool = False) -> float:
    odbd = next(p for p in odbd_paths(m.setup) if p.name == odbd_name)
    mine, theirs = m.median(odbd, world), m.median(m.chosen[key], world)
    if steady:
        return mine.steady_per_s / theirs.steady_per_s
    return mine.samples_per_s / theirs.samples_per_s


def headline(m: Measurement) -> list[str]:
    """The lines README.md quotes (checked by tests/unit/test_bench_headline.py)."""
    small, large = min(m.setup.worlds), max(m.setup.worlds)

    def both(odbd_name: str, key: str) -> str:
        return (
            f"{ratio(m, large, odbd_name, key):.2f}x at {large} ranks "
            f"({ratio(m, large, odbd_name, key, steady=True):.2f}x after the first step), "
            f"{ratio(m, small, odbd_name, key):.2f}x at {small}"
        )

    return [
        "- DDP training, tiny HF Llama on CPU (gloo), medians of alternated runs, samples/s: "
        f"odbd padded vs HF `group_by_length` {both('odbd padded', 'grouped')}; vs the "
        f"Lhotse-style token-budget bucketing sampler {both('odbd padded', 'bucketed')}; vs "
        f"the cosmos-rl-style load-balanced batcher {both('odbd padded', 'balanced')}; vs "
        f"fixed `DataLoader` batches {both('odbd padded', 'fixed')}.",
        "- odbd `--collate packed` vs HF `DataCollatorWithFlattening` "
        f"{both('odbd --collate packed', 'flatten')} under sdpa: on CPU a packed row's "
        "attention runs over the whole row, and odbd fills the row to the token budget. With "
        "odbclient's per-sample segment attention (`tests.bench.packed_kernel_ab`, 2 ranks, "
        "5 alternated reps, 2026-11-28): odbd packed 1.09x flatten on the same kernel, 1.47x "
        'flatten under sdpa (docs/bench/training.md, "Packed rows and the attention kernel").',
    ]
