import numpy as np
import pytest

from odbd.daemon.journal import Journal, check_header, replay
from odbd.errors import ConfigError

FINGERPRINT = {"world": "2", "token_budget": "100"}


@pytest.fixture(autouse=True)
def _close_journals(monkeypatch):
    opened = []
    original = Journal.open

    def tracking_open(self, *args):
        opened.append(self)
        original(self, *args)

    monkeypatch.setattr(Journal, "open", tracking_open)
    yield
    for journal in opened:
        journal.close()


def write_rounds(tmp_path, rounds):
    journal = Journal(tmp_path, 0)
    journal.open(FINGERPRINT, 10)
    for r, steps in enumerate(rounds):
        keys = np.asarray([k for _, _, per_rank in steps for ks in per_rank for k in ks])
        counts = np.asarray([[len(ks) for ks in per_rank] for _, _, per_rank in steps])
        summary = [[e, s, sum(len(ks) for ks in per_rank)] for e, s, per_rank in steps]
        journal.append_round(r, summary, keys, counts.reshape(-1, 2), [9], {"zero_length": 1})
    return journal


def test_replay_keeps_only_steps_before_the_resume_point(tmp_path):
    journal = write_rounds(
        tmp_path,
        [[(0, 0, [[1, 2], [3]]), (0, 1, [[4], [5, 6]])], [(0, 2, [[7], [8]])]],
    )
    state = replay(journal.records(), world_size=2, epoch=0, step=2)
    assert [(s.epoch, s.step) for s in state.trained_steps] == [(0, 0), (0, 1)]
    assert state.trained_steps[1].keys_by_rank[1].tolist() == [5, 6]
    assert state.rejected_keys == [9, 9] and state.rejected["zero_length"] == 2
    assert state.incarnation == 1


def test_a_resume_marker_voids_the_steps_planned_after_it(tmp_path):
    journal = write_rounds(tmp_path, [[(0, 0, [[1], [2]]), (0, 1, [[3], [4]])]])
    journal.append_resume(0, 1)  # the first restart: step 1 never ran
    journal.append_round(5, [[0, 1, 2]], np.asarray([5, 6]), np.asarray([[1, 1]]), [], {})
    state = replay(journal.records(), world_size=2, epoch=0, step=2)
    assert [s.keys_by_rank[0].tolist() for s in state.trained_steps] == [[1], [5]]
    assert state.incarnation == 2


def test_a_resume_point_the_journal_never_saw_is_refused(tmp_path):
    journal = write_rounds(tmp_path, [[(0, 0, [[1], [2]])]])
    with pytest.raises(ConfigError, match="records 1 steps of that epoch"):
        replay(journal.records(), world_size=2, epoch=0, step=3)


def test_a_torn_last_frame_is_ignored(tmp_path):
    journal = write_rounds(tmp_path, [[(0, 0, [[1], [2]])]])
    journal.close()
    with open(journal.path, "ab") as f:
        f.write(b"\x40\x00\x00\x00partial")
    assert len(Journal(tmp_path, 0).records()) == 2


def test_a_journal_of_other_settings_is_refused(tmp_path):
    journal = write_rounds(tmp_path, [])
    check_header(journal.records(), FINGERPRINT)
    with pytest.raises(ConfigError, match="token_budget='100'"):
        check_header(journal.records(), {**FINGERPRINT, "token_budget": "200"})
