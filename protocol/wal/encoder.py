"""Write valid PostgreSQL 15 WAL for synthetic records (tests and benchmarks).

``build_record`` lays out one record the way PostgreSQL's ``XLogRecordAssemble`` does: the
24-byte header, block headers (``BKPBLOCK_SAME_REL`` when a block repeats the previous
block's relation), the origin and top-level xid fragments, the main-data length, then the
payloads (per block: image, data; then main data), with the CRC-32C filled in.

``WalEncoder`` places records into the WAL byte stream: a page header on every 8 KiB page
(the long one at each segment start), records split across pages with
``XLP_FIRST_IS_CONTRECORD`` and ``xlp_rem_len``, MAXALIGN padding, the ``xl_prev`` chain, and
XLOG_SWITCH zero-filling the rest of its segment. ``take()`` returns the bytes produced since
the last call, so a benchmark can stream hundreds of MiB without keeping them.

Images: ``BlockSpec.image`` is a full 8192-byte page. Like PostgreSQL for a "standard" page,
the hole defaults to ``[pd_lower, pd_upper)`` when those header fields are sane; pass
``hole=(offset, length)`` to choose it, ``hole=(0, 0)`` for none. The writer omits the hole's
bytes whatever they contain; a reader restores zeros there.
"""

from __future__ import annotations

import struct
from collections.abc import Sequence

import attrs

from protocol.errors import LocalProtocolError
from protocol.lsn import WAL_SEGMENT_SIZE, XLOG_BLCKSZ, Lsn, format_lsn
from protocol.wal import crc as _crcmod
from protocol.wal.page import (
    XLP_BKP_REMOVABLE,
    XLP_FIRST_IS_CONTRECORD,
    encode_page_header,
)
from protocol.wal.pglz import pglz_compress
from protocol.wal.record import (
    BKPBLOCK_HAS_DATA,
    BKPBLOCK_HAS_IMAGE,
    BKPBLOCK_SAME_REL,
    BKPBLOCK_WILL_INIT,
    BKPIMAGE_APPLY,
    BKPIMAGE_COMPRESS_LZ4,
    BKPIMAGE_COMPRESS_PGLZ,
    BKPIMAGE_COMPRESS_ZSTD,
    BKPIMAGE_HAS_HOLE,
    BLCKSZ,
    SIZE_OF_XLOG_RECORD,
    XLR_BLOCK_ID_DATA_LONG,
    XLR_BLOCK_ID_DATA_SHORT,
    XLR_BLOCK_ID_ORIGIN,
    XLR_BLOCK_ID_TOPLEVEL_XID,
    XLR_MAX_BLOCK_ID,
    RelFileNode,
)
from protocol.wal.rmgr import XLOG_SWITCH, RmgrId

_HEAD20 = struct.Struct("<IIQBB2x")
_U32 = struct.Struct("<I")
_BLOCK_HEADER = struct.Struct("<BBH")  # id, fork_flags, data_length
_IMAGE_HEADER = struct.Struct("<HHB")
_U16 = struct.Struct("<H")
_RNODE = struct.Struct("<III")
_PD_LOWER_UPPER = struct.Struct("<HH")
_ORIGIN = struct.Struct("<BH")
_ID_U32 = struct.Struct("<BI")

_PAGE_MASK = XLOG_BLCKSZ - 1
_PAGE_INFO = XLP_BKP_REMOVABLE  # what a primary without a running backup writes
_SIZE_OF_PAGE_HEADER_DATA = 24  # the heap/index page header, for the default hole


@attrs.frozen(slots=True)
class BlockSpec:
    """One block reference to write. ``block_id`` defaults to the position in the list."""

    rnode: RelFileNode
    blkno: int
    forknum: int = 0
    data: bytes = b""
    image: bytes | None = None
    apply_image: bool = True
    will_init: bool = False
    hole: tuple[int, int] | None = None
    compression: str | None = None
    block_id: int | None = None


def standard_hole(page: bytes) -> tuple[int, int]:
    """PostgreSQL's hole for a standard page: ``[pd_lower, pd_upper)`` if the header is sane."""
    lower, upper = _PD_LOWER_UPPER.unpack_from(page, 12)
    if lower >= _SIZE_OF_PAGE_HEADER_DATA and lower < upper <= BLCKSZ:
        return lower, upper - lower
    return 0, 0


def _compress(body: bytes, method: str) -> tuple[bytes, int]:
    if method == "pglz":
        return pglz_compress(body), BKPIMAGE_COMPRESS_PGLZ
    if method == "lz4":
        import lz4.block

        return bytes(lz4.block.compress(body, store_size=False)), BKPIMAGE_COMPRESS_LZ4
    if method == "zstd":
        import zstandard

        return bytes(zstandard.ZstdCompressor().compress(body)), BKPIMAGE_COMPRESS_ZSTD
    raise LocalProtocolError(f"unknown WAL image compression {method!r}")


def build_record(
    *,
    prev: int,
    rmid: int,
    info: int,
    xid: int = 0,
    blocks: Sequence[BlockSpec] = (),
    main_data: bytes = b"",
    origin: int | None = None,
    toplevel_xid: int | None = None,
) -> bytes:
    """The bytes of one complete record, CRC included (see the module docstring)."""
    heads: list[bytes] = []
    payloads: list[bytes] = []
    last_id = -1
    prev_rnode: RelFileNode | None = None
    for index, blk in enumerate(blocks):
        block_id = index if blk.block_id is None else blk.block_id
        if not last_id < block_id <= XLR_MAX_BLOCK_ID:
            raise LocalProtocolError(f"block ids must increase and be <= 32, got {block_id}")
        last_id = block_id
        data_len = len(blk.data)
        if data_len > 0xFFFF:
            raise LocalProtocolError(f"block data of {data_len} bytes does not fit a u16")
        flags = blk.forknum & 0x0F
        if data_len:
            flags |= BKPBLOCK_HAS_DATA
        if blk.will_init:
            flags |= BKPBLOCK_WILL_INIT
        same_rel = blk.rnode == prev_rnode
        if same_rel:
            flags |= BKPBLOCK_SAME_REL
        image_head = b""
        if blk.image is not None:
            flags |= BKPBLOCK_HAS_IMAGE
            page = blk.image
            if len(page) != BLCKSZ:
                raise LocalProtocolError(f"block image must be {BLCKSZ} bytes, got {len(page)}")
            hole_off, hole_len = standard_hole(page) if blk.hole is None else blk.hole
            if hole_len and (hole_off <= 0 or hole_off + hole_len > BLCKSZ):
                raise LocalProtocolError(f"bad image hole {hole_off}+{hole_len}")
            body = page[:hole_off] + page[hole_off + hole_len :] if hole_len else page
            bimg_info = BKPIMAGE_APPLY if blk.apply_image else 0
            if hole_len:
                bimg_info |= BKPIMAGE_HAS_HOLE
            else:
                hole_off = 0
            if blk.compression is not None:
                body, method_bit = _compress(body, blk.compression)
                if len(body) >= BLCKSZ:
                    raise LocalProtocolError("compressed image is not smaller than a page")
                bimg_info |= method_bit
                image_head = _IMAGE_HEADER.pack(len(body), hole_off, bimg_info)
                if hole_len:
                    image_head += _U16.pack(hole_len)
            else:
                image_head = _IMAGE_HEADER.pack(len(body), hole_off, bimg_info)
            payloads.append(body)
        heads.append(_BLOCK_HEADER.pack(block_id, flags, data_len) + image_head)
        if not same_rel:
            heads.append(_RNODE.pack(blk.rnode.spc, blk.rnode.db, blk.rnode.rel))
            prev_rnode = blk.rnode
        heads.append(_U32.pack(blk.blkno))
        if data_len:
            payloads.append(blk.data)
    if origin is not None:
        heads.append(_ORIGIN.pack(XLR_BLOCK_ID_ORIGIN, origin))
    if toplevel_xid is not None:
        heads.append(_ID_U32.pack(XLR_BLOCK_ID_TOPLEVEL_XID, toplevel_xid))
    main_len = len(main_data)
    if main_len:
        if main_len > 255:
            heads.append(_ID_U32.pack(XLR_BLOCK_ID_DATA_LONG, main_len))
        else:
            heads.append(bytes((XLR_BLOCK_ID_DATA_SHORT, main_len)))
        payloads.append(main_data)
    body = b"".join(heads) + b"".join(payloads)
    head20 = _HEAD20.pack(SIZE_OF_XLOG_RECORD + len(body), xid, prev, info, rmid)
    crc_fn = _crcmod.crc32c
    crc = crc_fn(head20, crc_fn(body))
    return head20 + _U32.pack(crc) + body


class WalEncoder:
    """Append records to a WAL stream that starts at ``start_lsn`` (a record start).

    If ``start_lsn`` is a page boundary the stream begins with that page's header; otherwise
    it begins mid-page, continuing a page someone else wrote the header of.
    """

    def __init__(
        self,
        start_lsn: int,
        *,
        prev_lsn: int = 0,
        timeline: int = 1,
        system_identifier: int = 0x7000_0000_0000_0001,
        segment_size: int = WAL_SEGMENT_SIZE,
    ) -> None:
        if start_lsn & 7:
            raise LocalProtocolError(f"WAL start {format_lsn(start_lsn)} is not MAXALIGNed")
        self._pos: int = start_lsn
        self._out = bytearray()
        self._out_lsn: int = start_lsn
        self._prev: int = prev_lsn
        self._tli = timeline
        self._sysid = system_identifier
        self._segment_size = segment_size
        self.records_written = 0

    @property
    def insert_lsn(self) -> Lsn:
        """Where the next byte goes: the end LSN of the last record."""
        return Lsn(self._pos)

    @property
    def prev_lsn(self) -> Lsn:
        """Start of the last record written (the next record's ``xl_prev``)."""
        return Lsn(self._prev)

    @property
    def buffered(self) -> int:
        return len(self._out)

    def take(self) -> bytes:
        """The bytes produced since the last ``take`` (starting at the previous take's end)."""
        out = bytes(self._out)
        self._out_lsn += len(out)
        self._out.clear()
        return out

    def _header(self, pageaddr: int, info: int, rem_len: int) -> bytes:
        return encode_page_header(
            pageaddr,
            info=info,
            rem_len=rem_len,
            tli=self._tli,
            sysid=self._sysid,
            segment_size=self._segment_size,
        )

    def append(
        self,
        rmid: int,
        info: int,
        *,
        xid: int = 0,
        blocks: Sequence[BlockSpec] = (),
        main_data: bytes = b"",
        origin: int | None = None,
        toplevel_xid: int | None = None,
    ) -> tuple[Lsn, Lsn]:
        """Write one record; returns its (start LSN, end LSN)."""
        out = self._out
        pos = self._pos
        if pos & _PAGE_MASK == 0:
            hdr = self._header(pos, _PAGE_INFO, 0)
            out += hdr
            pos += len(hdr)
        lsn = pos
        raw = build_record(
            prev=self._prev,
            rmid=rmid,
            info=info,
            xid=xid,
            blocks=blocks,
            main_data=main_data,
            origin=origin,
            toplevel_xid=toplevel_xid,
        )
        n = len(raw)
        page_rem = XLOG_BLCKSZ - (pos & _PAGE_MASK)
        if n <= page_rem:
            out += raw
            pos += n
        else:
            mv = memoryview(raw)
            out += mv[:page_rem]
            off = page_rem
            pos += page_rem
            while off < n:
                hdr = self._header(pos, _PAGE_INFO | XLP_FIRST_IS_CONTRECORD, n - off)
                out += hdr
                piece = min(n - off, XLOG_BLCKSZ - len(hdr))
                out += mv[off : off + piece]
                off += piece
                pos += len(hdr) + piece
        end = (pos + 7) & ~7
        if end != pos:
            out += bytes(end - pos)
        if rmid == RmgrId.XLOG and info & 0xF0 == XLOG_SWITCH:
            seg_end = (lsn // self._segment_size + 1) * self._segment_size
            out += bytes(seg_end - end)
            end = seg_end
        self._pos = end
        self._prev = lsn
        self.records_written += 1
        return Lsn(lsn), Lsn(end)

    def switch(self) -> tuple[Lsn, Lsn]:
        """An XLOG_SWITCH record; the next record starts the next segment."""
        return self.append(RmgrId.XLOG, XLOG_SWITCH)

    def zero_fill_to_segment_end(self) -> None:
        """Zeros up to the segment end without a record: what a preallocated file holds."""
        seg_end = -(-self._pos // self._segment_size) * self._segment_size
        self._out += bytes(seg_end - self._pos)
        # Not a valid position to continue from: WAL ends here.
        self._pos = seg_end
