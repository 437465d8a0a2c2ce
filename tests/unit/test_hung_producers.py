"""odbd.ingest.hung: a producer is hung once one key stays in its lane header for the limit."""

from odbd.ingest.hung import InFlight, hung, track


def test_a_key_held_across_sweeps_keeps_its_first_sighting():
    tracked = track({}, {0: 7, 1: None}, now_s=10.0)
    assert tracked == {0: InFlight(7, 10.0)}
    tracked = track(tracked, {0: 7, 1: 3}, now_s=11.0)
    assert tracked == {0: InFlight(7, 10.0), 1: InFlight(3, 11.0)}


def test_a_new_key_or_an_idle_header_starts_the_clock_again():
    tracked = track({0: InFlight(7, 10.0), 1: InFlight(3, 10.0)}, {0: 8, 1: None}, now_s=12.0)
    assert tracked == {0: InFlight(8, 12.0)}


def test_a_producer_gone_from_the_headers_is_forgotten():
    assert track({0: InFlight(7, 10.0)}, {}, now_s=12.0) == {}


def test_hung_once_the_same_key_was_seen_for_the_limit():
    tracked = {0: InFlight(7, 10.0), 1: InFlight(3, 12.5)}
    assert hung(tracked, now_s=14.9, limit_s=5.0) == {}
    assert hung(tracked, now_s=15.0, limit_s=5.0) == {0: InFlight(7, 10.0)}
