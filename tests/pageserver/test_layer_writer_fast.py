"""The layer writer's batch path agrees byte for byte with its per-entry path.

``LayerFileWriter.put_many`` (and ``InMemoryLayer.write_l0``, which packs the values with
``_l0_select.pack_values``, compiled or twin, and hands the pieces to ``put_packed``) must write
exactly the file a ``put`` loop over the same entries writes: ``put`` is the oracle. Hypothesis
draws values (empty, small, bigger than an index block), keys with many LSNs, runs split
anywhere (inside a key, across index blocks, across packed pieces); mutants of the batch code
(a fence, a crc, a block boundary, a value cut, a cursor of the packing) must be caught.
"""

from __future__ import annotations

import inspect
import itertools
import random
import shutil
import tempfile
import textwrap
import warnings
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import pytest
import trio
from crc32c import crc32c
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as hst
from hypothesis.errors import HypothesisWarning

from pageserver.storage import _l0_py, inmemory_layer
from pageserver.storage.delta_layer import write_delta_layer
from pageserver.storage.ephemeral_file import EphemeralFile
from pageserver.storage.inmemory_layer import InMemoryLayer
from pageserver.storage.io_engine import BlockingIoEngine
from pageserver.storage.key import Key, KeyRange
from pageserver.storage.layer_file import (
    ENTRIES_PER_BLOCK,
    ENTRY,
    LayerDesc,
    LayerFileWriter,
    WriteOptions,
)
from protocol.lsn import Lsn
from tests.conftest import kernel

L0 = "pageserver.storage._l0_c"

Entry = tuple[Key, int, bytes, bool]


def k(i: int) -> Key:
    # neighbours differ in the last bytes, as relation blocks do
    return Key(bytes([0, 0, 0, 0x06, 0x7F]) + i.to_bytes(13, "big"))


@hst.composite
def entries_and_cuts(draw: hst.DrawFn) -> tuple[list[Entry], list[int], list[int]]:
    """Sorted entries, the points where ``put_many`` runs are cut (besides key changes), and
    where batches (calls) are cut."""
    n_keys = draw(hst.integers(1, 30))
    key_ids = sorted(draw(hst.sets(hst.integers(0, 10_000), min_size=n_keys, max_size=n_keys)))
    # (the bytes come from a drawn seed: drawing thousands of values byte by byte is too much)
    rng = random.Random(draw(hst.integers(0, 2**32)))
    out: list[Entry] = []
    for key_id in key_ids:
        # a few keys get many LSNs, so a key spans index blocks
        n_lsns = draw(hst.sampled_from([1, 1, 2, 3, 4, 150, 300, 450]))
        lsn = 100 + draw(hst.integers(0, 5))
        for _ in range(n_lsns):
            # empty, small, and bigger than an index block (and than a 4 KiB buffer)
            size = rng.choice((0, 0, 1, 7, 100, 140, 200, 200, 200, 8193 + rng.randrange(800)))
            out.append((k(key_id), lsn, rng.randbytes(size), rng.random() < 0.3))
            lsn += rng.choice((1, 1, 2, 3))
    cut = hst.lists(hst.integers(0, len(out)), max_size=12)
    return out, draw(cut), draw(cut)


def _desc() -> LayerDesc:
    return LayerDesc(KeyRange(k(0), k(10_001)), Lsn(100), Lsn(100 + 3 * 500 + 10), True)


async def _write_with_put(directory: Path, desc: LayerDesc, entries: Sequence[Entry], opts: WriteOptions) -> bytes:
    writer = await LayerFileWriter.create(BlockingIoEngine(), directory, desc, opts)
    for key, lsn, blob, will_init in entries:
        await writer.put(key, lsn, blob, will_init)
    return (await writer.finish()).read_bytes()


def _runs(entries: Sequence[Entry], cuts: set[int]) -> list[tuple[Key, int]]:
    runs: list[tuple[Key, int]] = []
    for i, (key, _, _, _) in enumerate(entries):
        if runs and runs[-1][0] == key and i not in cuts:
            runs[-1] = (key, runs[-1][1] + 1)
        else:
            runs.append((key, 1))
    return runs


async def _write_with_put_many(
    directory: Path,
    desc: LayerDesc,
    entries: Sequence[Entry],
    run_cuts: Sequence[int],
    batch_cuts: Sequence[int],
    opts: WriteOptions,
) -> bytes:
    writer = await LayerFileWriter.create(BlockingIoEngine(), directory, desc, opts)
    bounds = sorted({0, len(entries), *batch_cuts})
    for lo, hi in itertools.pairwise(bounds):
        part = entries[lo:hi]
        # some batches hand memoryviews, as the in-memory layer does
        blobs: list[bytes | memoryview] = [memoryview(e[2]) if lo % 2 else e[2] for e in part]
        await writer.put_many(
            _runs(part, {c - lo for c in run_cuts}), [e[1] for e in part], blobs, [e[3] for e in part]
        )
    return (await writer.finish()).read_bytes()


def _same_file_both_ways(entries: list[Entry], run_cuts: list[int], batch_cuts: list[int]) -> None:
    desc = _desc()
    root = Path(tempfile.mkdtemp(prefix="pagestore-writer-"))
    try:
        for buffer_size in (4096, 64 * 1024):
            opts = WriteOptions(buffer_size=buffer_size)
            (root / "a").mkdir()
            (root / "b").mkdir()
            want = trio.run(_write_with_put, root / "a", desc, entries, opts)
            got = trio.run(_write_with_put_many, root / "b", desc, entries, run_cuts, batch_cuts, opts)
            _assert_same_file(got, want)
            assert sorted(p.name for p in (root / "b").iterdir()) == [desc.file_name()]
            shutil.rmtree(root / "a")
            shutil.rmtree(root / "b")
    finally:
        shutil.rmtree(root)


@settings(max_examples=60, deadline=None, database=None, suppress_health_check=[HealthCheck.too_slow])
@given(case=entries_and_cuts())
def test_put_many_writes_the_same_file_as_put(case: tuple[list[Entry], list[int], list[int]]) -> None:
    _same_file_both_ways_case(case)


def _same_file_both_ways_case(case: tuple[list[Entry], list[int], list[int]]) -> None:
    _same_file_both_ways(*case)


def test_put_many_fixed_cases_span_index_blocks() -> None:
    # exactly at and around index block boundaries, one key and many
    for n in (1, ENTRIES_PER_BLOCK - 1, ENTRIES_PER_BLOCK, ENTRIES_PER_BLOCK + 1, 3 * ENTRIES_PER_BLOCK + 5):
        one_key = [(k(7), 100 + i, bytes([i % 251]) * (i % 50), i % 5 == 0) for i in range(n)]
        many = [(k(i // 2), 100 + i % 2, b"v%d" % i, False) for i in range(n)]
        for entries in (one_key, many):
            _same_file_both_ways(entries, [], [])
            _same_file_both_ways(entries, [ENTRIES_PER_BLOCK // 2], [n // 2, n // 2 + 1])


# -- put_many's checks are put's -----------------------------------------------------------


async def _expect_refused(
    tmp_path: Path, runs: list[tuple[Key, int]], lsns: list[int], blobs: list[bytes], wills: list[int], what: str
) -> None:
    writer = await LayerFileWriter.create(BlockingIoEngine(), tmp_path, _desc(), WriteOptions())
    try:
        await writer.put(k(5), 200, b"first", False)
        with pytest.raises(ValueError, match=what):
            await writer.put_many(runs, lsns, blobs, wills)
        assert writer.n_entries == 1 and writer.data_size == 5  # nothing of the batch written
    finally:
        await writer.abort()


@pytest.mark.parametrize(
    ("runs", "lsns", "what"),
    [
        ([(k(5), 1)], [200], "out of order"),  # same (key, lsn) as the last put
        ([(k(4), 1)], [300], "out of order"),  # a smaller key
        ([(k(6), 3)], [200, 202, 201], "out of order"),  # LSNs falling inside a run
        ([(k(6), 2), (k(6), 1)], [200, 202, 202], "out of order"),  # a key continued at the same LSN
        ([(k(6), 2), (k(7), 1)], [50, 202, 300], "outside the layer"),
        ([(k(6), 2), (k(7), 1)], [200, 202, 5000], "outside the layer"),
        ([(k(20_000), 1)], [300], "outside the layer"),
        ([(k(6), 2)], [200, 201, 202], "do not add up"),
        ([(Key(b"short"), 1)], [300], "key of 5 bytes"),
    ],
)
async def test_put_many_refuses_what_put_refuses(
    tmp_path: Path, runs: list[tuple[Key, int]], lsns: list[int], what: str
) -> None:
    await _expect_refused(tmp_path, runs, lsns, [b"x"] * len(lsns), [0] * len(lsns), what)


async def test_put_many_refuses_mismatched_columns(tmp_path: Path) -> None:
    await _expect_refused(tmp_path, [(k(6), 2)], [200, 201], [b"x"], [0, 0], "2 LSNs, 1 blobs")


async def test_put_many_refuses_will_init_flags_other_than_0_1(tmp_path: Path) -> None:
    await _expect_refused(tmp_path, [(k(6), 2)], [200, 201], [b"x", b"y"], [1, 2], "0/1")


# -- put_packed's checks, and the announced data size ---------------------------------------


def _packed(key: Key, lsn: int, offset: int, blob: bytes) -> bytes:
    return ENTRY.pack(key + lsn.to_bytes(8, "big"), offset << 1, len(blob), crc32c(blob))


@pytest.mark.parametrize(
    ("entries", "data", "what"),
    [
        (lambda at: _packed(k(5), 200, at, b"x"), b"x", "out of order"),  # same (key, lsn) as the last
        (lambda at: _packed(k(4), 300, at, b"x"), b"x", "out of order"),
        (lambda at: _packed(k(20_000), 300, at, b"x"), b"x", "outside the layer"),
        (lambda at: _packed(k(6), 300, at + 1, b"x"), b"x", "do not place the data"),
        (lambda at: _packed(k(6), 300, at, b"xy"), b"x", "do not place the data"),
        (lambda at: _packed(k(6), 300, at, b"x")[:-1], b"x", "packed entries of 41 bytes"),
        (lambda at: b"", b"x", "without an entry"),
    ],
)
async def test_put_packed_refuses_what_put_refuses(
    tmp_path: Path, entries: Callable[[int], bytes], data: bytes, what: str
) -> None:
    writer = await LayerFileWriter.create(BlockingIoEngine(), tmp_path, _desc(), WriteOptions())
    try:
        await writer.put(k(5), 200, b"first", False)
        with pytest.raises(ValueError, match=what):
            await writer.put_packed(data, entries(writer.next_offset))
        assert writer.n_entries == 1 and writer.data_size == 5  # nothing of it written
    finally:
        await writer.abort()


@pytest.mark.parametrize("put", [4, 6])
async def test_a_data_section_other_than_announced_is_refused(tmp_path: Path, put: int) -> None:
    """With ``data_size`` the index is written in place behind the data: a writer that puts
    more or less than it announced must not finish (nothing is left on disk), and no scratch
    index file is made."""
    writer = await LayerFileWriter.create(BlockingIoEngine(), tmp_path, _desc(), WriteOptions(), data_size=5)
    assert [p.name for p in tmp_path.iterdir()] == [writer.tmp_path.name]
    await writer.put(k(6), 200, b"v" * put, False)
    with pytest.raises(ValueError, match=f"{put} bytes of data written, 5 announced"):
        await writer.finish()
    assert list(tmp_path.iterdir()) == []


async def test_an_announced_data_size_writes_the_same_file(tmp_path: Path) -> None:
    files = []
    for size in (None, 9):
        (tmp_path / str(size)).mkdir()
        writer = await LayerFileWriter.create(BlockingIoEngine(), tmp_path / str(size), _desc(), WriteOptions(),
                                              data_size=size)
        await writer.put(k(6), 200, b"four", False)
        await writer.put(k(6), 201, b"five!", True)
        files.append((await writer.finish()).read_bytes())
    assert files[0] == files[1]


# -- InMemoryLayer.write_l0 (put_many) == the per-value view through put ------------------


@hst.composite
def layer_puts(draw: hst.DrawFn) -> list[tuple[Key, int, bytes, bool]]:
    """Puts in LSN order over a few keys, interleaved (so a key's values are scattered in the
    ephemeral file) or in streaks (back to back), some at an LSN already put (replaced); in
    half the cases nearly all of one size (a bulk load's inserts, in streaks longer than an
    index block's entries too)."""
    n_keys = draw(hst.integers(1, 12))
    n = draw(hst.integers(1, 700))
    streaky = draw(hst.booleans())
    one_size = draw(hst.sampled_from([None, 0, 1, 140, 9000]))
    streak = draw(hst.sampled_from([3, 60, 64, 65, 129, 200]))
    keys_return = draw(hst.booleans())
    rng = random.Random(draw(hst.integers(0, 2**32)))  # (see entries_and_cuts)
    puts: list[tuple[Key, int, bytes, bool]] = []
    lsn = 100
    key_id = 0
    for i in range(n):
        if one_size is not None:
            # keys in turn, ``streak`` values each (maybe coming back after ``n_keys`` streaks)
            key_id = i // streak % n_keys if keys_return else i // streak
        elif not streaky or rng.randrange(30) == 0:
            key_id = rng.randrange(n_keys)
        # (a replaced value leaves its old bytes between its key's values: rare in a bulk load)
        lsn += rng.choice((0, 1, 1, 1, 8) if one_size is None or rng.randrange(500) == 0 else (1, 8))
        if one_size is not None and rng.randrange(500):
            size = one_size
        else:
            size = rng.choice((0, 1, 60, 140, 200, 9000))
        puts.append((k(key_id), lsn, rng.randbytes(size), rng.random() < 0.3))
    return puts


async def _l0_both_ways(root: Path, puts: Sequence[tuple[Key, int, bytes, bool]]) -> tuple[bytes, bytes]:
    engine = BlockingIoEngine()
    eph = await EphemeralFile.create(engine, root, write_buffer_size=4096, double_buffering=False)
    layer = InMemoryLayer(eph, Lsn(100))
    try:
        for key, lsn, blob, will_init in puts:
            await layer.put(key, Lsn(lsn), blob, will_init)
        end = Lsn(puts[-1][1] + 1)
        await layer.freeze(end)
        opts = WriteOptions(buffer_size=4096)
        (root / "put").mkdir()
        (root / "put_many").mkdir()
        want = await write_delta_layer(
            engine, root / "put", KeyRange.full(), Lsn(100), end, layer._entries(), opts=opts
        )
        got = await layer.write_l0(engine, root / "put_many", opts)
        assert want is not None and got is not None and got.name == want.name
        return want.read_bytes(), got.read_bytes()
    finally:
        await layer.aclose()


def _assert_same_file(got: bytes, want: bytes) -> None:
    """``got == want`` without pytest's diff of two layer files: with ``CI`` set, pytest does
    not truncate it, and a difflib diff of two large byte strings takes many minutes (the
    mutant tests expect this assertion to fail)."""
    if got != want:
        at = next((i for i, (a, b) in enumerate(zip(got, want, strict=False)) if a != b), None)
        raise AssertionError(
            f"layer files differ: {len(got)} vs {len(want)} bytes, first difference at "
            f"{min(len(got), len(want)) if at is None else at}"
        )


def _same_l0_both_ways(puts: list[tuple[Key, int, bytes, bool]], big: bool, impl: str = "python") -> None:
    root = Path(tempfile.mkdtemp(prefix="pagestore-l0-"))
    try:
        with pytest.MonkeyPatch.context() as m:
            m.setattr(inmemory_layer, "_pack_values", kernel(impl, L0).pack_values)
            if big:
                # the big-layer path (the file mapped), in small pieces (keys split across them)
                m.setattr(inmemory_layer, "_READ_WHOLE_MAX", 0)
                m.setattr(inmemory_layer, "_PACK_BYTES", 300)
            want, got = trio.run(_l0_both_ways, root, puts)
        _assert_same_file(got, want)
    finally:
        shutil.rmtree(root)


def _bulk_load_puts() -> list[tuple[Key, int, bytes, bool]]:
    """A bulk load's shape: 130 inserts of one size per heap block, back to back, and a
    relation-size key put once per block (scattered)."""
    rng = random.Random(7)
    puts: list[tuple[Key, int, bytes, bool]] = []
    lsn = 100
    for block in range(1, 6):
        puts.append((k(0), lsn, rng.randbytes(12), True))
        for i in range(130):
            lsn += 1
            puts.append((k(block), lsn, rng.randbytes(140), i == 0))
    return puts


def test_write_l0_of_a_bulk_load_writes_the_same_file_as_put(impl: str) -> None:
    for big in (False, True):
        _same_l0_both_ways(_bulk_load_puts(), big, impl)


@settings(max_examples=40, deadline=None, database=None, suppress_health_check=[HealthCheck.too_slow])
@given(puts=layer_puts(), big=hst.booleans())
def test_write_l0_writes_the_same_file_as_put(impl: str, puts: list[tuple[Key, int, bytes, bool]], big: bool) -> None:
    _same_l0_both_ways(puts, big, impl)


async def test_write_l0_of_an_empty_layer_writes_nothing(tmp_path: Path) -> None:
    engine = BlockingIoEngine()
    eph = await EphemeralFile.create(engine, tmp_path, double_buffering=False)
    layer = InMemoryLayer(eph, Lsn(100))
    try:
        await layer.freeze(Lsn(200))
        (tmp_path / "out").mkdir()
        assert await layer.write_l0(engine, tmp_path / "out", WriteOptions()) is None
        assert list((tmp_path / "out").iterdir()) == []
    finally:
        await layer.aclose()


# -- mutants of the batch code fail the tests above ----------------------------------------


def _quick(check: Callable[..., None], **strategies: hst.SearchStrategy[Any]) -> None:
    """The property tests above with the same strategies, without shrinking (a mutant's
    failure is all we need, not its smallest example)."""
    run = settings(
        max_examples=60, deadline=None, database=None, phases=[Phase.generate],
        suppress_health_check=[HealthCheck.too_slow],
    )(given(**strategies)(check))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", HypothesisWarning)  # (the failing example's big repr)
        run()


def _mutate(mp: pytest.MonkeyPatch, owner: object, name: str, old: str, new: str) -> None:
    """Replace method (or module function) ``name`` of ``owner`` by its source with the first ``old`` replaced by
    ``new`` (every ``old`` when it starts with ``*``), compiled in the method's module."""
    source = textwrap.dedent(inspect.getsource(getattr(owner, name)))
    every = old.startswith("*")
    old = old.removeprefix("*")
    assert old in source, f"mutation point {old!r} not found in {name}"
    mutant = "from __future__ import annotations\n" + source.replace(old, new, -1 if every else 1)
    namespace: dict[str, Any] = {}
    module = inspect.getmodule(owner)
    assert module is not None
    exec(compile(mutant, f"<mutant of {name}>", "exec"), vars(module), namespace)
    mp.setattr(owner, name, namespace[name])


_WRITER_MUTANTS = [
    # the fence of a block is the entry after its first
    ("self._fences.append(keys[i] + _LSN.pack(lsns[i]))", "self._fences.append(keys[i] + _LSN.pack(lsns[min(i + 1, n - 1)]))"),
    # a block boundary one entry early
    ("*ENTRIES_PER_BLOCK", "(ENTRIES_PER_BLOCK - 1)"),
    # the crc of a big blob misses its last byte
    ("crcs = list(map(crc32c.crc32c, blobs))", "crcs = [crc32c.crc32c(b[:-1] if len(b) > 8192 else b) for b in blobs]"),
    # the crc of the last blob of a batch is the one before it
    ("crcs = list(map(crc32c.crc32c, blobs))", "crcs = list(map(crc32c.crc32c, blobs)); crcs[-1] = crcs[-2] if n > 1 else crcs[-1]"),
    # the will_init bit lost after the first entry of a batch
    ("map(or_, map(lshift, offsets, repeat(1)), will_inits)", "map(or_, map(lshift, offsets, repeat(1)), [will_inits[0]] * n)"),
]


@pytest.mark.parametrize(("old", "new"), _WRITER_MUTANTS)
def test_a_writer_mutant_is_caught(old: str, new: str, monkeypatch: pytest.MonkeyPatch) -> None:
    with monkeypatch.context() as m:
        _mutate(m, LayerFileWriter, "put_many", old, new)
        with pytest.raises((AssertionError, ValueError)):  # a wrong file, or a refused batch
            _quick(_same_file_both_ways_case, case=entries_and_cuts())


_L0_MUTANTS: list[tuple[str, str]] = [
    # a value cut one byte late
    ("blob = bytes(sv[off : off + length])", "blob = bytes(sv[off + 1 : off + 1 + length])"),
    # the will_init bit lost
    ("| (pos & 1)", "| 0"),
    # a piece's next cursor skips the value it stopped at
    ("                stopped = True\n", "                stopped = True\n                sub += 1\n"),
    # a piece's positions start at the data offset of the layer, not of the piece
    ("((data_offset + out) << 1)", "((data_offset) << 1)"),
    # the crc of a value misses its last byte
    ("crc32c(blob)", "crc32c(blob[:-1])"),
]


@pytest.mark.parametrize(("old", "new"), _L0_MUTANTS)
def test_a_write_l0_mutant_is_caught(old: str, new: str, monkeypatch: pytest.MonkeyPatch) -> None:
    with monkeypatch.context() as m:
        _mutate(m, _l0_py, "_pack", old, new)
        with pytest.raises((AssertionError, ValueError)):  # a wrong file, or a refused piece
            _same_l0_both_ways(_bulk_load_puts(), big=False)
            _same_l0_both_ways(_bulk_load_puts(), big=True)
            _quick(_same_l0_both_ways, puts=layer_puts(), big=hst.booleans())


class _Bytes:
    """A frozen layer's bytes (``FrozenData``), as the L0 worker hands them to ``write_l0``."""

    def __init__(self, data: bytes) -> None:
        self.data = data
        self.length = len(data)

    async def read_all(self) -> bytes:
        return self.data

    def mapped(self) -> None:
        return None

    async def read_many(self, ranges: Sequence[tuple[int, int]]) -> list[bytes]:
        return [self.data[o : o + n] for o, n in ranges]


async def test_an_index_naming_more_bytes_than_the_layer_is_refused_before_any_write(tmp_path: Path) -> None:
    """The worker's index comes off a pipe: lengths adding up to more than the layer's bytes
    are refused before a file is made (the in-place index would otherwise be written far
    behind the data, a huge sparse file, before the kernel refused a later value)."""
    from array import array

    data = b"x" * 100
    keys = k(1) + k(2)
    counts = array("Q", [1, 1])
    good = array("Q", [0x100, 0, 50, 0x101, 100, 50])
    layer = InMemoryLayer.frozen_view(_Bytes(data), (keys, counts, good), Lsn(0x100), Lsn(0x200))
    path = await layer.write_l0(BlockingIoEngine(), tmp_path, WriteOptions())
    assert path is not None and path.exists()
    path.unlink()
    huge = array("Q", [0x100, 0, 50, 0x101, 100, 1 << 40])
    layer = InMemoryLayer.frozen_view(_Bytes(data), (keys, counts, huge), Lsn(0x100), Lsn(0x200))
    with pytest.raises(ValueError, match="add up to"):
        await layer.write_l0(BlockingIoEngine(), tmp_path, WriteOptions())
    assert list(tmp_path.iterdir()) == []
