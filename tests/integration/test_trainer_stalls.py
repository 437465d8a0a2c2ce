"""A trainer that waits in vain learns from its DaemonTimeoutError what the daemon reports:
its phase, last error and what the next round waits for (issue 10: a stalled trainer only
said "check odbd status")."""

from __future__ import annotations

import pytest

from odbclient import ODBClient
from odbclient.errors import DaemonTimeoutError
from odbd.demo.cluster import ClusterSpec, LocalCluster

pytestmark = pytest.mark.timeout(120)


def test_timeout_names_what_the_round_waits_for() -> None:
    # External producers (--dataset-size) of which none ever connects: the round waits for them.
    spec = ClusterSpec(
        nodes=1,
        ranks_per_node=2,
        daemon_args=["--dataset-size", "10", "--shm-size", "16M"],
    )
    with LocalCluster(spec) as cluster:
        cluster.wait_sockets()
        with ODBClient(rank=0, socket=cluster.sockets[0], connect_timeout_s=30, deadline_s=4) as c:
            with pytest.raises(DaemonTimeoutError) as raised:
                next(iter(c))
    message = str(raised.value)
    assert f"no batch from odbd on unix:{cluster.sockets[0]} for rank 0 in 4 s" in message
    assert "the daemon reports phase running" in message, message
    assert "its next round waits because its producers filled 0 of the" in message, message
    assert "no producer is attached" in message, message
    assert "0 producers" in message and "local ranks not attached: [1]" in message, message
    assert cluster.leftover_segments() == []
