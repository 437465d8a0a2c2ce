"""simulate/planning_time.py: per-daemon planning time and payload bytes from a RoundTrace."""

from __future__ import annotations

import numpy as np

from odbd.planner.epoch import simulate
from odbd.planner.round import RoundTrace
from odbd.simulate.distributions import sample_lengths
from odbd.simulate.planning_time import planning_report, render_planning
from tests.unit.planner_factories import make_config


def test_trace_times_every_node_of_every_round_and_sizes_the_payloads():
    config = make_config(world=8, per_node=2, budget=4096, buffer=64)
    lengths = sample_lengths("sharegpt4o", 3000, 0)
    trace = RoundTrace()
    result = simulate(np.minimum(lengths, 4096), config, trace=trace)
    num_rounds, num_nodes = len(result.rounds), config.world.num_nodes
    assert trace.per_daemon_s().shape == (num_rounds, num_nodes)
    assert (trace.per_daemon_s() > 0).all()
    # A daemon plans its own node only: less than the whole world every round.
    assert (trace.per_daemon_s().max(axis=1) <= trace.whole_world_s()).all()
    assert [len(s) for s in trace.summaries] == [config.num_units] * num_rounds
    assert [len(t) for t in trace.totals] == [num_nodes] * num_rounds
    report = planning_report(trace, config)
    assert (report.num_rounds, report.num_nodes) == (num_rounds, num_nodes)
    # The offers carry 24 bytes per buffered sample; a full round buffers 8 x 64 samples.
    assert report.offer_bytes >= 24 * config.world.world_size * config.buffer_size * 0.5
    assert report.summary_bytes + report.totals_bytes < report.offer_bytes
    assert "per daemon" in render_planning(report)
