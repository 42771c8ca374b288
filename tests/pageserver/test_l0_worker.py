"""The background L0 writer (``pageserver/storage/l0_worker.py``, ``l0_writer = "process"``).

- The worker writes the L0 file the in-process ``write_l0`` writes, byte for byte (random
  layers, a bulk load's shape, values still in the write buffer at the freeze), and a hand-off
  that garbles the index (a mutant of ``iter_index_body``) is caught.
- The index codec round-trips (hypothesis) and refuses bodies that do not add up; a garbled
  answer from the worker is an ``L0WorkerProtocolError`` (XX000).
- The writer's roll returns before the rolled layer's L0 is written; readers read the frozen
  layer meanwhile; the background flush then publishes it (index_part, layer map, LSN); a
  second roll waits for the first flush (one rolled layer in flight).
- Failures: an EIO in the worker, a worker killed mid-job: the flush fails with a clear
  ``L0WorkerError``, the frozen layer stays, nothing advances (in memory or in index_part), no
  temp file is left, and the next flush (on a restarted worker after a kill) writes it.
- No orphans: timeline shutdown stops the worker (also mid-flush), a worker whose pageserver
  goes away exits by itself (idle: EOF; mid-job: its watchdog), one that died while idle is
  replaced at the next job, and the worker runs below the ingest's priority.
"""

from __future__ import annotations

import errno
import json
import os
import random
import signal
import subprocess
import sys
import textwrap
import time
from array import array
from collections.abc import AsyncIterator, Callable, Iterator, Sequence
from contextlib import asynccontextmanager
from pathlib import Path

import attrs
import pytest
import trio
import trio.testing
from hypothesis import given, settings
from hypothesis import strategies as hst

from pageserver.storage import l0_worker
from pageserver.storage.config import StorageConfig
from pageserver.storage.ephemeral_file import EphemeralFile
from pageserver.storage.inmemory_layer import InMemoryLayer, flat_index
from pageserver.storage.io_engine import BlockingIoEngine
from pageserver.storage.key import Key, rel_block_key
from pageserver.storage.l0_worker import (
    L0Worker,
    L0WorkerError,
    L0WorkerProtocolError,
    decode_index,
)
from pageserver.storage.layer_file import WriteOptions
from pageserver.storage.value import Image
from pageserver.tenant import Tenant
from pageserver.timeline import Timeline
from protocol.ids import TenantId, TimelineId
from protocol.lsn import Lsn, format_lsn

Put = tuple[Key, int, bytes, bool]


def k(i: int) -> Key:
    return rel_block_key(1663, 5, 1000, 0, i)


def _random_puts(seed: int) -> list[Put]:
    """Puts in LSN order over a few keys: scattered or in streaks, some replaced (same LSN),
    sizes from empty to bigger than an index block, or nearly all of one size (a bulk load)."""
    rng = random.Random(seed)
    n_keys = rng.randint(1, 40)
    one_size = rng.choice((None, 146))
    puts: list[Put] = []
    lsn = 100
    key = 0
    for _ in range(rng.randint(1, 1500)):
        if rng.randrange(8) == 0:
            key = rng.randrange(n_keys)
        lsn += rng.choice((0, 1, 1, 8))
        size = one_size if one_size is not None and rng.randrange(50) else rng.choice((0, 1, 60, 146, 9000))
        puts.append((k(key), lsn, rng.randbytes(size), rng.random() < 0.3))
    return puts


def _bulk_load_puts() -> list[Put]:
    rng = random.Random(7)
    puts: list[Put] = []
    lsn = 100
    for block in range(1, 40):
        puts.append((k(0), lsn, rng.randbytes(4), True))
        for i in range(60):
            lsn += 1
            puts.append((k(block), lsn, rng.randbytes(146), i == 0))
    return puts


async def _frozen_layer(root: Path, puts: Sequence[Put]) -> InMemoryLayer:
    # double buffering and a small buffer: the last values are still in a buffer when the
    # layer is frozen (the freeze must put them in the file before the hand-off)
    engine = BlockingIoEngine()
    async with trio.open_nursery() as nursery:
        eph = await EphemeralFile.create(engine, root, write_buffer_size=4096, nursery=nursery)
        layer = InMemoryLayer(eph, Lsn(100))
        for key, lsn, blob, will_init in puts:
            await layer.put(key, Lsn(lsn), blob, will_init)
        await layer.freeze(Lsn(puts[-1][1] + 1))
    return layer


async def _both_ways(root: Path, worker: L0Worker, puts: Sequence[Put], n: int) -> None:
    layer = await _frozen_layer(root, puts)
    try:
        inline_dir, worker_dir = root / f"inline-{n}", root / f"worker-{n}"
        inline_dir.mkdir()
        worker_dir.mkdir()
        want = await layer.write_l0(BlockingIoEngine(), inline_dir, WriteOptions(buffer_size=4096))
        got = await worker.write_l0(layer, worker_dir, buffer_size=4096, write_sync_mode="none")
        assert want is not None and got is not None
        assert got.parent == worker_dir and got.name == want.name
        if got.read_bytes() != want.read_bytes():
            raise AssertionError(f"the worker's L0 differs from the inline one ({got.name}, case {n})")
        assert sorted(p.name for p in worker_dir.iterdir()) == [got.name]  # no temp file left
    finally:
        await layer.aclose()


@pytest.mark.parametrize("args", [[], ["--big-layer-path"]])
async def test_the_worker_writes_the_inline_l0_byte_for_byte(tmp_path: Path, args: list[str]) -> None:
    # (inline: the whole-layer path; the worker: the same, or the big-layer path of a 256 MiB
    # layer, read per batch, with small batches)
    worker = L0Worker(worker_args=args)
    try:
        await _both_ways(tmp_path, worker, _bulk_load_puts(), 0)
        for seed in range(1, 16):
            await _both_ways(tmp_path, worker, _random_puts(seed), seed)
        assert worker.starts == 1 and worker.jobs == 16  # one long-lived process
    finally:
        await worker.aclose()


_REAL_BODY = l0_worker.iter_index_body


def _keys_shifted(index: dict[Key, array[int]]) -> Iterator[bytes]:
    """A hand-off bug: each key sent with its neighbour's entries."""
    values = list(index.values())
    return _REAL_BODY(dict(zip(index, values[1:] + values[:1], strict=True)))


def _last_value_cut(index: dict[Key, array[int]]) -> Iterator[bytes]:
    """A hand-off bug: the last value of the last key loses its last byte."""
    last = list(index)[-1]
    entries = array("Q", index[last])
    entries[-1] -= 1
    return _REAL_BODY({**index, last: entries})


@pytest.mark.parametrize("mutant", [_keys_shifted, _last_value_cut])
async def test_a_garbled_hand_off_is_caught(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, mutant: Callable[..., Iterator[bytes]]
) -> None:
    monkeypatch.setattr(l0_worker, "iter_index_body", mutant)
    worker = L0Worker()
    try:
        with pytest.raises((AssertionError, L0WorkerError)):
            await _both_ways(tmp_path, worker, _bulk_load_puts(), 0)
    finally:
        await worker.aclose()


async def test_an_unfrozen_layer_is_refused(tmp_path: Path) -> None:
    engine = BlockingIoEngine()
    eph = await EphemeralFile.create(engine, tmp_path, double_buffering=False)
    layer = InMemoryLayer(eph, Lsn(100))
    await layer.put(k(1), Lsn(101), b"x", True)
    worker = L0Worker()
    try:
        with pytest.raises(AssertionError, match="frozen"):
            await worker.write_l0(layer, tmp_path, buffer_size=4096, write_sync_mode="none")
        assert worker.pid is None  # refused before any process was started
    finally:
        await layer.aclose()
        await worker.aclose()


@settings(max_examples=60, deadline=None)
@given(hst.dictionaries(
    hst.binary(min_size=18, max_size=18),
    hst.lists(hst.tuples(hst.integers(0, 2**64 - 1), hst.integers(0, 2**64 - 1), hst.integers(0, 2**64 - 1)),
              min_size=1, max_size=300),
    max_size=40,
))
def test_the_index_codec_round_trips(raw: dict[bytes, list[tuple[int, int, int]]]) -> None:
    index = {Key(key): array("Q", [x for t in triples for x in t]) for key, triples in raw.items()}
    n_keys, pieces = len(index), list(l0_worker.iter_index_body(index))
    assert decode_index(n_keys, b"".join(pieces)) == flat_index(index)


def _as_dict(flat: tuple[bytes, array[int], array[int]]) -> dict[Key, array[int]]:
    keys, counts, triples = flat
    out, at = {}, 0
    for i, count in enumerate(counts):
        out[Key(keys[18 * i : 18 * (i + 1)])] = triples[at : at + 3 * count]
        at += 3 * count
    return out


@given(hst.binary(max_size=400), hst.integers(0, 20))
def test_a_body_that_does_not_add_up_is_refused(body: bytes, n_keys: int) -> None:
    try:
        index = _as_dict(decode_index(n_keys, body))
    except L0WorkerProtocolError:
        return
    n, pieces = len(index), list(l0_worker.iter_index_body(index))  # what was accepted is a well-formed index
    assert n == n_keys and b"".join(pieces) == body


def test_a_truncated_or_padded_body_is_refused() -> None:
    index = {k(1): array("Q", [1, 2, 3]), k(2): array("Q", [4, 5, 6, 7, 8, 9])}
    n, pieces = len(index), list(l0_worker.iter_index_body(index))
    body = b"".join(pieces)
    for bad in (body[:-8], body + bytes(8), body[:-1]):
        with pytest.raises(L0WorkerProtocolError):
            decode_index(n, bad)
    with pytest.raises(L0WorkerProtocolError, match="repeats a key"):
        decode_index(2, k(1) + k(1) + array("Q", [3, 3]).tobytes() + array("Q", range(6)).tobytes())
    with pytest.raises(L0WorkerProtocolError, match="not triples"):
        decode_index(1, k(1) + array("Q", [2]).tobytes() + array("Q", range(2)).tobytes())


# -- the timeline: roll in the background, failures, shutdown ----------------------------------

CFG = StorageConfig(
    validate_get=True, double_buffering=False, gc_horizon=0, pitr_interval_s=0,
    compaction_period_s=0, gc_period_s=0, checkpoint_distance=64 * 1024,
    l0_writer="process", l0_writer_min_bytes=0,
)
VALUE = 1000  # bytes per image: about 64 per layer


def _index_part(tl: Timeline) -> dict[str, object]:
    data = json.loads((tl.path / "index_part.json").read_bytes())
    assert isinstance(data, dict)
    return data


def _gone(pid: int) -> bool:
    """The process no longer runs (reaped, or a zombie nobody reaped yet whose threads have all
    exited: the worker has a watchdog thread, and until it is gone too the leader shows "Z"
    while ``waitpid`` still says running)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            zombie = f.read().rsplit(")", 1)[1].split()[0] == "Z"
        return zombie and len(os.listdir(f"/proc/{pid}/task")) <= 1
    except FileNotFoundError:
        return True


def _image(lsn: int) -> bytes:
    return lsn.to_bytes(4, "big") * (VALUE // 4)


async def _put(tl: Timeline, lsn: int) -> None:
    await tl.put(k(lsn % 50), Lsn(lsn), Image(_image(lsn)))
    tl.finish_write(Lsn(lsn))


async def _filled(root: Path, worker_args: list[str] | None = None) -> tuple[Tenant, Timeline]:
    """A tenant at ``root`` with one timeline holding 15 images at 0x110..0x1F0 (the open
    layer: nothing flushed), with an L0 worker started with ``worker_args`` if given."""
    tenant = Tenant(root, TenantId.generate(), CFG)
    tl = await tenant.create_timeline(TimelineId.generate())
    if worker_args is not None:
        tl.l0_worker = L0Worker(worker_args=worker_args)
    for lsn in range(0x110, 0x200, 0x10):
        await _put(tl, lsn)
    return tenant, tl


async def _until(cond: Callable[[], bool], what: str, timeout: float = 30.0) -> None:
    with trio.move_on_after(timeout):
        while not cond():
            await trio.sleep(0.02)
        return
    raise AssertionError(f"timed out waiting for {what}")


@asynccontextmanager
async def _background_timeline(root: Path, worker_args: list[str]) -> AsyncIterator[tuple[Tenant, Timeline]]:
    """A tenant whose timeline's rolls flush in the background (a nursery), through a worker
    started with ``worker_args``; the nursery is cancelled on the way out."""
    async with trio.open_nursery() as nursery:
        tenant = Tenant(root, TenantId.generate(), CFG, nursery=nursery)
        tl = await tenant.create_timeline(TimelineId.generate())
        tl.l0_worker = L0Worker(worker_args=worker_args)
        yield tenant, tl
        nursery.cancel_scope.cancel()


async def test_the_roll_goes_on_while_the_worker_writes(tmp_path: Path) -> None:
    async with _background_timeline(tmp_path, ["--stall-s", "1.0"]) as (tenant, tl):
        lsn = 0x100
        before = tl.disk_consistent_lsn
        while not tl.frozen_layers:
            lsn += 0x10
            await _put(tl, lsn)
        rolled = tl.frozen_layers[0]
        assert rolled.end_lsn is not None
        # the put that rolled returned at once: nothing written yet, the writer goes on
        assert tl.disk_consistent_lsn == before and tl.open_layer is not None
        lsn += 0x10
        await _put(tl, lsn)
        assert tl.frozen_layers == [rolled]
        # readers find the rolled values in the frozen layer meanwhile
        for at in (0x110, rolled.end_lsn - 1):
            assert await tl.get(k(at % 50), Lsn(at)) == at.to_bytes(4, "big") * (VALUE // 4)
        await _until(lambda: not tl.frozen_layers, "the background flush")
        assert tl.disk_consistent_lsn == rolled.end_lsn - 1
        index = _index_part(tl)
        assert index["disk_consistent_lsn"] == format_lsn(Lsn(rolled.end_lsn - 1))
        layers = index["layers"]
        assert isinstance(layers, dict) and len(layers) >= 1
        assert tl.l0_worker.jobs == 1
        # the next explicit flush ends durable before it returns
        await tl.flush()
        assert tl.disk_consistent_lsn == lsn and not tl.frozen_layers
        await tenant.shutdown()


async def test_a_second_roll_waits_for_the_first_flush(tmp_path: Path) -> None:
    async with _background_timeline(tmp_path, ["--stall-s", "0.5"]) as (tenant, tl):
        lsn = 0x100
        rolls = 0
        waited: list[float] = []
        while rolls < 3:
            lsn += 0x10
            frozen_before = list(tl.frozen_layers)
            t0 = time.monotonic()
            await _put(tl, lsn)
            assert len(tl.frozen_layers) <= 1, "two rolled layers in flight"
            if tl.frozen_layers and tl.frozen_layers != frozen_before:
                rolls += 1
                if frozen_before:
                    # the previous rolled layer was written before this roll went on
                    waited.append(time.monotonic() - t0)
                    assert frozen_before[0] not in tl.frozen_layers
                    assert tl.disk_consistent_lsn == frozen_before[0].end_lsn - 1  # type: ignore[operator]
        assert waited and max(waited) > 0.2  # (it really waited for the stalled worker)
        assert tl.background_flush_failures == 0
        await tenant.shutdown()


async def test_an_eio_in_the_worker_is_a_failed_flush(tmp_path: Path) -> None:
    tenant, tl = await _filled(tmp_path, ["--eio-jobs", "1"])
    before, index_before = tl.disk_consistent_lsn, _index_part(tl)
    with pytest.raises(L0WorkerError, match="injected EIO") as failure:
        await tl.flush()
    assert failure.value.errno == errno.EIO
    assert len(tl.frozen_layers) == 1 and tl.disk_consistent_lsn == before
    assert _index_part(tl) == index_before
    assert not [p.name for p in tl.path.iterdir() if "___temp" in p.name]  # the worker cleaned up
    assert await tl.get(k(0x150 % 50), Lsn(0x1F0)) == _image(0x150)
    # the worker survives its own error; the next flush writes the layer
    pid = tl.l0_worker.pid
    await tl.flush()
    assert tl.l0_worker.pid == pid and tl.l0_worker.starts == 1
    assert tl.disk_consistent_lsn == 0x1F0 and not tl.frozen_layers
    assert _index_part(tl) != index_before
    await tenant.shutdown()
    assert pid is not None and _gone(pid)
    # and it is on disk: a restart reads it back
    again = await Tenant.load(tmp_path, tenant.tenant_id, CFG)
    tl2 = again.timelines[tl.timeline_id]
    assert tl2.disk_consistent_lsn == 0x1F0
    assert await tl2.get(k(0x150 % 50), Lsn(0x1F0)) == _image(0x150)
    await again.shutdown()


async def test_a_killed_worker_is_a_failed_flush_and_is_restarted(tmp_path: Path) -> None:
    tenant, tl = await _filled(tmp_path, ["--stall-s", "1.0"])
    before, index_before = tl.disk_consistent_lsn, _index_part(tl)
    failure: list[BaseException] = []

    async def flush() -> None:
        try:
            await tl.flush()
        except L0WorkerError as exc:
            failure.append(exc)

    async with trio.open_nursery() as nursery:
        nursery.start_soon(flush)
        await _until(lambda: tl.l0_worker.busy and tl.l0_worker.pid is not None, "the job")
        pid = tl.l0_worker.pid
        assert pid is not None
        await trio.sleep(0.3)
        os.kill(pid, signal.SIGKILL)
    assert failure and "killed by signal 9" in str(failure[0]), failure
    assert _gone(pid)
    assert len(tl.frozen_layers) == 1 and tl.disk_consistent_lsn == before
    assert _index_part(tl) == index_before
    await tl.flush()  # a new worker
    assert tl.l0_worker.starts == 2 and tl.l0_worker.pid != pid
    assert tl.disk_consistent_lsn == 0x1F0 and not tl.frozen_layers
    await tenant.shutdown()


async def test_a_worker_that_died_while_idle_is_replaced(tmp_path: Path) -> None:
    tenant = Tenant(tmp_path, TenantId.generate(), CFG)
    tl = await tenant.create_timeline(TimelineId.generate())
    await _put(tl, 0x110)
    await tl.flush()
    pid = tl.l0_worker.pid
    assert pid is not None
    os.kill(pid, signal.SIGKILL)
    await _until(lambda: _gone(pid), "the kill")
    await _put(tl, 0x120)
    await tl.flush()  # nothing was lost: a new worker takes the job
    assert tl.l0_worker.starts == 2 and tl.disk_consistent_lsn == 0x120
    await tenant.shutdown()


async def test_a_failed_background_flush_keeps_the_layer_for_the_next(tmp_path: Path) -> None:
    async with _background_timeline(tmp_path, ["--eio-jobs", "1"]) as (tenant, tl):
        lsn = 0x100
        while not tl.frozen_layers:
            lsn += 0x10
            await _put(tl, lsn)
        before = tl.disk_consistent_lsn
        await tl.wait_background_flush()
        assert tl.background_flush_failures == 1
        assert len(tl.frozen_layers) == 1 and tl.disk_consistent_lsn == before
        await tl.flush()  # writes the kept layer, then the open one
        assert tl.disk_consistent_lsn == lsn and not tl.frozen_layers
        await tenant.shutdown()


async def test_shutdown_stops_the_worker_even_mid_flush(tmp_path: Path) -> None:
    async with _background_timeline(tmp_path, ["--stall-s", "30"]) as (tenant, tl):
        lsn = 0x100
        while not tl.frozen_layers:
            lsn += 0x10
            await _put(tl, lsn)
        await _until(lambda: tl.l0_worker.busy and tl.l0_worker.pid is not None, "the background job")
        pid = tl.l0_worker.pid
        assert pid is not None
        before = tl.disk_consistent_lsn
        t0 = time.monotonic()
        await tenant.shutdown()
        assert time.monotonic() - t0 < 10  # the stalled job was not waited for
        assert _gone(pid) and tl.l0_worker.pid is None and tl.l0_worker.closed
        assert tl.disk_consistent_lsn == before


async def test_shutdown_stops_an_idle_worker(tmp_path: Path) -> None:
    tenant, tl = await _filled(tmp_path)
    await tl.flush()
    pid = tl.l0_worker.pid
    assert pid is not None and not _gone(pid)
    with open(f"/proc/{pid}/stat") as f:  # background work, below the ingest
        assert int(f.read().rsplit(")", 1)[1].split()[16]) == min(19, os.nice(0) + l0_worker.WORKER_NICE)
    await tenant.shutdown()
    assert _gone(pid)
    with pytest.raises(L0WorkerError, match="closed"):
        await tl.l0_worker._start()


@pytest.mark.parametrize("mid_job", [False, True])
def test_a_worker_whose_pageserver_dies_exits(tmp_path: Path, mid_job: bool) -> None:
    """The pageserver is killed (no shutdown): an idle worker sees EOF on its pipe and exits; a
    worker in the middle of a (30 s) job is ended by its watchdog, and writes nothing."""
    script = textwrap.dedent(f"""
        import os, sys, trio
        from functools import partial
        from pathlib import Path
        from pageserver.storage.l0_worker import L0Worker
        from tests.pageserver.test_l0_worker import _frozen_layer, _bulk_load_puts

        async def main():
            root = Path({str(tmp_path)!r})
            layer = await _frozen_layer(root, _bulk_load_puts())
            (root / "out").mkdir()
            if {mid_job!r}:
                worker = L0Worker(worker_args=["--stall-s", "30"])
                async with trio.open_nursery() as nursery:
                    nursery.start_soon(partial(worker.write_l0, buffer_size=4096, write_sync_mode="none"), layer, root / "out")
                    while worker.pid is None or not worker.busy:
                        await trio.sleep(0.01)
                    await trio.sleep(0.5)
                    print(worker.pid, flush=True)
                    os.kill(os.getpid(), 9)
            worker = L0Worker()
            await worker.write_l0(layer, root / "out", buffer_size=4096, write_sync_mode="none")
            print(worker.pid, flush=True)
            os.kill(os.getpid(), 9)

        trio.run(main)
    """)
    root = Path(__file__).resolve().parents[2]
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60,
                          cwd=root, env={**os.environ, "PYTHONPATH": str(root)})
    assert proc.returncode == -9, proc.stderr
    pid = int(proc.stdout.split()[0])
    deadline = time.monotonic() + 10
    while not _gone(pid):
        assert time.monotonic() < deadline, f"the orphaned L0 worker {pid} is still running"
        time.sleep(0.05)
    if mid_job:
        time.sleep(0.5)
        assert not list((tmp_path / "out").iterdir())  # it wrote nothing


def test_inline_mode_starts_no_process(tmp_path: Path) -> None:
    async def main() -> None:
        cfg = attrs.evolve(CFG, l0_writer="inline")
        tenant = Tenant(tmp_path, TenantId.generate(), cfg)
        tl = await tenant.create_timeline(TimelineId.generate())
        for lsn in range(0x110, 0x400, 0x10):
            await _put(tl, lsn)  # rolls several times, each written before the put returns
            assert not tl.frozen_layers
        await tl.flush()
        assert tl.l0_worker.pid is None and tl.l0_worker.starts == 0
        await tenant.shutdown()

    trio.run(main)


@pytest.mark.parametrize(
    "answer",
    [
        b"XXXX" + bytes(4),  # wrong magic
        l0_worker._ANSWER.pack(l0_worker.ANSWER_MAGIC, 3) + b"{{{",  # not JSON
        l0_worker._ANSWER.pack(l0_worker.ANSWER_MAGIC, 2) + b"[]",  # not an object
        l0_worker._ANSWER.pack(l0_worker.ANSWER_MAGIC, 1 << 30),  # oversized
    ],
)
async def test_a_garbled_answer_is_a_protocol_error(answer: bytes) -> None:
    send, receive = trio.testing.memory_stream_pair()
    await send.send_all(answer)
    await send.aclose()
    with pytest.raises(L0WorkerProtocolError) as failure:
        await L0Worker()._receive(receive)
    assert failure.value.sqlstate == "XX000"


async def test_an_answer_cut_short_is_a_broken_pipe() -> None:
    send, receive = trio.testing.memory_stream_pair()
    await send.send_all(l0_worker._ANSWER.pack(l0_worker.ANSWER_MAGIC, 10) + b'{"pa')
    await send.aclose()
    with pytest.raises(trio.BrokenResourceError):
        await L0Worker()._receive(receive)
