from odbd.round.stall import MIN_STALL_S, StallWatch, frozen_past_deadline


def test_a_gap_between_ticks_is_a_stall_and_scheduling_noise_is_not():
    watch = StallWatch(now_s=100.0)
    for t in (100.25, 100.5, 100.5 + 0.9 * MIN_STALL_S):  # noisy but running
        watch.tick(t)
    assert watch.longest_since(0.0, now_s=101.5) is None
    watch.tick(108.0)  # frozen ~6.6 s
    stall = watch.longest_since(100.0, now_s=108.1)
    assert stall is not None and round(stall.duration_s, 1) == 6.6


def test_the_gap_still_open_counts_before_the_next_tick():
    """A deadline that fires on resuming may run before the ticker: the open gap is a stall."""
    watch = StallWatch(now_s=10.0)
    stall = watch.longest_since(0.0, now_s=15.0)
    assert stall is not None and stall.duration_s == 5.0


def test_old_stalls_are_outside_the_window():
    watch = StallWatch(now_s=0.0)
    watch.tick(5.0)  # a 5 s stall, long ago
    for quarter in range(21, 160):
        watch.tick(quarter / 4)
    assert watch.longest_since(20.0, now_s=40.0) is None
    assert watch.longest_since(0.0, now_s=40.0).duration_s == 5.0


def test_a_deadline_passed_only_while_frozen_is_told_apart_from_a_real_one():
    """A spoke stopped 11.5 s into a 2 s join deadline ran 0.5 s: the pause, not the hub."""
    watch = StallWatch(now_s=0.0)
    watch.tick(0.25)
    stall = watch.longest_since(0.0, now_s=12.0)  # resumed: the gap is still open
    assert frozen_past_deadline(stall, elapsed_s=12.0, deadline_s=2.0)
    for t in range(1, 13):  # ran the whole time: the hub is to blame
        watch.tick(0.25 + t)
    assert not frozen_past_deadline(watch.longest_since(13.0, 13.25), 13.0, 2.0)
    assert not frozen_past_deadline(None, elapsed_s=3.0, deadline_s=2.0)
