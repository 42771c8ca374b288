"""The safekeeper's WAL IO engines (``safekeeper.wal_io``) and the ingest loop on them: calls
run in submission order, one at a time, off the event loop's thread; results and errors
reach the waiter; with the writer thread the ingest loop checks and submits the next group
while a write is still running, yet acknowledges a group only after its write returned."""

from __future__ import annotations

import argparse
import sys
import threading
from pathlib import Path

import pytest
import trio
import trio.testing

import safekeeper.node
import safekeeper.wal_io
from protocol.lsn import Lsn
from safekeeper.config import ConfigError, parse_config
from safekeeper.receive_wal import SYNCS_IN_FLIGHT, _ByteBudget, _write_stage
from safekeeper.testing import synthetic_wal
from safekeeper.wal_io import ENGINES, Job, WalIo, WalIoEngine
from safekeeper.wal_storage import TrackedGroup
from tests.safekeeper.conftest import (
    START,
    SYSTEM_ID,
    AckRecorder,
    elected_timeline,
    queued_appends,
    wait_until,
)


@pytest.mark.parametrize("engine", ENGINES)
async def test_calls_run_in_order_one_at_a_time_off_the_loop_thread(engine: WalIoEngine) -> None:
    io = WalIo(engine)
    loop_thread = threading.get_ident()
    running = 0
    overlap = False
    order: list[int] = []
    threads: set[int] = set()

    def call(k: int) -> int:
        nonlocal running, overlap
        running += 1
        overlap = overlap or running > 1
        threads.add(threading.get_ident())
        order.append(k)
        running -= 1
        return k * k

    jobs = [await io.submit(call, k) for k in range(200)]
    assert [await job.wait() for job in jobs] == [k * k for k in range(200)]
    assert order == list(range(200))
    assert not overlap
    assert loop_thread not in threads
    if engine == "writer-thread":
        assert len(threads) == 1  # one persistent thread, not one per call


@pytest.mark.parametrize("engine", ENGINES)
async def test_an_error_reaches_the_waiter_and_later_calls_still_run(engine: WalIoEngine) -> None:
    io = WalIo(engine)

    def fail() -> None:
        raise OSError(5, "Input/output error")

    bad = await io.submit(fail)
    good = await io.submit(lambda: "after")
    with pytest.raises(OSError, match="Input/output error"):
        await bad.wait()
    with pytest.raises(OSError):  # asked again: the same error
        await bad.wait()
    assert await good.wait() == "after"


async def test_the_writer_thread_does_not_block_the_submitter_and_waiting_is_not_cancellable() -> None:
    io = WalIo("writer-thread")
    gate = threading.Event()
    done: list[str] = []

    def slow() -> str:
        assert gate.wait(10)
        done.append("slow")
        return "slow"

    job = await io.submit(slow)  # returns while the call is blocked
    assert not job.done
    with trio.move_on_after(0.05) as scope:
        scope.cancel()
        trio.lowlevel.current_trio_token().run_sync_soon(gate.set)
        # Cancelled before it waits, yet it waits for the call to end (as to_thread does).
        assert await job.wait() == "slow"
    assert done == ["slow"]


async def test_an_idle_writer_thread_exits_and_the_next_call_starts_another(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(safekeeper.wal_io, "IDLE_EXIT_S", 0.05)
    io = WalIo("writer-thread")
    assert await io.run(threading.current_thread) is not threading.current_thread()
    with trio.fail_after(10):
        while io.has_thread():
            await trio.sleep(0.02)
    # The thread is gone; the next call starts a new one and runs.
    second = await io.run(threading.current_thread)
    assert io.has_thread() and second.is_alive() and second.name == "wal-writer"


def test_the_engine_is_a_config_with_a_default() -> None:
    assert parse_config({"data_dir": "/x"}).wal_io_engine == "writer-thread"
    assert parse_config({"data_dir": "/x", "wal_io_engine": "threadpool"}).wal_io_engine == "threadpool"
    with pytest.raises(ConfigError, match="wal_io_engine"):
        parse_config({"data_dir": "/x", "wal_io_engine": "io_uring"})
    with pytest.raises(ValueError, match="wal_io_engine"):
        WalIo("io_uring")  # type: ignore[arg-type]


def test_a_completed_job_is_done() -> None:
    job = Job.completed(7)
    assert job.done


async def test_no_fsync_ingest_submits_the_next_group_while_a_write_runs_but_acks_after_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """fsync off, writer thread: group 1's write is held; group 2 is checked and submitted
    meanwhile (the pipelining), nothing is acknowledged until group 1's write returned, and
    every acknowledgement covers only groups whose write returned."""
    tl = await elected_timeline(tmp_path / "tl", no_sync=True, wal_io_engine="writer-thread")

    gate = threading.Event()
    written: list[Lsn] = []  # group end LSNs whose write returned
    real_write = tl.storage.write_tracked

    def held_first_write(begin: Lsn, group: TrackedGroup) -> None:
        if not written:
            assert gate.wait(10)
        real_write(begin, group)
        written.append(tl.storage.write_lsn)

    monkeypatch.setattr(tl.storage, "write_tracked", held_first_write)

    recorder = AckRecorder(lambda: list(written))
    piece = 65536
    groups = 4
    wal = synthetic_wal(START, groups * piece, system_id=SYSTEM_ID)
    send, receive = queued_appends(wal, piece, groups)
    with trio.fail_after(20):
        async with trio.open_nursery() as nursery:
            # max_write_bytes = one message: every message is its own group.
            nursery.start_soon(
                _write_stage, recorder, receive, tl, 3, piece, _ByteBudget(1 << 30)  # type: ignore[arg-type]
            )
            await wait_until(lambda: tl.stats.groups >= SYNCS_IN_FLIGHT + 1)
            # Once every task waits (the write stage on group 1's held write), groups 2 and
            # 3 were checked and submitted while group 1's write is still held (two groups
            # pending, and the next one submitted before the loop waits for the oldest);
            # group 4 waits.
            await trio.testing.wait_all_tasks_blocked(0.05)
            assert tl.stats.groups == SYNCS_IN_FLIGHT + 1
            assert written == [] and recorder.acks == []
            gate.set()
            await send.aclose()
    acks = recorder.acks
    assert len(written) == groups
    assert [f for f, _ in acks] == sorted(f for f, _ in acks)
    for flush, done in acks:
        assert done and flush <= done[-1], f"ack at {flush:X} before its group was written"
    assert acks[-1][0] == tl.acceptor.flush_lsn > START
    assert tl.storage.read(START, groups * piece) == wal[: groups * piece]


def test_the_gil_switch_interval_is_a_config_the_node_applies(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    assert parse_config({"data_dir": "/x"}).gil_switch_interval_s == 0.0005
    assert parse_config({"data_dir": "/x", "gil_switch_interval_s": 0.005}).gil_switch_interval_s == 0.005
    for bad in (0, -0.001, 1e-7, 2.0, 1e300):
        with pytest.raises(ConfigError, match="gil_switch_interval_s"):
            parse_config({"data_dir": "/x", "gil_switch_interval_s": bad})

    # The node's process sets it before its event loop starts.
    config = tmp_path / "sk.toml"
    config.write_text(f'data_dir = "{tmp_path / "data"}"\ngil_switch_interval_s = 0.002\n')
    applied: list[float] = []
    monkeypatch.setattr(sys, "setswitchinterval", applied.append)
    monkeypatch.setattr(trio, "run", lambda *_a, **_k: applied.append(-1.0))
    assert safekeeper.node.run(argparse.Namespace(config=config)) == 0
    assert applied == [0.002, -1.0]
