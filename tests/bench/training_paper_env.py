"""The benchmark's own venv for the paper's code (`online-dynamic-batching==0.1.2`).

The package is a baseline, never a project dependency: it lives in a separate venv (default
`/tmp/odbd-bench-paper-venv`, or $ODBD_BENCH_PAPER_VENV) with the same torch==2.13.0 wheel and
numpy, so the shared trainer script (`tests.integration.ddp_trainer --loader paper`) runs there
with the project's tests on PYTHONPATH and without odbd installed.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

PAPER_PACKAGE = "online-dynamic-batching==0.1.2"
REQUIREMENTS = ["torch==2.13.0", "numpy", PAPER_PACKAGE]
DEFAULT_VENV = Path("/tmp/odbd-bench-paper-venv")


def paper_venv() -> Path:
    return Path(os.environ.get("ODBD_BENCH_PAPER_VENV", DEFAULT_VENV))


def _has_package(python: Path) -> bool:
    probe = "import odb, torch; assert odb.__version__ == '0.1.2', odb.__version__"
    return subprocess.run([str(python), "-c", probe], capture_output=True).returncode == 0


def ensure_paper_python() -> str:
    """The venv's interpreter, creating the venv and installing the package on first use."""
    venv = paper_venv()
    python = venv / "bin" / "python"
    if python.exists() and _has_package(python):
        return str(python)
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    install = [str(python), "-m", "pip", "install", "--quiet", *REQUIREMENTS]
    result = subprocess.run(install, capture_output=True, text=True, timeout=1200)
    if result.returncode != 0 or not _has_package(python):
        raise RuntimeError(
            f"could not install {PAPER_PACKAGE} into {venv} (pip exit {result.returncode}): "
            f"{result.stderr[-2000:]}; set ODBD_BENCH_PAPER_VENV to a venv that has it"
        )
    return str(python)
