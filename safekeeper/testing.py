"""A small walproposer for tests and benchmarks: the proposer side of START_WAL_PUSH.

``TestProposer`` connects with our own libpq client, greets, asks for a vote, announces its
election and pushes AppendRequests. It keeps no quorum logic: one proposer, one safekeeper
at a time, which is what tests of a single acceptor need. ``synthetic_wal`` makes valid WAL
(XLOG NOOP records of a chosen size) with the protocol's WAL encoder.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import AsyncIterator, Iterable
from contextlib import asynccontextmanager
from pathlib import Path
from types import TracebackType
from typing import Any

import tomli_w
import trio

from common.pgclient import PgClientConnection, connect
from common.pgcopy import CopyBothStream
from common.ports import free_port
from protocol.errors import RemoteProtocolError
from protocol.ids import TenantId, TimelineId
from protocol.lsn import INVALID_LSN, WAL_SEGMENT_SIZE, Lsn
from protocol.safekeeper import (
    AcceptorGreeting,
    AcceptorMessage,
    AppendRequest,
    AppendResponse,
    ProposerElected,
    ProposerGreeting,
    ProtocolVersion,
    TermSwitchEntry,
    VoteRequest,
    VoteResponse,
    decode_acceptor_message,
    encode_append_request_header,
    encode_message,
)
from protocol.wal.encoder import WalEncoder
from protocol.wal.rmgr import XLOG_NOOP as XLOG_NOOP  # re-exported for bench/wal_acceptor.py
from protocol.wal.rmgr import RmgrId
from safekeeper.config import SafekeeperConfig
from safekeeper.node import SafekeeperNode

PG_VERSION = 150000


def synthetic_wal(start: Lsn, total: int, record_size: int = 200, system_id: int = 1) -> bytes:
    """At least ``total`` bytes of valid WAL from ``start`` (XLOG NOOP records)."""
    enc = WalEncoder(start, system_identifier=system_id)
    payload = bytes(range(256)) * (record_size // 256 + 1)
    body = payload[: max(record_size - 24 - 2, 0)]
    while enc.buffered < total:
        enc.append(RmgrId.XLOG, XLOG_NOOP, main_data=body)
    return enc.take()


@asynccontextmanager
async def running_node(data_dir: Path, **settings: Any) -> AsyncIterator[SafekeeperNode]:
    """An in-process safekeeper on free loopback ports, fsync off unless ``no_sync=False``;
    ``settings`` are further ``SafekeeperConfig`` fields. Stopped on exit."""
    cfg = SafekeeperConfig(
        data_dir=str(data_dir),
        listen_pg="127.0.0.1:0",
        listen_http="127.0.0.1:0",
        **{"no_sync": True, **settings},
    )
    sk = SafekeeperNode(cfg)
    async with trio.open_nursery() as nursery:
        await nursery.start(sk.run)
        try:
            yield sk
        finally:
            sk.stop()


class TestProposer:
    """One START_WAL_PUSH connection. Use ``async with await TestProposer.connect(...)``."""

    __test__ = False  # not a pytest class

    def __init__(
        self,
        conn: PgClientConnection,
        copy: CopyBothStream,
        version: ProtocolVersion,
        tenant_id: TenantId,
        timeline_id: TimelineId,
    ) -> None:
        self.conn = conn
        self.copy = copy
        self.version: ProtocolVersion = version
        self.tenant_id = tenant_id
        self.timeline_id = timeline_id
        self.term = 0
        self.history: tuple[TermSwitchEntry, ...] = ()
        # Sent as every AppendRequest's truncate_lsn (the peer horizon); tests set it.
        self.truncate_lsn = INVALID_LSN

    @classmethod
    async def connect(
        cls,
        host: str,
        port: int,
        tenant_id: TenantId,
        timeline_id: TimelineId,
        *,
        version: ProtocolVersion = 3,
        allow_timeline_creation: bool = True,
        password: str | None = None,
    ) -> TestProposer:
        """``password``: a tenant token for a safekeeper with auth on."""
        conn = await connect(
            host,
            port,
            user="postgres",
            dbname="replication",
            options={"tenant_id": tenant_id.hex, "timeline_id": timeline_id.hex},
            password=password,
        )
        creation = "true" if allow_timeline_creation else "false"
        copy = await conn.copy_both(
            f"START_WAL_PUSH (proto_version '{version}', allow_timeline_creation '{creation}')"
        )
        return cls(conn, copy, version, tenant_id, timeline_id)

    async def __aenter__(self) -> TestProposer:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.conn.aclose()

    async def send(self, msg: ProposerGreeting | VoteRequest | ProposerElected | AppendRequest) -> None:
        await self.copy.send(encode_message(msg, self.version))

    async def receive(self) -> AcceptorMessage:
        payload = await self.copy.receive()
        if payload is None:
            raise RemoteProtocolError("safekeeper ended the stream")
        return decode_acceptor_message(payload, self.version)

    async def greet(self, system_id: int = 1, pg_version: int = PG_VERSION) -> AcceptorGreeting:
        await self.send(
            ProposerGreeting(
                self.tenant_id, self.timeline_id, pg_version, system_id, WAL_SEGMENT_SIZE
            )
        )
        reply = await self.receive()
        assert isinstance(reply, AcceptorGreeting), reply
        self.term = reply.term
        return reply

    async def vote(self, term: int) -> VoteResponse:
        await self.send(VoteRequest(term))
        reply = await self.receive()
        assert isinstance(reply, VoteResponse), reply
        return reply

    async def elect(self, start: Lsn, term: int | None = None) -> Lsn:
        """Win a vote for a new term and start streaming at ``start`` (when the acceptor has
        no WAL) or at the acceptor's flush_lsn (when it has). Returns the streaming start."""
        greeting_term = self.term
        term = term or greeting_term + 1
        vote = await self.vote(term)
        if not vote.vote_given:
            raise RuntimeError(f"vote for term {term} refused (acceptor term {vote.term})")
        if vote.term_history:
            begin = vote.flush_lsn
            history = (*vote.term_history, TermSwitchEntry(term, begin))
        else:
            begin = start
            history = (TermSwitchEntry(term, begin),)
        await self.send(ProposerElected(term, begin, history))
        self.term = term
        self.history = history
        return begin

    def append_payload(self, begin: Lsn, wal: bytes | memoryview, commit_lsn: Lsn) -> list[bytes | memoryview]:
        msg = AppendRequest(
            self.term, begin, Lsn(begin + len(wal)), commit_lsn, self.truncate_lsn, wal
        )
        return [encode_append_request_header(msg, self.version), wal]

    async def append(self, begin: Lsn, wal: bytes, commit_lsn: Lsn = INVALID_LSN) -> None:
        await self.copy.send(b"".join(self.append_payload(begin, wal, commit_lsn)))

    async def append_many(self, begin: Lsn, chunks: Iterable[bytes], commit: bool = True) -> Lsn:
        """Send one AppendRequest per chunk (commit_lsn = the previous chunk's end)."""
        payloads = []
        pos = begin
        for chunk in chunks:
            commit_lsn = pos if commit else INVALID_LSN
            payloads.append(b"".join(self.append_payload(pos, chunk, commit_lsn)))
            pos = Lsn(pos + len(chunk))
        await self.copy.send_many(payloads)
        return pos

    async def wait_flush(self, lsn: Lsn) -> AppendResponse:
        """Read AppendResponses until one reports flush_lsn >= ``lsn``."""
        while True:
            reply = await self.receive()
            if isinstance(reply, AppendResponse) and reply.flush_lsn >= lsn:
                return reply


class SafekeeperProcess:
    """The real node as a subprocess (``python -m control_plane.cli safekeeper -c FILE``)."""

    __test__ = False

    def __init__(
        self, workdir: Path, *, node_id: int = 1, pure_python: bool = False, **settings: object
    ) -> None:
        # pure_python: run the node on the pure-Python kernels (PAGESTORE_PURE_PYTHON=1), for
        # benchmarks that compare both implementations side by side.
        self.pure_python = pure_python
        self.workdir = workdir
        self.pg_port = free_port()
        self.http_port = free_port()
        self.config_path = workdir / "safekeeper.toml"
        self.log_path = workdir / "safekeeper.log"
        config = {
            "id": node_id,
            "listen_pg": f"127.0.0.1:{self.pg_port}",
            "listen_http": f"127.0.0.1:{self.http_port}",
            "data_dir": str(workdir / "data"),
            "log_file": str(self.log_path),
            **settings,
        }
        workdir.mkdir(parents=True, exist_ok=True)
        self.config_path.write_text(tomli_w.dumps(config))
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def data_dir(self) -> Path:
        return self.workdir / "data"

    def timeline_dir(self, tenant_id: TenantId, timeline_id: TimelineId) -> Path:
        return self.data_dir / tenant_id.hex / timeline_id.hex

    def start(self, timeout: float = 60) -> None:
        root = Path(__file__).resolve().parent.parent
        env = {k: v for k, v in os.environ.items() if k != "PAGESTORE_PURE_PYTHON"}
        if self.pure_python:
            env["PAGESTORE_PURE_PYTHON"] = "1"
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "control_plane.cli", "safekeeper", "-c", str(self.config_path)],
            cwd=root,
            env=env,
            stdout=subprocess.DEVNULL,
            stderr=open(self.workdir / "stderr.log", "ab"),  # noqa: SIM115
        )
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(
                    f"safekeeper exited with {self.proc.returncode}: "
                    + (self.workdir / "stderr.log").read_text()[-2000:]
                )
            try:
                self.http_get("/v1/status")
                return
            except OSError:
                time.sleep(0.05)
        raise RuntimeError("safekeeper did not start")

    def http_get(self, path: str) -> Any:
        with urllib.request.urlopen(f"http://127.0.0.1:{self.http_port}{path}", timeout=30) as r:
            body = r.read()
        return json.loads(body) if path != "/metrics" else body.decode()

    def timeline_status(self, tenant_id: TenantId, timeline_id: TimelineId) -> dict[str, Any]:
        result: dict[str, Any] = self.http_get(f"/v1/tenant/{tenant_id}/timeline/{timeline_id}")
        return result

    def kill(self) -> None:
        """kill -9: no chance to save anything."""
        if self.proc is not None:
            self.proc.kill()
            self.proc.wait()
            self.proc = None

    def stop(self, timeout: float = 15) -> int:
        if self.proc is None:
            return 0
        self.proc.send_signal(signal.SIGTERM)
        try:
            code = self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
            raise
        self.proc = None
        return code
