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

Arguments outside the buffer (``o + k * stride + tot_len > len(buf)``), a ``tot_len`` below
the 46 bytes a run compares, a ``stride`` below ``tot_len``, a negative ``o`` or ``k``, a
``vm_at`` at or past ``tot_len``, or an LSN ``pos + k * stride`` beyond 64 bits are a
``ValueError``: the kernel never reads past what it was given.
"""

from __future__ import annotations

import struct
from collections.abc import Sequence
from functools import lru_cache
from typing import TYPE_CHECKING, Final

from protocol._wal_py import crc32c

if TYPE_CHECKING:
    from typing_extensions import Buffer

__all__ = ["IMPL", "same_run"]

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
            crcs = tuple(map(crc32c, pieces[0::2], map(crc32c, pieces[1::2])))
            want_crcs = heads[3 : 5 * m : 5]
            if crcs != want_crcs:
                m = _first_difference(crcs, want_crcs)
    return m, _run_struct(f"{tot_len}s", stride - tot_len, m + 1).unpack_from(view, o)
