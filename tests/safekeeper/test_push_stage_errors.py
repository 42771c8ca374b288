"""The WAL push pipeline ends with the write stage's own error, whatever the reader was doing.

``serve_wal_push`` runs a reader and a write stage in one nursery. When the write stage fails,
closing the queue wakes the reader; neither that wake-up (a ``BrokenResourceError``) nor the
cancellation it causes may replace the write stage's error, which decides how the connection
ends (FATAL with its SQLSTATE). The fake timeline fails with the reader blocked on a full queue
(deterministic) or while it is still receiving (repeated). The race of the channel's
``aclose()`` checkpoint with the reader's error depends on trio's run order and on threads;
``test_write_errors.py``'s node test reached it under load (4 in 150 runs before the fix)."""

from __future__ import annotations

from typing import Any

import pytest
import trio
import trio.testing

from protocol.ids import TenantId, TimelineId
from protocol.lsn import INVALID_LSN, WAL_SEGMENT_SIZE, Lsn
from protocol.safekeeper import AppendRequest, ProposerGreeting, ProposerMessage, encode_message
from protocol.wal.errors import InvalidWal
from safekeeper.receive_wal import IngestConfig, serve_wal_push
from safekeeper.wal_storage import WalStorageBroken

TENANT = TenantId(bytes(range(16)))
TIMELINE = TimelineId(bytes(range(16, 32)))


class EndlessPush:
    """A proposer's copy stream that never runs dry: the greeting, then AppendRequests."""

    def __init__(self) -> None:
        self.greeted = False
        self.lsn = Lsn(WAL_SEGMENT_SIZE)

    def _next(self) -> bytes:
        if not self.greeted:
            self.greeted = True
            msg: ProposerMessage = ProposerGreeting(TENANT, TIMELINE, 150000, 1, WAL_SEGMENT_SIZE)
        else:
            msg = AppendRequest(1, self.lsn, Lsn(self.lsn + 8), INVALID_LSN, INVALID_LSN, bytes(8))
            self.lsn = Lsn(self.lsn + 8)
        return encode_message(msg, 3)

    async def receive(self) -> bytes:
        await trio.lowlevel.checkpoint()
        return self._next()

    def receive_nowait(self) -> bytes:
        return self._next()

    async def send_many(self, payloads: Any) -> None:
        list(payloads)
        await trio.lowlevel.checkpoint()


class FailingTimeline:
    """Answers the greeting; fails the first write group, with ``reader_blocked`` once the
    reader waits for room in the queue, else while it is still receiving (runnable)."""

    def __init__(self, error: Exception, reader_blocked: bool) -> None:
        self.error = error
        self.reader_blocked = reader_blocked
        self.push_connections = 0

    async def process_batch(self, batch: list[ProposerMessage]) -> tuple[list[Any], Exception | None]:
        if isinstance(batch[0], ProposerGreeting):
            return [], None
        if self.reader_blocked:
            await trio.testing.wait_all_tasks_blocked()
        else:
            await trio.lowlevel.checkpoint()
        return [], self.error


@pytest.mark.parametrize(
    "error",
    [WalStorageBroken("writing WAL failed: EIO"), InvalidWal("bad record"), RuntimeError("bug")],
    ids=["broken", "invalid", "other"],
)
@pytest.mark.parametrize("reader_blocked", [True, False], ids=["reader-blocked", "reader-running"])
async def test_the_write_stages_error_ends_the_push(error: Exception, reader_blocked: bool) -> None:
    timeline = FailingTimeline(error, reader_blocked)

    async def get_timeline(tenant: TenantId, tl: TimelineId, create: bool) -> Any:
        return timeline

    cfg = IngestConfig(ingest_queue=1 if reader_blocked else 4096, max_write_bytes=0,
                       ingest_queue_bytes=1 << 30)
    for _ in range(1 if reader_blocked else 10):
        with trio.fail_after(10), pytest.raises(type(error)) as info:
            await serve_wal_push(EndlessPush(), 3, (TENANT, TIMELINE), get_timeline, True, cfg)  # type: ignore[arg-type]
        assert info.value is error
        assert timeline.push_connections == 0
