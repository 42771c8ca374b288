"""The safekeeper as a real process: real WAL in, pg_waldump / pg_receivewal out, kill -9."""

from __future__ import annotations

import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
import trio

from compute.postgres import pg_binary
from protocol.ids import TenantId, TimelineId
from protocol.lsn import WAL_SEGMENT_SIZE, Lsn, format_lsn, parse_lsn, segment_file_name
from protocol.pgwire.errors import PgError
from safekeeper.testing import SafekeeperProcess, TestProposer, synthetic_wal
from tests.safekeeper.conftest import RealWal

pytestmark = pytest.mark.postgres

TENANT = TenantId(bytes.fromhex("11" * 16))
TIMELINE = TimelineId(bytes.fromhex("22" * 16))
SEG = WAL_SEGMENT_SIZE


@pytest.fixture
def sk(pg_tmp_path: Path) -> Iterator[SafekeeperProcess]:
    proc = SafekeeperProcess(pg_tmp_path / "sk")
    proc.start(timeout=90)  # a loaded machine imports slowly
    try:
        yield proc
    finally:
        proc.kill()


def waldump(directory: Path, start: Lsn, end: Lsn) -> str:
    proc = subprocess.run(
        [pg_binary("pg_waldump"), "-p", str(directory), "-s", format_lsn(start), "-e", format_lsn(end)],
        capture_output=True,
        check=False,
    )
    return proc.stdout.decode()


async def commit_all(p: TestProposer, end: Lsn) -> None:
    await p.append(end, b"", commit_lsn=end)
    resp = await p.wait_flush(end)
    while resp.commit_lsn < end:
        resp = await p.wait_flush(end)


async def test_real_wal_readable_by_pg_waldump_and_pg_receivewal(
    sk: SafekeeperProcess, real_wal: RealWal, pg_tmp_path: Path
) -> None:
    target = pg_tmp_path / "received"
    target.mkdir()
    conninfo = (
        f"host=127.0.0.1 port={sk.pg_port} user=postgres "
        f"options='-c tenant_id={TENANT} timeline_id={TIMELINE}'"
    )
    data = real_wal.data
    chunk = 128 * 1024
    received: subprocess.CompletedProcess[bytes] | None = None

    def receivewal() -> None:
        nonlocal received
        received = subprocess.run(
            [pg_binary("pg_receivewal"), "-D", str(target), "-d", conninfo, "--no-loop", "-n",
             "-E", format_lsn(real_wal.end - 1)],
            capture_output=True,
            timeout=60,
            check=False,
        )

    with trio.fail_after(90):
        async with await TestProposer.connect("127.0.0.1", sk.pg_port, TENANT, TIMELINE) as p:
            await p.greet(system_id=real_wal.system_id)
            assert await p.elect(real_wal.start) == real_wal.start
            # Commit the first MiB, so pg_receivewal starts streaming at segment 1 ...
            split = next(s for s in real_wal.record_starts if s > real_wal.start + (1 << 20) and s % 8192 > 40)
            head = data[: split - real_wal.start]
            first = await p.append_many(real_wal.start, [head[i : i + chunk] for i in range(0, len(head), chunk)])
            await commit_all(p, first)
            async with trio.open_nursery() as nursery:
                nursery.start_soon(trio.to_thread.run_sync, receivewal)
                # ... and receives the rest live, as it is committed.
                rest = data[first - real_wal.start :]
                end = await p.append_many(first, [rest[i : i + chunk] for i in range(0, len(rest), chunk)])
                await commit_all(p, end)
    assert end == real_wal.end
    status = sk.timeline_status(TENANT, TIMELINE)
    assert parse_lsn(status["flush_lsn"]) == end
    assert parse_lsn(status["commit_lsn"]) == end
    assert status["system_id"] == real_wal.system_id

    tl_dir = sk.timeline_dir(TENANT, TIMELINE)
    names = sorted(p.name for p in tl_dir.iterdir() if p.name.startswith("0000"))
    assert names == [segment_file_name(1), segment_file_name(2), segment_file_name(3) + ".partial"]
    # pg_waldump reads the safekeeper's files (the open one under its plain name).
    view = pg_tmp_path / "view"
    view.mkdir()
    for name in names:
        shutil.copy(tl_dir / name, view / name.removesuffix(".partial"))
    source = pg_tmp_path / "source"
    source.mkdir()
    for segno in (1, 2, 3):
        piece = data[(segno - 1) * SEG : segno * SEG]
        (source / segment_file_name(segno)).write_bytes(piece + bytes(SEG - len(piece)))
    first_record = Lsn(real_wal.start + 40)
    ours = waldump(view, first_record, end)
    assert ours.count("rmgr:") == len(real_wal.record_starts)
    assert ours == waldump(source, first_record, end)

    # pg_receivewal got byte-identical segments.
    assert received is not None
    assert received.returncode == 0, received.stderr.decode()
    assert sorted(p.name for p in target.iterdir()) == names
    for name in names:
        assert (target / name).read_bytes() == (tl_dir / name).read_bytes(), name


async def test_kill9_keeps_acknowledged_wal(pg_tmp_path: Path) -> None:
    sk = SafekeeperProcess(pg_tmp_path / "sk", no_sync=False)
    sk.start(timeout=90)
    try:
        start = Lsn(SEG + 0x28)
        wal = synthetic_wal(start, 6 * 1024 * 1024, record_size=500)
        with trio.fail_after(60):
            async with await TestProposer.connect("127.0.0.1", sk.pg_port, TENANT, TIMELINE) as p:
                await p.greet(system_id=5)
                await p.elect(start)
                chunks = [wal[i : i + 32768] for i in range(0, len(wal), 32768)]
                half = len(chunks) // 2
                mid = await p.append_many(start, chunks[:half])
                # flush_lsn is record-aligned: the last record before ``mid`` ends within 1 KiB.
                acked = (await p.wait_flush(Lsn(mid - 1024))).flush_lsn
                # More WAL in flight, then kill -9 right after an acknowledgement.
                await p.append_many(mid, chunks[half:])
                acked = max(acked, (await p.wait_flush(Lsn(mid + 1))).flush_lsn)
                sk.kill()
        assert acked > mid
        sk.start(timeout=90)
        status = sk.timeline_status(TENANT, TIMELINE)
        flush = parse_lsn(status["flush_lsn"])
        assert flush >= acked
        tl_dir = sk.timeline_dir(TENANT, TIMELINE)
        seg = (tl_dir / (segment_file_name(1) + ".partial")).read_bytes()
        assert seg[start - SEG : acked - SEG] == wal[: acked - start]
        # A proposer learns the durable position from the vote.
        with trio.fail_after(30):
            async with await TestProposer.connect("127.0.0.1", sk.pg_port, TENANT, TIMELINE) as p:
                await p.greet(system_id=5)
                vote = await p.vote(p.term + 1)
                assert vote.flush_lsn == flush
                assert vote.term_history[0].lsn == start
        assert sk.stop(timeout=60) == 0
    finally:
        sk.kill()


async def test_hostile_bytes_end_only_their_connection(sk: SafekeeperProcess) -> None:
    start = Lsn(SEG)
    wal = synthetic_wal(start, 64 * 1024)
    with trio.fail_after(60):
        async with await TestProposer.connect("127.0.0.1", sk.pg_port, TENANT, TIMELINE) as p:
            await p.greet()
            await p.elect(start)
            end = await p.append_many(start, [wal])
            await p.wait_flush(end)
            for hostile in (b"\xff garbage", b"a" + bytes(10)):
                async with await TestProposer.connect(
                    "127.0.0.1", sk.pg_port, TENANT, TIMELINE
                ) as bad:
                    await bad.greet()
                    await bad.copy.send(hostile)
                    with pytest.raises(PgError) as info:
                        await bad.receive()
                    assert info.value.sqlstate == "XX000"
            more = synthetic_wal(end, 8192)
            end2 = await p.append_many(end, [more])
            assert (await p.wait_flush(end2)).flush_lsn == end2
    assert parse_lsn(sk.timeline_status(TENANT, TIMELINE)["flush_lsn"]) == end2
