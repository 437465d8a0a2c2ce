"""Pure parts of the round barrier: fingerprints, the hub's handshake decision, the round table."""

from __future__ import annotations

import enum
from typing import Any

import grpc
import pytest
from hypothesis import given
from hypothesis import strategies as st

from odbclient.wire.odbd.v1 import peer_pb2
from odbd.errors import ConfigError
from odbd.round import PROTOCOL_VERSION, RoundConfig, auth, fingerprint_mismatch, fingerprint_of
from odbd.round.handshake import check_hello, check_version
from odbd.round.table import ProtocolViolation, RoundTable

SETTINGS = {"world": "16", "token_budget": "12288", "seed": "0", "join": "true"}


def make_config(num_nodes: int = 4, **overrides: object) -> RoundConfig:
    fields: dict[str, object] = {
        "job_id": "job-a",
        "node_rank": 0,
        "num_nodes": num_nodes,
        "peers": tuple(f"127.0.0.1:{7000 + n}" for n in range(num_nodes)),
        "listen": "127.0.0.1:7000",
        "fingerprint": SETTINGS,
        "job_token": b"secret",
    }
    fields.update(overrides)
    return RoundConfig(**fields)  # type: ignore[arg-type]


def make_hello(node_rank: int = 1, **overrides: object) -> peer_pb2.Hello:
    config = make_config()
    fields: dict[str, object] = {
        "protocol_version": PROTOCOL_VERSION,
        "job_id": "job-a",
        "node_rank": node_rank,
        "fingerprint": config.settings,
        "nonce": b"n" * 32,
    }
    fields.update(overrides)
    return peer_pb2.Hello(**fields)  # type: ignore[arg-type]


# -- fingerprints ------------------------------------------------------------------------------


def test_mismatch_names_the_setting_and_both_values() -> None:
    theirs = {**SETTINGS, "token_budget": "8192"}
    message = fingerprint_mismatch(SETTINGS, theirs, theirs_name="node 1")
    assert message == (
        "setting token_budget differs: this daemon has 12288, node 1 has 8192; "
        "start every daemon with the same flags"
    )


def test_mismatch_reports_the_first_setting_in_name_order() -> None:
    theirs = {**SETTINGS, "world": "8", "seed": "1"}
    assert "setting seed differs" in (fingerprint_mismatch(SETTINGS, theirs) or "")


def test_a_setting_missing_on_one_side_is_a_mismatch() -> None:
    theirs = {k: v for k, v in SETTINGS.items() if k != "join"}
    message = fingerprint_mismatch(SETTINGS, theirs)
    assert message is not None and "join differs" in message and "(not set)" in message


def test_empty_values_are_shown_not_blank() -> None:
    assert '""' in (fingerprint_mismatch({"k": ""}, {"k": "x"}) or "")


@given(st.dictionaries(st.text(max_size=8), st.text(max_size=8), max_size=8))
def test_identical_fingerprints_match(settings: dict[str, str]) -> None:
    assert fingerprint_mismatch(settings, dict(settings)) is None


@given(
    st.dictionaries(st.text(max_size=4), st.text(max_size=4), max_size=6),
    st.dictionaries(st.text(max_size=4), st.text(max_size=4), max_size=6),
)
def test_mismatch_is_reported_iff_fingerprints_differ(a: dict[str, str], b: dict[str, str]) -> None:
    assert (fingerprint_mismatch(a, b) is None) == (a == b)


class _Mode(enum.Enum):
    EXACT = "exact"


def test_canonical_values_spell_equal_settings_the_same() -> None:
    got = fingerprint_of({"budget": 12288.0, "join": True, "scale": _Mode.EXACT, "lr": 0.1})
    assert got == {"budget": "12288", "join": "true", "scale": "exact", "lr": "0.1"}
    assert fingerprint_of({"budget": 12288}) == fingerprint_of({"budget": 12288.0})


# -- handshake decision ------------------------------------------------------------------------


def test_a_matching_hello_is_admitted() -> None:
    assert check_hello(make_hello(), make_config(), joined=()) is None


def test_a_proof_holds_only_for_its_token_nonces_and_claims() -> None:
    hello, nonce = make_hello(), b"h" * 32
    proof = auth.spoke_proof(b"secret", hello, nonce)
    assert auth.proof_matches(proof, auth.spoke_proof(b"secret", hello, nonce))
    assert not auth.proof_matches(proof, auth.spoke_proof(b"guess", hello, nonce))
    assert not auth.proof_matches(proof, auth.spoke_proof(b"secret", hello, b"x" * 32))  # replay
    assert not auth.proof_matches(proof, auth.hub_proof(b"secret", hello, nonce))  # reflection
    for claim in ({"node_rank": 2}, {"job_id": "job-b"}, {"listen_address": "10.0.0.9:1"}):
        other = make_hello(**claim)  # type: ignore[arg-type]
        assert not auth.proof_matches(proof, auth.spoke_proof(b"secret", other, nonce)), claim
    settings = {**make_config().settings, "seed": "1"}
    assert not auth.proof_matches(
        proof, auth.spoke_proof(b"secret", make_hello(fingerprint=settings), nonce)
    )


def test_a_strangers_refusal_reveals_no_settings_and_is_never_fatal() -> None:
    settings = {**make_config().settings, "token_budget": "8192"}
    refusal = check_hello(
        make_hello(fingerprint=settings), make_config(), joined=(), authenticated=False
    )
    assert refusal is not None and not refusal.fatal
    told = refusal.told(authenticated=False)
    assert "token_budget" not in told and "12288" not in told and "differ" in told
    assert "token_budget" in refusal.message  # the hub's own log keeps the detail
    other_job = check_hello(
        make_hello(job_id="job-b"), make_config(), joined=(), authenticated=False
    )
    assert other_job is not None and "job-a" not in other_job.told(authenticated=False)
    out_of_range = check_hello(make_hello(9), make_config(), joined=(), authenticated=False)
    assert out_of_range is not None and "4" not in out_of_range.told(authenticated=False)


def test_settings_mismatch_is_a_fatal_failed_precondition_naming_both_values() -> None:
    settings = {**make_config().settings, "token_budget": "8192"}
    refusal = check_hello(make_hello(2, fingerprint=settings), make_config(), joined=())
    assert refusal is not None and refusal.code is grpc.StatusCode.FAILED_PRECONDITION
    assert refusal.fatal
    assert "token_budget" in refusal.message
    assert "12288" in refusal.message and "node 2 has 8192" in refusal.message


def test_node_count_is_part_of_the_compared_settings() -> None:
    settings = {**make_config().settings, "num_nodes": "2"}
    refusal = check_hello(make_hello(fingerprint=settings), make_config(), joined=())
    assert refusal is not None and "num_nodes" in refusal.message


def test_protocol_version_mismatch_is_named_and_not_fatal() -> None:
    assert check_version(make_hello()) is None
    refusal = check_version(make_hello(protocol_version=99))
    assert refusal is not None and refusal.code is grpc.StatusCode.FAILED_PRECONDITION
    assert "protocol 99" in refusal.message and not refusal.fatal
    assert "job" not in refusal.message.replace("job-token", "")


def test_another_jobs_daemon_is_refused_without_failing_ours() -> None:
    refusal = check_hello(make_hello(job_id="job-b"), make_config(), joined=())
    assert refusal is not None and refusal.code is grpc.StatusCode.FAILED_PRECONDITION
    assert not refusal.fatal and "job-b" in refusal.message


@pytest.mark.parametrize("node_rank", [0, 4, 17])
def test_node_rank_out_of_range_is_invalid_argument(node_rank: int) -> None:
    refusal = check_hello(make_hello(node_rank), make_config(), joined=())
    assert refusal is not None and refusal.code is grpc.StatusCode.INVALID_ARGUMENT


def test_duplicate_node_rank_is_invalid_argument() -> None:
    refusal = check_hello(make_hello(2), make_config(), joined={1, 2})
    assert refusal is not None and refusal.code is grpc.StatusCode.INVALID_ARGUMENT
    assert "already joined" in refusal.message


# -- round table -------------------------------------------------------------------------------


def test_round_completes_with_payloads_in_node_order_and_names_the_last_node() -> None:
    table = RoundTable(3, max_payload_bytes=100)
    assert table.add(2, 0, b"c") is None
    assert table.add(0, 0, b"a") is None
    done = table.add(1, 0, b"b")
    assert done is not None and done.payloads == (b"a", b"b", b"c") and done.last_node == 1


def test_nodes_may_run_one_round_ahead() -> None:
    table = RoundTable(2, max_payload_bytes=100)
    assert table.add(0, 0, b"a0") is None
    assert table.add(0, 1, b"a1") is None
    assert table.missing(1) == [1]
    assert table.add(1, 0, b"b0") is not None
    done = table.add(1, 1, b"b1")
    assert done is not None and done.payloads == (b"a1", b"b1")


@pytest.mark.parametrize("round_index", [0, 2])
def test_replayed_or_skipped_rounds_are_protocol_violations(round_index: int) -> None:
    table = RoundTable(2, max_payload_bytes=100)
    table.add(0, 0, b"x")
    with pytest.raises(ProtocolViolation, match="next round is 1"):
        table.add(0, round_index, b"x")


def test_oversized_payload_is_a_protocol_violation() -> None:
    with pytest.raises(ProtocolViolation, match="101 bytes"):
        RoundTable(2, max_payload_bytes=100).add(0, 0, b"x" * 101)


def test_the_one_missing_node_is_the_straggler_once_it_owes_only_this_round() -> None:
    table = RoundTable(3, max_payload_bytes=100)
    table.add(0, 0, b"a")
    assert table.straggler(0) is None  # two nodes still missing
    table.add(2, 0, b"c")
    assert table.straggler(0) == 1 and table.partial(0) == (b"a", b"", b"c")
    table.add(0, 1, b"a1")
    table.add(2, 1, b"c1")
    assert table.straggler(1) is None  # node 1 still owes round 0: its round-1 result must wait
    table.add(1, 0, b"b")
    assert table.straggler(1) == 1


def test_missing_of_an_unstarted_round_is_every_node_not_past_it() -> None:
    assert RoundTable(3, max_payload_bytes=1).missing(0) == [0, 1, 2]


# -- config validation -------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("overrides", "needle"),
    [
        ({"node_rank": 4}, "outside 0..3"),
        ({"peers": ("127.0.0.1:1",)}, "lists 1 addresses"),
        ({"listen": "localhost"}, "not HOST:PORT"),
        ({"listen": ""}, "needs --listen"),
        ({"round_timeout_s": 0.0}, "timeouts must be > 0"),
        ({"node_rank": 1, "peers": ("127.0.0.1:0",) * 4}, "port 0"),
    ],
)
def test_invalid_round_config_is_a_config_error(overrides: dict[str, Any], needle: str) -> None:
    with pytest.raises(ConfigError, match=needle):
        make_config(**overrides)


def test_single_node_needs_no_peers_or_listener() -> None:
    config = make_config(1, peers=(), listen="")
    assert not config.is_hub and config.settings["num_nodes"] == "1"
