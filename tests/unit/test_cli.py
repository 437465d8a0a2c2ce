"""`odbd` flags and ODBD_* values: parsed, checked at parse time, one-line errors (exit 2)."""

import os
import resource
import subprocess
import sys
import time
from pathlib import Path

import pytest

import odbd.daemon.app
from odbd import cli, flags
from odbd.cli import apply_environment, config_from_args, daemon_parser, run_daemon_command
from odbd.config import node_rank_from_environment
from odbd.demo.command import ProgressPrinter
from odbd.demo.command import main as demo_main
from odbd.errors import ConfigError
from odbd.simulate import main as simulate_main

REPO = Path(__file__).resolve().parents[2]


def parse(argv, environ):
    parser = daemon_parser()
    apply_environment(parser, environ)
    return config_from_args(parser.parse_args(argv), environ)


@pytest.fixture
def no_daemon(monkeypatch):
    """A flag the checks wrongly accept must fail the test, not start a daemon."""

    def refuse(*args, **kwargs):
        raise AssertionError("the daemon started: the bad input was accepted")

    monkeypatch.setattr(odbd.daemon.app, "run_daemon", refuse)


def run_cli(argv, environ, capsys):
    """(exit status, stderr) of `odbd argv` with exactly `environ` as its environment."""
    try:
        code = run_daemon_command(argv, environ)
    except SystemExit as stop:
        code = stop.code
    return code, capsys.readouterr().err


def test_every_flag_reads_its_odbd_variable(tmp_path):
    config = parse(
        ["--dataset-size", "10"],
        {"ODBD_WORLD": "16", "ODBD_NPROC_PER_NODE": "8", "ODBD_NODE_RANK": "1",
         "ODBD_PEERS": "a:1,b:2", "ODBD_JOIN": "false", "ODBD_SHM_SIZE": "512M",
         "ODBD_PAD": "input_ids=7", "ODBD_SOCKET": str(tmp_path / "s.sock"),
         "ODBD_INSECURE": "true"},  # peers a and b are not loopback: protected mode
    )  # fmt: skip
    assert config.world.world_size == 16 and config.world.ranks_per_node == 8
    assert config.node_rank == 1 and config.peers == ("a:1", "b:2")
    assert config.join is False and config.shm_size == 512 << 20
    assert dict(config.pads)["input_ids"] == 7.0
    assert config.socket == str(tmp_path / "s.sock") and config.insecure


def test_the_command_line_wins_over_the_environment(tmp_path):
    config = parse(
        ["--world", "4", "--nproc-per-node", "2", "--dataset-size", "3", "--peers", "x:1,y:2",
         "--socket", str(tmp_path / "s.sock"), "--insecure"],
        {"ODBD_WORLD": "16", "ODBD_NPROC_PER_NODE": "8"},
    )  # fmt: skip
    assert config.world.world_size == 4


def test_odbd_variables_unlike_any_flag_are_left_alone(capsys):
    parser = daemon_parser()
    cli.refuse_misspelt_variables(parser, {"ODBD_BENCH_RUNS": "3", "ODBD_SOAK_SAMPLES": "9"})
    assert capsys.readouterr().err == ""


@pytest.mark.parametrize(
    ("raw", "value"),
    [("1", True), ("TRUE", True), (" yes ", True), ("on", True),
     ("0", False), ("False", False), ("no", False), ("off", False)],
)  # fmt: skip
def test_boolean_variables_take_the_usual_spellings(raw, value, tmp_path):
    config = parse(
        ["--world", "1", "--nproc-per-node", "1", "--dataset-size", "1",
         "--socket", str(tmp_path / "s.sock")],
        {"ODBD_JOIN": raw, "ODBD_SHUFFLE": raw},
    )  # fmt: skip
    assert config.join is value and config.shuffle is value


@pytest.mark.parametrize(
    ("environ", "rank"),
    [
        ({"NODE_RANK": "3"}, 3),
        ({"NODE_RANK": " 1"}, 1),
        ({"NODE_RANK": "2\n"}, 2),
        ({"NODE_RANK": "", "GROUP_RANK": "2"}, 2),
        ({"GROUP_RANK": "2"}, 2),
        ({"JOB_COMPLETION_INDEX": "5"}, 5),
        ({"HOSTNAME": "train-odbd-7"}, 7),
        ({}, 0),
    ],
)
def test_node_rank_defaults_like_torchrun_and_kubernetes(environ, rank):
    assert node_rank_from_environment(environ) == rank


@pytest.mark.parametrize("value", ["one", "-1", "1.0", "1 2"])
def test_a_node_rank_variable_that_is_not_an_index_is_an_error_naming_it(value):
    with pytest.raises(ConfigError, match=f"GROUP_RANK={value!r} is not a node index"):
        node_rank_from_environment({"GROUP_RANK": value})


LONG_NAME = "s" * 120 + ".sock"
BAD_INPUTS = [
    # (extra flags, environment, text the one-line error must contain)
    (["--metrics-port", "70000"], {}, "--metrics-port"),
    (["--metrics-port", "-1"], {}, "--metrics-port"),
    (["--socket", "{tmp}/missing/s.sock"], {}, "--socket"),
    (["--socket", "{tmp}/" + LONG_NAME], {}, "--socket"),
    (["--socket", "{tmp}"], {}, "--socket"),
    (["--dataset-size", "4611686018427387904"], {}, "--dataset-size"),
    (["--dataset-size", "-1"], {}, "--dataset-size"),
    (["--round-timeout", "-1"], {}, "--round-timeout"),
    (["--round-timeout", "nan"], {}, "--round-timeout"),
    (["--join-timeout", "0"], {}, "--join-timeout"),
    (["--lease-timeout", "0"], {}, "--lease-timeout"),
    (["--drain-timeout", "inf"], {}, "--drain-timeout"),
    (["--steps-ahead", "-3"], {}, "--steps-ahead"),
    (["--seed", "-1"], {}, "--seed"),
    (["--epochs", "-1"], {}, "--epochs"),
    (["--dataset", "odbd.demo.dataset:synthetic", "--workers", "0"], {}, "--workers"),
    (["--dataset", "odbd.demo.dataset:synthetic"], {"ODBD_WORKERS": "0"}, "--workers"),
    ([], {"ODBD_JOIN": "maybe"}, "ODBD_JOIN"),
    ([], {"ODBD_SHUFFLE": "flase"}, "ODBD_SHUFFLE"),
    ([], {"ODBD_METRICS_PORT": "http"}, "ODBD_METRICS_PORT"),
    ([], {"ODBD_GROUPING": "papr"}, "ODBD_GROUPING"),
    ([], {"ODBD_WROLD": "2"}, "ODBD_WROLD is not a flag's variable; did you mean ODBD_WORLD?"),
    ([], {"ODBD_NO_JOIN": "1"}, "ODBD_NO_JOIN is not read; write ODBD_JOIN=false instead"),
    ([], {"NODE_RANK": "one"}, "NODE_RANK"),
    ([], {"JOB_COMPLETION_INDEX": "-2"}, "JOB_COMPLETION_INDEX"),
    (["--state-dir", "{tmp}/file"], {}, "--state-dir"),
    (["--state-dir", "{tmp}/file/journal"], {}, "--state-dir"),
    (["--job-token-file", "{tmp}/empty-token"], {}, "--job-token-file"),
    (["--job-token-file", "{tmp}/no-such-token"], {}, "--job-token-file"),
    (["--token-budget", "0"], {}, "--token-budget"),
    (["--buffer", "0"], {}, "--buffer"),
    (["--shm-size", "0"], {}, "--shm-size"),
    (["--shm-size", "lots"], {}, "--shm-size"),
    (["--shm-size", "inf"], {}, "--shm-size"),
    (["--listen", "127.0.0.1"], {}, "--listen"),
    (["--listen", "127.0.0.1:99999"], {}, "--listen"),
    (["--health-listen", "localhost"], {}, "--health-listen"),
    (["--world", "2", "--peers", "10.0.0.1,10.0.0.2"], {}, "--peers"),
    (["--world", "2"], {}, "--peers"),
    (["--pad", "input_ids=abc"], {}, "--pad"),
    (["--pad", "=0"], {}, "--pad"),
    (["--dataset-arg", "size"], {}, "--dataset-arg"),
    (["--metrics-host", ""], {}, "--metrics-host"),
    (["--log-level", "LOUD"], {}, "--log-level"),
    (["--world", "0"], {}, "--world"),
    (["--world", "3", "--nproc-per-node", "2"], {}, "--world 3 --nproc-per-node 2"),
    (["--nproc-per-node", "0"], {}, "--nproc-per-node"),
    (["--node-rank", "1"], {}, "node rank 1 is outside"),
    (["--loss-scaling", "exakt"], {}, "--loss-scaling"),
    (["--tls-cert", "{tmp}/file"], {}, "--tls-key"),
    (["--length-key", " "], {}, "--length-key"),
    (["--accumulate", "0"], {}, "--accumulate"),
    (["--tokens-per-update", "-5"], {}, "--tokens-per-update"),
    (["--accumulate", "2", "--tokens-per-update", "9"], {}, "pass one of them"),
    (["--accumulate", "2", "--no-join"], {}, "need join mode"),
]


@pytest.mark.parametrize(("extra", "environ", "names"), BAD_INPUTS)
def test_a_bad_flag_or_variable_exits_2_with_one_line_naming_it(
    extra, environ, names, tmp_path, capsys, no_daemon
):
    (tmp_path / "file").write_text("x")
    (tmp_path / "empty-token").write_text("\n")
    argv = ["--world", "1", "--nproc-per-node", "1", "--socket", str(tmp_path / "s.sock")]
    if not {"--dataset", "--dataset-size"} & set(extra):
        argv += ["--dataset-size", "5"]
    argv += [arg.replace("{tmp}", str(tmp_path)) for arg in extra]
    code, err = run_cli(argv, environ, capsys)
    assert code == 2, err
    assert err.startswith("odbd: error: ") and err.count("\n") == 1, err
    assert names in err, err
    assert not (tmp_path / "s.sock").exists()


@pytest.mark.skipif(os.geteuid() == 0, reason="root may write into a read-only directory")
def test_a_state_dir_this_user_cannot_write_is_refused(tmp_path, capsys, no_daemon):
    locked = tmp_path / "locked"
    locked.mkdir(mode=0o500)
    argv = ["--world", "1", "--nproc-per-node", "1", "--dataset-size", "5"]
    argv += ["--socket", str(tmp_path / "s.sock"), "--state-dir", str(locked / "journal")]
    code, err = run_cli(argv, {}, capsys)
    assert code == 2 and "--state-dir" in err and "not writable" in err, err


def test_a_state_dir_without_write_permission_is_refused_even_as_root(
    tmp_path, capsys, monkeypatch, no_daemon
):
    """Root passes the real permission check above, so here os.access answers as for a user."""
    locked = tmp_path / "locked"
    locked.mkdir()
    real_access = os.access
    monkeypatch.setattr(
        os, "access", lambda path, mode: Path(path) != locked and real_access(path, mode)
    )
    argv = ["--world", "1", "--nproc-per-node", "1", "--dataset-size", "5"]
    argv += ["--socket", str(tmp_path / "s.sock"), "--state-dir", str(locked / "journal")]
    code, err = run_cli(argv, {}, capsys)
    assert code == 2 and f"--state-dir {locked / 'journal'}: {locked} is not writable" in err, err


def test_a_state_dir_that_does_not_exist_yet_is_accepted(tmp_path):
    config = parse(
        ["--world", "1", "--nproc-per-node", "1", "--dataset-size", "5",
         "--socket", str(tmp_path / "s.sock"), "--state-dir", str(tmp_path / "a" / "b")],
        {},
    )  # fmt: skip
    assert config.state_dir == tmp_path / "a" / "b"


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--wrold", "2"], "unrecognized argument --wrold; did you mean --world?"),
        (["--world=2", "--nproc-per-nod=1"], "unrecognized argument --nproc-per-nod; did you mean"),
        (["--work", "2"], "unrecognized argument --work; did you mean --workers?"),
        (["--world", "1", "--sed", "-1"], "unrecognized argument --sed; did you mean --seed?"),
        (["--zzzzzz"], "unrecognized argument --zzzzzz (see odbd --help)"),
    ],
)
def test_an_unknown_flag_is_named_before_missing_ones_are(argv, message, capsys, no_daemon):
    code, err = run_cli(argv, {}, capsys)
    assert code == 2 and message in err and err.count("\n") == 1, err


@pytest.mark.parametrize(
    ("command", "message"),
    [
        ("statsu", "unknown command 'statsu'; did you mean 'status'?"),
        ("simualte", "unknown command 'simualte'; did you mean 'simulate'?"),
        ("run", "unknown command 'run' (commands: simulate, demo, status;"),
    ],
)
def test_an_unknown_command_is_named_with_the_closest_one(command, message, capsys):
    assert cli.main([command]) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1, err


def test_help_shows_every_default_the_commands_and_the_environment(capsys):
    with pytest.raises(SystemExit) as stop:
        cli.main(["--help"])
    assert stop.value.code == 0
    text = " ".join(capsys.readouterr().out.split())  # argparse wraps lines
    assert "--token-budget L padded tokens per group (default: 12288)" in text
    assert "--shm-size BYTES shared memory arena, e.g. 512M, 4G (default: 1G)" in text
    assert "(default: None)" not in text
    for command in ("odbd simulate", "odbd demo", "odbd status"):
        assert command in text
    assert "ODBD_<FLAG>" in text


def test_every_flag_has_help_text():
    undocumented = [a.dest for a in daemon_parser()._actions if not a.help]
    assert undocumented == []


def test_the_readme_flag_table_matches_the_parser():
    readme = (REPO / "server" / "README.md").read_text()
    begin, end = "<!-- flags:begin -->\n", "<!-- flags:end -->"
    assert begin in readme and end in readme
    table = readme.split(begin, 1)[1].split(end, 1)[0]
    assert table == cli.flags_markdown(), (
        "server/README.md is out of date; regenerate the table between the flags markers: "
        "python -c \"from odbd.cli import flags_markdown; print(flags_markdown(), end='')\""
    )


def test_prefix_abbreviations_are_refused():
    parser = flags.OneLineParser(prog="x")
    parser.add_argument("--workers", type=int)
    with pytest.raises(SystemExit):
        parser.parse_args(["--work", "2"])


@pytest.mark.timeout(60)
def test_a_bad_flag_exits_2_at_once_without_a_traceback_or_leftovers(tmp_path):
    """The real command in its own process: nothing starts, nothing is left behind."""
    job = f"clitest{os.getpid()}"
    argv = [sys.executable, "-m", "odbd", "--world", "1", "--nproc-per-node", "1"]
    argv += ["--dataset-size", "5", "--job-id", job, "--socket", str(tmp_path / "s.sock")]
    argv += ["--round-timeout", "-1"]
    env = dict(os.environ, PYTHONPATH=f"{REPO / 'server'}:{REPO / 'client'}")
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    started = time.monotonic()
    proc = subprocess.run(argv, capture_output=True, text=True, env=env, timeout=50)
    wall_s = time.monotonic() - started
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu_s = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.count("\n") == 1 and "--round-timeout" in proc.stderr, proc.stderr
    assert "Traceback" not in proc.stderr and proc.stdout == ""
    # CPU time, not wall time, is the budget: the machine may be busy with other tests.
    assert cpu_s < 1.0, f"a bad flag took {cpu_s:.2f} s of CPU ({wall_s:.2f} s wall)"
    assert not (tmp_path / "s.sock").exists()
    assert [n for n in os.listdir("/dev/shm") if job in n] == []


def test_demo_progress_off_a_terminal_prints_only_changed_lines_and_the_last():
    printer = ProgressPrinter(tty=False, every_s=10.0)
    shown = [
        (t, line)
        for t, line, final in [
            (0.0, "0%", False), (0.2, "0%", False), (20.0, "0%", False),  # unchanged: once
            (21.0, "5%", False), (25.0, "9%", False),  # changed, but within 10 s of the last
            (31.5, "50%", False), (31.7, "100%", True),  # the final line always shows
            (31.9, "100%", True),  # ...once
        ]
        if printer.due(line, t, final)
    ]  # fmt: skip
    assert shown == [(0.0, "0%"), (21.0, "5%"), (31.5, "50%"), (31.7, "100%")]


def test_demo_progress_on_a_terminal_redraws_every_poll():
    printer = ProgressPrinter(tty=True)
    assert all(printer.due("0%", t, False) for t in (0.0, 0.1, 0.2))


@pytest.mark.parametrize(
    ("argv", "names"),
    [
        (["--nodes", "0"], "--nodes"),
        (["--epochs", "0"], "--epochs"),
        (["--num-samples", "-5"], "--num-samples"),
        (["--dist", "sharegtp4o"], "did you mean sharegpt4o?"),
        (["--timeout", "0"], "--timeout"),
        (["--seconds-per-token", "-1"], "--seconds-per-token"),
        (["--node", "2"], "did you mean --nodes?"),
    ],
)
def test_bad_demo_input_exits_2_with_one_line(argv, names, capsys):
    with pytest.raises(SystemExit) as stop:
        demo_main(argv)
    err = capsys.readouterr().err
    assert stop.value.code == 2 and names in err and err.count("\n") == 1, err


@pytest.mark.parametrize(
    ("argv", "names"),
    [
        (["--wrold", "4"], "unrecognized argument --wrold; did you mean --world?"),
        (["--num-sample", "10"], "did you mean --num-samples?"),
        (["--comp"], "unrecognized argument --comp; did you mean --compare?"),
        (["--cost-a", "nan"], "--cost-a"),
        (["--seed", "-1"], "--seed"),
        (["--num-samples", "99999999999999"], "--num-samples"),
    ],
)
def test_bad_simulate_input_exits_2_with_one_line(argv, names, capsys):
    try:
        code = simulate_main(["--dist", "llava", *argv])
    except SystemExit as stop:
        code = stop.code
    err = capsys.readouterr().err
    assert code == 2 and names in err and err.count("\n") == 1, err


def test_update_flags_reach_the_planner_and_the_fingerprint_only_when_set(tmp_path):
    base = ["--world", "1", "--nproc-per-node", "1", "--dataset-size", "5"]
    base += ["--socket", str(tmp_path / "s.sock")]
    plain = parse(base, {})
    assert not plain.planner(5).windows
    assert not {"accumulate", "tokens_per_update"} & set(plain.fingerprint(5))
    windowed = parse([*base, "--tokens-per-update", "4096"], {"ODBD_ACCUMULATE": "1"})
    assert windowed.planner(5).tokens_per_update == 4096
    assert windowed.fingerprint(5)["tokens_per_update"] == "4096"
