"""The dataset's size, learned before the daemon opens its socket, and said while it takes long.

The daemon calls the user's --dataset factory once for len() (its workers call it again). A
real factory may tokenize a corpus for minutes; the socket, `odbd status` and the producers'
connections come only after it. So a build past BUILD_NOTICE_S is said in the log, and again
every BUILD_NOTICE_EVERY_S, rather than leaving the daemon silent (a wait names what it waits
for).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

from odbd.config import DaemonConfig

log = logging.getLogger("odbd")

BUILD_NOTICE_S = 5.0
BUILD_NOTICE_EVERY_S = 30.0


def dataset_size_of(config: DaemonConfig) -> int:
    """--dataset-size, or len() of the dataset the producers will import."""
    if config.dataset_size is not None:
        return config.dataset_size
    from odbclient.producer.dataset import load_dataset, parse_dataset_args

    assert config.dataset is not None
    args = parse_dataset_args([f"{k}={v}" for k, v in config.dataset_args])
    with build_notices(config.dataset):
        return len(load_dataset(config.dataset, args))


@contextmanager
def build_notices(dataset: str) -> Iterator[None]:
    """Logs, from a helper thread, that the build of `dataset` still runs: after
    BUILD_NOTICE_S, then every BUILD_NOTICE_EVERY_S; and its duration once it ends, if said."""
    done = threading.Event()
    started = time.monotonic()
    said = threading.Event()

    def notice() -> None:
        wait_s = BUILD_NOTICE_S
        while not done.wait(wait_s):
            said.set()
            log.info(
                "building --dataset %s to learn its size: %.0f s so far; the daemon opens its "
                "socket (producers, trainers, `odbd status`) once it returns",
                dataset,
                time.monotonic() - started,
            )
            wait_s = BUILD_NOTICE_EVERY_S

    thread = threading.Thread(target=notice, name="odbd-build-notice", daemon=True)
    thread.start()
    try:
        yield
    finally:
        done.set()
        thread.join()
        if said.is_set():
            log.info("built --dataset %s in %.1f s", dataset, time.monotonic() - started)
