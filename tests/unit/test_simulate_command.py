"""odbd simulate in-process: flag handling, epochs, the paper baseline's config."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest

from odbd.planner.config import Balance, Grouping
from odbd.planner.epoch import simulate
from odbd.simulate import add_arguments, main, run

SMALL = ["--world", "4", "--nproc-per-node", "2", "--buffer", "32", "--num-samples", "600"]


def test_json_without_compare_has_empty_baselines(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--dist", "llava", *SMALL, "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["baselines"] == {}
    assert out["steps"] > 0 and 0 < out["efficiency"] <= 1.0


def test_compare_batch_sizes_name_the_baselines(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["--dist", "bimodal", *SMALL, "--json", "--compare", "--compare-batch-sizes", "2,8,2"]
    assert main(argv) == 0
    names = list(json.loads(capsys.readouterr().out)["baselines"])
    assert names == ["fixed-2", "fixed-8", "paper", "oracle"]


def test_epochs_appear_in_the_plan(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    plan = tmp_path / "plan.jsonl"
    assert main(["--dist", "all-short", *SMALL, "--epochs", "2", "--plan-out", str(plan)]) == 0
    steps = [json.loads(line) for line in plan.read_text().splitlines()]
    epochs = [s["epoch"] for s in steps]
    assert epochs == sorted(epochs) and set(epochs) == {0, 1}
    assert sum(len(g) for s in steps for g in s["ranks"]) == 2 * 600
    assert "2 epoch(s)" in capsys.readouterr().out


def test_num_samples_takes_a_prefix_of_the_file(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "l.txt"
    path.write_text("100\n" * 50)
    assert main(["--lengths", str(path), "--num-samples", "10", "--world", "1",
                 "--nproc-per-node", "1", "--json"]) == 0  # fmt: skip
    assert json.loads(capsys.readouterr().out)["samples_per_step"] == 10
    assert main(["--lengths", str(path), "--num-samples", "51"]) == 2
    assert "exceeds the 50 lengths" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--epochs", "0"], "--epochs must be >= 1"),
        (["--buffer", "0"], "buffer size must be > 0"),
        (["--num-samples", "-5"], "--num-samples must be >= 0"),
        (["--cost-c", "-1"], "coefficients must be >= 0"),
    ],
)
def test_config_errors_return_2(
    argv: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["--dist", "llava", *argv]) == 2
    err = capsys.readouterr().err
    assert err.startswith("odbd simulate: error: ") and message in err and err.count("\n") == 1


def test_add_arguments_works_on_a_foreign_parser(capsys: pytest.CaptureFixture[str]) -> None:
    parser = argparse.ArgumentParser(prog="odbd simulate")
    add_arguments(parser)
    args = parser.parse_args(["--dist", "uniform-narrow", *SMALL, "--grouping", "paper",
                              "--balance", "rank", "--json"])  # fmt: skip
    assert (Grouping(args.grouping), Balance(args.balance)) == (Grouping.PAPER, Balance.RANK)
    assert run(args) == 0
    assert json.loads(capsys.readouterr().out)["padding_ratio"] >= 0


def test_accumulate_reports_k_micro_steps_per_update(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--dist", "llava", *SMALL, "--json", "--accumulate", "3", "--epochs", "2"]) == 0
    updates = json.loads(capsys.readouterr().out)["updates"]
    assert len(updates["updates_per_epoch"]) == 2
    assert updates["micro_steps_per_update"]["max"] == 3
    assert updates["updates"] == sum(updates["updates_per_epoch"])


def test_tokens_per_update_reports_an_even_token_count(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["--dist", "ultrachat", "--world", "16", "--nproc-per-node", "8"]
    assert main([*argv, "--num-samples", "30000", "--tokens-per-update", "1000000"]) == 0
    out = capsys.readouterr().out
    assert "optimizer updates:" in out and "each epoch's last update excluded" in out
    assert main([*argv, "--num-samples", "30000", "--tokens-per-update", "1000000", "--json"]) == 0
    tokens = json.loads(capsys.readouterr().out)["updates"]["tokens_per_update"]
    assert tokens["min"] >= 0 and tokens["mean"] >= 1_000_000
    assert tokens["cv_except_last"] < 0.05, tokens


def test_windows_refuse_no_join(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--dist", "llava", *SMALL, "--accumulate", "2", "--no-join"]) == 2
    assert "need join mode" in capsys.readouterr().err


def test_packed_beside_padded_fewer_steps_no_padding(capsys: pytest.CaptureFixture[str]) -> None:
    runs = {}
    for collate in ("padded", "packed"):
        assert main(["--dist", "sharegpt4o", *SMALL, "--json", "--collate", collate]) == 0
        runs[collate] = json.loads(capsys.readouterr().out)
    assert runs["packed"]["padding_ratio"] == 0.0
    assert runs["packed"]["steps"] <= runs["padded"]["steps"]


def test_max_patches_reads_the_second_column(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    lines = [f"{100 + (i * 37) % 900} {(i * 53) % 700}" for i in range(400)]
    path = tmp_path / "lengths.txt"
    path.write_text("\n".join(lines) + "\n")
    plan = tmp_path / "plan.jsonl"
    argv = ["--lengths", str(path), *SMALL[:6], "--token-budget", "4096", "--max-patches", "1000"]
    assert main([*argv, "--collate", "packed", "--plan-out", str(plan)]) == 0
    assert "packed batches of <= 1000 patches" in capsys.readouterr().out
    patches = [int(line.split()[1]) for line in lines]
    for step in (json.loads(line) for line in plan.read_text().splitlines()):
        for group in step["ranks"]:
            if len(group) > 1:
                assert sum(patches[i] for i, _ in group) <= 1000
                assert sum(length for _, length in group) <= 4096


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--dist", "llava", "--max-patches", "10"], "needs each sample's patch count"),
        (["--dist", "llava", "--collate", "packed", "--compare"], "--compare's baselines"),
        (["--dist", "llava", "--grouping", "paper", "--collate", "packed"], "--grouping paper"),
    ],
)
def test_batch_form_misuse_is_one_error(argv, message, capsys: pytest.CaptureFixture[str]) -> None:
    assert main([*argv, *SMALL]) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1


def test_align_updates_is_timed_beside_aligned_steps(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["--dist", "longtail", *SMALL[:-2], "--num-samples", "3000", "--buffer", "16"]
    assert main([*argv, "--accumulate", "4", "--align", "updates", "--json"]) == 0
    align = json.loads(capsys.readouterr().out)["align"]
    assert align["updates"] > 0 and align["updates_time"] <= align["steps_time"]
    assert align["speedup"] == pytest.approx(align["steps_time"] / align["updates_time"])
    assert main([*argv, "--accumulate", "4", "--align", "updates"]) == 0
    assert "--align updates vs steps over" in capsys.readouterr().out
    assert main([*argv, "--align", "updates"]) == 2  # no updates of several micro-steps
    assert "--align updates" in capsys.readouterr().err


def test_migrate_auto_reports_bytes_moved_and_the_node_local_oracle(
    capsys: pytest.CaptureFixture[str],
) -> None:
    # A link of 1e6 Gb/s makes every balancing move pay; 4 nodes of 2 ranks.
    argv = ["--dist", "longtail", *SMALL, "--migrate", "auto", "--link-gbps", "1e6"]
    assert main([*argv, "--json", "--compare"]) == 0
    out = json.loads(capsys.readouterr().out)
    moved = out["migration"]
    assert moved["samples_moved"] > 0 and 0 < moved["bytes_moved"] < moved["bytes_ingested"]
    assert set(moved["links"]) == {"100gbps", "25gbps"}
    assert list(out["baselines"])[-2:] == ["oracle", "node-local oracle"]
    assert main(argv) == 0
    text = capsys.readouterr().out
    assert "migrate auto: link 1e+06 Gb/s" in text and "samples moved between nodes" in text


def test_migrate_decision_picks_the_digest_or_the_pooled_moves(
    capsys: pytest.CaptureFixture[str],
) -> None:
    # The default is the live daemons' decision (digests); pooled is the reference. Each run
    # must report the moves of its own decision, as simulate() makes them.
    from odbd.simulate.command import build_setup

    argv = ["--dist", "longtail", *SMALL, "--migrate", "auto", "--link-gbps", "1e6"]
    moved = {}
    for decision in ("digest", "pooled"):
        assert main([*argv, "--migrate-decision", decision, "--json"]) == 0
        moved[decision] = json.loads(capsys.readouterr().out)["migration"]["samples_moved"]
        parser = argparse.ArgumentParser()
        add_arguments(parser)
        setup = build_setup(parser.parse_args([*argv, "--migrate-decision", decision]))
        result = simulate(
            setup.lengths, setup.config, migration=setup.migration, digest=decision == "digest"
        )
        assert moved[decision] == int(result.moved_samples.sum()) > 0
    assert main(argv) == 0
    assert "decided from digests (as live daemons do)" in capsys.readouterr().out


def test_migrate_off_reports_no_moves(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--dist", "longtail", *SMALL, "--json"]) == 0
    assert "migration" not in json.loads(capsys.readouterr().out)


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--migrate", "auto", "--balance", "rank"], "drop --balance rank or pass --migrate off"),
        (["--migrate", "auto", "--link-gbps", "0"], "--link-gbps must be > 0"),
    ],
)
def test_migrate_misuse_is_one_error(argv, message, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--dist", "llava", *argv, *SMALL]) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1
