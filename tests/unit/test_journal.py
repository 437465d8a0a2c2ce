import errno
import os
import tempfile
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from odbd.daemon import journal as journal_module
from odbd.daemon.journal import FILE_HEADER, Journal, JournalError, check_header, replay
from odbd.errors import ConfigError

FINGERPRINT = {"world": "2", "token_budget": "100"}


@pytest.fixture(autouse=True)
def _close_journals(monkeypatch):
    opened = []
    original = Journal.__init__

    def tracking_init(self, *args):
        opened.append(self)  # a journal holds its directory's fd from construction
        original(self, *args)

    monkeypatch.setattr(Journal, "__init__", tracking_init)
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


def test_moved_records_survive_resume_markers(tmp_path):
    """--migrate auto: every view a node sent away, whatever run sent it, reaches replay (a
    restart holds those of them its own ranks did not train, NodeState.restore)."""
    journal = write_rounds(tmp_path, [[(0, 0, [[1], [2]]), (0, 1, [[3], [4]])]])
    journal.append_moved(0, np.asarray([11, 12]), target=1)
    journal.append_resume(0, 1)
    journal.append_moved(7, np.asarray([13]), target=1)
    journal.append_round(8, [[0, 1, 2]], np.asarray([5, 6]), np.asarray([[1, 1]]), [], {})
    state = replay(journal.records(), world_size=2, epoch=0, step=2)
    assert state.moved_keys == [11, 12, 13]
    assert [s.keys_by_rank[0].tolist() for s in state.trained_steps] == [[1], [5]]


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


def _round_records(records):
    return [(h["kind"], h.get("round"), [a.tolist() for a in arrays]) for h, arrays in records]


def test_open_cuts_a_torn_tail_so_the_resume_record_after_it_is_read(tmp_path, caplog):
    """Issue 11: appending after a torn frame made a later round read as garbage."""
    journal = write_rounds(tmp_path, [[(0, 0, [[1], [2]])], [(0, 1, [[3], [4]])]])
    journal.close()
    data = journal.path.read_bytes()
    intact = len(data)
    torn = data + data[-40:-3]  # a crash 37 bytes into appending a copy of the last frame
    journal.path.write_bytes(torn)
    reopened = Journal(tmp_path, 0)
    with caplog.at_level("WARNING", logger="odbd.daemon.journal"):
        reopened.open(FINGERPRINT, 10)
    reopened.append_resume(0, 1)
    records = reopened.records()
    assert [h["kind"] for h, _ in records] == ["header", "round", "round", "resume"]
    assert records[2][1][1].tolist() == [1, 1]  # the round before the tear is intact
    (warning,) = [r.getMessage() for r in caplog.records]
    assert str(journal.path) in warning and f"offset {intact}" in warning
    assert "dropping the last 37 bytes" in warning and "produced again" in warning


def test_a_layout_1_journal_is_refused_with_the_fix(tmp_path):
    head = b'{"kind":"header","version":1,"fingerprint":{}}'
    body = len(head).to_bytes(4, "little") + head
    (tmp_path / "node0.journal").write_bytes(len(body).to_bytes(4, "little") + body)
    with pytest.raises(ConfigError, match="journal layout 1 .*empty --state-dir"):
        Journal(tmp_path, 0).records()


def test_a_torn_file_header_starts_afresh(tmp_path):
    (tmp_path / "node0.journal").write_bytes(b"ODBDJ")
    journal = Journal(tmp_path, 0)
    assert not journal.exists()
    journal.open(FINGERPRINT, 10)
    assert [h["kind"] for h, _ in journal.records()] == ["header"]


@settings(max_examples=300, deadline=None)
@given(data=st.data())
def test_a_torn_or_flipped_tail_never_yields_a_garbage_record(data):
    """Any cut or bit flip in the last frame: the records read are a prefix of those written."""
    with tempfile.TemporaryDirectory() as name:
        _check_damaged_tail(Path(name), data)


def _check_damaged_tail(directory, data):
    rounds = [[(0, k, [[10 * k + 1], [10 * k + 2, 10 * k + 3]])] for k in range(3)]
    journal = write_rounds(directory, rounds)
    journal.close()
    written = _round_records(journal.records())
    raw = bytearray(journal.path.read_bytes())
    start = len(raw) - _last_frame_size(raw)
    if data.draw(st.booleans(), label="cut"):
        raw = raw[: data.draw(st.integers(start, len(raw) - 1), label="cut at")]
    else:
        bit = data.draw(st.integers(start * 8, len(raw) * 8 - 1), label="flipped bit")
        raw[bit // 8] ^= 1 << (bit % 8)
    journal.path.write_bytes(bytes(raw))
    read = _round_records(Journal(directory, 0).records())
    assert read == written[: len(written) - 1]
    reopened = Journal(directory, 0)
    reopened.open(FINGERPRINT, 10)
    reopened.append_resume(0, 2)
    assert _round_records(reopened.records()) == [*read, ("resume", None, [])]
    reopened.close()


def _last_frame_size(raw: bytes) -> int:
    pos, size = len(FILE_HEADER), 0
    while pos < len(raw):
        size = 8 + int.from_bytes(raw[pos : pos + 4], "little")
        pos += size
    return size


def test_a_full_disk_fails_the_append_with_the_fix(tmp_path):
    """ENOSPC from the kernel (/dev/full dup'ed onto the journal's descriptor), not a mock."""
    journal = write_rounds(tmp_path, [])
    full = os.open("/dev/full", os.O_WRONLY)
    try:
        os.dup2(full, journal._fd)
    finally:
        os.close(full)
    with pytest.raises(JournalError) as caught:
        journal.append_round(0, [[0, 0, 2]], np.asarray([1, 2]), np.asarray([[1, 1]]), [], {})
    message = str(caught.value)
    assert str(journal.path) in message and "--state-dir" in message
    assert "No space left on device" in message and "ENOSPC" in message
    assert "The job stops" in message and "free space" in message
    journal.close()
    journal.close()  # twice: still no error


def test_a_journal_on_a_full_device_fails_at_open(tmp_path, monkeypatch):
    def full(fd, data):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    journal = Journal(tmp_path, 0)
    assert not journal.exists()
    monkeypatch.setattr(journal_module.os, "write", full)
    with pytest.raises(JournalError, match="cannot write the --state-dir journal .*ENOSPC"):
        journal.open(FINGERPRINT, 10)
    monkeypatch.undo()
    journal.close()


@pytest.mark.parametrize("target", ["missing", "empty", "/dev/full"])
def test_a_symlinked_journal_is_refused_and_nothing_is_created_or_changed(tmp_path, target):
    """Issue 29: another user plants node0.journal -> a file for a root daemon to create or
    overwrite (and fchmod); the daemon refuses the link and touches nothing through it."""
    state, elsewhere = tmp_path / "state", tmp_path / "elsewhere"
    state.mkdir(mode=0o700)
    elsewhere.mkdir(mode=0o700)
    if target == "/dev/full":
        pointed = Path(target)
    else:
        pointed = elsewhere / "victim"
        if target == "empty":
            pointed.write_bytes(b"")
            pointed.chmod(0o644)
    (state / "node0.journal").symlink_to(pointed)
    before = sorted(os.listdir(elsewhere)), (pointed.stat() if pointed.exists() else None)
    journal = Journal(state, 0)
    with pytest.raises(JournalError, match="is a symbolic link; odbd never follows one") as err:
        journal.exists()  # the daemon's first look at it
    assert str(state / "node0.journal") in str(err.value)
    with pytest.raises(JournalError, match="is a symbolic link"):
        journal.open(FINGERPRINT, 10)
    after = sorted(os.listdir(elsewhere)), (pointed.stat() if pointed.exists() else None)
    assert after == before  # nothing created; the empty file kept its size, mode and times
    assert sorted(os.listdir(state)) == ["node0.journal"]


def test_a_state_dir_of_another_user_or_writable_by_others_is_refused(tmp_path):
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o777)
    with pytest.raises(ConfigError, match=r"is writable by group or others .*mode 0777.*chmod 700"):
        Journal(shared, 0)
    theirs = tmp_path / "theirs"
    theirs.mkdir(mode=0o700)
    os.chown(theirs, 65534, 65534)
    with pytest.raises(ConfigError, match=r"owned by another user.*owner uid 65534"):
        Journal(theirs, 0)
    assert os.listdir(shared) == [] and os.listdir(theirs) == []


def test_an_absent_state_dir_is_created_0700(tmp_path):
    journal = Journal(tmp_path / "a" / "state", 0)
    journal.open(FINGERPRINT, 10)
    assert (tmp_path / "a" / "state").stat().st_mode & 0o777 == 0o700
    assert journal.path.stat().st_mode & 0o777 == 0o600


def test_close_logs_rather_than_raises_when_the_descriptor_is_gone(tmp_path, caplog):
    journal = write_rounds(tmp_path, [])
    os.close(journal._fd)  # e.g. closed under it: os.close now fails with EBADF
    with caplog.at_level("WARNING", logger="odbd.daemon.journal"):
        journal.close()
    assert "cannot close the --state-dir journal" in caplog.text
