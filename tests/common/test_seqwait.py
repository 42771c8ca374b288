"""SeqWait: many waiters, wake-ups in order, timeouts, cancellation tombstones, shutdown."""

from __future__ import annotations

import pytest
import trio
import trio.testing
from hypothesis import given
from hypothesis import strategies as st

from common.seqwait import SeqWait, SeqWaitShutdown, SeqWaitTimeout


async def test_wakes_exactly_the_waiters_at_or_below() -> None:
    sw = SeqWait(10)
    woke: list[tuple[int, int]] = []

    async def waiter(target: int) -> None:
        woke.append((target, await sw.wait_for(target)))

    async with trio.open_nursery() as nursery:
        for target in (5, 10, 20, 30, 25, 40):
            nursery.start_soon(waiter, target)
        await trio.testing.wait_all_tasks_blocked()
        assert sorted(woke) == [(5, 10), (10, 10)]  # already satisfied
        assert sw.waiters == 4
        sw.advance(25)
        await trio.testing.wait_all_tasks_blocked()
        assert sorted(t for t, _ in woke) == [5, 10, 20, 25]
        assert all(v == 25 for t, v in woke if t > 10)
        sw.advance(25)  # equal is fine
        sw.advance(100)
    assert sorted(t for t, _ in woke) == [5, 10, 20, 25, 30, 40]
    assert sw.waiters == 0


async def test_timeout_names_target_and_current(autojump_clock: trio.testing.MockClock) -> None:
    sw = SeqWait(0x16, what="last_record_lsn")
    with pytest.raises(SeqWaitTimeout, match=r"last_record_lsn 0/100 \(current 0/16\)") as info:
        await sw.wait_for(0x100, timeout_s=1.5)
    assert info.value.timeout_s == 1.5
    assert sw.waiters == 0


async def test_backwards_is_refused() -> None:
    sw = SeqWait(5)
    with pytest.raises(ValueError, match="backwards"):
        sw.advance(4)


async def test_cancelled_waiters_leave_purgeable_tombstones() -> None:
    sw = SeqWait(0)
    async with trio.open_nursery() as nursery:
        for i in range(200):
            nursery.start_soon(sw.wait_for, 1000 + i)
        await trio.testing.wait_all_tasks_blocked()
        assert sw.waiters == 200
        nursery.cancel_scope.cancel()
    assert sw.waiters == 0
    assert len(sw._heap) <= 64 + 1


async def test_shutdown_wakes_everyone_with_an_error() -> None:
    sw = SeqWait(0)
    errors: list[BaseException] = []

    async def waiter() -> None:
        try:
            await sw.wait_for(10)
        except SeqWaitShutdown as exc:
            errors.append(exc)

    async with trio.open_nursery() as nursery:
        for _ in range(3):
            nursery.start_soon(waiter)
        await trio.testing.wait_all_tasks_blocked()
        sw.shutdown()
    assert len(errors) == 3
    with pytest.raises(SeqWaitShutdown):
        await sw.wait_for(0)


@given(st.lists(st.integers(0, 50), min_size=1, max_size=20), st.lists(st.integers(0, 60), max_size=10))
def test_property_every_satisfied_waiter_wakes(targets: list[int], advances: list[int]) -> None:
    async def main() -> None:
        sw = SeqWait(0)
        done: set[int] = set()

        async def waiter(i: int, target: int) -> None:
            await sw.wait_for(target)
            done.add(i)

        async with trio.open_nursery() as nursery:
            for i, t in enumerate(targets):
                nursery.start_soon(waiter, i, t)
            value = 0
            for a in advances:
                value = max(value, a)
                sw.advance(value)
                await trio.testing.wait_all_tasks_blocked()
                assert done == {i for i, t in enumerate(targets) if t <= value}
            nursery.cancel_scope.cancel()

    trio.run(main)
