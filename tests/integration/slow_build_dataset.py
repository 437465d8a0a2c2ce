"""A dataset whose factory is slow in the producers (loaded by path): a real factory tokenizes
a whole corpus before it returns, for minutes, and the daemon's spawned workers do not connect
until then. The daemon's own call (for len()) returns at once unless `in_daemon` is set; a
producer's call waits until the file `release` exists, so the test decides when the build ends
instead of sleeping."""

import os
import time
from pathlib import Path

import numpy as np

_BUILD_DEADLINE_S = 600.0  # a forgotten release file must not leave a producer behind forever


def make(release: str, size: int = 16, in_daemon: int = 0) -> list[dict]:
    # ODBD_DAEMON_PID is set by the daemon for the workers it spawns.
    if in_daemon or os.environ.get("ODBD_DAEMON_PID"):
        started = time.monotonic()
        while not Path(release).exists() and time.monotonic() - started < _BUILD_DEADLINE_S:
            time.sleep(0.05)
    return [{"input_ids": np.arange(1, 2 + i % 7, dtype=np.int64)} for i in range(size)]
