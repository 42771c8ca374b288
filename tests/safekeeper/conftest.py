"""Fixtures for the safekeeper tests: real PostgreSQL 15 WAL, made once per session; and the
harness of the ingest loop's write stage (``_write_stage``) that the pipelining tests share:
an elected timeline, queued AppendRequests and a stand-in connection that records each
acknowledgement with what the test had observed at that moment."""

from __future__ import annotations

import os
import re
import shutil
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Generic, TypeVar

import attrs
import pytest
import trio

from compute.postgres import PostgresInstance, pg_binary, run_as_postgres
from protocol.errors import RemoteProtocolError
from protocol.ids import TenantId, TimelineId
from protocol.lsn import INVALID_LSN, WAL_SEGMENT_SIZE, Lsn, parse_lsn, segment_file_name
from protocol.safekeeper import (
    AppendRequest,
    AppendResponse,
    ProposerElected,
    ProposerGreeting,
    ProposerMessage,
    TermSwitchEntry,
    VoteRequest,
    decode_acceptor_message,
)
from safekeeper.timeline import Timeline
from safekeeper.wal_io import WalIoEngine

T = TypeVar("T")


@attrs.frozen
class RealWal:
    """WAL bytes from ``start`` (a segment start) to ``end`` (end of the last record)."""

    start: Lsn
    end: Lsn
    data: bytes
    record_starts: tuple[Lsn, ...]
    system_id: int


@pytest.fixture(scope="session")
def real_wal() -> Iterator[RealWal]:
    base = Path(tempfile.mkdtemp(prefix="pagestore-sk-wal-", dir="/tmp"))
    os.chmod(base, 0o755)
    try:
        pg = PostgresInstance.create(base / "pg", {"wal_keep_size": "1GB"})
        pg.start()
        try:
            pg.psql(
                "create table t(a int, b text);"
                "insert into t select g, repeat('x', g % 700) from generate_series(1, 40000) g;"
                "select pg_switch_wal();"
                "insert into t values (1, 'after switch');"
            )
        finally:
            pg.stop()
        wal_dir = pg.wal_dir()
        out = run_as_postgres(
            [pg_binary("pg_waldump"), "-p", str(wal_dir), "-s", "0/1000028"], check=False
        ).stdout.decode()
        starts = tuple(parse_lsn(m) for m in re.findall(r"lsn: ([0-9A-F]+/[0-9A-F]+),", out))
        ctl = run_as_postgres([pg_binary("pg_controldata"), str(pg.datadir)]).stdout.decode()
        system_id = int(re.search(r"Database system identifier:\s+(\d+)", ctl).group(1))  # type: ignore[union-attr]
        # The end of WAL is the end of the last record: the shutdown checkpoint (114 bytes).
        last = starts[-1]
        data = bytearray()
        segno = 1
        while segno * WAL_SEGMENT_SIZE <= last:
            data += (wal_dir / segment_file_name(segno)).read_bytes()
            segno += 1
        end = Lsn((last + 114 + 7) & ~7)
        yield RealWal(
            start=Lsn(WAL_SEGMENT_SIZE),
            end=end,
            data=bytes(data[: end - WAL_SEGMENT_SIZE]),
            record_starts=starts,
            system_id=system_id,
        )
    finally:
        shutil.rmtree(base, ignore_errors=True)


# -- the write stage's harness -------------------------------------------------------------

TENANT = TenantId(bytes(range(16)))
TIMELINE = TimelineId(bytes(range(16, 32)))
# Where the harness's timelines are elected: mid-segment, so the first segment's headers
# are written too.
START = Lsn(WAL_SEGMENT_SIZE + 40)
SYSTEM_ID = 7


async def elected_timeline(
    directory: Path, *, no_sync: bool = False, wal_io_engine: WalIoEngine = "writer-thread",
    start: Lsn = START,
) -> Timeline:
    """A new timeline in ``directory``, greeted and elected in term 1 at ``start``."""
    tl = Timeline.create(
        directory, 1, TENANT, TIMELINE, no_sync=no_sync, wal_io_engine=wal_io_engine
    )
    greeting = ProposerGreeting(
        tenant_id=TENANT, timeline_id=TIMELINE, pg_version=150000, system_id=SYSTEM_ID,
        wal_seg_size=WAL_SEGMENT_SIZE,
    )
    elected = ProposerElected(1, start, (TermSwitchEntry(1, start),))
    _, error = await tl.process_batch([greeting, VoteRequest(1), elected])
    assert error is None
    return tl


def queued_appends(
    wal: bytes, piece: int, groups: int
) -> tuple[
    trio.MemorySendChannel[ProposerMessage | RemoteProtocolError],
    trio.MemoryReceiveChannel[ProposerMessage | RemoteProtocolError],
]:
    """A channel holding ``groups`` consecutive AppendRequests of ``piece`` bytes of ``wal``
    (WAL from ``START``), as the reader stage would have queued them; close the send side to
    end the stream."""
    send, receive = trio.open_memory_channel[ProposerMessage | RemoteProtocolError](groups + 1)
    for k in range(groups):
        begin = Lsn(START + k * piece)
        chunk = wal[k * piece : (k + 1) * piece]
        send.send_nowait(
            AppendRequest(1, begin, Lsn(begin + len(chunk)), INVALID_LSN, INVALID_LSN, chunk)
        )
    return send, receive


class AckRecorder(Generic[T]):
    """Stands in for the connection in ``_write_stage``: every AppendResponse sent is kept
    as ``(flush_lsn, snapshot())``, where ``snapshot`` copies what the test observed so far
    (the groups written, the fdatasyncs finished) at the moment the reply left. ``sent`` is
    set at each reply, so a test can wait for the next one instead of sleeping."""

    def __init__(self, snapshot: Callable[[], list[T]]) -> None:
        self.snapshot = snapshot
        self.acks: list[tuple[Lsn, list[T]]] = []
        self.sent = trio.Event()

    async def send_many(self, payloads: list[bytes]) -> None:
        for payload in payloads:
            msg = decode_acceptor_message(payload, 3)
            assert isinstance(msg, AppendResponse)
            self.acks.append((msg.flush_lsn, self.snapshot()))
        self.sent.set()
        self.sent = trio.Event()


async def wait_until(condition: Callable[[], bool]) -> None:
    """Wait for ``condition()`` to hold, looking again every few milliseconds (the caller
    bounds the wait with ``trio.fail_after``): a wait for what the test needs to see, never
    a guessed sleep before an assertion."""
    while not condition():
        await trio.sleep(0.005)


@pytest.fixture
def refuse_direct_io(monkeypatch: pytest.MonkeyPatch) -> None:
    """A filesystem that refuses O_DIRECT: every ``os.open`` asking for it fails with EINVAL,
    as tmpfs did before Linux 6.6."""
    real_open = os.open

    def no_direct(path: str | os.PathLike[str], flags: int, *args: int) -> int:
        if flags & os.O_DIRECT:
            raise OSError(22, "Invalid argument")
        return real_open(path, flags, *args)

    monkeypatch.setattr(os, "open", no_direct)
