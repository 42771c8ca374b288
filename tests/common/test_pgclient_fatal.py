"""Our libpq client after a FATAL error: the session is over, so the client closes its side at
once (a server lingering for our EOF is not kept waiting) and sends no Terminate."""

from __future__ import annotations

import pytest
import trio
import trio.testing

from common.pgclient import PgClientConnection
from protocol.pgwire import messages as m
from protocol.pgwire.errors import PgError

FATAL = m.ErrorResponse.build("terminating connection", "57P01", severity="FATAL")


async def _read_until_eof(stream: trio.abc.ReceiveStream) -> bytes:
    got = bytearray()
    while chunk := await stream.receive_some(65536):
        got += chunk
    return bytes(got)


@pytest.mark.parametrize("severity", ["FATAL", "PANIC", "ERROR"])
async def test_a_fatal_error_closes_the_client_side_before_aclose(severity: str) -> None:
    client_stream, server_stream = trio.testing.memory_stream_pair()
    conn = PgClientConnection(client_stream, 1 << 20)
    replies: list[m.Message] = [m.ErrorResponse.build("boom", "57P01", severity=severity)]
    if severity == "ERROR":
        replies.append(m.ReadyForQuery("I"))  # the session goes on

    async def server() -> bytes:
        await server_stream.receive_some(65536)  # the Query
        await server_stream.send_all(m.encode(*replies))
        with trio.fail_after(5):
            return await _read_until_eof(server_stream)

    async with trio.open_nursery() as nursery:
        seen: list[bytes] = []

        async def run_server() -> None:
            seen.append(await server())

        nursery.start_soon(run_server)
        with pytest.raises(PgError) as info:
            await conn.execute("SELECT 1")
        assert info.value.severity == severity
        if severity == "ERROR":
            # The session goes on: nothing closed, the next aclose() sends Terminate.
            await trio.testing.wait_all_tasks_blocked()
            assert not seen
            await conn.aclose()
    if severity == "ERROR":
        assert seen == [m.encode(m.Terminate())]
    else:
        # EOF reached the server before any aclose(), and no Terminate was sent.
        assert seen == [b""]
        await conn.aclose()


async def test_a_fatal_error_during_copy_ends_the_session() -> None:
    client_stream, server_stream = trio.testing.memory_stream_pair()
    conn = PgClientConnection(client_stream, 1 << 20)

    async def server() -> None:
        await server_stream.receive_some(65536)  # the Query
        await server_stream.send_all(m.encode(m.CopyBothResponse(), m.CopyData(b"x"), FATAL))
        with trio.fail_after(5):
            rest = await _read_until_eof(server_stream)
        assert m.encode(m.Terminate()) not in rest

    async with trio.open_nursery() as nursery:
        nursery.start_soon(server)
        copy = await conn.copy_both("START_REPLICATION 0/0")
        assert await conn.copy_receive(copy) == b"x"
        with pytest.raises(PgError) as info:
            await conn.copy_receive(copy)
        assert info.value.severity == "FATAL"
        with pytest.raises(trio.BrokenResourceError):
            await conn.finish_copy()
        await conn.aclose()
