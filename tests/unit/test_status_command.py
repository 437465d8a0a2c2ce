"""`odbd status` finds the daemon like ODBClient does: --socket, else $ODBD_SOCKET, else default."""

from __future__ import annotations

import json
import socket as socketlib
from collections.abc import Iterator
from concurrent import futures
from pathlib import Path

import grpc
import pytest

from odbclient.wire.odbd.v1 import admin_pb2, admin_pb2_grpc
from odbd import status
from odbd.config import default_socket


class _Admin(admin_pb2_grpc.AdminServicer):
    def Status(self, request, context):  # noqa: N802 (gRPC method name)
        return admin_pb2.StatusReply(job_id="from-the-env-socket", num_nodes=1, phase="running")


@pytest.fixture
def daemon_socket(tmp_path: Path) -> Iterator[str]:
    """A real gRPC Admin service on a unix socket (what `odbd status` talks to)."""
    path = str(tmp_path / "d.sock")
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=1))
    admin_pb2_grpc.add_AdminServicer_to_server(_Admin(), server)
    server.add_insecure_port(f"unix:{path}")
    server.start()
    try:
        yield path
    finally:
        server.stop(None).wait()


@pytest.mark.timeout(60)
def test_status_asks_the_daemon_named_by_odbd_socket(daemon_socket, capsys):
    assert status.main([], environ={"ODBD_SOCKET": daemon_socket}) == 0
    assert "from-the-env-socket" in capsys.readouterr().out


@pytest.mark.timeout(60)
def test_status_says_which_socket_it_tried_and_where_that_came_from(tmp_path, capsys):
    missing = str(tmp_path / "none.sock")
    assert status.main(["--timeout", "10"], environ={"ODBD_SOCKET": missing}) == 1
    err = capsys.readouterr().err
    assert f"no daemon answered on {missing} (from ODBD_SOCKET)" in err, err
    assert "a daemon still building its --dataset opens it only after the build" in err, err
    assert err.count("\n") == 1


@pytest.mark.timeout(60)
def test_status_of_a_daemon_that_accepts_but_never_answers_says_it_is_frozen(tmp_path, capsys):
    # A SIGSTOPped daemon: the kernel still accepts connections on its socket, nobody answers.
    path = str(tmp_path / "frozen.sock")
    listener = socketlib.socket(socketlib.AF_UNIX, socketlib.SOCK_STREAM)
    listener.bind(path)
    listener.listen(8)
    try:
        assert status.main(["--socket", path, "--timeout", "0.5"]) == 1
    finally:
        listener.close()
    err = capsys.readouterr().err
    assert f"the daemon on {path} (from --socket) accepts connections but did not answer" in err
    assert "stopped (SIGSTOP, a debugger), hung or overloaded" in err, err
    assert err.count("\n") == 1


@pytest.mark.parametrize(
    ("flag", "environ", "expected"),
    [
        ("/a.sock", {"ODBD_SOCKET": "/b.sock"}, ("/a.sock", "--socket")),
        (None, {"ODBD_SOCKET": " /b.sock "}, ("/b.sock", "ODBD_SOCKET")),
        (None, {"ODBD_SOCKET": ""}, (default_socket(), "the default")),
        (None, {}, (default_socket(), "the default")),
    ],
)
def test_the_flag_wins_over_odbd_socket_which_wins_over_the_default(flag, environ, expected):
    assert status.resolve_socket(flag, environ) == expected


@pytest.mark.parametrize(
    ("argv", "environ", "names"),
    [
        (["--timeout", "0"], {}, "--timeout"),
        (["--watch", "-1"], {}, "--watch"),
        (["--sockt", "/x.sock"], {}, "did you mean --socket?"),
        ([], {"ODBD_SOCKET": "/" + "s" * 120}, "ODBD_SOCKET"),
    ],
)
def test_bad_status_input_exits_2_with_one_line(argv, environ, names, capsys):
    with pytest.raises(SystemExit) as stop:
        status.main(argv, environ=environ)
    err = capsys.readouterr().err
    assert stop.value.code == 2 and names in err and err.count("\n") == 1, err


@pytest.mark.timeout(60)
def test_status_json_is_one_object_with_counts_as_numbers(daemon_socket, capsys):
    assert status.main(["--socket", daemon_socket, "--json"]) == 0
    out = capsys.readouterr().out
    assert out.count("\n") == 1
    reply = json.loads(out)
    assert reply["job_id"] == "from-the-env-socket" and reply["phase"] == "running"
    # uint64 fields: numbers (proto3's JSON mapping would give "0"), zeros included
    assert reply["planned_steps"] == 0 and reply["trained_samples_per_s"] == 0.0
