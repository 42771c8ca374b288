"""SP-GiST's tuple kernel (``pageserver/walredo/_spgist_c.pyx``) against its pure-Python twin
(``_spgist_py.py``) and both against PostgreSQL's one-tuple-at-a-time steps.

- ``place_leaves``: a record's leaf tuples added or put in place of placeholders, offset by
  offset, equal the page that ``addOrReplaceTuple`` (PageIndexTupleDelete + PageAddItem per
  tuple, ``bufpage``'s primitives) gives, for both implementations.
- ``multi_delete``: ``spgPageIndexMultiDelete`` (PageIndexMultiDelete, then a dead tuple added
  at each offset, the counters) likewise.
- Hostile input: mutated pages, mutated and random records, arguments out of range: both give
  the same result and page, or an error of the same class; the native kernel never writes
  outside its 8 KiB (a page inside a larger buffer keeps its guard bytes).

The real-WAL checks of the whole SP-GiST redo are in ``test_walredo_spgist.py``.
"""

from __future__ import annotations

import inspect
import random
import struct
from pathlib import Path
from types import ModuleType, SimpleNamespace
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from bench.fuzz import spgist_leaf_page
from pageserver.walredo import _spgist_py, spgist
from pageserver.walredo import bufpage as bp
from tests.conftest import kernel
from tests.fuzz_helpers import harness_takes_its_seeds_and_catches

SPG = "pageserver.walredo._spgist_c"
LIVE, REDIRECT, DEAD, PLACEHOLDER = 0, 1, 2, 3
_COUNTS = struct.Struct("<HH")  # nRedirection, nPlaceholder
_OPAQUE = bp.BLCKSZ - 8


def _leaf(size: int, fill: int) -> bytes:
    """A live leaf tuple of ``size`` bytes (header: word0 = size << 2, t_info, heap pointer)."""
    return struct.pack("<IHHHH", size << 2, 0, 0, 7, fill) + bytes([fill]) * (size - 12)


def _dead(state: int) -> bytes:
    return _spgist_py._form_dead(state, 5, 9, 1234)


def _counts(page: bytearray) -> tuple[int, int]:
    r, p = _COUNTS.unpack_from(page, _OPAQUE + 2)
    return r, p


def _set_counts(page: bytearray, redirects: int, placeholders: int) -> None:
    _COUNTS.pack_into(page, _OPAQUE + 2, redirects, placeholders)


@st.composite
def leaf_pages(draw: st.DrawFn, max_items: int = 60) -> tuple[bytearray, list[int]]:
    """An SP-GiST leaf page of live tuples (MAXALIGNed and not), placeholders and redirects,
    with the counters PostgreSQL keeps; and the state of each offset."""
    page = bytearray(bp.BLCKSZ)
    spgist.init_page(page, spgist.SPGIST_LEAF)
    states: list[int] = []
    for i in range(draw(st.integers(0, max_items))):
        state = draw(st.sampled_from([LIVE, LIVE, PLACEHOLDER, REDIRECT]))
        tup = _leaf(draw(st.sampled_from([16, 24, 32, 40, 64, 20, 27])), i & 0xFF) if state == LIVE else _dead(state)
        if not bp.page_append_items(page, [tup]):
            break
        states.append(state)
    _set_counts(page, states.count(REDIRECT), states.count(PLACEHOLDER))
    return page, states


@st.composite
def placements(draw: st.DrawFn) -> tuple[bytearray, bytes, int, int, int, int, int, list[tuple[int, bytes]]]:
    """A page and a record that places tuples on it correctly: (page, data, offsets_at,
    select_at, tuples_at, n, want, the (offset, tuple) pairs this page gets, in order)."""
    page, states = draw(leaf_pages())
    free = bp.get_upper(page) - bp.get_lower(page)
    n = draw(st.integers(0, 60))
    select = draw(st.booleans())
    want = draw(st.integers(0, 1))
    offsets: list[int] = []
    tuples: list[bytes] = []
    sel: list[int] = []
    applied: list[tuple[int, bytes]] = []
    for i in range(n):
        tup = _leaf(draw(st.sampled_from([16, 24, 48, 21])), (100 + i) & 0xFF)
        chosen = not select or draw(st.booleans())
        sel.append(want if chosen else 1 - want)
        off = draw(st.integers(0, 400))
        if chosen:
            holes = [j + 1 for j, s in enumerate(states) if s == PLACEHOLDER]
            reuse = draw(st.booleans())
            if holes and reuse:
                off = draw(st.sampled_from(holes))
                states[off - 1] = LIVE
                free -= bp.maxalign(len(tup)) - 16
            else:
                off = len(states) + 1
                states.append(LIVE)
                free -= bp.maxalign(len(tup)) + 4
            if free < 0:
                break
            applied.append((off, tup))
        offsets.append(off)
        tuples.append(tup)
    n = len(offsets)
    prefix = bytes(draw(st.integers(0, 5)))
    offsets_at = len(prefix)
    body = prefix + struct.pack(f"<{n}H", *offsets)
    select_at = -1
    if select:
        select_at = len(body)
        body += bytes(sel[:n])
    tuples_at = len(body)
    return page, body + b"".join(tuples), offsets_at, select_at, tuples_at, n, want, applied


def _reference_place(page: bytearray, pairs: list[tuple[int, bytes]]) -> None:
    """addOrReplaceTuple, one tuple at a time, with bufpage's PostgreSQL primitives."""
    for off, tup in pairs:
        if off <= bp.max_offset(page):
            assert page[bp.item_offset(page, off)] & 3 == PLACEHOLDER
            r, p = _counts(page)
            _set_counts(page, r, p - 1)
            bp.page_index_tuple_delete(page, off)
        assert bp.page_add_item(page, tup, off, overwrite=False, is_heap=False) == off


def _reference_multi_delete(page: bytearray, offs: list[int], first: int, rest: int, blkno: int, offnum: int, xid: int) -> None:
    ordered = sorted(offs)
    bp.page_index_multi_delete(page, ordered)
    for itemno in ordered:
        state = first if itemno == offs[0] else rest
        assert bp.page_add_item(page, _spgist_py._form_dead(state, blkno, offnum, xid), itemno, overwrite=False, is_heap=False) == itemno
        r, p = _counts(page)
        _set_counts(page, r + (state == REDIRECT), p + (state == PLACEHOLDER))


def _outcome(mod: ModuleType, fn: str, page: bytearray, *args: Any) -> tuple[object, ...]:
    try:
        got = getattr(mod, fn)(page, *args)
    except (ValueError, bp.PageError, MemoryError) as exc:
        assert len(page) == bp.BLCKSZ
        return ("err", type(exc).__name__)
    assert len(page) == bp.BLCKSZ
    return ("ok", got, bytes(page))


# --- parity -----------------------------------------------------------------------------


@pytest.mark.native
def test_same_names_and_signatures() -> None:
    c, py = kernel("native", SPG), kernel("python", SPG)
    assert c.__all__ == py.__all__
    assert (c.IMPL, py.IMPL) == ("native", "python")
    for name in py.__all__:
        obj = getattr(py, name)
        if callable(obj):
            params = [(p.name, p.default) for p in inspect.signature(obj).parameters.values()]
            assert [(p.name, p.default) for p in inspect.signature(getattr(c, name)).parameters.values()] == params, name


# --- against PostgreSQL's steps ---------------------------------------------------------


@settings(max_examples=60, deadline=None)
@given(case=placements())
def test_place_leaves_equals_add_or_replace_one_at_a_time(impl: str, case: tuple[Any, ...]) -> None:
    page, data, offsets_at, select_at, tuples_at, n, want, applied = case
    expected = bytearray(page)
    _reference_place(expected, applied)
    got = bytearray(page)
    end = kernel(impl, SPG).place_leaves(got, data, offsets_at, select_at, tuples_at, n, want)
    assert end == len(data)
    assert got == expected


@settings(max_examples=60, deadline=None)
@given(built=leaf_pages(), data=st.data())
def test_multi_delete_equals_postgres_steps(impl: str, built: tuple[bytearray, list[int]], data: st.DataObject) -> None:
    page, states = built
    if not states:
        return
    offs = data.draw(st.lists(st.integers(1, len(states)), min_size=1, max_size=len(states), unique=True))
    first, rest = data.draw(st.sampled_from([(REDIRECT, PLACEHOLDER), (PLACEHOLDER, PLACEHOLDER), (DEAD, DEAD)]))
    blkno, offnum, xid = data.draw(st.integers(0, 0xFFFF_FFFF)), data.draw(st.integers(0, 0xFFFF)), data.draw(st.integers(0, 0xFFFF_FFFF))
    expected = bytearray(page)
    _reference_multi_delete(expected, offs, first, rest, blkno, offnum, xid)
    got = bytearray(page)
    record = b"\x01" + struct.pack(f"<{len(offs)}H", *offs)
    kernel(impl, SPG).multi_delete(got, record, 1, len(offs), first, rest, blkno, offnum, xid)
    assert got == expected


def test_skip_leaves_finds_the_end(impl: str) -> None:
    k = kernel(impl, SPG)
    data = b"xy" + _leaf(16, 1) + _leaf(40, 2) + _leaf(27, 3)
    assert k.skip_leaves(data, 2, 3) == len(data)
    assert k.skip_leaves(data, 2, 0) == 2
    assert k.skip_leaves(memoryview(data), 2, 2) == 2 + 16 + 40


# --- hostile input ----------------------------------------------------------------------

HOSTILE = [
    ("truncated tuple", lambda d: d[:-3], bp.PageError),
    ("tuple header cut", lambda d: d[: len(d) - 20] + d[len(d) - 20 : len(d) - 12], bp.PageError),
    ("oversized tuple", lambda d: d[:-16] + struct.pack("<I", 400 << 2) + d[-12:], bp.PageError),
    ("tuple below its header", lambda d: d[:-16] + struct.pack("<I", 8 << 2) + d[-12:], bp.PageError),
    ("offset past the page", lambda d: struct.pack("<H", 5000) + d[2:], bp.PageError),
    ("offset 0", lambda d: struct.pack("<H", 0) + d[2:], bp.PageError),
]


@pytest.mark.parametrize(("case", "mutate", "error"), HOSTILE, ids=[h[0] for h in HOSTILE])
def test_hostile_records_fail_with_the_same_error(impl: str, case: str, mutate: Any, error: type[Exception]) -> None:
    page = bytearray(bp.BLCKSZ)
    spgist.init_page(page, spgist.SPGIST_LEAF)
    bp.page_append_items(page, [_leaf(24, 1), _dead(PLACEHOLDER)])
    _set_counts(page, 0, 1)
    data = struct.pack("<HH", 3, 4) + _leaf(32, 5) + _leaf(16, 6)
    bad = mutate(data)
    with pytest.raises(error):
        kernel(impl, SPG).place_leaves(page, bad, 0, -1, 4, 2, 1)
    assert len(page) == bp.BLCKSZ


def test_a_tuple_that_does_not_fit_is_an_error(impl: str) -> None:
    """Appended or in place of a placeholder, a tuple bigger than the free space fails."""
    k = kernel(impl, SPG)
    for off in (3, 2):  # maxoff + 1, the placeholder
        page = bytearray(bp.BLCKSZ)
        spgist.init_page(page, spgist.SPGIST_LEAF)
        bp.page_append_items(page, [_leaf(4000, 1), _dead(PLACEHOLDER)])
        _set_counts(page, 0, 1)
        data = struct.pack("<H", off) + _leaf(4200, 2)
        with pytest.raises(bp.PageError, match="failed to add"):
            k.place_leaves(page, data, 0, -1, 2, 1, 1)


BAD_ARGS: list[tuple[str, str, tuple[Any, ...]]] = [
    ("place_leaves", "negative count", (b"\x00" * 40, 0, -1, 4, -1, 1)),
    ("place_leaves", "offsets past the data", (b"\x00" * 40, 38, -1, 0, 2, 1)),
    ("place_leaves", "negative offsets position", (b"\x00" * 40, -2, -1, 0, 1, 1)),
    ("place_leaves", "selectors past the data", (b"\x00" * 40, 0, 39, 4, 2, 1)),
    ("place_leaves", "tuples past the data", (b"\x00" * 40, 0, -1, 41, 0, 1)),
    ("skip_leaves", "negative count", (b"\x00" * 40, 0, -1)),
    ("multi_delete", "offsets past the data", (b"\x01\x00", 0, 2, 3, 3, 0, 0, 0)),
    ("multi_delete", "a state that is not one", (b"\x01\x00", 0, 1, 4, 3, 0, 0, 0)),
    ("multi_delete", "a block past 32 bits", (b"\x01\x00", 0, 1, 1, 3, 1 << 32, 0, 0)),
    ("multi_delete", "an offset past 16 bits", (b"\x01\x00", 0, 1, 1, 3, 0, 1 << 16, 0)),
]


@pytest.mark.parametrize(("fn", "case", "args"), BAD_ARGS, ids=[f"{b[0]}: {b[1]}" for b in BAD_ARGS])
def test_bad_arguments_are_value_errors(impl: str, fn: str, case: str, args: tuple[Any, ...]) -> None:
    page = bytearray(bp.BLCKSZ)
    spgist.init_page(page, spgist.SPGIST_LEAF)
    k = kernel(impl, SPG)
    with pytest.raises(ValueError):
        if fn == "skip_leaves":
            k.skip_leaves(*args)
        else:
            getattr(k, fn)(page, *args)


def test_a_page_that_is_not_8k_is_refused(impl: str) -> None:
    k = kernel(impl, SPG)
    with pytest.raises(ValueError):
        k.place_leaves(bytearray(100), b"", 0, -1, 0, 0, 1)
    with pytest.raises(ValueError):
        k.multi_delete(bytearray(100), b"\x01\x00", 0, 1, 1, 3, 0, 0, 0)


def _mutate(data: st.DataObject, buf: bytearray, lo: int, hi: int) -> None:
    for _ in range(data.draw(st.integers(0, 4))):
        if hi > lo:
            buf[data.draw(st.integers(lo, hi - 1))] = data.draw(st.integers(0, 255))


@pytest.mark.native
@settings(max_examples=80, deadline=None)
@given(case=placements(), data=st.data())
def test_native_equals_twin_on_hostile_placements(case: tuple[Any, ...], data: st.DataObject) -> None:
    page, record, offsets_at, select_at, tuples_at, n, want, _ = case
    page = bytearray(page)
    record = bytearray(record)
    _mutate(data, page, 0, bp.SIZE_OF_PAGE_HEADER + 4 * bp.max_offset(page))  # header and line pointers
    _mutate(data, page, 0, bp.BLCKSZ)
    _mutate(data, record, 0, len(record))
    if data.draw(st.booleans()):
        record = record[: data.draw(st.integers(0, len(record)))]
    n = data.draw(st.sampled_from([n, n + 1, max(0, n - 1)]))
    c, py = kernel("native", SPG), kernel("python", SPG)
    args = (bytes(record), offsets_at, select_at, tuples_at, n, want)
    assert _outcome(c, "place_leaves", bytearray(page), *args) == _outcome(py, "place_leaves", bytearray(page), *args)


@pytest.mark.native
@settings(max_examples=80, deadline=None)
@given(built=leaf_pages(), data=st.data())
def test_native_equals_twin_on_hostile_deletes(built: tuple[bytearray, list[int]], data: st.DataObject) -> None:
    page, states = built
    page = bytearray(page)
    _mutate(data, page, 0, bp.SIZE_OF_PAGE_HEADER + 4 * len(states))
    _mutate(data, page, 0, bp.BLCKSZ)
    offs = data.draw(st.lists(st.integers(0, len(states) + 2), min_size=0, max_size=len(states) + 2))
    first, rest = data.draw(st.integers(0, 3)), data.draw(st.integers(0, 3))
    args = (b"\x07" + struct.pack(f"<{len(offs)}H", *offs), 1, len(offs), first, rest, 77, 3, 99)
    c, py = kernel("native", SPG), kernel("python", SPG)
    assert _outcome(c, "multi_delete", bytearray(page), *args) == _outcome(py, "multi_delete", bytearray(page), *args)


@pytest.mark.native
@settings(max_examples=80, deadline=None)
@given(raw=st.binary(max_size=600), seed=st.integers(0, 2**32), header=st.lists(st.integers(0, 0xFFFF), min_size=3, max_size=3),
       data=st.data())
def test_native_equals_twin_on_random_bytes(raw: bytes, seed: int, header: list[int], data: st.DataObject) -> None:
    """Random records on random pages (pointers drawn or random too) and on a real leaf page,
    at random positions."""
    c, py = kernel("native", SPG), kernel("python", SPG)
    noise = bytearray(random.Random(seed).randbytes(bp.BLCKSZ))
    if data.draw(st.booleans()):
        bp.LOWER_UPPER_SPECIAL.pack_into(noise, bp.OFF_LOWER, *sorted(header))
    pages = [noise, data.draw(leaf_pages(40))[0]]
    pos = st.integers(-2, len(raw) + 2)
    args = (raw, data.draw(pos), data.draw(st.sampled_from([-1, 0, 3])), data.draw(pos), data.draw(st.integers(-1, 40)), 1)
    for page in pages:
        assert _outcome(c, "place_leaves", bytearray(page), *args) == _outcome(py, "place_leaves", bytearray(page), *args)
        d = (raw, data.draw(pos), data.draw(st.integers(-1, 30)), 1, 3, 5, 6, 7)
        assert _outcome(c, "multi_delete", bytearray(page), *d) == _outcome(py, "multi_delete", bytearray(page), *d)
    s = (raw, data.draw(pos), data.draw(st.integers(-1, 40)))
    try:
        cs: object = ("ok", c.skip_leaves(*s))
    except (ValueError, bp.PageError) as exc:
        cs = ("err", type(exc).__name__)
    try:
        ps: object = ("ok", py.skip_leaves(*s))
    except (ValueError, bp.PageError) as exc:
        ps = ("err", type(exc).__name__)
    assert cs == ps


@pytest.mark.native
@settings(max_examples=60, deadline=None)
@given(case=placements(), data=st.data())
def test_native_never_writes_outside_the_page(case: tuple[Any, ...], data: st.DataObject) -> None:
    """The page inside a larger buffer: whatever the (mutated) page and record, the bytes
    around it stay as they were."""
    page, record, offsets_at, select_at, tuples_at, n, want, _ = case
    page = bytearray(page)
    _mutate(data, page, 0, bp.BLCKSZ)
    record = bytearray(record)
    _mutate(data, record, 0, len(record))
    guard = bytes(range(64))
    buf = bytearray(guard + page + guard)
    view = memoryview(buf)[64 : 64 + bp.BLCKSZ]
    c = kernel("native", SPG)
    calls: list[tuple[str, tuple[object, ...]]] = [
        ("place_leaves", (bytes(record), offsets_at, select_at, tuples_at, n, want)),
        ("multi_delete", (bytes(record), offsets_at, n, REDIRECT, PLACEHOLDER, 1, 2, 3)),
    ]
    for fn, args in calls:
        try:
            getattr(c, fn)(view, *args)
        except (ValueError, bp.PageError):
            pass
        assert buf[:64] == guard and buf[-64:] == guard


# --- the fuzz harness -------------------------------------------------------------------


def test_fuzz_harness_accepts_its_seeds_and_catches_a_planted_difference(tmp_path: Path) -> None:
    twin = kernel("python", SPG)
    liar = SimpleNamespace(place_leaves=lambda *a: 0, multi_delete=lambda *a: None)
    for data in harness_takes_its_seeds_and_catches("spgist-leaves", tmp_path, twin, liar, seeds=8):
        # the seeds are well-formed: the twin takes them
        page, _ = spgist_leaf_page(data[2])
        n = data[1]
        if data[0] & 1:
            twin.multi_delete(page, data[6:], 0, n, 1, 3, 5, 6, 7)
        else:
            select = bool(data[0] & 2)
            end = twin.place_leaves(page, data[6:], 0, 2 * n if select else -1, 3 * n if select else 2 * n, n, 1)
            assert end == len(data) - 6
