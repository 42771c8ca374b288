"""WAL kernels in pure Python: the reference twin of ``protocol/_wal_c.pyx``.

Same names, signatures and results (errors included) as the compiled module; the tests run
both on the same bytes (tests/protocol/test_native_wal.py). Which one the rest of pagestore
uses is decided once, by ``protocol._native`` (``PAGESTORE_PURE_PYTHON=1`` selects this one).

- ``crc32c(data, value=0)``: CRC-32C continuing from ``value`` (``crc32c(b, crc32c(a)) ==
  crc32c(a + b)``). This twin calls the ``crc32c`` package (a C extension pagestore already
  depends on): a pure-Python table runs at ~10 MB/s, too slow for even the test suite, and
  the package is an independent implementation for the differential tests. The tests also
  check both against a pure-Python bitwise definition.
- ``crc32c_kernel()``: which CRC kernel runs (``"sse4.2"``, ``"table"`` or, here,
  ``"crc32c-package/hardware"`` / ``"crc32c-package/software"``).
- ``scan_records(buf, i, n, base, seg_size)``: the safekeeper's record walk (see its
  docstring).
"""

from __future__ import annotations

import struct
from collections.abc import Callable
from typing import TYPE_CHECKING, Final

if TYPE_CHECKING:
    from typing_extensions import Buffer

__all__ = ["IMPL", "crc32c", "crc32c_kernel", "scan_records"]

IMPL: Final = "python"

# PostgreSQL 15 constants (protocol.wal.page / rmgr / record; this module stays a leaf so the
# compiled twin can mirror it exactly; tests/protocol/test_native_wal.py checks they agree).
XLOG_BLCKSZ: Final = 8192
SHORT_PHD: Final = 24
RECORD_HEADER: Final = 24
XLOG_PAGE_MAGIC: Final = 0xD110
XLP_FIRST_IS_CONTRECORD: Final = 0x0001
XLP_LONG_HEADER: Final = 0x0002
XLP_ALL_FLAGS: Final = 0x000F
XLOG_SWITCH: Final = 0x40
RM_XLOG_ID: Final = 0
# CRC-32C over any message followed by its own CRC (little-endian) is this constant: checking
# header bytes [0, 24) (the stored xl_crc last) against it is the "computed == stored" check.
CRC_RESIDUE: Final = 0x48674BC7

_PAGE_HEADER = struct.Struct("<HHIQI")
_REC_HEAD = struct.Struct("<I12xBB")
# A continuation page's header may not have unknown bits nor the long-header flag.
_BAD_CONT_INFO = (~XLP_ALL_FLAGS | XLP_LONG_HEADER) & 0xFFFF
_PAGE_ROOM = XLOG_BLCKSZ - SHORT_PHD


_package_crc: Callable[[Buffer, int], int] | None = None


def _crc() -> Callable[[Buffer, int], int]:
    # The package's __init__ imports socket (protocol/ may not, at import): load it lazily.
    global _package_crc
    if _package_crc is None:
        from crc32c import crc32c as fast

        _package_crc = fast
    return _package_crc


def crc32c(data: Buffer, value: int = 0) -> int:
    """CRC-32C of ``data``, continuing from ``value`` (the previous call's result)."""
    if not 0 <= value <= 0xFFFFFFFF:
        raise OverflowError(f"CRC value {value} out of range")
    return int(_crc()(data, value))


def crc32c_kernel() -> str:
    """Which CRC-32C kernel this twin runs."""
    import crc32c as package

    return "crc32c-package/" + ("hardware" if package.hardware_based else "software")


def _check_scan_args(buf_len: int, i: int, n: int, base: int, seg_size: int) -> None:
    if not 0 <= i <= n <= buf_len:
        raise ValueError(f"scan range [{i}, {n}) is not inside a buffer of {buf_len} bytes")
    if seg_size <= 0 or seg_size % XLOG_BLCKSZ:
        raise ValueError(f"segment size {seg_size} is not a positive multiple of {XLOG_BLCKSZ}")
    if base < 0 or base + n >= 1 << 64:
        raise ValueError(f"base LSN {base:#x} + {n} is not a 64-bit LSN")
    if (base + i) % 8:
        raise ValueError(f"record start {base + i:#x} is not MAXALIGNed")


def scan_records(buf: Buffer, i: int, n: int, base: int, seg_size: int) -> tuple[int, int, int]:
    """Walk complete records in ``buf[i:n]`` (``buf[k]`` is the WAL byte at LSN ``base + k``).

    ``i`` must be a MAXALIGNed record start that is not a page start. Consumes every record
    that lies wholly in ``buf[i:n]``, with its MAXALIGN padding, including records that
    continue over short page headers (each checked: magic, address, flags, continuation
    length); every record's CRC-32C is checked. It stops before anything else (a page start,
    a segment's long header, an XLOG_SWITCH, an incomplete record, anything suspicious),
    which the caller's state machine handles and reports.

    Returns ``(index, last_end, bad)``: ``index`` where the caller resumes; ``last_end`` the
    index just past the last complete record's padding (``-1`` if none; it may exceed ``n``
    when the padding is not in the buffer, and then ``index`` is that record's end);
    ``bad`` the index of the first record whose CRC is wrong (``-1`` if none; the walk stops
    there, and ``last_end`` covers the good records before it).
    """
    view = memoryview(buf).cast("B")
    _check_scan_args(len(view), i, n, base, seg_size)
    # Slicing bytes is cheaper than slicing a memoryview: copy small-record chunks once.
    data: bytes | memoryview = view.tobytes() if n - i < 1 << 20 else view
    crc32 = _crc()
    unpack = _REC_HEAD.unpack_from
    unpack_page = _PAGE_HEADER.unpack_from
    last_end = -1
    while True:
        in_page = (base + i) % XLOG_BLCKSZ
        if not in_page:
            break  # a page header: the caller's
        page_end = i + XLOG_BLCKSZ - in_page
        stop = page_end if page_end < n else n
        # Records wholly on this page.
        while stop - i >= RECORD_HEADER:
            tot_len, info, rmid = unpack(data, i)
            end = i + tot_len
            if tot_len < RECORD_HEADER or end > stop:
                break
            if rmid == RM_XLOG_ID and info & 0xF0 == XLOG_SWITCH:
                break
            body = i + RECORD_HEADER
            if crc32(data[i:body], crc32(data[body:end], 0)) != CRC_RESIDUE:
                return i, last_end, i
            # MAXALIGN: a record starts aligned, so its padding follows from its length.
            last_end = i + ((tot_len + 7) & ~7)
            if last_end > n:
                return end, last_end, -1  # the padding is not in this buffer
            i = last_end
        # A record that continues on the next pages, if it is all in the buffer.
        if page_end - i < RECORD_HEADER or n - i < RECORD_HEADER:
            break
        tot_len, info, rmid = unpack(data, i)
        end = i + tot_len
        if end <= page_end or end > n or (rmid == RM_XLOG_ID and info & 0xF0 == XLOG_SWITCH):
            break
        body = i + RECORD_HEADER
        crc = crc32(data[body:page_end], 0)
        left = end - page_end
        p = page_end
        while left:
            piece = p + SHORT_PHD
            if piece > n or (base + p) % seg_size == 0:
                break
            magic, pinfo, _tli, pageaddr, rem_len = unpack_page(data, p)
            if (
                magic != XLOG_PAGE_MAGIC
                or pageaddr != base + p
                or pinfo & _BAD_CONT_INFO
                or not pinfo & XLP_FIRST_IS_CONTRECORD
                or rem_len != left
            ):
                break
            take = left if left < _PAGE_ROOM else _PAGE_ROOM
            p = piece + take
            if p > n:
                break
            crc = crc32(data[piece:p], crc)
            left -= take
        if left:
            break
        if crc32(data[i:body], crc) != CRC_RESIDUE:
            return i, last_end, i
        last_end = ((base + p + 7) & ~7) - base
        if last_end > n:
            return p, last_end, -1
        i = last_end
    return i, last_end, -1
