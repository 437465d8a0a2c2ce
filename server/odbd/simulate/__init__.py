"""`odbd simulate`: the production planner over a length distribution (DESIGN.md section 4).

distributions.py (named lengths) and lengths.py (--lengths FILE) -> planner (odbd.planner.epoch)
and baselines.py (fixed batch) -> report.py (Summary, table, JSON); command.py holds the flags.

The command loads on first use (PEP 562): producers importing `odbd.simulate.distributions`
for a synthetic dataset must not pay for torch, which the planner's sampler imports.
"""

from __future__ import annotations

import importlib
from typing import Any

__all__ = ["add_arguments", "main", "run"]


def __getattr__(name: str) -> Any:
    if name in __all__:
        return getattr(importlib.import_module("odbd.simulate.command"), name)
    raise AttributeError(f"module 'odbd.simulate' has no attribute {name!r}")
