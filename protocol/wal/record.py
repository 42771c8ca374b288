"""Decoded PostgreSQL 15 WAL records: the interface WAL ingest and redo build on.

Names here are stable:

- ``RelFileNode(spc, db, rel)``: a relation's physical identity.
- ``XLogRecordHeader``: the 24-byte ``XLogRecord`` header (``tot_len, xid, prev, info, rmid,
  crc``); ``XLOG_RECORD_HEADER`` is its precompiled struct.
- ``BlockRef``: one block reference. ``block_id``, ``rnode`` (also ``spc``/``db``/``rel``),
  ``forknum``, ``blkno``, ``fork_flags`` (the raw byte: fork in the low nibble, ``BKPBLOCK_*``
  in the high one; ``has_image``, ``has_data``, ``will_init``, ``same_rel`` read it),
  ``bimg_len``, ``hole_offset``, ``hole_length``, ``bimg_info`` (``apply_image``,
  ``compression`` read it), ``image_data`` (the image bytes exactly as stored in the record:
  hole removed, maybe compressed) and ``data`` (the block's payload). ``image`` is the full
  8192-byte page with the hole re-inserted and decompressed, computed on first access and
  cached, so a reader that only needs record boundaries never pays for it.
- ``DecodedRecord``: ``lsn`` (start), ``end_lsn`` (PostgreSQL's EndRecPtr: where the next
  record begins, MAXALIGNed; for XLOG_SWITCH the next segment start), the header fields under
  PostgreSQL's names ``xl_tot_len, xl_xid, xl_prev, xl_info, xl_rmid, xl_crc``, ``blocks``
  (in block-id order), ``main_data``, ``origin`` and ``toplevel_xid`` (``None`` if absent) and
  ``raw`` (the whole record, header included, as covered by the CRC).
- ``decode_record(raw, lsn, end_lsn=None)``: decode a complete record, e.g. one a pageserver
  stored raw; this is what the stream reader calls too. Bad input raises
  ``RemoteProtocolError`` with pg_waldump's wording for the same fault.

The body is parsed exactly like PostgreSQL's ``DecodeXLogRecord``: fragment headers (block
references, origin, top-level xid, main-data length) until the remaining length equals the
announced payload length, then the payloads in header order (per block: image, data; then
the main data).
"""

from __future__ import annotations

import functools
import struct

import attrs

from protocol.errors import RemoteProtocolError
from protocol.lsn import WAL_SEGMENT_SIZE, Lsn, format_lsn
from protocol.wal import crc as _crcmod
from protocol.wal.page import record_end_lsn
from protocol.wal.pglz import pglz_decompress
from protocol.wal.rmgr import XLOG_SWITCH, RmgrId, record_type_name, rmgr_name

BLCKSZ = 8192
SIZE_OF_XLOG_RECORD = 24
MAX_RECORD_LENGTH = 0x3FFF_FFFF  # PostgreSQL's MaxAllocSize: larger records cannot be read

XLR_MAX_BLOCK_ID = 32
XLR_BLOCK_ID_DATA_SHORT = 255
XLR_BLOCK_ID_DATA_LONG = 254
XLR_BLOCK_ID_ORIGIN = 253
XLR_BLOCK_ID_TOPLEVEL_XID = 252

BKPBLOCK_FORK_MASK = 0x0F
BKPBLOCK_HAS_IMAGE = 0x10
BKPBLOCK_HAS_DATA = 0x20
BKPBLOCK_WILL_INIT = 0x40
BKPBLOCK_SAME_REL = 0x80

BKPIMAGE_HAS_HOLE = 0x01
BKPIMAGE_APPLY = 0x02
BKPIMAGE_COMPRESS_PGLZ = 0x04
BKPIMAGE_COMPRESS_LZ4 = 0x08
BKPIMAGE_COMPRESS_ZSTD = 0x10
BKPIMAGE_COMPRESSED_MASK = BKPIMAGE_COMPRESS_PGLZ | BKPIMAGE_COMPRESS_LZ4 | BKPIMAGE_COMPRESS_ZSTD

MAIN_FORKNUM = 0
FSM_FORKNUM = 1
VISIBILITYMAP_FORKNUM = 2
INIT_FORKNUM = 3
FORK_NAMES = ("main", "fsm", "vm", "init")

# tot_len, xid, prev, info, rmid, (2 pad), crc
XLOG_RECORD_HEADER = struct.Struct("<IIQBB2xI")
_U8 = struct.Struct("<B")
_U16 = struct.Struct("<H")
_U32 = struct.Struct("<I")
_BLOCK_HEADER = struct.Struct("<BH")  # fork_flags, data_length (after the id byte)
_IMAGE_HEADER = struct.Struct("<HHB")  # bimg_len, hole_offset, bimg_info
_RNODE_BLKNO = struct.Struct("<IIII")  # spc, db, rel, blkno
_CRC_OFFSET = 20
# The commonest record (a heap or btree insert): block 0 without an image or SAME_REL, then the
# short main-data header and nothing else. Fragment headers: block_id, fork_flags, data_length,
# spc, db, rel, blkno, XLR_BLOCK_ID_DATA_SHORT, main_len.
_SIMPLE_HEADERS = struct.Struct("<BBHIIIIBB")
_SIMPLE_PAYLOAD_AT = SIZE_OF_XLOG_RECORD + _SIMPLE_HEADERS.size
_SIMPLE_NOT = BKPBLOCK_HAS_IMAGE | BKPBLOCK_SAME_REL



def record_crc(raw: bytes | bytearray | memoryview) -> int:
    """CRC-32C as PostgreSQL computes it: the body after the header, then header bytes 0..20."""
    # Plain slices: for a ~150-byte record, copying beats building memoryview objects.
    crc = _crcmod.crc32c
    return crc(raw[:_CRC_OFFSET], crc(raw[SIZE_OF_XLOG_RECORD:]))


@attrs.frozen(slots=True)
class RelFileNode:
    spc: int
    db: int
    rel: int

    def __str__(self) -> str:
        return f"{self.spc}/{self.db}/{self.rel}"


@attrs.frozen(slots=True)
class XLogRecordHeader:
    tot_len: int
    xid: int
    prev: int
    info: int
    rmid: int
    crc: int

    @classmethod
    def parse(cls, buf: bytes | bytearray | memoryview, off: int = 0) -> XLogRecordHeader:
        if len(buf) - off < SIZE_OF_XLOG_RECORD:
            raise RemoteProtocolError("truncated XLogRecord header")
        return cls(*XLOG_RECORD_HEADER.unpack_from(buf, off))

    def pack(self) -> bytes:
        return XLOG_RECORD_HEADER.pack(
            self.tot_len, self.xid, self.prev, self.info, self.rmid, self.crc
        )


# BlockRef and DecodedRecord are built once per record on the ingest hot path. A frozen attrs
# class sets each field through object.__setattr__, which made construction about 4x slower
# than plain slot assignment (~3.5 vs ~0.9 us for DecodedRecord), so these two are mutable
# slotted classes; nobody mutates them, and unsafe_hash keeps them usable as dict keys.
@attrs.define(slots=True, unsafe_hash=True)
class BlockRef:
    block_id: int
    rnode: RelFileNode
    forknum: int
    blkno: int
    fork_flags: int
    bimg_len: int
    hole_offset: int
    hole_length: int
    bimg_info: int
    image_data: bytes | None
    data: bytes

    @property
    def spc(self) -> int:
        return self.rnode.spc

    @property
    def db(self) -> int:
        return self.rnode.db

    @property
    def rel(self) -> int:
        return self.rnode.rel

    @property
    def has_image(self) -> bool:
        return bool(self.fork_flags & BKPBLOCK_HAS_IMAGE)

    @property
    def has_data(self) -> bool:
        return bool(self.fork_flags & BKPBLOCK_HAS_DATA)

    @property
    def will_init(self) -> bool:
        return bool(self.fork_flags & BKPBLOCK_WILL_INIT)

    @property
    def same_rel(self) -> bool:
        return bool(self.fork_flags & BKPBLOCK_SAME_REL)

    @property
    def apply_image(self) -> bool:
        return bool(self.fork_flags & BKPBLOCK_HAS_IMAGE) and bool(self.bimg_info & BKPIMAGE_APPLY)

    @property
    def compression(self) -> str | None:
        """``"pglz"``, ``"lz4"``, ``"zstd"`` or ``None`` for an uncompressed (or no) image."""
        if self.bimg_info & BKPIMAGE_COMPRESS_PGLZ:
            return "pglz"
        if self.bimg_info & BKPIMAGE_COMPRESS_LZ4:
            return "lz4"
        if self.bimg_info & BKPIMAGE_COMPRESS_ZSTD:
            return "zstd"
        return None

    @functools.cached_property
    def image(self) -> bytes | None:
        """The full 8192-byte page image, or ``None`` if the reference carries no image.

        Restored (decompressed, hole zero-filled) on first access and kept.
        """
        if self.image_data is None:
            return None
        return restore_block_image(
            self.image_data, self.bimg_info, self.hole_offset, self.hole_length
        )


def restore_block_image(
    stored: bytes | memoryview, bimg_info: int, hole_offset: int, hole_length: int
) -> bytes:
    """PostgreSQL's ``RestoreBlockImage``: decompress, then put the zero hole back."""
    if hole_offset + hole_length > BLCKSZ:
        raise RemoteProtocolError(
            f"block image hole offset {hole_offset} length {hole_length} exceeds the page"
        )
    want = BLCKSZ - hole_length
    if bimg_info & BKPIMAGE_COMPRESSED_MASK:
        body = _decompress(stored, bimg_info, want)
    else:
        body = bytes(stored)
    if len(body) != want:
        raise RemoteProtocolError(f"block image is {len(body)} bytes, expected {want}")
    if hole_length == 0:
        return body
    return body[:hole_offset] + bytes(hole_length) + body[hole_offset:]


def _check_image_header(
    bimg_len: int, hole_offset: int, hole_length: int, bimg_info: int, lsn: int
) -> None:
    """The cross-checks PostgreSQL applies to a block image header."""
    compressed = bimg_info & BKPIMAGE_COMPRESSED_MASK
    has_hole = bimg_info & BKPIMAGE_HAS_HOLE
    if has_hole and (hole_offset == 0 or hole_length == 0 or bimg_len == BLCKSZ):
        raise RemoteProtocolError(
            f"BKPIMAGE_HAS_HOLE set, but hole offset {hole_offset} length {hole_length}"
            f" block image length {bimg_len} at {format_lsn(lsn)}"
        )
    if not has_hole and (hole_offset != 0 or hole_length != 0):
        raise RemoteProtocolError(
            f"BKPIMAGE_HAS_HOLE not set, but hole offset {hole_offset}"
            f" length {hole_length} at {format_lsn(lsn)}"
        )
    if compressed and bimg_len == BLCKSZ:
        raise RemoteProtocolError(
            f"BKPIMAGE_COMPRESSED set, but block image length {bimg_len} at {format_lsn(lsn)}"
        )
    if not has_hole and not compressed and bimg_len != BLCKSZ:
        raise RemoteProtocolError(
            "neither BKPIMAGE_HAS_HOLE nor BKPIMAGE_COMPRESSED set, but block image"
            f" length is {bimg_len} at {format_lsn(lsn)}"
        )


def _decompress(stored: bytes | memoryview, bimg_info: int, want: int) -> bytes:
    if bimg_info & BKPIMAGE_COMPRESS_PGLZ:
        return pglz_decompress(stored, want)
    if bimg_info & BKPIMAGE_COMPRESS_LZ4:
        import lz4.block

        try:
            out = lz4.block.decompress(bytes(stored), uncompressed_size=want)
        except Exception as exc:  # lz4 raises LZ4BlockError; corrupt input is the peer's fault
            raise RemoteProtocolError(f"could not decompress lz4 block image: {exc}") from None
        return bytes(out)
    import zstandard

    try:
        out = zstandard.ZstdDecompressor().decompress(bytes(stored), max_output_size=want)
    except zstandard.ZstdError as exc:
        raise RemoteProtocolError(f"could not decompress zstd block image: {exc}") from None
    return bytes(out)


@attrs.define(slots=True, unsafe_hash=True)  # mutable for speed: see BlockRef
class DecodedRecord:
    lsn: Lsn
    end_lsn: Lsn
    xl_tot_len: int
    xl_xid: int
    xl_prev: Lsn
    xl_info: int
    xl_rmid: int
    xl_crc: int
    blocks: tuple[BlockRef, ...]
    main_data: bytes
    origin: int | None
    toplevel_xid: int | None
    raw: bytes

    @property
    def header(self) -> XLogRecordHeader:
        return XLogRecordHeader(
            self.xl_tot_len, self.xl_xid, self.xl_prev, self.xl_info, self.xl_rmid, self.xl_crc
        )

    @property
    def rmgr_name(self) -> str:
        return rmgr_name(self.xl_rmid)

    @property
    def record_type(self) -> str:
        """pg_waldump's identify string, e.g. ``INSERT+INIT``."""
        return record_type_name(self.xl_rmid, self.xl_info)

    @property
    def fpi_len(self) -> int:
        """Bytes of block images (pg_waldump's ``tot - rec``)."""
        return sum(b.bimg_len for b in self.blocks if b.image_data is not None)

    @property
    def is_switch(self) -> bool:
        return self.xl_rmid == RmgrId.XLOG and self.xl_info & 0xF0 == XLOG_SWITCH

    def block(self, block_id: int) -> BlockRef | None:
        for blk in self.blocks:
            if blk.block_id == block_id:
                return blk
        return None


def decode_record(
    raw: bytes,
    lsn: int,
    end_lsn: int | None = None,
    *,
    verify_crc: bool = True,
    segment_size: int = WAL_SEGMENT_SIZE,
) -> DecodedRecord:
    """Decode one complete record (header included) that starts at ``lsn``.

    ``end_lsn`` defaults to the position PostgreSQL computes from ``lsn`` and the length.
    """
    raw = bytes(raw)
    if len(raw) < SIZE_OF_XLOG_RECORD:
        raise RemoteProtocolError(
            f"invalid record length at {format_lsn(lsn)}: wanted {SIZE_OF_XLOG_RECORD},"
            f" got {len(raw)}"
        )
    tot_len, xid, prev, info, rmid, crc = XLOG_RECORD_HEADER.unpack_from(raw)
    if tot_len != len(raw):
        raise RemoteProtocolError(
            f"record at {format_lsn(lsn)} has xl_tot_len {tot_len} but {len(raw)} bytes"
            " were given"
        )
    if verify_crc and record_crc(raw) != crc:
        raise RemoteProtocolError(
            f"incorrect resource manager data checksum in record at {format_lsn(lsn)}"
        )
    blocks, main_data, origin, toplevel_xid = decode_body(raw, lsn)
    if end_lsn is None:
        if rmid == RmgrId.XLOG and info & 0xF0 == XLOG_SWITCH:
            end_lsn = (lsn // segment_size + 1) * segment_size
        else:
            end_lsn = record_end_lsn(lsn, tot_len, segment_size)
    return DecodedRecord(
        Lsn(lsn),
        Lsn(end_lsn),
        tot_len,
        xid,
        Lsn(prev),
        info,
        rmid,
        crc,
        blocks,
        main_data,
        origin,
        toplevel_xid,
        raw,
    )


def _invalid_length(lsn: int) -> RemoteProtocolError:
    return RemoteProtocolError(f"record with invalid length at {format_lsn(lsn)}")


# RelFileNodes repeat constantly; share one object per relation instead of building one per
# block reference. Bounded so hostile input cannot grow it without limit.
_RNODE_CACHE: dict[tuple[int, int, int], RelFileNode] = {}
_RNODE_CACHE_MAX = 65536


def _rnode(key: tuple[int, int, int]) -> RelFileNode:
    rnode = _RNODE_CACHE.get(key)
    if rnode is None:
        if len(_RNODE_CACHE) >= _RNODE_CACHE_MAX:
            _RNODE_CACHE.clear()
        rnode = _RNODE_CACHE[key] = RelFileNode(*key)
    return rnode


def decode_body(
    raw: bytes, lsn: int
) -> tuple[tuple[BlockRef, ...], bytes, int | None, int | None]:
    """Parse the fragment headers and payloads after the 24-byte header.

    Returns ``(blocks, main_data, origin, toplevel_xid)``. ``lsn`` is the record's start,
    for error messages.
    """
    end = len(raw)
    if end >= _SIMPLE_PAYLOAD_AT and raw[SIZE_OF_XLOG_RECORD] == 0:
        # Fast path for the single-block record; it accepts exactly what the general parse
        # below would accept for this layout and returns the same values.
        _, fork_flags, data_len, spc, db, rel, blkno, main_id, main_len = (
            _SIMPLE_HEADERS.unpack_from(raw, SIZE_OF_XLOG_RECORD)
        )
        if (
            main_id == XLR_BLOCK_ID_DATA_SHORT
            and not fork_flags & _SIMPLE_NOT
            and _SIMPLE_PAYLOAD_AT + data_len + main_len == end
            and (data_len != 0) == bool(fork_flags & BKPBLOCK_HAS_DATA)
        ):
            key = (spc, db, rel)
            rnode = _RNODE_CACHE.get(key)
            if rnode is None:
                rnode = _rnode(key)
            split = _SIMPLE_PAYLOAD_AT + data_len
            block = BlockRef(
                0, rnode, fork_flags & BKPBLOCK_FORK_MASK, blkno, fork_flags, 0, 0, 0, 0, None,
                raw[_SIMPLE_PAYLOAD_AT:split],
            )
            return (block,), raw[split:], None, None
    pos = SIZE_OF_XLOG_RECORD
    datatotal = 0
    max_block_id = -1
    main_len = 0
    origin: int | None = None
    toplevel_xid: int | None = None
    prev_rnode: RelFileNode | None = None
    # (block_id, rnode, forknum, blkno, fork_flags, data_len, bimg_len, hole_off, hole_len, info)
    headers: list[tuple[int, RelFileNode, int, int, int, int, int, int, int, int]] = []
    while end - pos > datatotal:
        block_id = raw[pos]
        pos += 1
        if block_id <= XLR_MAX_BLOCK_ID:
            if block_id <= max_block_id:
                raise RemoteProtocolError(
                    f"out-of-order block_id {block_id} at {format_lsn(lsn)}"
                )
            max_block_id = block_id
            if pos + 3 > end:
                raise _invalid_length(lsn)
            fork_flags, data_len = _BLOCK_HEADER.unpack_from(raw, pos)
            pos += 3
            if fork_flags & BKPBLOCK_HAS_DATA:
                if data_len == 0:
                    raise RemoteProtocolError(
                        f"BKPBLOCK_HAS_DATA set, but no data included at {format_lsn(lsn)}"
                    )
            elif data_len != 0:
                raise RemoteProtocolError(
                    f"BKPBLOCK_HAS_DATA not set, but data length is {data_len}"
                    f" at {format_lsn(lsn)}"
                )
            datatotal += data_len
            bimg_len = hole_offset = hole_length = bimg_info = 0
            if fork_flags & BKPBLOCK_HAS_IMAGE:
                if pos + 5 > end:
                    raise _invalid_length(lsn)
                bimg_len, hole_offset, bimg_info = _IMAGE_HEADER.unpack_from(raw, pos)
                pos += 5
                compressed = bimg_info & BKPIMAGE_COMPRESSED_MASK
                if compressed:
                    if bimg_info & BKPIMAGE_HAS_HOLE:
                        if pos + 2 > end:
                            raise _invalid_length(lsn)
                        (hole_length,) = _U16.unpack_from(raw, pos)
                        pos += 2
                else:
                    # PostgreSQL keeps this in a uint16, so a bogus bimg_len > BLCKSZ wraps.
                    hole_length = (BLCKSZ - bimg_len) & 0xFFFF
                datatotal += bimg_len
                _check_image_header(bimg_len, hole_offset, hole_length, bimg_info, lsn)
            if fork_flags & BKPBLOCK_SAME_REL:
                if prev_rnode is None:
                    raise RemoteProtocolError(
                        f"BKPBLOCK_SAME_REL set but no previous rel at {format_lsn(lsn)}"
                    )
                rnode = prev_rnode
                if pos + 4 > end:
                    raise _invalid_length(lsn)
                (blkno,) = _U32.unpack_from(raw, pos)
                pos += 4
            else:
                if pos + 16 > end:
                    raise _invalid_length(lsn)
                spc, db, rel, blkno = _RNODE_BLKNO.unpack_from(raw, pos)
                pos += 16
                rnode = prev_rnode = _rnode((spc, db, rel))
            headers.append(
                (
                    block_id,
                    rnode,
                    fork_flags & BKPBLOCK_FORK_MASK,
                    blkno,
                    fork_flags,
                    data_len,
                    bimg_len,
                    hole_offset,
                    hole_length,
                    bimg_info,
                )
            )
        elif block_id == XLR_BLOCK_ID_DATA_SHORT:
            if pos + 1 > end:
                raise _invalid_length(lsn)
            main_len = raw[pos]
            pos += 1
            datatotal += main_len
            break  # by convention the main data header is the last one
        elif block_id == XLR_BLOCK_ID_DATA_LONG:
            if pos + 4 > end:
                raise _invalid_length(lsn)
            (main_len,) = _U32.unpack_from(raw, pos)
            pos += 4
            datatotal += main_len
            break
        elif block_id == XLR_BLOCK_ID_ORIGIN:
            if pos + 2 > end:
                raise _invalid_length(lsn)
            (origin,) = _U16.unpack_from(raw, pos)
            pos += 2
        elif block_id == XLR_BLOCK_ID_TOPLEVEL_XID:
            if pos + 4 > end:
                raise _invalid_length(lsn)
            (toplevel_xid,) = _U32.unpack_from(raw, pos)
            pos += 4
        else:
            raise RemoteProtocolError(f"invalid block_id {block_id} at {format_lsn(lsn)}")
    if end - pos != datatotal:
        raise _invalid_length(lsn)
    blocks: list[BlockRef] = []
    for bid, rnode, forknum, blkno, fork_flags, data_len, bimg_len, hoff, hlen, binfo in headers:
        image: bytes | None = None
        if fork_flags & BKPBLOCK_HAS_IMAGE:
            image = raw[pos : pos + bimg_len]
            pos += bimg_len
        data = raw[pos : pos + data_len]
        pos += data_len
        blocks.append(
            BlockRef(bid, rnode, forknum, blkno, fork_flags, bimg_len, hoff, hlen, binfo, image, data)
        )
    main_data = raw[pos : pos + main_len]
    return tuple(blocks), main_data, origin, toplevel_xid
