"""Local trust (issue 29): the default socket's private directory, uid checks, hello bounds."""

from __future__ import annotations

import os
import socket
import struct
from pathlib import Path

import pytest

from odbclient import local_trust
from odbclient.errors import UntrustedDaemonError
from odbclient.framing import MAX_FRAME_BYTES, FrameBuffer, FrameError, frame
from odbd import flag_files
from odbd.errors import ConfigError

UID = os.getuid()


def test_the_default_socket_is_in_xdg_runtime_dir_when_it_is_ours_and_private(tmp_path):
    runtime = tmp_path / "run"
    runtime.mkdir(mode=0o700)
    environ = {"XDG_RUNTIME_DIR": str(runtime)}
    assert local_trust.default_socket(environ) == f"{runtime}/odbd/odbd.sock"
    runtime.chmod(0o777)  # others can write it: not a place for the socket
    assert local_trust.default_socket(environ) == f"/tmp/odbd-{UID}/odbd.sock"
    runtime.chmod(0o700)
    os.chown(runtime, 65534, 65534)  # another user's (a stale value from another login)
    assert local_trust.default_socket(environ) == f"/tmp/odbd-{UID}/odbd.sock"
    for stale in ({}, {"XDG_RUNTIME_DIR": ""}, {"XDG_RUNTIME_DIR": "relative/dir"}):
        assert local_trust.default_socket(stale) == f"/tmp/odbd-{UID}/odbd.sock"
    assert local_trust.default_socket({}, uid=1234) == "/tmp/odbd-1234/odbd.sock"


def test_the_default_socket_directory_is_created_0700_and_refused_when_not_private(tmp_path):
    directory = tmp_path / "odbd-dir"
    flag_files.ensure_private_dir(directory, flag="--socket", fix="or pass --socket")
    assert directory.stat().st_mode & 0o777 == 0o700
    flag_files.ensure_private_dir(directory, flag="--socket", fix="or pass --socket")  # again
    directory.chmod(0o733)
    with pytest.raises(ConfigError, match=r"writable by group or others .*mode 0733.*chmod 700"):
        flag_files.ensure_private_dir(directory, flag="--socket", fix="or pass --socket")
    directory.chmod(0o700)
    os.chown(directory, 65534, 65534)
    with pytest.raises(ConfigError, match=r"--socket: directory .* owned by another user"):
        flag_files.ensure_private_dir(directory, flag="--socket", fix="or pass --socket")


def test_a_symlink_is_followed_only_when_this_user_owns_it(tmp_path):
    target = tmp_path / "target"
    target.mkdir(mode=0o700)
    link = tmp_path / "link"
    link.symlink_to(target)
    assert flag_files.private_dir_problem(link) == ""  # the user's own link to a big disk
    os.lchown(link, 65534, 65534)  # planted by another user
    assert "symbolic link owned by uid 65534" in flag_files.private_dir_problem(link)


def test_the_cli_refuses_the_default_socket_directory_of_another_user(monkeypatch, tmp_path):
    runtime = tmp_path / "run"
    runtime.mkdir(mode=0o700)
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(runtime))
    squatted = runtime / "odbd"
    squatted.mkdir(mode=0o777)
    squatted.chmod(0o777)
    with pytest.raises(ConfigError, match=r"--socket: directory .*/odbd is writable"):
        flag_files.check_socket_directory(local_trust.default_socket())
    squatted.chmod(0o700)
    flag_files.check_socket_directory(local_trust.default_socket())


def test_trusted_uids_are_the_own_user_and_root():
    assert local_trust.trusted_uid(UID, UID)
    assert local_trust.trusted_uid(0, 1000)
    assert not local_trust.trusted_uid(65534, 1000)
    assert not local_trust.trusted_uid(1000, 0)  # a root trainer trusts only root's daemon


def test_peer_credentials_name_the_process_on_the_other_end():
    left, right = socket.socketpair(socket.AF_UNIX)
    with left, right:
        peer = local_trust.peer_credentials(left)
    assert (peer.pid, peer.uid, peer.gid) == (os.getpid(), os.getuid(), os.getgid())


def test_a_socket_file_of_another_user_is_refused_before_connecting(tmp_path):
    path = tmp_path / "odbd.sock"
    server = socket.socket(socket.AF_UNIX)
    server.bind(str(path))
    with server:
        local_trust.check_socket_owner(str(path), who="trainer")
        os.chown(path, 65534, 65534)
        with pytest.raises(UntrustedDaemonError, match=rf"{path} belongs to uid 65534"):
            local_trust.check_socket_owner(str(path), who="trainer")
    local_trust.check_socket_owner(str(tmp_path / "absent"), who="trainer")  # connect says so


def test_a_shm_segment_of_another_user_or_with_open_modes_is_not_mapped(tmp_path):
    from odbclient.shm import ShmAttachError, map_segment

    path = tmp_path / "odbd-job-0-0"
    path.write_bytes(b"\0" * 4096)
    path.chmod(0o600)
    assert len(map_segment(str(path), name=path.name)) == 4096
    path.chmod(0o644)
    with pytest.raises(UntrustedDaemonError, match="has mode 0644"):
        map_segment(str(path), name=path.name)
    path.chmod(0o600)
    os.chown(path, 65534, 65534)
    with pytest.raises(UntrustedDaemonError, match="belongs to uid 65534"):
        map_segment(str(path), name=path.name)
    link = tmp_path / "odbd-job-0-1"
    link.symlink_to("/dev/zero")
    with pytest.raises(ShmAttachError, match="not a symbolic link"):
        map_segment(str(link), name=link.name)


def test_the_first_frame_is_bounded_apart_from_the_rest():
    hello_limit = 64
    buffer = FrameBuffer(first_frame_limit=hello_limit, first_frame="TrainerHello")
    with pytest.raises(FrameError, match=r"first frame \(TrainerHello\) announces 65 bytes"):
        buffer.feed(struct.pack("<I", hello_limit + 1))
    # A hello within the bound, then (even in the same read) frames of the usual bound.
    buffer = FrameBuffer(first_frame_limit=hello_limit, first_frame="TrainerHello")
    big = b"x" * 1000
    assert buffer.feed(frame(b"h" * 64) + frame(big)[:10]) == [b"h" * 64]
    assert buffer.feed(frame(big)[10:]) == [big]
    with pytest.raises(FrameError, match="a frame announces"):
        buffer.feed(struct.pack("<I", MAX_FRAME_BYTES + 1))


def test_a_hello_arriving_byte_by_byte_is_still_one_hello():
    buffer = FrameBuffer(first_frame_limit=16, first_frame="Hello")
    data = frame(b"0123456789abcdef") + frame(b"z" * 100)
    out: list[bytes] = []
    for i in range(len(data)):
        out += buffer.feed(data[i : i + 1])
    assert out == [b"0123456789abcdef", b"z" * 100]


def test_journal_directory_check_runs_at_the_cli(tmp_path: Path):
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o757)
    with pytest.raises(ConfigError, match=r"--state-dir: directory .* writable by group or others"):
        flag_files.check_state_dir(shared)
    flag_files.check_state_dir(tmp_path / "absent")  # created 0700 by the journal


def test_odbd_status_probes_the_listener_before_its_grpc_request(tmp_path, capsys):
    """gRPC shows no peer credentials: `odbd status` checks the socket's owner first."""
    from odbd import status

    path = tmp_path / "odbd.sock"
    server = socket.socket(socket.AF_UNIX)
    server.bind(str(path))
    server.listen(1)
    with server:
        local_trust.probe_daemon(str(path), who="odbd status")  # ours: nothing to say
        os.chown(path, 65534, 65534)
        assert status.main(["--socket", str(path)], environ={}) == 1
    err = capsys.readouterr().err
    assert f"the socket {path} belongs to uid 65534" in err, err
    assert "odbd status sent nothing" in err
