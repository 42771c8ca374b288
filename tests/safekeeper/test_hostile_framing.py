"""Hostile pgwire framing after START_WAL_PUSH, on the zero-copy receive path (a real
socket, so ``recv_into`` and ``copy_data_views`` run): oversized lengths, a wrong tag mid
stream, a header cut at the end. Each gives an ErrorResponse (or a clean close at EOF) and
ends only its own connection; WAL acknowledged before it stays."""

from __future__ import annotations

import struct
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
import trio

from protocol.lsn import WAL_SEGMENT_SIZE, Lsn
from protocol.pgwire.errors import PgError
from protocol.safekeeper import AppendRequest, AppendResponse, encode_message
from safekeeper.node import SafekeeperNode
from safekeeper.testing import TestProposer, running_node, synthetic_wal
from tests.auth_helpers import AuthKit
from tests.safekeeper.test_node_inprocess import TENANT, TIMELINE


@pytest.fixture(params=["trust", "jwt"])
def auth(request: pytest.FixtureRequest, tmp_path: Path) -> AuthKit | None:
    """Every case runs with and without auth on (the default of a cluster)."""
    return AuthKit.create(tmp_path / "auth") if request.param == "jwt" else None


@pytest.fixture
async def node(tmp_path: Path, auth: AuthKit | None) -> AsyncIterator[SafekeeperNode]:
    settings = {} if auth is None else {
        "pg_auth_type": "NeonJWT", "auth_validation_public_key_path": str(auth.public_path)}
    async with running_node(tmp_path / "sk", **settings) as sk:
        yield sk


def token(auth: AuthKit | None) -> str | None:
    return None if auth is None else auth.tenant(TENANT)


def _frame(tag: bytes, body: bytes) -> bytes:
    return tag + struct.pack("!I", len(body) + 4) + body


BAD_TAILS = {
    "oversized CopyData length": b"d" + struct.pack("!I", 0x7FFF_FFF0) + b"\0" * 64,
    "CopyData length below 4": b"d" + struct.pack("!I", 2) + b"\0" * 64,
    "a Query in the middle of COPY": _frame(b"Q", b"SELECT 1\0"),
    "an unknown tag": b"\xfe" + struct.pack("!I", 8) + b"\0" * 4,
}


@pytest.mark.parametrize("tail", list(BAD_TAILS), ids=list(BAD_TAILS))
async def test_bad_framing_after_valid_appends_ends_only_that_connection(
    node: SafekeeperNode, tail: str, auth: AuthKit | None
) -> None:
    assert node.pg_port is not None
    start = Lsn(WAL_SEGMENT_SIZE)
    wal = synthetic_wal(start, 64 * 1024)
    with trio.fail_after(30):
        async with await TestProposer.connect("127.0.0.1", node.pg_port, TENANT, TIMELINE,
                                                  password=token(auth)) as p:
            await p.greet()
            await p.elect(start)
            # Valid appends and the hostile bytes in one send: they share a receive array.
            raw = b""
            pos = start
            for k in range(0, len(wal), 8192):
                chunk = wal[k : k + 8192]
                req = AppendRequest(p.term, pos, Lsn(pos + len(chunk)), start, start, chunk)
                raw += _frame(b"d", encode_message(req, p.version))
                pos = Lsn(pos + len(chunk))
            await p.conn.send_bytes(raw + BAD_TAILS[tail])
            with pytest.raises(PgError) as info:
                while True:
                    msg = await p.receive()
                    assert isinstance(msg, AppendResponse) and msg.flush_lsn <= pos
            assert info.value.sqlstate == "08P01"
        # The node goes on: a new proposer continues from what was acknowledged.
        async with await TestProposer.connect("127.0.0.1", node.pg_port, TENANT, TIMELINE,
                                                  password=token(auth)) as q:
            await q.greet()
            begin = await q.elect(start)
            assert start <= begin <= pos
            more = synthetic_wal(begin, 16384)
            end = await q.append_many(begin, [more])
            assert (await q.wait_flush(end)).flush_lsn == end


async def test_header_cut_at_eof_closes_cleanly(node: SafekeeperNode, auth: AuthKit | None) -> None:
    assert node.pg_port is not None
    start = Lsn(WAL_SEGMENT_SIZE)
    with trio.fail_after(30):
        async with await TestProposer.connect("127.0.0.1", node.pg_port, TENANT, TIMELINE,
                                                  password=token(auth)) as p:
            await p.greet()
            await p.elect(start)
            await p.conn.send_bytes(b"d\0\0")
            await p.conn.transport.send_eof()  # type: ignore[attr-defined]
            with pytest.raises(PgError, match="middle of a message"):
                await p.receive()
        async with await TestProposer.connect("127.0.0.1", node.pg_port, TENANT, TIMELINE,
                                                  password=token(auth)) as q:
            await q.greet()
            begin = await q.elect(start)
            wal = synthetic_wal(begin, 8192)
            end = await q.append_many(begin, [wal])
            assert (await q.wait_flush(end)).flush_lsn == end
