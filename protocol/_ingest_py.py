"""The pageserver's ingest kernel in pure Python: the reference twin of ``protocol/_ingest_c.pyx``.

Same names, signatures and results (errors included) as the compiled module; the tests run
both on the same bytes (tests/protocol/test_native_ingest.py). ``protocol._native`` decides
which one the pageserver uses (``PAGESTORE_PURE_PYTHON=1`` selects this one).

- ``same_run(buf, o, pos, tot_len, stride, k, vm_at)``: the fused WAL ingest's run of like
  records (``pageserver.walingest.WalIngest.ingest_decoder``). The record at offset ``o`` of
  ``buf`` (LSN ``pos``, ``tot_len`` bytes, already checked by the caller) is followed, every
  ``stride`` bytes, by ``k`` more record starts inside ``buf``. Returns ``(m, raws)``: how many
  of those ``k`` in a row are *like* it -- the same ``xl_tot_len``, ``xl_xid``, ``xl_info``,
  ``xl_rmid`` and header padding, the same 22 layout bytes after the header (block 0's header
  and the short main-data header), ``xl_prev`` the start of the record before (``pos``,
  ``pos + stride``, ...), when ``vm_at > 0`` the byte at ``vm_at`` of each (a heap INSERT's
  flags) without the VM bit 0x01, and a right CRC-32C -- and the raw bytes of the record at
  ``o`` and of those ``m``. A bulk load's INSERTs into one heap page are such a run.

- ``fused_walk(buf, base, pos, prev, latest_page, tli, seg_size, rels, nxt, last)``: the
  fused ingest's walk over a whole received piece of WAL (``WalIngest.ingest_decoder`` calls
  it first at every in-page cursor). From the record at LSN ``pos`` (``buf[0]`` is at LSN
  ``base``; the record before started at ``prev``) it takes records for as long as each is of
  the fused kind, crossing WAL pages: a page header on the way (at the record's start, or
  between the two pieces of a record that crosses into the next page) must be a short one
  (not a segment's first page), with the right magic, known info bits, its own address, the
  timeline ``tli`` and, between pieces, ``XLP_FIRST_IS_CONTRECORD`` (no overwrite flag) with
  ``xlp_rem_len`` the rest of the record, which ends on that page. A record is taken when
  ``xl_prev`` is ``prev``, it is of the simple layout (block id 0 without image or
  ``SAME_REL``, a short main data, the lengths adding up to ``xl_tot_len``), its resource
  manager only changes its pages (heap, heap2, btree, hash, gin, gist, sequence, spgist, brin,
  generic), its end LSN is above ``last``, a heap or heap2 record clears no visibility-map bit
  (as ``pageserver.walingest._may_clear_vm_main`` decides), its fork is at most the init fork,
  its xid is 0 or below nextXid ``nxt`` (-1: unknown, so no record with an xid is taken), its
  relation fork is one of ``rels`` (``(spc, db, rel, fork, nblocks)`` each) with the block
  below ``nblocks`` or the one just past it (the fork grows by one), and its CRC-32C is right.
  Returns ``(pos, prev, latest_page, records, items, sizes, stop, stop_rel)``: where the walk
  stopped (the end of the last record taken, the start of that record, the last page header
  crossed up to there), how many records it took, their values for the in-memory layer
  (``Timeline.put_mixed_nowait`` items, see below), each of ``rels``' block counts after
  them, why it stopped (``WALK_INPUT``: the next record or page header is not all in
  ``buf``; ``WALK_OTHER``: the next record is not of the fused kind, the caller's general
  path reads it; ``WALK_REL``: its relation fork is not in ``rels``, ``stop_rel`` says which).
  Items: for each stretch of taken records with one block, one will_init flag and one length,
  a run ``(key, ends, out, at, vlen, will_init)``: the values ``out[at + v * vlen : at +
  (v + 1) * vlen]`` (the value head, then the raw record) at ``ends[v]`` (an ``array('Q')``);
  and after a record that grows its fork, the fork's new size ``(size key, end, value,
  True)``. Keys are the storage keys (``pageserver.storage.key``'s layout); ``out`` is one
  ``bytes`` object shared by the runs of a call.

- ``append_triples(entries, ends, start, stop, offset, vlen, will_init)``: the in-memory layer's
  index entries of a packed run's values ``start .. stop - 1`` (``InMemoryLayer.try_put_mixed``):
  appends ``(ends[v], (offset + (v - start) * vlen) << 1 | will_init, vlen)`` for each to
  ``entries``, an ``array('Q')``. ``ends`` must be an ``array('Q')`` too, ``0 <= start <= stop
  <= len(ends)``, ``offset >= 0``, ``vlen > 0`` and the last offset must fit (``<< 1``) in 64
  bits, else ``ValueError``.

Arguments outside the buffer (``o + k * stride + tot_len > len(buf)``), a ``tot_len`` below
the 46 bytes a run compares, a ``stride`` below ``tot_len``, a negative ``o`` or ``k``, a
``vm_at`` at or past ``tot_len``, or an LSN ``pos + k * stride`` beyond 64 bits are a
``ValueError``: the kernel never reads past what it was given.
"""

from __future__ import annotations

import struct
from array import array
from collections.abc import Sequence
from functools import lru_cache
from itertools import repeat
from typing import TYPE_CHECKING, Final, TypeAlias

from protocol._wal_py import _crc as _crc_function
from protocol._wal_py import crc32c

if TYPE_CHECKING:
    from typing_extensions import Buffer

__all__ = ["IMPL", "WALK_INPUT", "WALK_OTHER", "WALK_REL", "append_triples", "fused_walk", "same_run"]

IMPL: Final = "python"

RECORD_HEADER: Final = 24  # SizeOfXLogRecord
# per record of a run: (xl_tot_len, xl_xid), xl_prev, (xl_info, xl_rmid, padding), xl_crc, and
# the 22 layout bytes (reader.SIMPLE_HEADERS)
_RUN_HEAD: Final = "8sQ4sI22s"
_RUN_ONE: Final = struct.Struct("<" + _RUN_HEAD)
RUN_COMPARED: Final = _RUN_ONE.size  # 46
_EVEN_BYTES: Final = bytes(range(0, 256, 2))
_U64_MAX: Final = (1 << 64) - 1


@lru_cache(maxsize=1024)
def _run_struct(one: str, gap: int, count: int) -> struct.Struct:
    """``count`` times ``one``, ``gap`` pad bytes between two (none after the last, so an
    unpack never reads past the last record)."""
    return struct.Struct("<" + f"{gap}x".join([one] * count))


def _same_prefix(got: Sequence[object], want: object) -> int:
    """How many items at the start of ``got`` equal ``want``."""
    for i, x in enumerate(got):
        if x != want:
            return i
    return len(got)


def _first_difference(a: Sequence[object], b: Sequence[object]) -> int:
    """The first index where two sequences of one length (that differ) differ."""
    return next(i for i, (x, y) in enumerate(zip(a, b, strict=True)) if x != y)


def _vm_kept(buf: Buffer, at: int, stride: int, m: int) -> int:
    """How many of the ``m`` flags bytes at ``at``, ``at + stride``... in a row have no VM
    bit (0x01)."""
    flags = bytes(memoryview(buf)[at : at + (m - 1) * stride + 1 : stride])
    if flags.translate(None, _EVEN_BYTES):
        return next(i for i, f in enumerate(flags) if f & 0x01)
    return m


def check_run_args(size: int, o: int, pos: int, tot_len: int, stride: int, k: int, vm_at: int) -> None:
    """The argument checks both implementations make (same messages), ``size`` = ``len(buf)``."""
    if o < 0 or k < 0:
        raise ValueError(f"a run needs a non-negative offset and count, got o={o} k={k}")
    if tot_len < RUN_COMPARED or stride < tot_len:
        raise ValueError(f"a run needs tot_len >= {RUN_COMPARED} and stride >= tot_len, got {tot_len}, {stride}")
    if vm_at >= tot_len:
        raise ValueError(f"vm_at {vm_at} is not inside a record of {tot_len} bytes")
    room = size - o - tot_len  # bytes after the first record: k more strides must fit
    if room < 0 or k > room // stride:
        raise ValueError(f"a run of {k} records of {tot_len} bytes every {stride} from {o} "
                         f"is not inside a buffer of {size} bytes")
    if pos < 0 or pos > _U64_MAX - k * stride:
        raise ValueError(f"run LSNs from {pos} every {stride} for {k} records overflow 64 bits")


def same_run(
    buf: Buffer, o: int, pos: int, tot_len: int, stride: int, k: int, vm_at: int
) -> tuple[int, tuple[bytes, ...]]:
    """The run of records like the one at ``o`` (see the module docstring): ``(m, raws)``.

    A few C calls per run instead of a loop iteration per record: struct unpacks of every
    record's header fields and of its two CRC pieces, tuple compares, one ``crc32c`` map."""
    view = memoryview(buf).cast("B")
    check_run_args(len(view), o, pos, tot_len, stride, k, vm_at)
    h8, _prev, irp, _crc, sig = _RUN_ONE.unpack_from(view, o)
    first = o + stride
    m = k
    if k:
        heads = _run_struct(_RUN_HEAD, stride - RUN_COMPARED, k).unpack_from(view, first)
        for col, want in ((heads[0::5], h8), (heads[2::5], irp), (heads[4::5], sig)):
            if col.count(want) != k:
                m = min(m, _same_prefix(col, want))
        if m:
            prevs = heads[1 : 5 * m : 5]
            chain = tuple(range(pos, pos + m * stride, stride))
            if prevs != chain:
                m = _first_difference(prevs, chain)
        if m and vm_at > 0:
            m = _vm_kept(view, first + vm_at, stride, m)
        if m:
            crc_pieces = _run_struct(f"20s4x{tot_len - RECORD_HEADER}s", stride - tot_len, m)
            pieces = crc_pieces.unpack_from(view, first)
            fast = _crc_function()  # (the package's function itself: CRC values need no range check)
            crcs = tuple(map(fast, pieces[0::2], map(fast, pieces[1::2], repeat(0))))
            want_crcs = heads[3 : 5 * m : 5]
            if crcs != want_crcs:
                m = _first_difference(crcs, want_crcs)
    return m, _run_struct(f"{tot_len}s", stride - tot_len, m + 1).unpack_from(view, o)


# --- fused_walk ---------------------------------------------------------------------------------

# fused_walk's items: a packed run (key, ends, out, at, vlen, will_init), a size value (key,
# end, value, True)
WalkItem: TypeAlias = "tuple[bytes, array[int], bytes, int, int, bool] | tuple[bytes, int, bytes, bool]"
WALK_INPUT: Final = 0
WALK_OTHER: Final = 1
WALK_REL: Final = 2

_PAGE: Final = 8192
_PAGE_MASK: Final = _PAGE - 1
_SHORT_PHD: Final = struct.Struct("<HHIQI")  # magic, info, tli, pageaddr, rem_len (24 bytes)
_PHD_SIZE: Final = 24
_PAGE_MAGIC: Final = 0xD110
_XLP_FIRST_IS_CONTRECORD: Final = 0x0001
_XLP_LONG_HEADER: Final = 0x0002
_XLP_FIRST_IS_OVERWRITE_CONTRECORD: Final = 0x0008
_XLP_ALL_FLAGS: Final = 0x000F
# the XLogRecord header, block 0's header and the short main data header (reader.SIMPLE_RECORD)
_SIMPLE: Final = struct.Struct("<IIQBBxxIBBHIIIIBB")
_SIMPLE_AT: Final = _SIMPLE.size  # 46: the block data starts here
# heap2 .. brin, and generic: resource managers whose records only change the pages they name
_FAST_RMGRS: Final = frozenset((9, 10, 11, 12, 13, 14, 15, 16, 17, 20))
_RM_HEAP2: Final = 9
_RM_HEAP: Final = 10
_HEAP_FLAGS_AT_7: Final = frozenset((0x10, 0x20, 0x40, 0x60))  # DELETE, UPDATE, HOT_UPDATE, LOCK
_KEY: Final = struct.Struct(">BIIIBI")  # pageserver.storage.key: section, spc, db, rel, fork, blkno
_SIZE_BLKNO: Final = 0xFFFF_FFFF
# (room for a record's end: two pages past the buffer's last byte)
_LSN_MAX: Final = _U64_MAX - 2 * _PAGE
_HEADS: Final = (b"\x01\x00", b"\x01\x01")  # the PostgresRecord value head, by will_init
_SIZE_VALUE: Final = struct.Struct("<BI")  # an Image value of a 4-byte relation size
# like records after a taken one checked as a run (same_run) when at least this many could follow
_RUN_MIN: Final = 2


def _clears_vm(rmid: int, info: int, main: bytes) -> bool:
    """``pageserver.walingest._may_clear_vm_main`` for a heap or heap2 record."""
    op = info & 0x70
    if rmid == _RM_HEAP:
        if op == 0x00:
            return len(main) < 3 or bool(main[2] & 0x01)
        if op in _HEAP_FLAGS_AT_7:
            return len(main) < 8 or bool(main[7] & 0x03)
        return False
    if op == 0x50:
        return not main or bool(main[0] & 0x01)
    if op == 0x60:
        return len(main) < 8 or bool(main[7] & 0x01)
    return False


def _short_page_ok(buf: bytes, o: int, pageaddr: int, tli: int, seg_size: int) -> int:
    """The info bits of the short page header at ``buf[o]`` (LSN ``pageaddr``) if it passes
    the walk's checks, else -1."""
    if pageaddr % seg_size == 0:
        return -1
    magic, info, ptli, addr, _rem = _SHORT_PHD.unpack_from(buf, o)
    if magic != _PAGE_MAGIC or info & ~_XLP_ALL_FLAGS or info & _XLP_LONG_HEADER or addr != pageaddr or ptli != tli:
        return -1
    return int(info)


def check_walk_args(
    size: int, base: int, pos: int, prev: int, latest_page: int, tli: int, seg_size: int,
    rels: Sequence[Sequence[int]], nxt: int, last: int,
) -> None:
    """The argument checks both implementations make (same messages), ``size`` = ``len(buf)``."""
    if base < 0 or base > _LSN_MAX - size:
        raise ValueError(f"a buffer of {size} bytes at LSN {base} is not inside 64-bit LSNs")
    if pos & 7 or pos < base or pos - base > size:
        raise ValueError(f"a walk starts at a MAXALIGNed LSN inside the buffer, got {pos} (buffer at {base}, {size} bytes)")
    if not 0 <= prev < pos:
        raise ValueError(f"the record before {pos} must start below it, got {prev}")
    if not 0 <= latest_page <= _U64_MAX or not 0 <= tli <= 0xFFFF_FFFF:
        raise ValueError(f"a page LSN and a 32-bit timeline, got {latest_page} and {tli}")
    if seg_size < _PAGE or seg_size > 1 << 40 or seg_size & (seg_size - 1):
        raise ValueError(f"a WAL segment size is a power of two from {_PAGE} to 2**40, got {seg_size}")
    if not -1 <= nxt <= 0xFFFF_FFFF or not 0 <= last <= _U64_MAX:
        raise ValueError(f"nextXid is a 32-bit xid or -1 and last an LSN, got {nxt} and {last}")
    if len(rels) > 64:
        raise ValueError(f"at most 64 relation forks, got {len(rels)}")
    for r in rels:
        if len(r) != 5 or not all(0 <= x <= 0xFFFF_FFFF for x in r):
            raise ValueError(f"a relation fork is (spc, db, rel, fork, nblocks) of 32-bit values, got {tuple(r)!r}")


def fused_walk(
    buf: Buffer, base: int, pos: int, prev: int, latest_page: int, tli: int, seg_size: int,
    rels: Sequence[tuple[int, int, int, int, int]], nxt: int, last: int,
) -> tuple[int, int, int, int, list[WalkItem], tuple[int, ...], int, tuple[int, int, int, int] | None]:
    """The fused ingest's walk over a piece of WAL (see the module docstring). A loop turn
    per record only where a run of like records starts: the records after a taken one on
    its page that are like it are checked together by ``same_run``, as the in-page loop of
    ``WalIngest.ingest_decoder`` does."""
    data = bytes(buf)
    size = len(data)
    check_walk_args(size, base, pos, prev, latest_page, tli, seg_size, rels, nxt, last)
    table = {tuple(r[:4]): i for i, r in enumerate(rels)}
    nblocks = [r[4] for r in rels]
    out = bytearray()
    items: list[WalkItem] = []
    records = 0
    stop = WALK_INPUT
    stop_rel: tuple[int, int, int, int] | None = None
    run: tuple[bytes, array[int], int, int, bool] | None = None  # the stretch at hand
    runs: list[tuple[bytes, array[int], int, int, bool]] = []
    placed: list[int] = []  # where each run goes in items
    while True:
        at = pos
        page_at = latest_page
        if not at & _PAGE_MASK:
            # a page header first: the record starts right after it
            o = at - base
            if size - o < _PHD_SIZE:
                break
            info = _short_page_ok(data, o, at, tli, seg_size)
            if info < 0 or info & _XLP_FIRST_IS_CONTRECORD:
                stop = WALK_OTHER
                break
            page_at = at
            at += _PHD_SIZE
        o = at - base
        page_rem = _PAGE - (at & _PAGE_MASK)
        if size - o < 4:
            break
        tot_len = int.from_bytes(data[o : o + 4], "little")
        if tot_len < _SIMPLE_AT:
            stop = WALK_OTHER
            break
        if tot_len <= page_rem:
            if size - o < tot_len:
                break
            raw = data[o : o + tot_len]
            end = (at + tot_len + 7) & ~7
        else:
            rest = tot_len - page_rem
            nextpage = at + page_rem
            no = nextpage - base
            if rest > _PAGE - _PHD_SIZE:
                stop = WALK_OTHER
                break
            if size - no < _PHD_SIZE:
                break
            info = _short_page_ok(data, no, nextpage, tli, seg_size)
            if info < 0 or info & (_XLP_FIRST_IS_CONTRECORD | _XLP_FIRST_IS_OVERWRITE_CONTRECORD) != _XLP_FIRST_IS_CONTRECORD:
                stop = WALK_OTHER
                break
            if _SHORT_PHD.unpack_from(data, no)[4] != rest:
                stop = WALK_OTHER
                break
            if size - no - _PHD_SIZE < rest:
                break
            raw = data[o : o + page_rem] + data[no + _PHD_SIZE : no + _PHD_SIZE + rest]
            end = (nextpage + _PHD_SIZE + rest + 7) & ~7
            page_at = nextpage
        (
            _tot, xid, xprev, info, rmid, crc, block_id, flags, data_len, spc, db, rel, blkno, main_id, main_len,
        ) = _SIMPLE.unpack_from(raw)
        if (
            xprev != prev
            or rmid not in _FAST_RMGRS
            or block_id != 0
            or main_id != 255
            or flags & 0x90  # HAS_IMAGE, SAME_REL
            or _SIMPLE_AT + data_len + main_len != tot_len
            or (data_len != 0) != bool(flags & 0x20)
            or end <= last
        ):
            stop = WALK_OTHER
            break
        if rmid <= _RM_HEAP and _clears_vm(rmid, info, raw[_SIMPLE_AT + data_len :]):
            stop = WALK_OTHER
            break
        fork = flags & 0x0F
        if fork > 3:
            stop = WALK_OTHER
            break
        if xid:
            if nxt < 0:
                stop = WALK_OTHER
                break
            if xid >= 3 and nxt >= 3:
                if ((xid - nxt) & 0xFFFF_FFFF) < 0x8000_0000:
                    stop = WALK_OTHER
                    break
            elif xid >= nxt:
                stop = WALK_OTHER
                break
        slot = table.get((spc, db, rel, fork))
        if slot is None:
            stop = WALK_REL
            stop_rel = (spc, db, rel, fork)
            break
        n = nblocks[slot]
        grown = blkno >= n
        if grown and blkno != n:
            stop = WALK_OTHER
            break
        if crc32c(raw[:20], crc32c(raw[24:])) != crc:
            stop = WALK_OTHER
            break
        # taken
        will_init = bool(flags & 0x40)
        key = _KEY.pack(0, spc, db, rel, fork, blkno)
        vlen = 2 + tot_len
        if run is None or grown or run[0] != key or run[3] != vlen or run[4] != will_init:
            run = (key, array("Q"), len(out), vlen, will_init)
            placed.append(len(items))
            items.append((key, 0, b"", False))  # (the run's tuple, made at the end)
            runs.append(run)
        run[1].append(end)
        head = _HEADS[will_init]
        out += head
        out += raw
        records += 1
        prev = at
        pos = end
        latest_page = page_at
        if grown:
            nblocks[slot] = n + 1
            items.append((_KEY.pack(0, spc, db, rel, fork, _SIZE_BLKNO), end, _SIZE_VALUE.pack(0, n + 1), True))
            run = None
            continue
        # The records after this one on its page that are like it -- the same header fields
        # and layout bytes, so the same tests above pass for them -- in a few C calls
        # (``same_run``, which checks their xl_prev chain, CRC-32C and, for a heap INSERT, the
        # VM bit of each): a bulk load's INSERTs into one heap page, no loop turn per record.
        # Not for a record that crosses a page (the like ones must be on its page) nor for a
        # heap or heap2 record whose VM test reads anything but an INSERT's flags byte.
        if tot_len > page_rem:
            continue
        if rmid > _RM_HEAP:
            vm_at = 0
        elif rmid == _RM_HEAP and info & 0x70 == 0:
            vm_at = _SIMPLE_AT + data_len + 2
        else:
            continue
        stride = end - at
        k = (min(at - (at & _PAGE_MASK) + _PAGE - base, size) - o - tot_len) // stride
        if k < _RUN_MIN:
            continue
        m, raws = same_run(data, o, at, tot_len, stride, k, vm_at)
        if m:
            run[1].extend(range(end + stride, end + m * stride + 1, stride))
            out += head
            out += head.join(raws[1:])
            records += m
            prev = at + m * stride
            pos = end + m * stride
    blob = bytes(out)
    for i, (key, ends, at, vlen, will_init) in zip(placed, runs, strict=True):
        items[i] = (key, ends, blob, at, vlen, will_init)
    return pos, prev, latest_page, records, items, tuple(nblocks), stop, stop_rel


def check_triples_args(entries: object, ends: object, start: int, stop: int, offset: int, vlen: int) -> None:
    """The argument checks both implementations of ``append_triples`` make (same messages)."""
    if not isinstance(entries, array) or entries.typecode != "Q" or not isinstance(ends, array) or ends.typecode != "Q":
        raise ValueError("append_triples takes two array('Q')")
    if not 0 <= start <= stop <= len(ends):
        raise ValueError(f"values {start}..{stop} are not inside a run of {len(ends)}")
    if offset < 0 or vlen <= 0 or (offset + (stop - start) * vlen) << 1 > _U64_MAX:
        raise ValueError(f"values of {vlen} bytes from offset {offset} do not fit an index entry")


def append_triples(entries: array[int], ends: array[int], start: int, stop: int, offset: int, vlen: int, will_init: bool) -> None:
    """The index entries of a packed run's values (see the module docstring)."""
    check_triples_args(entries, ends, start, stop, offset, vlen)
    count = stop - start
    triples = [vlen] * (3 * count)
    triples[0::3] = ends[start:stop]
    at = (offset << 1) | bool(will_init)
    step = vlen << 1
    triples[1::3] = range(at, at + count * step, step)
    entries.fromlist(triples)
