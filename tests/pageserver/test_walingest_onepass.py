"""The fused path's runs of like records (``_same_run`` checks a page's run of records like
the one just taken in a few C calls; the run is one item, ``Timeline.put_mixed_nowait`` /
``InMemoryLayer.try_put_mixed`` store it without a tuple or a loop iteration per value) store
exactly what the batch path and ``put`` store.

- ``_same_run`` (``protocol.wal.ingest_kernel.same_run``, both implementations) against a per-record reference of the checks it stands for (hypothesis:
  a bulk load's page with any one record changed: a byte anywhere, the VM bit, the xid, the
  length, the resource manager, the block, a stale ``xl_prev`` or trailing bytes made
  CRC-valid);
- the fused path on such WAL against the batch path (``decode_into`` + ``ingest_records``):
  same puts in the same order, ``last_record_lsn``, statistics, end of WAL, with write
  buffers filling and layers rolling inside runs (tests/pageserver/test_walingest_fused.py's
  harness), and the runs do take most of a bulk load;
- ``try_put_mixed`` driven like the ingest (the value it does not take through ``put``)
  against ``put`` per value: same index, file bytes and ``max_lsn``; ``put_mixed_nowait``
  keeps the timeline's put rules.
"""

from __future__ import annotations

import struct
import tempfile
from collections.abc import Sequence
from typing import Any

import pytest
import trio
from hypothesis import given, settings
from hypothesis import strategies as st

from pageserver import walingest
from pageserver.storage.ephemeral_file import EphemeralFile
from pageserver.storage.inmemory_layer import InMemoryLayer
from pageserver.storage.io_engine import BlockingIoEngine
from pageserver.storage.key import Key, rel_block_key
from protocol.lsn import Lsn
from protocol.wal.encoder import BlockSpec
from protocol.wal.record import record_crc
from protocol.wal.rmgr import RmgrId
from tests.conftest import kernel
from tests.pageserver import test_walingest_fused as fz

_HEAD = struct.Struct("<IIQBB2xI")  # xl_tot_len, xl_xid, xl_prev, xl_info, xl_rmid, xl_crc


def _reference_run(buf: bytes, o: int, pos: int, tot_len: int, stride: int, k: int, vm_at: int) -> int:
    """What ``_same_run`` stands for, one record at a time: how many of the ``k`` records
    after the one at ``o`` are like it and valid."""
    first = _HEAD.unpack_from(buf, o)
    layout = buf[o + 24 : o + 46]
    for i in range(1, k + 1):
        r = o + i * stride
        tot, xid, prev, info, rmid, crc = _HEAD.unpack_from(buf, r)
        if (tot, xid, info, rmid) != (first[0], first[1], first[3], first[4]):
            return i - 1
        if buf[r + 18 : r + 20] != buf[o + 18 : o + 20] or buf[r + 24 : r + 46] != layout:
            return i - 1
        if prev != pos + (i - 1) * stride:
            return i - 1
        if vm_at > 0 and buf[r + vm_at] & 0x01:
            return i - 1
        if record_crc(buf[r : r + tot_len]) != crc:
            return i - 1
    return k


_CHANGES = ["byte", "body_byte", "body_byte", "vm", "xid_fused", "xid_general", "length", "btree", "block", "stale_prev", "trailing", "none"]


def _hot_updates(n: int) -> list[dict[str, Any]]:
    """``n`` HOT updates of A's block 0 (like records whose VM test reads the main data)."""
    return [
        {"rmid": RmgrId.HEAP, "info": 0x40, "xid": 900, "blocks": [BlockSpec(fz.A, 0, data=fz._tuple(100))],
         "main_data": struct.pack("<IHBBIH", 900, 2 + i % 50, 0, 0, 0, 3)}
        for i in range(n)
    ]


def _bulk_with_change(
    n: int, at: int, change: str, seed: int, kind: str = "insert"
) -> tuple[bytes, list[tuple[Lsn, Lsn]]]:
    """``n`` INSERTs into one new block of A (or HOT updates of block 0: like records),
    record ``at`` changed."""
    specs = fz._bulk_load(n, every=10_000) if kind == "insert" else _hot_updates(n)
    spec: dict[str, Any] = dict(specs[at])
    block = spec["blocks"][0]
    if change == "vm" and kind == "insert":
        spec["main_data"] = spec["main_data"][:2] + b"\x01"
    elif change == "vm":
        spec["main_data"] = spec["main_data"][:7] + b"\x01" + spec["main_data"][8:]
    elif change == "xid_fused":
        spec["xid"] = 901  # below nextXid: still the fused path, another xid
    elif change == "xid_general":
        spec["xid"] = fz.NEXT_XID + 5
    elif change == "length":
        spec["blocks"] = [BlockSpec(block.rnode, block.blkno, data=fz._tuple(101), will_init=block.will_init)]
    elif change == "btree":
        spec["rmid"] = RmgrId.BTREE
    elif change == "block":
        spec["blocks"] = [BlockSpec(block.rnode, 1, data=block.data)]
    specs[at] = spec
    hostile = (change, at) if change in ("stale_prev", "trailing") else None
    wal, spans = fz.encode(specs, hostile)
    if change in ("byte", "body_byte"):
        start, end = spans[at]
        skip = 46 if change == "body_byte" else 0  # (the block's data and the main data)
        buf = bytearray(wal)
        buf[start - fz.WAL_START + skip + seed % (end - start - skip)] ^= 1 + seed % 255
        wal = bytes(buf)
    return wal, spans


@settings(max_examples=300, deadline=None)
@given(
    n=st.integers(5, 120),
    at=st.integers(0, 2**31),
    change=st.sampled_from(_CHANGES),
    seed=st.integers(0, 2**31),
)
def test_same_run_is_the_per_record_checks(impl: str, n: int, at: int, change: str, seed: int) -> None:
    """``_same_run`` (the ingest kernel, compiled and twin) from every record of the WAL that
    starts a run (its layout read as the fused path reads it) gives the count the per-record
    checks give, and the raw records."""
    same_run = kernel(impl, "protocol._ingest_c").same_run
    wal, spans = _bulk_with_change(n, at % n, change, seed)
    calls = 0
    for i, (start, _end) in enumerate(spans[:-1]):
        o = start - fz.WAL_START
        page_end = min(((start | 8191) + 1) - fz.WAL_START, len(wal))  # the ingest's bound
        tot_len = struct.unpack_from("<I", wal, o)[0]
        if o + tot_len > page_end or start & 8191 == 0:
            continue
        data_len, main_len = struct.unpack_from("<H", wal, o + 26)[0], wal[o + 45]
        if 46 + data_len + main_len != tot_len or record_crc(wal[o : o + tot_len]) != _HEAD.unpack_from(wal, o)[5]:
            continue  # the fused path never takes it (a corrupted record): no run from it
        stride = (tot_len + 7) & ~7
        main_at = 46 + data_len
        k = (page_end - o - tot_len) // stride
        if k < 1:
            continue
        want = _reference_run(wal, o, start, tot_len, stride, k, main_at + 2)
        got, raws = same_run(wal, o, start, tot_len, stride, k, main_at + 2)
        assert got == want, (i, change)
        assert list(raws) == [wal[o + j * stride : o + j * stride + tot_len] for j in range(got + 1)]
        calls += 1
    assert calls or n < 10


@settings(max_examples=100, deadline=None)
@given(
    n=st.integers(5, 400),
    at=st.integers(0, 2**31),
    change=st.sampled_from(_CHANGES),
    seed=st.integers(0, 2**31),
    sizes=st.lists(st.sampled_from([977, 8192, 20000, 131072]), min_size=1, max_size=3),
    skip=st.none() | st.none() | st.integers(0, 2**31),
    kind=st.sampled_from(["insert", "insert", "hot_update"]),
)
def test_runs_store_what_the_batch_path_stores(
    n: int, at: int, change: str, seed: int, sizes: list[int], skip: int | None, kind: str
) -> None:
    """Fused (with runs) against batch on a bulk load with one record changed: the same puts
    in the same order, layers and all (4 KiB write buffers and 48 KiB layers: both fill inside
    runs), the same ``last_record_lsn``, statistics, sizes, records per piece, end of WAL."""
    wal, spans = _bulk_with_change(n, at % n, change, seed, kind)
    skip_to = None if skip is None else Lsn(spans[skip % len(spans)][1])
    batch, fused = fz.both(wal, fz.chunking(len(wal), sizes), skip_to)
    fz.assert_same(batch, fused)


def test_runs_take_the_bulk_load(monkeypatch: pytest.MonkeyPatch) -> None:
    """Not vacuous: on a bulk load most records are taken in runs (the walk kernel's packed runs
    or ``_same_run``'s), runs are cut by full write
    buffers and layer rolls (``_store`` goes on inside a run after ``put_encoded``),
    and the result is the batch path's."""
    wal, _spans = fz.encode(fz._bulk_load(3000))
    in_runs: list[int] = []
    cuts: list[int] = []
    real_run, real_mixed = walingest._same_run, InMemoryLayer.try_put_mixed

    def counting(*a: Any) -> tuple[int, tuple[bytes, ...]]:
        m, raws = real_run(*a)
        in_runs.append(m + 1 if m else 0)
        return m, raws

    def cut(self: InMemoryLayer, items: Any, start: int, sub: int, *a: Any) -> tuple[int, int]:
        i, v = real_mixed(self, items, start, sub, *a)
        cuts.append(v)
        return i, v

    real_walk = walingest._fused_walk

    def walking(*a: Any) -> Any:
        got = real_walk(*a)
        in_runs.append(sum(len(item[1]) for item in got[4] if len(item) == 6))
        return got

    batch, _ = fz.both(wal, fz.chunking(len(wal), [131072]))
    monkeypatch.setattr(walingest, "_same_run", counting)
    monkeypatch.setattr(walingest, "_fused_walk", walking)
    monkeypatch.setattr(InMemoryLayer, "try_put_mixed", cut)
    _, fused = fz.both(wal, fz.chunking(len(wal), [131072]))
    fz.assert_same(batch, fused)
    assert sum(in_runs) > 0.8 * 3000
    assert any(cuts)  # a run met a full buffer or a roll


# -- try_put_mixed against put ----------------------------------------------------------------

_SEGMENTS = st.lists(
    # (key, LSN step before it (0: the key's last LSN again), run length (1: a single value
    # as a single value), raw size, head, will_init)
    st.tuples(
        st.integers(0, 3), st.integers(0, 2), st.integers(1, 40), st.integers(0, 300),
        st.sampled_from([b"", b"\x01", b"\x07\x00\x00\x00\x01"]), st.booleans(),
    ),
    max_size=30,
)


def _key(i: int) -> Key:
    return rel_block_key(1663, 5, 16384 + i, 0, 7)


@settings(max_examples=150, deadline=None)
@given(
    segments=_SEGMENTS,
    buffer_size=st.sampled_from([512, 2048, 1 << 16]),
    max_size=st.sampled_from([1 << 62, 3000, 20_000]),
    stride=st.integers(1, 200),
)
def test_try_put_mixed_stores_what_put_stores(
    segments: list[tuple[int, int, int, int, bytes, bool]], buffer_size: int, max_size: int, stride: int
) -> None:
    """``try_put_mixed`` of values and runs, driven like the ingest (the value it does not
    take through ``put``, then on from the next), leaves the same index, file bytes and
    ``max_lsn`` as ``put`` per value: keys with earlier values, a run or a value at a key's
    last LSN (a replace: left to ``put``), full buffers and the ``max_size`` limit inside
    runs."""
    items: list[Any] = []
    values: list[tuple[Key, Lsn, bytes, bool]] = []
    lsn = 100
    for n, (key, step, count, size, head, will_init) in enumerate(segments):
        lsn += step
        lsns = range(lsn, lsn + count * stride, stride)
        raws = tuple(bytes([(n + j) % 251]) * size for j in range(count))
        if count == 1:
            items.append((_key(key), lsn, head + raws[0], will_init))
        else:
            items.append((_key(key), lsns, head, raws, will_init))
        values += [(_key(key), Lsn(x), head + raw, will_init) for x, raw in zip(lsns, raws, strict=True)]
        lsn = lsns[-1]

    async def run(fast: bool, directory: str) -> tuple[object, ...]:
        file = await EphemeralFile.create(
            BlockingIoEngine(), directory, write_buffer_size=buffer_size, double_buffering=False
        )
        layer = InMemoryLayer(file, Lsn(100))
        if not fast:
            for value in values:
                await layer.put(*value)
        else:
            i, v = layer.try_put_mixed(items, 0, 0, max_size)
            while i < len(items):
                item = items[i]
                if len(item) == 4:
                    await layer.put(*item)
                    i, v = i + 1, 0
                else:
                    key, lsns, head, raws, will_init = item
                    await layer.put(key, Lsn(lsns[v]), head + raws[v], will_init)
                    i, v = (i, v + 1) if v + 1 < len(raws) else (i + 1, 0)
                i, v = layer.try_put_mixed(items, i, v, max_size)
        index = {key: list(entries) for key, entries in layer.index.items()}
        await layer.freeze(Lsn(1 << 40))
        data = await file.read_all()
        await layer.aclose()
        return index, data, layer.max_lsn

    with tempfile.TemporaryDirectory() as a, tempfile.TemporaryDirectory() as b:
        assert trio.run(run, True, a) == trio.run(run, False, b)


@pytest.mark.parametrize(
    ("lsns", "raws"),
    [
        (range(10, 40, 10), [b"ab", b"cd", b"e"]),
        (range(10, 30, 10), [b"ab"] * 3),
        (range(40, 10, -10), [b"ab"] * 3),
        (range(10, 10), []),
    ],
)
def test_try_put_mixed_refuses_what_is_not_a_run(lsns: range, raws: Sequence[bytes]) -> None:
    """Raws of two lengths, one LSN per raw missing, falling LSNs, no value: refused,
    nothing stored."""

    async def run(directory: str) -> None:
        file = await EphemeralFile.create(BlockingIoEngine(), directory, double_buffering=False)
        layer = InMemoryLayer(file, Lsn(1))
        with pytest.raises(ValueError):
            layer.try_put_mixed([(_key(0), lsns, b"h", raws, False)], 0, 0)
        assert file.length == 0 and not layer.index
        await layer.aclose()

    with tempfile.TemporaryDirectory() as d:
        trio.run(run, d)


async def test_put_mixed_nowait_keeps_the_timelines_put_rules(tmp_path: Any) -> None:
    """``Timeline.put_mixed_nowait`` refuses a run at or below ``last_record_lsn`` and a run
    a roll is due in (its last LSN ``checkpoint_distance`` past the layer start), and leaves
    ``_max_put_lsn`` at the last value it stored: a freeze refuses until those records are
    finished."""
    from pageserver.storage.config import StorageConfig
    from pageserver.tenant import Tenant
    from pageserver.timeline import PartialRecordError
    from protocol.ids import TenantId, TimelineId

    cfg = StorageConfig(checkpoint_distance=1 << 20, double_buffering=False, compaction_period_s=0, gc_period_s=0)
    tenant = Tenant(tmp_path, TenantId.generate(), cfg)
    try:
        tl = await tenant.create_timeline(TimelineId.generate())
        await tl.put_encoded(_key(0), Lsn(0x100), b"first", False)
        tl.finish_write(Lsn(0x100))
        raws = [b"abc"] * 3
        assert tl.put_mixed_nowait([(_key(1), range(0x100, 0x130, 0x10), b"h", raws, False)]) == (0, 0)
        far = 0x100 + (1 << 20)
        assert tl.put_mixed_nowait([(_key(1), range(far - 0x20, far + 0x10, 0x10), b"h", raws, False)]) == (0, 0)
        assert tl.put_mixed_nowait([(_key(1), range(0x110, 0x140, 0x10), b"h", raws, True)]) == (1, 0)
        tl.finish_write(Lsn(0x120))
        with pytest.raises(PartialRecordError):
            await tl.freeze()
        tl.finish_write(Lsn(0x130))
        await tl.freeze()
        assert list(tl.frozen_layers[-1].index[_key(1)]) == [
            0x110, (5 + 0 * 4) << 1 | 1, 4, 0x120, (5 + 4) << 1 | 1, 4, 0x130, (5 + 8) << 1 | 1, 4
        ]
    finally:
        await tenant.shutdown()


@pytest.mark.parametrize("kind", ["insert", "hot_update"])
@pytest.mark.parametrize("at", [3, 20, 47, 48, 70])
def test_vm_bit_inside_a_run(kind: str, at: int) -> None:
    """A record that clears a VM bit among like records (an INSERT's flags byte, a HOT
    update's flags at byte 7): neither a run nor the shortcut may take it."""
    wal, _spans = _bulk_with_change(90, at, "vm", 0, kind)
    batch, fused = fz.both(wal, fz.chunking(len(wal), [131072]))
    fz.assert_same(batch, fused)


@pytest.mark.parametrize("change", ["xid_general", "vm", "btree", "xid_fused", "none"])
def test_record_crossing_a_page_changed(change: str) -> None:
    """The record crossing into the next page (``next_record`` gives it whole; the fused path
    takes it when no general record waits: ``_fused_whole``) with an xid at nextXid, a VM bit,
    another resource manager: the same values as the batch path."""
    _wal, spans = fz.encode(fz._bulk_load(200, every=10_000))
    crossing = [i for i, (a, b) in enumerate(spans) if a // 8192 != (b - 1) // 8192]
    assert len(crossing) >= 2
    for at in crossing[:3]:
        wal, _ = _bulk_with_change(200, at, change, 0)
        batch, fused = fz.both(wal, fz.chunking(len(wal), [131072]))
        fz.assert_same(batch, fused)
