"""A member's round offer: every field range-checked, every failure names the node (issue 29).

The fuzz builds offers the way a hostile member would (the codec's layout with any header
values and any column values) and feeds whatever passes decode_offer to what the daemon does
next with it (the epoch tally, the planner, the cost fit): either the offer is refused with an
OdbdError naming node 1, or nothing downstream raises.
"""

from __future__ import annotations

import json
import math
import struct
from collections import Counter
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from odbd.daemon import offer_codec, payload_checks
from odbd.daemon.cost_learning import CostLearner
from odbd.daemon.payload_checks import BadPayloadError, OfferLimits, decode_offer
from odbd.errors import OdbdError
from odbd.planner.cost_fit import CostModelMode, FitConfig
from odbd.planner.round import plan_round, units_of_node
from odbd.planner.sampler import num_views
from odbd.planner.types import SampleTable, UnitOffer
from tests.unit.planner_factories import make_config

CONFIG = make_config(world=4, per_node=2, budget=1000, buffer=8)
DATASET = 64
LIMITS = OfferLimits(
    units_of_node=[list(units_of_node(CONFIG, n)) for n in range(2)],
    views_per_iteration=num_views(DATASET, 4),
)
_PREFIX = struct.Struct("<IHHI")
_COLUMNS = (("views", "<i8"), ("lengths", "<i4"), ("tokens", "<i4"), ("ages", "<i4"))


def raw_offer(header: dict[str, Any], columns: dict[str, list[int]], obs: list[float]) -> bytes:
    """offer_codec's layout with any values (json allows NaN and Infinity)."""
    head = json.dumps(header).encode()
    parts = [_PREFIX.pack(0x4F444252, 3, 0, len(head)), head]
    rows = len(columns["views"])
    for name, dtype in (*_COLUMNS, ("patches", "<i4")):
        values = columns.get(name, [0] * rows)
        info = np.iinfo(np.dtype(dtype))
        clipped = [min(max(v, int(info.min)), int(info.max)) for v in values]
        parts.append(np.array(clipped, dtype=dtype).tobytes())
    parts.append(np.array(obs, dtype="<f8").tobytes())
    return b"".join(parts)


def valid_parts(rows: int = 3) -> tuple[dict[str, Any], dict[str, list[int]], list[float]]:
    header = {
        "node": 1,
        "epoch": 0,
        "rejected": {"preprocess_error": 2},
        "resume": None,
        "units": [[1, False, rows]],
        "observations": 1,
    }
    columns = {
        "views": [10 + i for i in range(rows)],
        "lengths": [100 + i for i in range(rows)],
        "tokens": [50] * rows,
        "ages": [0] * rows,
    }
    return header, columns, [4096.0, 1e6, 0.25]


def own_offer() -> offer_codec.NodeOffer:
    table = SampleTable.of(np.arange(3), [120, 130, 140])
    observations = np.array([[2048.0, 5e4, 0.1], [8192.0, 9e5, 0.4]])  # with node 1's: a fit
    return offer_codec.NodeOffer(0, 0, (UnitOffer(0, table, False),), {}, None, observations)


def consume(offers: list[offer_codec.NodeOffer]) -> None:
    """What RoundLoop does with decoded offers: tally rejections, plan, fit the cost model."""
    tally: Counter[str] = Counter()
    for offer in offers:
        tally.update(offer.rejected)
        sum(offer.rejected.values())
    units = sorted((u for o in offers for u in o.units), key=lambda u: u.unit)
    plan_round(units, CONFIG, 7)
    learner = CostLearner(CostModelMode.AUTO, CONFIG.cost, FitConfig(warmup=3))
    fit = learner.absorb([o.observations for o in offers])
    model = fit.model
    assert all(math.isfinite(v) for v in (model.a, model.b, model.c, model.p)), model


def test_a_valid_offer_passes_and_plans() -> None:
    offer = decode_offer(raw_offer(*valid_parts()), 1, 0, LIMITS)
    assert offer.rejected == {"preprocess_error": 2}
    consume([own_offer(), offer])


def test_a_real_encoded_offer_passes() -> None:
    table = SampleTable.of(np.arange(5) + 20, [10, 20, 30, 40, 50])
    offer = offer_codec.NodeOffer(
        1,
        0,
        (UnitOffer(1, table, True),),
        {"zero_length": 1},
        (0, 3),
        np.array([[100.0, 2000.0, 0.01]] * 64),
    )
    assert decode_offer(offer_codec.encode(offer), 1, 4, LIMITS).resume == (0, 3)


@pytest.mark.parametrize(
    ("change", "needle"),
    [
        (lambda h, c, o: h.update(rejected={"preprocess_error": "x"}), "preprocess_error"),
        (lambda h, c, o: h.update(rejected={"preprocess_error": -1}), "preprocess_error"),
        (lambda h, c, o: h.update(rejected={"made_up": 1}), "made_up"),
        (lambda h, c, o: h.update(rejected={str(i): 1 for i in range(20_000)}), "20000"),
        (lambda h, c, o: o.__setitem__(0, 1e308), "padded tokens"),
        (lambda h, c, o: o.__setitem__(2, float("nan")), "finite"),
        (lambda h, c, o: o.__setitem__(1, -1.0), "squared"),
        (lambda h, c, o: c["lengths"].__setitem__(0, 2**31 - 1), "lengths"),
        (lambda h, c, o: c["views"].__setitem__(0, -5), "views"),
        (lambda h, c, o: h.update(node=0), "calls itself node 0"),
        (lambda h, c, o: h.update(epoch=-1), "epoch"),
        (lambda h, c, o: h.update(resume=[0, "x"]), "resume"),
        (lambda h, c, o: h["units"][0].__setitem__(0, 3), "units"),
    ],
)
def test_each_bad_field_fails_naming_the_node(change: Any, needle: str) -> None:
    header, columns, obs = valid_parts()
    change(header, columns, obs)
    with pytest.raises(BadPayloadError) as failed:
        decode_offer(raw_offer(header, columns, obs), 1, 5, LIMITS)
    message = str(failed.value)
    assert message.startswith("node 1 sent a round 5 offer") and needle in message, message


_HOSTILE_NUMBERS = st.sampled_from(
    [0, 1, -1, 2**31 - 1, 2**31, 2**63 - 1, 2**64, 1e308, -1e308, 0.5]
) | st.integers(-(2**70), 2**70)
_HOSTILE = (
    _HOSTILE_NUMBERS
    | st.sampled_from([float("nan"), float("inf"), None, True, "x", [], {}, [1, 2]])
    | st.text(max_size=8)
)
_FLOATS = st.floats(allow_nan=True, allow_infinity=True) | st.sampled_from([1e308, -0.0])


# derandomize: `make test` runs the same 300 examples every time, so a new random draw cannot
# fail CI; random draws in CI found two real gaps (an empty sample, a subnormal step time), each
# fixed with its own test above. To explore anew, set derandomize=False locally.
@settings(
    max_examples=300,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
    derandomize=True,
)
@given(
    field=st.sampled_from(["node", "epoch", "resume", "units", "observations", "rejected"]),
    value=_HOSTILE,
    reason_count=_HOSTILE,
    column=st.sampled_from(["views", "lengths", "tokens", "ages", "patches"]),
    cell=st.integers(-(2**63), 2**63 - 1),
    obs=st.lists(_FLOATS, min_size=3, max_size=3),
    which=st.integers(0, 3),
)
def test_fuzzed_offers_fail_naming_the_node_or_plan_cleanly(
    field: str,
    value: Any,
    reason_count: Any,
    column: str,
    cell: int,
    obs: list[float],
    which: int,
) -> None:
    header, columns, good_obs = valid_parts()
    if which == 0:  # one header field replaced
        header[field] = {"preprocess_error": reason_count} if field == "rejected" else value
        if field == "units" and isinstance(value, int) and not isinstance(value, bool):
            header["units"] = [[1, False, value]]
    elif which == 1:  # one column cell
        columns.setdefault(column, [0] * 3)[0] = cell
    elif which == 2:  # one observation
        good_obs = obs
    else:  # a unit of another node, or rows the payload does not carry
        header["units"] = [[value, False, 3]] if field == "units" else [[1, value, 3]]
    payload = raw_offer(header, columns, good_obs)
    try:
        offer = decode_offer(payload, 1, 2, LIMITS)
    except OdbdError as error:
        assert str(error).startswith("node 1 sent a round 2 "), error
        return
    consume([own_offer(), offer])


def test_the_limits_are_far_above_real_offers() -> None:
    assert payload_checks.MAX_SAMPLE_TOKENS >= 2**24
    assert payload_checks.MAX_REASONS > len(LIMITS.reasons)


def test_an_empty_sample_in_an_offer_fails_naming_the_node() -> None:
    """Ingest rejects 0-length samples, so an offer holding one is a broken or hostile member;
    the planner's invariant used to raise instead (hypothesis found it)."""
    header, columns, good_obs = valid_parts()
    columns["lengths"][0] = 0
    with pytest.raises(OdbdError, match=r"^node 1 sent a round 2 .*lengths value 0"):
        decode_offer(raw_offer(header, columns, good_obs), 1, 2, LIMITS)


def test_a_subnormal_step_time_fails_naming_the_node() -> None:
    """5e-324 s passed the range check and overflowed the cost fit's relative error (hypothesis
    found it in CI)."""
    header, columns, _ = valid_parts()
    with pytest.raises(OdbdError, match=r"^node 1 sent a round 2 .*seconds"):
        decode_offer(raw_offer(header, columns, [1.0, 0.0, 5e-324]), 1, 2, LIMITS)
