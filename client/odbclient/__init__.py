"""odbclient: trainer client and producer for odbd (no server dependencies).

    from odbclient import ODBClient, Producer

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
    from odbclient.batch import Batch
    from odbclient.client import DEFAULT_SOCKET, ODBClient
    from odbclient.packed_check import PackedAttentionError, check_packed_model
    from odbclient.producer import Producer, RejectReason

_LAZY = {
    "ODBClient": "odbclient.client",
    "DEFAULT_SOCKET": "odbclient.connect",
    "Batch": "odbclient.batch",
    "Producer": "odbclient.producer",
    "RejectReason": "odbclient.samples",
    "check_packed_model": "odbclient.packed_check",
    "PackedAttentionError": "odbclient.packed_check",
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
