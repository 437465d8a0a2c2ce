"""`odbd simulate`: the production planner over a length distribution (DESIGN.md section 4).

distributions.py (named lengths) and lengths.py (--lengths FILE) -> planner (odbd.planner.epoch)
and baselines.py (fixed batch) -> report.py (Summary, table, JSON); command.py holds the flags.
"""

from odbd.simulate.command import add_arguments, main, run

__all__ = ["add_arguments", "main", "run"]
