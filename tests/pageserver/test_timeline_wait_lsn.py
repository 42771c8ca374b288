"""A WAL wait that ends without its LSN (timed out, cancelled) leaves nothing behind.

``Timeline.wait_lsn`` parks each waiter in a heap ordered by LSN that ``finish_write`` pops as
WAL arrives. A request for an LSN that never comes (a client's ``0xFFFF…`` request LSN) must not
leave its entry there after it gave up: with one entry per timed-out request the heap would grow
for the timeline's life. A waiter whose LSN does arrive is still woken, and the ones that gave up
beside it do not disturb the order of the others.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import trio

from pageserver.timeline import LsnTimeoutError
from protocol.lsn import Lsn
from tests.pageserver.test_timeline_get_page import _layered_timeline


async def test_timed_out_and_cancelled_waiters_leave_the_heap(tmp_path: Path) -> None:
    tenant, tl = await _layered_timeline(tmp_path, False)
    try:
        never = Lsn(0xFFFF_FFFF_FFFF_FFFF)
        for _ in range(20):
            with pytest.raises(LsnTimeoutError):
                await tl.wait_lsn(never, 0.001)
        assert tl._waiters == []

        with trio.move_on_after(0.01):
            await tl.wait_lsn(never, 60.0)
        assert tl._waiters == []

        # waiters that arrive, between ones that give up, are still woken in LSN order
        base = tl.last_record_lsn
        woken: list[int] = []
        gave_up: list[int] = []

        async def wait_for(n: int, timeout: float) -> None:
            try:
                await tl.wait_lsn(Lsn(base + 8 * n), timeout)
                woken.append(n)
            except LsnTimeoutError:
                gave_up.append(n)

        async with trio.open_nursery() as nursery:
            for n in range(1, 7):
                nursery.start_soon(wait_for, n, 0.005 if n % 2 else 30.0)
            await trio.sleep(0.05)  # the odd ones time out
            assert sorted(gave_up) == [1, 3, 5]
            assert len(tl._waiters) == 3
            tl.finish_write(Lsn(base + 8 * 4))
            await trio.sleep(0.01)
            assert sorted(woken) == [2, 4]
            tl.finish_write(Lsn(base + 8 * 6))
        assert sorted(woken) == [2, 4, 6]
        assert tl._waiters == []
    finally:
        await tenant.shutdown()
