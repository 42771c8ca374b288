"""The redo manager through the storage engine's interface: keys, stored values, errors."""

from __future__ import annotations

import struct

import lz4.block
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pageserver.storage.key import (
    SLRU_CLOG,
    SLRU_MULTIXACT_MEMBERS,
    SLRU_MULTIXACT_OFFSETS,
    Key,
    rel_block_key,
    relmap_file_key,
    slru_block_key,
)
from pageserver.storage.reconstruct import PageReconstructError
from pageserver.storage.value import (
    ClearVisibilityMapFlags,
    ClogSetAborted,
    ClogSetCommitted,
    MultixactMembersCreate,
    MultixactOffsetCreate,
    PostgresRecord,
    TestRecord,
    TruncateVisibilityMap,
    WalRecordValue,
)
from pageserver.walredo import bufpage as bp
from pageserver.walredo import clog, multixact
from pageserver.walredo.manager import PostgresRedoManager
from pageserver.walredo.visibilitymap import vm_get, vm_set_in_page
from protocol.lsn import Lsn
from protocol.wal.encoder import BlockSpec, build_record
from protocol.wal.record import RelFileNode, record_crc
from protocol.wal.rmgr import XACT_XINFO_HAS_SUBXACTS

REL = RelFileNode(1663, 5, 16384)
KEY = rel_block_key(1663, 5, 16384, 0, 7)


def _heap_insert(offnum: int, payload: bytes, *, init: bool, xid: int = 900, flags: int = 0) -> bytes:
    xlhdr = struct.pack("<HHB", 2, 0x0802, 24)  # natts 2, HEAP_XMAX_INVALID|HASVARWIDTH, hoff
    return build_record(
        prev=0,
        rmid=10,
        info=0x80 if init else 0x00,
        xid=xid,
        blocks=[BlockSpec(REL, 7, data=xlhdr + b"\x00" + payload, will_init=init)],
        main_data=struct.pack("<HB", offnum, flags),
    )


def _apply(key: bytes, base: bytes | bytearray | None, recs: list[tuple[int, WalRecordValue]]) -> bytes:
    base_b = bytes(base) if base is not None else None
    return PostgresRedoManager().apply(Key(key), base_b, [(Lsn(lsn), v) for lsn, v in recs])


def test_heap_insert_init_then_insert() -> None:
    r1 = _heap_insert(1, b"hello", init=True)
    r2 = _heap_insert(2, b"world!", init=False, xid=901)
    page = _apply(KEY, None, [(0x1000, PostgresRecord(True, r1)), (0x2000, PostgresRecord(False, r2))])
    assert bp.page_get_lsn(page) == 0x2000
    assert bp.max_offset(page) == 2
    raw = bp.get_itemid(page, 2)
    off = bp.lp_off(raw)
    xmin, xmax, cid, bhi, blo, posid = struct.unpack_from("<IIIHHH", page, off)
    assert (xmin, xmax, cid, (bhi << 16) | blo, posid) == (901, 0, 0, 7, 2)
    assert page[off + 24 : off + bp.lp_len(raw)] == b"world!"


def test_record_already_applied_is_skipped() -> None:
    r1 = _heap_insert(1, b"hello", init=True)
    r2 = _heap_insert(2, b"again", init=False)
    page = _apply(KEY, None, [(0x1000, PostgresRecord(True, r1))])
    newer = bytearray(page)
    bp.page_set_lsn(newer, 0x3000)
    assert _apply(KEY, bytes(newer), [(0x2000, PostgresRecord(False, r2))]) == bytes(newer)


def test_unknown_rmgr_names_it() -> None:
    # a custom resource manager (an extension's): no redo here, ever
    custom = build_record(prev=0, rmid=130, info=0x00, blocks=[BlockSpec(REL, 7, data=b"xx")], main_data=b"\0\0")
    with pytest.raises(PageReconstructError, match="no redo for resource manager custom130"):
        _apply(KEY, bp.new_page(0), [(0x1000, PostgresRecord(False, custom))])


def test_record_not_touching_the_page_is_an_error() -> None:
    other = _heap_insert(1, b"x", init=True)
    with pytest.raises(PageReconstructError, match="does not reference"):
        _apply(rel_block_key(1663, 5, 16384, 0, 8), bp.new_page(0), [(0x1000, PostgresRecord(True, other))])


def test_missing_base_is_an_error() -> None:
    r2 = _heap_insert(2, b"x", init=False)
    with pytest.raises(PageReconstructError, match="no base image"):
        _apply(KEY, None, [(0x1000, PostgresRecord(False, r2))])


def test_fpi_restores_image_with_lsn() -> None:
    img = bp.new_page(0)
    bp.page_add_item(img, b"i" * 40, 1, overwrite=True, is_heap=True)
    fpi = build_record(prev=0, rmid=0, info=0xB0, blocks=[BlockSpec(REL, 7, image=bytes(img))])
    page = _apply(KEY, None, [(0x5000, PostgresRecord(True, fpi))])
    expect = bytearray(img)
    bp.page_set_lsn(expect, 0x5000)
    assert page == bytes(expect)


def test_vm_bits_cleared_by_heap_record_on_vm_page() -> None:
    vm = bp.new_page(0)
    for blk in (6, 7, 8):
        vm_set_in_page(vm, blk, 3)
    rec = _heap_insert(1, b"x", init=False, flags=0x01)  # ALL_VISIBLE_CLEARED on heap block 7
    vm_key = rel_block_key(1663, 5, 16384, 2, 0)
    out = _apply(vm_key, bytes(vm), [(0x1000, PostgresRecord(False, rec))])
    assert [vm_get(out, b) for b in (6, 7, 8)] == [3, 0, 3]
    assert bp.page_get_lsn(out) == 0  # PostgreSQL does not stamp the VM page here
    neon = _apply(vm_key, bytes(vm), [(0x1000, ClearVisibilityMapFlags(8, None, 2))])
    assert [vm_get(neon, b) for b in (6, 7, 8)] == [3, 3, 1]
    trunc = _apply(vm_key, bytes(vm), [(0x1000, TruncateVisibilityMap(1, 6))])  # keep heap blocks < 7
    assert [vm_get(trunc, b) for b in (6, 7, 8)] == [3, 0, 0]


def test_clog_and_multixact_values() -> None:
    page = _apply(slru_block_key(SLRU_CLOG, 0, 1), bytes(8192), [
        (0x10, ClogSetCommitted((32768 + 5, 32768 + 6, 7), 0)),
        (0x20, ClogSetAborted((32768 + 9,))),
    ])
    assert clog.clog_get_status(page, 32768 + 5) == clog.TRANSACTION_STATUS_COMMITTED
    assert clog.clog_get_status(page, 32768 + 9) == clog.TRANSACTION_STATUS_ABORTED
    assert clog.clog_get_status(page, 32768 + 7) == 0  # xid 7 lives on page 0
    off = _apply(slru_block_key(SLRU_MULTIXACT_OFFSETS, 0, 0), bytes(8192), [(0x10, MultixactOffsetCreate(5, 77))])
    assert struct.unpack_from("<I", off, 20)[0] == 77
    mem = _apply(
        slru_block_key(SLRU_MULTIXACT_MEMBERS, 0, 0), bytes(8192),
        [(0x10, MultixactMembersCreate(3, ((1000, 1), (1001, 2))))],
    )
    # member 3 is the last of group 0; member 4 the first of group 1 (20-byte groups)
    assert mem[3] == 1 and struct.unpack_from("<I", mem, 4 + 12)[0] == 1000
    assert mem[20] == 2 and struct.unpack_from("<I", mem, 24)[0] == 1001
    assert multixact.MULTIXACT_MEMBERS_PER_PAGE == 1636


def test_raw_commit_with_subxacts_sets_clog() -> None:
    xinfo = XACT_XINFO_HAS_SUBXACTS
    main = struct.pack("<qI", 0, xinfo) + struct.pack("<i", 2) + struct.pack("<II", 1001, 1002)
    rec = build_record(prev=0, rmid=1, info=0x80, xid=1000, main_data=main)
    page = _apply(slru_block_key(SLRU_CLOG, 0, 0), bytes(8192), [(0x10, PostgresRecord(False, rec))])
    assert [clog.clog_get_status(page, x) for x in (999, 1000, 1001, 1002)] == [0, 1, 1, 1]


def test_test_records_are_delegated() -> None:
    out = _apply(KEY, b"a", [(0x10, TestRecord.wal_append(",b"))])
    assert out == b"a,b"


def _sample_heap_page() -> bytes:
    page = _apply(KEY, None, [(0x1000, PostgresRecord(True, _heap_insert(1, b"hello", init=True)))])
    return _apply(KEY, page, [(0x2000, PostgresRecord(False, _heap_insert(2, b"world", init=False)))])


@settings(max_examples=300)
@given(
    rmid=st.sampled_from([9, 10, 11, 15, 0]),
    info=st.integers(0, 255).map(lambda i: i & 0xF0),
    main=st.binary(max_size=40),
    data=st.binary(max_size=60),
    will_init=st.booleans(),
    block_id=st.integers(0, 4),
)
def test_hostile_records_give_clear_errors(
    rmid: int, info: int, main: bytes, data: bytes, will_init: bool, block_id: int
) -> None:
    """Garbage in a record of a supported rmgr: a page or PageReconstructError, nothing else."""
    base = _sample_heap_page()
    rec = build_record(
        prev=0, rmid=rmid, info=info, xid=5,
        blocks=[BlockSpec(REL, 7, data=data, will_init=will_init, block_id=block_id)], main_data=main,
    )
    try:
        out = _apply(KEY, base, [(0x9000, PostgresRecord(will_init, rec))])
    except PageReconstructError:
        return
    assert len(out) == bp.BLCKSZ


def test_fpi_without_image() -> None:
    page = _sample_heap_page()
    hint = build_record(prev=0, rmid=0, info=0xA0, blocks=[BlockSpec(REL, 7)])
    assert _apply(KEY, page, [(0x9000, PostgresRecord(False, hint))]) == page
    fpi = build_record(prev=0, rmid=0, info=0xB0, blocks=[BlockSpec(REL, 7)])
    with pytest.raises(PageReconstructError, match="XLOG/FPI block 0 has no image"):
        _apply(KEY, page, [(0x9000, PostgresRecord(False, fpi))])


def _relmap_update(nbytes: int, payload: bytes) -> bytes:
    return build_record(prev=0, rmid=7, info=0x00, main_data=struct.pack("<IIi", 5, 1663, nbytes) + payload)


def test_relmap_update_replaces_the_file() -> None:
    new_map = bytes(range(256)) * 2
    out = _apply(relmap_file_key(1663, 5), b"\0" * 512, [(0x10, PostgresRecord(False, _relmap_update(512, new_map)))])
    assert out == new_map


@pytest.mark.parametrize(
    ("main", "match"),
    [
        (b"\1\2", "truncated RelMap/UPDATE"),
        (struct.pack("<IIi", 5, 1663, 512) + b"x" * 100, "not a 512-byte map file"),
        (struct.pack("<IIi", 5, 1663, -1) + b"x" * 512, "not a 512-byte map file"),
        (struct.pack("<IIi", 5, 1663, 100) + b"x" * 100, "not a 512-byte map file"),
    ],
)
def test_hostile_relmap_update_is_a_reconstruct_error(main: bytes, match: str) -> None:
    rec = build_record(prev=0, rmid=7, info=0x00, main_data=main)
    with pytest.raises(PageReconstructError, match=match):
        _apply(relmap_file_key(1663, 5), b"\0" * 512, [(0x10, PostgresRecord(False, rec))])


def test_undecodable_relmap_record_is_a_reconstruct_error() -> None:
    with pytest.raises(PageReconstructError, match="undecodable stored record"):
        _apply(relmap_file_key(1663, 5), b"\0" * 512, [(0x10, PostgresRecord(False, b"\xff" * 30))])


@settings(max_examples=200)
@given(
    target=st.sampled_from([
        slru_block_key(SLRU_CLOG, 0, 0),
        slru_block_key(SLRU_MULTIXACT_OFFSETS, 0, 0),
        slru_block_key(SLRU_MULTIXACT_MEMBERS, 0, 0),
        relmap_file_key(1663, 5),
    ]),
    rmid=st.sampled_from([1, 3, 6, 7]),
    info=st.integers(0, 255),
    main=st.binary(max_size=80),
)
def test_hostile_slru_and_relmap_records_give_clear_errors(target: bytes, rmid: int, info: int, main: bytes) -> None:
    """Garbage in a record stored under an SLRU page or a relmap file: a result or
    PageReconstructError, never another exception type."""
    rec = build_record(prev=0, rmid=rmid, info=info, xid=5, main_data=main)
    base = bytes(512) if target == relmap_file_key(1663, 5) else bytes(8192)
    try:
        out = _apply(target, base, [(0x9000, PostgresRecord(False, rec))])
    except PageReconstructError:
        return
    assert len(out) == len(base)


def test_corrupt_verification_image_is_a_reconstruct_error() -> None:
    """validate: a compressed check image that does not decompress is a per-request error
    naming the record, not a RemoteProtocolError escaping redo."""
    page = _sample_heap_page()
    body = struct.pack("<HHB", 2, 0x0802, 24) + b"\x00" + b"zz"
    rec = bytearray(build_record(
        prev=0, rmid=10, info=0x00, xid=902,
        blocks=[BlockSpec(REL, 7, data=body, image=bytes(8192), apply_image=False, compression="lz4")],
        main_data=struct.pack("<HB", 3, 0),
    ))
    packed = bytes(lz4.block.compress(bytes(8192), store_size=False))
    at = bytes(rec).find(packed)
    assert at > 0
    rec[at : at + len(packed)] = b"\xff" * len(packed)  # same length, undecompressable
    struct.pack_into("<I", rec, 20, record_crc(rec))
    with pytest.raises(PageReconstructError, match="verification image"):
        PostgresRedoManager(validate=True).apply(Key(KEY), page, [(Lsn(0x9000), PostgresRecord(False, bytes(rec)))])
