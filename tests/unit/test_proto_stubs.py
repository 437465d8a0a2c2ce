"""The committed gRPC stubs match proto/odbd/v1/*.proto and import without the server package."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_committed_stubs_are_up_to_date() -> None:
    result = subprocess.run(
        [sys.executable, str(ROOT / "proto" / "gen.py"), "--check"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr


def test_stubs_import_from_odbclient_not_the_server_package() -> None:
    # A fresh interpreter, so a stray `import odbd` elsewhere in the test session cannot mask it.
    code = (
        "import sys\n"
        "from odbclient.wire.odbd.v1 import peer_pb2, peer_pb2_grpc\n"
        "msg = peer_pb2.HubMessage(abort=peer_pb2.Abort(missing=[{'node_rank': 1}]))\n"
        "assert peer_pb2.HubMessage.FromString(msg.SerializeToString()) == msg\n"
        "assert peer_pb2_grpc.PeerStub is not None\n"
        "assert 'odbd' not in sys.modules, 'stubs imported the server package'\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)
