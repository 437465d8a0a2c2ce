"""odbclient: trainer client and producer for odbd (no server dependencies).

    from odbclient import ODBClient, Producer

Two sides of the daemon's shared memory, one package each: `odbclient.trainer` runs in each
training process and reads batches out of it, `odbclient.producer` runs in producer processes
and writes samples into it. The modules at this level are what both sides and the daemon
(odbd) share: the segment and sample layout (shm, samples, alloc), the socket framing and
where the daemon listens (framing, connect), the trust checks on its files (local_trust), the
errors (errors) and the generated protocol (wire). `adapters` wraps the trainer side for
Hugging Face Trainer and Accelerate.

`ODBClient`, `Batch`, `Producer` and `DEFAULT_SOCKET` load on first use (PEP 562), so the
daemon can import `odbclient.shm` without paying for torch and the gRPC stubs.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from odbclient.errors import (
    ClientClosedError,
    CollateError,
    DaemonConnectionError,
    DaemonTimeoutError,
    DaemonUnavailableError,
    DatasetLoadError,
    IteratorInUseError,
    JobFailedError,
    JobMismatchError,
    ODBClientError,
    ProtocolError,
    RankInUseError,
    RankRefusedError,
    ReaderProcessError,
    StateDictError,
    UntrustedDaemonError,
)

if TYPE_CHECKING:
    from odbclient.producer.producer import Producer, RejectReason
    from odbclient.trainer.batch import Batch
    from odbclient.trainer.client import DEFAULT_SOCKET, ODBClient
    from odbclient.trainer.packed_check import PackedAttentionError, check_packed_model

_LAZY = {
    "ODBClient": "odbclient.trainer.client",
    "DEFAULT_SOCKET": "odbclient.connect",
    "Batch": "odbclient.trainer.batch",
    "Producer": "odbclient.producer.producer",
    "RejectReason": "odbclient.samples",
    "check_packed_model": "odbclient.trainer.packed_check",
    "PackedAttentionError": "odbclient.trainer.packed_check",
}

__all__ = [
    "DEFAULT_SOCKET",
    "Batch",
    "ClientClosedError",
    "CollateError",
    "DaemonConnectionError",
    "DaemonTimeoutError",
    "DaemonUnavailableError",
    "DatasetLoadError",
    "IteratorInUseError",
    "JobFailedError",
    "JobMismatchError",
    "ODBClient",
    "ODBClientError",
    "PackedAttentionError",
    "Producer",
    "ProtocolError",
    "RankInUseError",
    "RankRefusedError",
    "ReaderProcessError",
    "RejectReason",
    "StateDictError",
    "UntrustedDaemonError",
    "check_packed_model",
]


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'odbclient' has no attribute {name!r}")
