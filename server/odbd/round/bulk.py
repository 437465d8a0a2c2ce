"""The bulk channel (issue 26 item 1 b): moved samples, daemon to daemon, beside the round
barrier, straight into the receiving node's arena. Never through a trainer.

One transfer is one TCP connection from the sending daemon to the receiver's bulk port:
    receiver -> sender: u32 magic "ODBM", u16 version, u16 0, 32-byte fresh nonce
    sender -> receiver: the head (_HEAD: magic, version, source node, target node, round,
        count, payload bytes, job id length), the job id, `count` records (_RECORD: view key,
        identity, length, loss tokens, patches, age, payload bytes, crc32 of the payload),
        a 32-byte head proof, then the payloads back to back, then a 32-byte payload proof
    receiver -> sender: u32 status (0 = landed), u32 text length, UTF-8 text (why not)

Authentication is the peer port's (round/auth.py): HMAC-SHA256 keyed by the job token, over
the receiver's fresh nonce and every byte before the proof, with a label per proof, so a
recorded transfer cannot be replayed and a stranger without the token is refused before one
byte of its payload reaches the arena. The payload proof covers the payloads (a man in the
middle cannot swap bytes whose crc32 he matched); the crc32 per sample and the lengths, which
must add up to the head's payload bytes, catch a sender's own bug and name the sample. With an
empty token (a loopback job without --job-token-file) the proofs authenticate nobody, as on
the peer port: the receiver then accepts only a loopback peer.

The receiver takes one region of its arena per transfer (`allocate`, sized from the head: every
sample at a 64-byte aligned offset, as a producer lane lays them out, so a daemon-owned lane can
hold them), writes each payload into it as it arrives, and hands the landed samples over
(`landed`, with each sample's offset in the region) only once every check passed; on any
refusal it frees the region (`release`) and the sender gets the reason, which it raises: a move
that did not land fails the round, as a lost node does.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import hmac
import ipaddress
import logging
import secrets
import struct
import zlib
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Generic, TypeVar

from odbclient.shm import align_up
from odbd.errors import OdbdError

log = logging.getLogger("odbd.bulk")

MAGIC = 0x4F44424D  # "ODBM"
VERSION = 1
NONCE_BYTES = 32
PROOF_BYTES = 32
_GREETING = struct.Struct("<IHH")
_HEAD = struct.Struct("<IHHIIIIQI")
_RECORD = struct.Struct("<qqqqqqqI")
_STATUS = struct.Struct("<II")
_HEAD_LABEL = b"odbd bulk v1: head"
_PAYLOAD_LABEL = b"odbd bulk v1: payload"
MAX_SAMPLES = 1 << 20  # one round's moves of one node to another: far below this
MAX_JOB_ID = 256
_READ_CHUNK = 1 << 20
TIMEOUT_S = 60.0  # one transfer's whole exchange; a round's moves take milliseconds

_H = TypeVar("_H")  # the receiver's handle of one arena region


class BulkError(OdbdError):
    """A transfer was refused or did not complete: what, why, and what the job does now."""


@dataclass(frozen=True, slots=True)
class SampleRecord:
    """One moved sample's metadata: what the receiving node's buffer needs to plan and serve it."""

    view: int  # the sampler's view key (the ledger's key: the journal and quota count it)
    identity: int  # dataset index
    length: int
    tokens: int
    patches: int
    age: int
    nbytes: int
    crc32: int


@dataclass(frozen=True, slots=True)
class Transfer:
    """What landed: the head's facts, the records in order, and the receiver's handles."""

    source: int
    target: int
    round_index: int
    records: tuple[SampleRecord, ...]


def record_of(
    view: int, identity: int, length: int, tokens: int, patches: int, age: int, payload: bytes
) -> SampleRecord:
    return SampleRecord(
        view, identity, length, tokens, patches, age, len(payload), zlib.crc32(payload)
    )


def _proof(token: bytes, label: bytes, nonce: bytes, data: bytes) -> bytes:
    return hmac.new(token, label + nonce + data, hashlib.sha256).digest()


async def send_samples(
    host: str,
    port: int,
    *,
    token: bytes,
    job_id: str,
    source: int,
    target: int,
    round_index: int,
    records: Sequence[SampleRecord],
    payloads: Sequence[bytes | memoryview],
    timeout_s: float = TIMEOUT_S,
) -> None:
    """Ships one round's samples from `source` to `target`; returns once the receiver says they
    landed, raises BulkError (naming the node) otherwise."""
    if len(records) != len(payloads):
        raise BulkError(f"{len(records)} records for {len(payloads)} payloads")
    try:
        await asyncio.wait_for(
            _send(host, port, token, job_id, source, target, round_index, records, payloads),
            timeout_s,
        )
    except (OSError, asyncio.IncompleteReadError, TimeoutError) as error:
        raise BulkError(
            f"node {source} could not move {len(records)} samples of round {round_index} to node "
            f"{target} at {host}:{port} ({type(error).__name__}: {error}); the job stops as when "
            f"node {target} is lost; restart it from --state-dir once node {target} runs"
        ) from None


async def _send(
    host: str,
    port: int,
    token: bytes,
    job_id: str,
    source: int,
    target: int,
    round_index: int,
    records: Sequence[SampleRecord],
    payloads: Sequence[bytes | memoryview],
) -> None:
    reader, writer = await asyncio.open_connection(host, port)
    try:
        magic, version, _ = _GREETING.unpack(await reader.readexactly(_GREETING.size))
        if magic != MAGIC or version != VERSION:
            raise BulkError(
                f"{host}:{port} is not an odbd bulk port of this release (magic {magic:#x} "
                f"version {version}); every daemon of a job must run the same odbd release"
            )
        nonce = await reader.readexactly(NONCE_BYTES)
        jid = job_id.encode()
        total = sum(r.nbytes for r in records)
        head = _HEAD.pack(
            MAGIC, VERSION, 0, source, target, round_index, len(records), total, len(jid)
        )
        head += jid + b"".join(
            _RECORD.pack(
                r.view, r.identity, r.length, r.tokens, r.patches, r.age, r.nbytes, r.crc32
            )
            for r in records
        )
        writer.write(head + _proof(token, _HEAD_LABEL, nonce, head))
        mac = hmac.new(token, _PAYLOAD_LABEL + nonce, hashlib.sha256)
        for payload in payloads:
            writer.write(payload)
            mac.update(payload)
            await writer.drain()
        writer.write(mac.digest())
        await writer.drain()
        status, size = _STATUS.unpack(await reader.readexactly(_STATUS.size))
        text = (await reader.readexactly(size)).decode(errors="replace")
        if status != 0:
            raise BulkError(
                f"node {target} refused node {source}'s {len(records)} moved samples of round "
                f"{round_index}: {text}"
            )
    finally:
        writer.close()
        with contextlib.suppress(OSError, ConnectionError):
            await writer.wait_closed()


class _Refused(Exception):
    pass


def region_offsets(records: Sequence[SampleRecord]) -> tuple[list[int], int]:
    """Each sample's offset in a transfer's region (64-byte aligned) and the region's size."""
    offsets, pos = [], 0
    for r in records:
        offsets.append(pos)
        pos += align_up(r.nbytes)
    return offsets, pos


class BulkReceiver(Generic[_H]):
    """The receiving end: an asyncio TCP server on the bulk port.

    `allocate(nbytes)` -> (handle, writable memoryview) of one arena region, or None when the
    arena is full (the transfer is refused: the sender's round fails, as at a lost node);
    `release(handle)` frees it; `landed(transfer, handle, offsets)` takes a checked transfer's
    samples (offsets[i]: record i's bytes in the region, region_offsets)."""

    def __init__(
        self,
        *,
        token: bytes,
        job_id: str,
        node: int,
        allocate: Callable[[int], tuple[_H, memoryview] | None],
        release: Callable[[_H], None],
        landed: Callable[[Transfer, _H, list[int]], Awaitable[None] | None],
    ) -> None:
        self.token = token
        self.job_id = job_id
        self.node = node
        self._allocate = allocate
        self._release = release
        self._landed = landed
        self._server: asyncio.Server | None = None
        self.refused = 0  # transfers refused (auth, checks, arena full)
        self.received_bytes = 0  # payload bytes landed

    async def start(self, host: str = "127.0.0.1", port: int = 0) -> int:
        self._server = await asyncio.start_server(self._serve, host, port)
        return int(self._server.sockets[0].getsockname()[1])

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()
            self._server = None

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            await asyncio.wait_for(self._receive(reader, writer), TIMEOUT_S)
        except _Refused as why:
            self.refused += 1
            log.warning("bulk channel: refused a transfer from %s: %s", _peer(writer), why)
            with contextlib.suppress(OSError, ConnectionError):
                text = str(why).encode()
                writer.write(_STATUS.pack(1, len(text)) + text)
                await writer.drain()
        except (OSError, asyncio.IncompleteReadError, TimeoutError) as error:
            self.refused += 1
            log.warning("bulk channel: a transfer from %s broke off: %s", _peer(writer), error)
        finally:
            writer.close()
            with contextlib.suppress(OSError, ConnectionError):
                await writer.wait_closed()

    async def _receive(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if not self.token and not _loopback(writer):
            raise _Refused(
                "this job has no --job-token-file, so its bulk port accepts loopback peers only; "
                "give every daemon the same --job-token-file"
            )
        nonce = secrets.token_bytes(NONCE_BYTES)
        writer.write(_GREETING.pack(MAGIC, VERSION, 0) + nonce)
        await writer.drain()
        raw = await reader.readexactly(_HEAD.size)
        magic, version, _, source, target, round_index, count, total, jid_len = _HEAD.unpack(raw)
        if magic != MAGIC or version != VERSION:
            raise _Refused(f"not an odbd bulk transfer of this release (version {version})")
        if count > MAX_SAMPLES or jid_len > MAX_JOB_ID:
            raise _Refused(f"head out of range: {count} samples, job id of {jid_len} bytes")
        rest = await reader.readexactly(jid_len + count * _RECORD.size)
        proof = await reader.readexactly(PROOF_BYTES)
        if not hmac.compare_digest(_proof(self.token, _HEAD_LABEL, nonce, raw + rest), proof):
            raise _Refused(
                "its proof does not match this job's token: only this job's daemons, with the "
                "same --job-token-file, may move samples here"
            )
        job_id = rest[:jid_len].decode(errors="replace")
        if job_id != self.job_id or target != self.node:
            raise _Refused(
                f"it is meant for job {job_id!r} node {target}, this is job {self.job_id!r} "
                f"node {self.node}"
            )
        records = tuple(SampleRecord(*fields) for fields in _RECORD.iter_unpack(rest[jid_len:]))
        bad = [r.view for r in records if r.nbytes < 1 or min(r.length, r.tokens) < 0]
        if bad or sum(r.nbytes for r in records) != total:
            raise _Refused(
                f"its lengths do not add up: {sum(r.nbytes for r in records)} bytes in records "
                f"against {total} in the head, views with no bytes {bad[:8]}"
            )
        offsets, size = region_offsets(records)
        try:
            got = self._allocate(size) if records else None
        except OdbdError as error:  # e.g. larger than any segment of the arena
            raise _Refused(f"node {self.node}: {error}") from None
        if records and got is None:
            raise _Refused(
                f"node {self.node}'s arena has no room for {len(records)} moved samples "
                f"({size} bytes); raise --shm-size (moves need room beside the buffer)"
            )
        try:
            mac = hmac.new(self.token, _PAYLOAD_LABEL + nonce, hashlib.sha256)
            for r, at in zip(records, offsets, strict=True):
                assert got is not None
                view = got[1][at : at + r.nbytes]
                await _read_into(reader, view)
                mac.update(view)
                if zlib.crc32(view) != r.crc32:
                    raise _Refused(
                        f"sample view {r.view} (identity {r.identity}) arrived with crc32 "
                        f"{zlib.crc32(view):#010x}, sent as {r.crc32:#010x}"
                    )
            if not hmac.compare_digest(mac.digest(), await reader.readexactly(PROOF_BYTES)):
                raise _Refused("its payload proof does not match: the bytes were altered")
            if got is not None:
                done = self._landed(Transfer(source, target, round_index, records), got[0], offsets)
                if done is not None:
                    await done
        except BaseException:
            if got is not None:
                self._release(got[0])
            raise
        self.received_bytes += total
        writer.write(_STATUS.pack(0, 0))
        await writer.drain()


async def _read_into(reader: asyncio.StreamReader, view: memoryview) -> None:
    """Fills `view` (an arena allocation) from the stream: the bytes go straight to shm."""
    pos = 0
    while pos < len(view):
        chunk = await reader.read(min(_READ_CHUNK, len(view) - pos))
        if not chunk:
            raise asyncio.IncompleteReadError(b"", len(view) - pos)
        view[pos : pos + len(chunk)] = chunk
        pos += len(chunk)


def _peer(writer: asyncio.StreamWriter) -> str:
    peer = writer.get_extra_info("peername")
    return f"{peer[0]}:{peer[1]}" if isinstance(peer, tuple) else str(peer)


def _loopback(writer: asyncio.StreamWriter) -> bool:
    peer = writer.get_extra_info("peername")
    if not isinstance(peer, tuple):
        return False
    with contextlib.suppress(ValueError):
        return ipaddress.ip_address(peer[0]).is_loopback
    return False
