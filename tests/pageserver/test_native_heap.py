"""The heap placement kernel (pageserver/walredo/_heap_c.pyx) against its pure-Python twin.

Both place heap tuples on an 8 KiB page as ``heap_xlog_insert`` / ``heap_xlog_multi_insert``
do. On the same page and record bytes -- well-formed records, the same records cut or
mutated anywhere, random bytes, corrupt page headers -- both give the same outcome: the same
result and the same page bytes, or the same error class and message with the same page bytes
(the tuples placed before the failing one). Nothing is written outside the page (the ASan
pass, scripts/test-asan, runs these tests on a sanitized build). Real PostgreSQL WAL through
the kernel is tests/pageserver/test_walredo_realwal.py (pgbench -i is COPY FREEZE: MULTI_INSERT).
"""

from __future__ import annotations

import inspect
import struct
from pathlib import Path
from types import ModuleType

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from pageserver.walredo import _heap_py
from pageserver.walredo import bufpage as bp
from pageserver.walredo.errors import PageError
from protocol import _native
from tests.conftest import kernel
from tests.fuzz_helpers import harness_takes_its_seeds_and_catches

HEAP = "pageserver.walredo._heap_c"


@pytest.fixture
def both() -> tuple[ModuleType, ModuleType]:
    return _native.load_native(HEAP), _heap_py


def _outcome(fn: object, page: bytearray, *args: object) -> tuple[object, ...]:
    try:
        result = fn(page, *args)  # type: ignore[operator]
    except Exception as exc:
        return ("err", type(exc).__name__, str(exc), len(page), bytes(page))
    return ("ok", result, len(page), bytes(page))


def _same(name: str, page: bytes, *args: object) -> tuple[object, ...]:
    c, py = _native.load_native(HEAP), _heap_py
    got_c = _outcome(getattr(c, name), bytearray(page), *args)
    got_py = _outcome(getattr(py, name), bytearray(page), *args)
    assert got_c == got_py
    return got_py


def _tuples_data(tuples: list[tuple[int, int, int, bytes]]) -> bytes:
    """xl_multi_insert_tuple headers (SHORTALIGNed) and bodies: (infomask2, infomask, hoff, body)."""
    out = bytearray()
    for im2, im, hoff, body in tuples:
        if len(out) & 1:
            out += b"\x00"
        out += struct.pack("<HHHB", len(body), im2, im, hoff) + body
    return bytes(out)


def _main(flags: int, n: int, offsets: list[int] | None) -> bytes:
    return struct.pack("<BxH", flags, n) + (struct.pack(f"<{len(offsets)}H", *offsets) if offsets else b"")


bodies = st.binary(min_size=0, max_size=200)
tuple_fields = st.tuples(st.integers(0, 0xFFFF), st.integers(0, 0xFFFF), st.integers(0, 255), bodies)


# --- parity -----------------------------------------------------------------------------------


@pytest.mark.native
def test_same_names_and_signatures(both: tuple[ModuleType, ModuleType]) -> None:
    c, py = both
    assert c.__all__ == py.__all__
    for name in py.__all__:
        if callable(getattr(py, name)):
            c_params = [(p.name, p.default) for p in inspect.signature(getattr(c, name)).parameters.values()]
            py_params = [(p.name, p.default) for p in inspect.signature(getattr(py, name)).parameters.values()]
            assert c_params == py_params, name


@pytest.mark.native
def test_the_build_matches_the_sources_on_disk() -> None:
    assert _native._expected_hash(HEAP) == _native.load_native(HEAP).SOURCE_HASH


def test_the_selected_kernel_is_the_one_heap_redo_calls() -> None:
    from pageserver.walredo import _heap_select, heap

    assert _heap_select.IMPL == _native.IMPL
    assert vars(heap)["placement"] is _heap_select


# --- what the placement writes ----------------------------------------------------------------


def test_multi_insert_on_an_initialized_page_matches_page_add_item(impl: str) -> None:
    """Offsets 1..n, each tuple where PageAddItem puts it, header fields from the record."""
    k = kernel(impl, HEAP)
    tuples = [(3, 0x0902, 24, bytes([i]) * (10 + i)) for i in range(20)]
    page = bytearray(b"\xaa" * bp.BLCKSZ)
    flags = k.multi_insert(page, _main(0x20, len(tuples), None), _tuples_data(tuples), 777, 0x12345, True)
    assert flags == 0x20
    ref = bp.new_page(0)
    for i, (im2, im, hoff, body) in enumerate(tuples, 1):
        tup = struct.pack("<IIIHHHHHB", 777, 0, 0, 0x1, 0x2345, i, im2, im, hoff) + body
        assert bp.page_add_item(ref, tup, i, overwrite=True, is_heap=True) == i
    assert page == ref


def test_multi_insert_into_free_slots_of_an_existing_page(impl: str) -> None:
    k = kernel(impl, HEAP)
    page = bp.new_page(0)
    k.multi_insert(page, _main(0, 3, [1, 2, 3]), _tuples_data([(1, 2, 24, b"a" * 9)] * 3), 5, 1, False)
    bp.set_itemid(page, 2, 0, bp.LP_UNUSED, 0)  # a pruned slot that a later COPY reuses
    k.multi_insert(page, _main(0, 2, [2, 4]), _tuples_data([(1, 2, 24, b"b" * 30), (1, 2, 24, b"c")]), 6, 1, False)
    assert bp.max_offset(page) == 4
    assert page[bp.item_offset(page, 2) + 23 :][:30] == b"b" * 30
    assert struct.unpack_from("<I", page, bp.item_offset(page, 4))[0] == 6


def test_put_tuple_appends_and_refuses_a_used_slot(impl: str) -> None:
    k = kernel(impl, HEAP)
    page = bp.new_page(0)
    k.put_tuple(page, 1, 10, 11, 7, 2, 0x0800, 24, b"hello")
    raw = bp.get_itemid(page, 1)
    assert bp.lp_len(raw) == 28 and bp.lp_off(raw) == bp.BLCKSZ - 32
    assert struct.unpack_from("<IIIHHH", page, bp.lp_off(raw)) == (10, 11, 0, 0, 7, 1)
    with pytest.raises(PageError, match="line pointer is in use"):
        k.put_tuple(page, 1, 10, 11, 7, 2, 0x0800, 24, b"again")


# --- hostile input: the same error, the same page, nothing outside it --------------------------


@pytest.mark.native
@pytest.mark.parametrize(
    ("main", "data", "init", "match"),
    [
        (b"\x00\x00", b"", True, "main data has 2 bytes"),
        (_main(0, 2, None), b"", False, "2 offsets do not fit"),
        (_main(0, 1, None), b"\x05\x00\x00", True, "tuple header at 0 past 3"),
        (_main(0, 1, None), struct.pack("<HHHB", 50, 0, 0, 24) + b"x", True, "tuple of 50 bytes"),
        (_main(0, 1, None), _tuples_data([(0, 0, 24, b"ab")]) + b"\x00", True, "the tuples end at 9"),
        (_main(0, 1, None), _tuples_data([(0, 0, 24, b"x" * 8200)]), True, "do not fit"),
        (_main(0, 300, None), _tuples_data([(0, 0, 24, b"")] * 300), True, "past 291 tuples"),
        (_main(0, 1, [0]), _tuples_data([(0, 0, 24, b"z")]), False, "invalid offset number 0"),
        (_main(0, 1, [9]), _tuples_data([(0, 0, 24, b"z")]), False, "invalid offset number 9"),
    ],
)
def test_hostile_multi_insert_records(main: bytes, data: bytes, init: bool, match: str) -> None:
    outcome = _same("multi_insert", bytes(bp.new_page(0)), main, data, 1, 1, init)
    assert outcome[:2] == ("err", "PageError") and match in str(outcome[2]), outcome[:3]


@pytest.mark.native
@pytest.mark.parametrize(
    ("lower", "upper", "special"),
    [(0, 8192, 8192), (30, 20, 8192), (24, 8192, 8000), (24, 9000, 9000), (24, 0xFFFF, 0xFFFF)],
)
def test_corrupt_page_pointers(lower: int, upper: int, special: int) -> None:
    page = bp.new_page(0)
    struct.pack_into("<HHH", page, 12, lower, upper, special)
    outcome = _same("put_tuple", bytes(page), 1, 1, 0, 0, 0, 0, 24, b"q" * 40)
    assert outcome[:2] == ("err", "PageError") and "corrupted page pointers" in str(outcome[2])
    outcome = _same("multi_insert", bytes(page), _main(0, 1, [1]), _tuples_data([(0, 0, 24, b"q")]), 1, 1, False)
    assert outcome[:2] == ("err", "PageError")


@pytest.mark.parametrize("size", [0, 100, 8191, 8193])
def test_a_page_of_the_wrong_size(impl: str, size: int) -> None:
    k = kernel(impl, HEAP)
    page = bytearray(size)
    with pytest.raises(PageError, match=f"page is {size} bytes"):
        k.put_tuple(page, 1, 1, 0, 0, 0, 0, 24, b"")
    with pytest.raises(PageError, match=f"page is {size} bytes"):
        k.multi_insert(page, _main(0, 0, None), b"", 1, 1, True)
    assert len(page) == size


def test_a_page_that_is_not_a_bytearray(impl: str) -> None:
    k = kernel(impl, HEAP)
    with pytest.raises(TypeError):
        k.put_tuple(bytes(bp.BLCKSZ), 1, 1, 0, 0, 0, 0, 24, b"")


@pytest.mark.native
@pytest.mark.parametrize(
    "args",
    [(-1, 1, 0, 0, 0, 0, 24), (1, 1 << 32, 0, 0, 0, 0, 24), (1, 1, 0, -5, 0, 0, 24),
     (1, 1, 0, 0, 1 << 16, 0, 24), (1, 1, 0, 0, 0, 0, 256), (1 << 16, 1, 0, 0, 0, 0, 24)],
)
def test_fields_out_of_range(args: tuple[int, ...]) -> None:
    outcome = _same("put_tuple", bytes(bp.new_page(0)), *args, b"body")
    assert outcome[1] == "OverflowError"
    outcome = _same("multi_insert", bytes(bp.new_page(0)), _main(0, 0, None), b"", -1, 0, True)
    assert outcome[1] == "OverflowError"


# --- differential: random and mutated bytes ---------------------------------------------------


@pytest.mark.native
@settings(max_examples=300, deadline=None)
@given(
    tuples=st.lists(tuple_fields, max_size=70),
    init=st.booleans(),
    xid=st.integers(0, 0xFFFF_FFFF),
    blkno=st.integers(0, 0xFFFF_FFFF),
    cut=st.none() | st.integers(0, 20_000),
    flip=st.none() | st.tuples(st.integers(0, 20_000), st.integers(1, 255)),
    pre=st.integers(0, 40),
)
def test_multi_insert_twin_and_native_agree(
    tuples: list[tuple[int, int, int, bytes]], init: bool, xid: int, blkno: int,
    cut: int | None, flip: tuple[int, int] | None, pre: int,
) -> None:
    """A well-formed record (on a fresh page, or after ``pre`` tuples already there), then the
    same record cut at a drawn offset or with one byte changed."""
    page = bp.new_page(0)
    for i in range(pre):
        _heap_py.put_tuple(page, i + 1, 1, 0, 0, 0, 0, 24, b"p" * (i % 13))
    first = 1 if init else pre + 1
    offsets = None if init else list(range(first, first + len(tuples)))
    main = _main(0x01, len(tuples), offsets)
    data = bytearray(_tuples_data(tuples))
    if cut is not None:
        del data[cut:]
    if flip is not None and data:
        data[flip[0] % len(data)] ^= flip[1]
    _same("multi_insert", bytes(page), main, bytes(data), xid, blkno, init)


@pytest.mark.native
@settings(max_examples=300, deadline=None)
@given(header=st.binary(min_size=24, max_size=24), body=st.binary(min_size=1, max_size=64),
       main=st.binary(max_size=64), data=st.binary(max_size=600), init=st.booleans())
@example(header=bytes(24), body=b"\x00", main=b"\x00\x00\xff\xff", data=b"", init=True)
def test_multi_insert_on_random_bytes(header: bytes, body: bytes, main: bytes, data: bytes, init: bool) -> None:
    """Random page header (pointers included) over a repeated random pattern, random record."""
    page = (header + body * (bp.BLCKSZ // len(body) + 1))[: bp.BLCKSZ]
    _same("multi_insert", page, main, data, 9, 9, init)


@st.composite
def _pages(draw: st.DrawFn) -> bytes:
    """A page with some tuples and freed slots, and its pointers possibly corrupted."""
    page = bp.new_page(0)
    for i in range(draw(st.integers(0, 60))):
        _heap_py.put_tuple(page, i + 1, i, 0, 0, 0, 0, 24, b"t" * draw(st.integers(0, 120)))
    for off in draw(st.lists(st.integers(1, 60), max_size=5)):
        if off <= bp.max_offset(page):
            bp.set_itemid(page, off, 0, bp.LP_UNUSED, 0)
    if draw(st.booleans()):
        struct.pack_into("<H", page, draw(st.sampled_from([12, 14, 16])), draw(st.integers(0, 0xFFFF)))
    return bytes(page)


@pytest.mark.native
@settings(max_examples=400, deadline=None)
@given(page=_pages(), offnum=st.integers(0, 320), fields=tuple_fields,
       xmin=st.integers(0, 0xFFFF_FFFF), xmax=st.integers(0, 0xFFFF_FFFF), blkno=st.integers(0, 0xFFFF_FFFF),
       bodylen=st.none() | st.integers(0, 9000))
def test_put_tuple_twin_and_native_agree(
    page: bytes, offnum: int, fields: tuple[int, int, int, bytes], xmin: int, xmax: int, blkno: int,
    bodylen: int | None,
) -> None:
    im2, im, hoff, body = fields
    if bodylen is not None:
        body = b"L" * bodylen
    _same("put_tuple", page, offnum, xmin, xmax, blkno, im2, im, hoff, body)


# --- the fuzz harness (pagestore fuzz heap-multi-insert) ---------------------------------------


def test_fuzz_harness_accepts_its_seeds_and_catches_a_planted_difference(tmp_path: Path) -> None:
    from types import SimpleNamespace

    def skip_the_last(page: bytearray, main: bytes, data: bytes, xid: int, blkno: int, init: bool) -> int:
        flags = _heap_py.multi_insert(page, main, data, xid, blkno, init)
        struct.pack_into("<H", page, 12, struct.unpack_from("<H", page, 12)[0] - 4)
        return flags

    harness_takes_its_seeds_and_catches("heap-multi-insert", tmp_path, _heap_py,
                                        SimpleNamespace(multi_insert=skip_the_last), seeds=4)
