"""README's "A minimal job", exactly as written there (issue 28: the README is the quickstart).

The commands and `train.py` are read out of README.md, not copied here, so an edit that breaks
the example fails: the fast test checks that the `odbd` command is a valid daemon configuration
and that `train.py` compiles (in `make test`); the soak test runs both for real, the daemon
spawning its producers over docs/examples/numpy_dataset.py and `torchrun --standalone` training
two DDP ranks (gloo), and expects every process to exit 0 at the job's end (~35 s on 2 busy
cores, so `make soak`).
"""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from odbd.cli import config_from_args, daemon_parser
from tests.integration.harness import scaled

REPO = Path(__file__).resolve().parents[2]


def minimal_job() -> tuple[list[list[str]], str]:
    """The shell commands (argv, comments and `&` dropped) and train.py of README's minimal job."""
    readme = (REPO / "README.md").read_text()
    section = readme.partition("## A minimal job")[2].partition("\n## ")[0]
    blocks = re.findall(r"```(\w+)\n(.*?)```", section, re.DOTALL)
    shell = next(body for lang, body in blocks if lang == "bash")
    train = next(body for lang, body in blocks if lang == "python")
    assert train.startswith("# train.py"), "README's minimal job lost its `# train.py` block"
    commands = []
    for line in shell.replace("\\\n", " ").splitlines():
        for part in line.split("&&"):
            argv = [word for word in shlex.split(part, comments=True) if word != "&"]
            if argv:
                commands.append(argv)
    return commands, train


def command(commands: list[list[str]], program: str) -> list[str]:
    found = [argv for argv in commands if argv[0] == program]
    assert len(found) == 1, f"README's minimal job should run `{program}` once: {commands}"
    return found[0]


def test_the_readme_job_is_a_valid_daemon_and_a_compiling_train_py(tmp_path: Path) -> None:
    commands, train = minimal_job()
    assert command(commands, "export")[1].startswith("ODBD_SOCKET=")
    odbd = command(commands, "odbd")
    args = daemon_parser().parse_args(odbd[1:])
    config = config_from_args(args, {"ODBD_SOCKET": str(tmp_path / "odbd.sock")})
    assert (config.world.world_size, config.world.ranks_per_node) == (2, 2)
    assert config.dataset is not None and (REPO / config.dataset.partition(":")[0]).is_file()
    assert command(commands, "torchrun")[1:] == [
        "--standalone",
        "--nproc-per-node",
        "2",
        "train.py",
    ]
    compile(train, "train.py", "exec")


@pytest.mark.soak
@pytest.mark.timeout(900)
def test_the_readme_job_trains_to_the_end(tmp_path: Path) -> None:
    commands, train = minimal_job()
    (tmp_path / "train.py").write_text(train)
    bin_dir = Path(sys.executable).parent
    env = {
        **os.environ,
        "ODBD_SOCKET": str(tmp_path / "odbd.sock"),  # the README's export, in this test's dir
        "PATH": f"{bin_dir}{os.pathsep}{os.environ.get('PATH', '')}",
        "OMP_NUM_THREADS": "1",
    }
    odbd, torchrun = command(commands, "odbd"), command(commands, "torchrun")
    with open(tmp_path / "daemon.log", "wb") as daemon_log:
        daemon = subprocess.Popen(
            [str(bin_dir / "odbd"), *odbd[1:]], cwd=REPO, env=env, stdout=daemon_log,
            stderr=subprocess.STDOUT,
        )  # fmt: skip
    trainers = None
    try:
        with open(tmp_path / "torchrun.log", "wb") as torchrun_log:
            trainers = subprocess.Popen(
                [str(bin_dir / "torchrun"), *torchrun[1:]], cwd=tmp_path, env=env,
                stdout=torchrun_log, stderr=subprocess.STDOUT,
            )  # fmt: skip
        trainers_rc = trainers.wait(timeout=scaled(300))
        daemon_rc = daemon.wait(timeout=scaled(60))
    finally:
        for proc in (trainers, daemon):
            if proc is not None and proc.poll() is None:
                proc.kill()
                proc.wait()
    logs = "\n".join(
        f"--- {name}\n{(tmp_path / name).read_text(errors='replace')[-4000:]}"
        for name in ("daemon.log", "torchrun.log")
    )
    assert (trainers_rc, daemon_rc) == (0, 0), logs
    daemon_text = (tmp_path / "daemon.log").read_text(errors="replace")
    assert "epoch 1 trained" in daemon_text and "took the job's end" in daemon_text, logs
