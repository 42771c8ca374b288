"""The L0 writer's packing kernel: compiled (pageserver/storage/_l0_c.pyx) against the
pure-Python twin (``_l0_py``, the reference).

Both pack the same bytes and entries and return the same cursor for every well-formed index,
in pieces of any size; on hostile input (wrong shapes, keys out of order, LSNs outside the
layer or not rising, lengths past the source or past an index entry, a cursor or offset out of
range, mutated triples) both raise ``ValueError`` with the same message, and nothing else.
What the writer makes of the pieces is checked byte for byte in test_layer_writer_fast.py.
"""

from __future__ import annotations

import mmap
import random
import struct
from array import array
from types import ModuleType

import pytest
from crc32c import crc32c
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.conftest import kernel

L0 = "pageserver.storage._l0_c"
ENTRY = struct.Struct(">18sQQII")


def _outcome(mod: ModuleType, *args: object) -> tuple[object, ...]:
    try:
        return ("ok", *mod.pack_values(*args))
    except Exception as exc:
        return ("err", type(exc).__name__, str(exc))


def _both(*args: object) -> tuple[object, ...]:
    native, twin = _outcome(kernel("native", L0), *args), _outcome(kernel("python", L0), *args)
    assert native == twin
    return twin


def _both_to_the_end(*args: object) -> tuple[object, ...]:
    """``_both`` piece after piece (from the cursor each returns) until the index is packed
    or a call fails: the last outcome (a value past where a piece stops is checked by the
    call that reaches it)."""
    call = list(args)
    while True:
        outcome = _both(*call)
        if outcome[0] == "err" or outcome[3] == len(call[1]):  # type: ignore[arg-type]
            return outcome
        call[4], call[5] = outcome[3], outcome[4]
        call[6] = call[6] + len(outcome[1])  # type: ignore[operator, arg-type]


def _index(rng: random.Random, n_keys: int, src_len: int) -> tuple[bytes, array[int], array[int]]:
    keys = sorted({rng.randbytes(18) for _ in range(n_keys)})
    counts = array("Q", [rng.choice((1, 1, 2, 5, 40)) for _ in keys])
    triples = array("Q")
    for count in counts:
        lsn = rng.randrange(100, 200)
        for _ in range(count):
            length = rng.choice((0, 1, 7, 60, 300))
            off = rng.randrange(0, max(1, src_len - length + 1))
            triples.extend((lsn, off << 1 | rng.randrange(2), min(length, src_len - off)))
            lsn += rng.choice((1, 1, 9))
    return b"".join(keys), counts, triples


@st.composite
def indexes(draw: st.DrawFn) -> tuple[bytes, array[int], array[int], bytes]:
    rng = random.Random(draw(st.integers(0, 2**32)))
    src = rng.randbytes(draw(st.sampled_from([0, 1, 500, 5000])))
    keys, counts, triples = _index(rng, draw(st.integers(0, 30)), len(src))
    return keys, counts, triples, src


def _pack_all(impl: str, keys: bytes, counts: array[int], triples: array[int], src: object,
              max_bytes: int, offset: int = 4096) -> tuple[bytes, bytes]:
    mod = kernel(impl, L0)
    data: list[bytes] = []
    entries: list[bytes] = []
    key_at = sub = 0
    while key_at < len(counts):
        d, e, key_at, sub = mod.pack_values(keys, counts, triples, src, key_at, sub,
                                            offset + sum(map(len, data)), max_bytes, 0, 1 << 64)
        assert d or e  # progress
        data.append(d)
        entries.append(e)
    return b"".join(data), b"".join(entries)


@pytest.mark.native
@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(case=indexes(), max_bytes=st.sampled_from([0, 1, 100, 1000, 1 << 30]))
def test_twin_and_kernel_pack_the_same_pieces(
    case: tuple[bytes, array[int], array[int], bytes], max_bytes: int
) -> None:
    keys, counts, triples, src = case
    got = {impl: _pack_all(impl, keys, counts, triples, src, max_bytes) for impl in ("native", "python")}
    assert got["native"] == got["python"]


def test_the_pieces_are_the_values_and_their_entries(impl: str) -> None:
    """The twin (and so the kernel) against a plain reading of the format."""
    rng = random.Random(3)
    src = rng.randbytes(4000)
    keys, counts, triples = _index(rng, 20, len(src))
    for max_bytes in (0, 250, 1 << 20):
        data, entries = _pack_all(impl, keys, counts, triples, src, max_bytes, offset=8192)
        want_data, want_entries, at, v = bytearray(), bytearray(), 8192, 0
        for k, count in enumerate(counts):
            for _ in range(count):
                lsn, pos, length = triples[3 * v : 3 * v + 3]
                blob = src[pos >> 1 : (pos >> 1) + length]
                want_entries += ENTRY.pack(keys[18 * k : 18 * k + 18], lsn, at << 1 | pos & 1, length, crc32c(blob))
                want_data += blob
                at += length
                v += 1
        assert (data, entries) == (bytes(want_data), bytes(want_entries))


def test_a_piece_stops_before_the_value_that_does_not_fit(impl: str) -> None:
    keys = bytes(17) + b"\x01" + bytes(17) + b"\x02"
    counts = array("Q", [2, 1])
    triples = array("Q", [10, 0, 4, 11, 8, 4, 10, 16, 4])
    src = bytes(range(20))
    mod = kernel(impl, L0)
    # 4 + 4 > 6: the first value only; a value bigger than the whole piece still goes alone
    assert mod.pack_values(keys, counts, triples, src, 0, 0, 4096, 6, 0, 100)[2:] == (0, 1)
    assert mod.pack_values(keys, counts, triples, src, 0, 1, 4096, 1, 0, 100)[2:] == (1, 0)
    assert mod.pack_values(keys, counts, triples, src, 0, 0, 4096, 8, 0, 100)[2:] == (1, 0)
    data, entries, key_at, sub = mod.pack_values(keys, counts, triples, src, 1, 0, 4096, 8, 0, 100)
    assert (data, key_at, sub, len(entries)) == (src[8:12], 2, 0, 42)
    assert mod.pack_values(keys, counts, triples, src, 2, 0, 4096, 8, 0, 100) == (b"", b"", 2, 0)


def _good() -> list[object]:
    keys = bytes(17) + b"\x01" + bytes(17) + b"\x02"
    return [keys, array("Q", [2, 1]), array("Q", [10, 0, 4, 11, 9, 4, 10, 16, 4]), bytes(range(20)),
            0, 0, 4096, 1 << 20, 10, 12]


HOSTILE: list[tuple[str, int, object]] = [
    ("short keys", 0, bytes(30)),
    ("long keys", 0, bytes(37)),
    ("a key without values", 1, array("Q", [3, 0])),
    ("counts above the triples", 1, array("Q", [2, 2])),
    ("counts below the triples", 1, array("Q", [1, 1])),
    ("huge counts", 1, array("Q", [2**64 - 1, 2**64 - 1])),
    ("triples not in threes", 2, array("Q", [10, 0, 4, 11, 9, 4, 10, 16])),
    ("keys out of order", 0, bytes(17) + b"\x02" + bytes(17) + b"\x01"),
    ("keys repeated", 0, bytes(17) + b"\x01" + bytes(17) + b"\x01"),
    ("LSNs not rising", 2, array("Q", [11, 0, 4, 11, 9, 4, 10, 16, 4])),
    ("LSN below the layer", 2, array("Q", [9, 0, 4, 11, 9, 4, 10, 16, 4])),
    ("LSN at the layer's end", 2, array("Q", [10, 0, 4, 12, 9, 4, 10, 16, 4])),
    ("value past the source", 2, array("Q", [10, 0, 4, 11, 9, 4, 10, 34, 4])),
    ("value ending past the source", 2, array("Q", [10, 0, 4, 11, 9, 4, 10, 32, 5])),
    ("huge offset", 2, array("Q", [10, 0, 4, 11, 2**64 - 1, 4, 10, 16, 4])),
    ("huge length", 2, array("Q", [10, 0, 4, 11, 9, 2**64 - 1, 10, 16, 4])),
    ("length past an index entry", 2, array("Q", [10, 0, 4, 11, 9, 2**32, 10, 16, 4])),
    ("empty source", 3, b""),
    ("cursor past the keys", 4, 3),
    ("negative cursor", 4, -1),
    ("cursor past a key's values", 5, 2),
    ("negative sub", 5, -1),
    ("sub at the end", 4, 2),
    ("negative data offset", 6, -1),
    ("huge data offset", 6, 1 << 62),
    ("negative max_bytes", 7, -5),
    ("huge max_bytes", 7, 1 << 70),
    ("negative layer start", 8, -(1 << 70)),
    ("layer start above every LSN", 8, 1 << 70),
    ("negative layer end", 9, -1),
]


def _hostile_args(what: str, at: int, value: object) -> list[object]:
    args = _good()
    args[at] = value
    if what == "sub at the end":
        args[5] = 1  # (at the end only (len(counts), 0) is a cursor)
    return args


@pytest.mark.parametrize(("what", "at", "value"), HOSTILE, ids=[h[0] for h in HOSTILE])
def test_hostile_input_is_a_value_error(impl: str, what: str, at: int, value: object) -> None:
    mod = kernel(impl, L0)
    assert _outcome(mod, *_good())[0] == "ok"
    call = _hostile_args(what, at, value)
    while (outcome := _outcome(mod, *call))[0] == "ok" and outcome[3] != len(call[1]):  # type: ignore[arg-type]
        call[4], call[5], call[6] = outcome[3], outcome[4], call[6] + len(outcome[1])  # type: ignore[operator, arg-type]
    if what in ("negative layer start", "huge max_bytes") and outcome[0] == "ok":
        return  # (a bound below every LSN is no error; nothing else may pass)
    assert outcome[0] == "err" and outcome[1] == "ValueError", (what, outcome)


@pytest.mark.native
def test_hostile_input_is_the_same_error_from_both() -> None:
    for what, at, value in HOSTILE:
        _both_to_the_end(*_hostile_args(what, at, value))


@pytest.mark.native
@settings(max_examples=300, deadline=None)
@given(data=st.data())
def test_mutated_triples_give_the_same_outcome(data: st.DataObject) -> None:
    args = _good()
    good = args[2]
    assert isinstance(good, array)
    triples = array("Q", good)
    for _ in range(data.draw(st.integers(1, 3))):
        i = data.draw(st.integers(0, len(triples) - 1))
        triples[i] = data.draw(st.sampled_from([0, 1, 4, 9, 10, 11, 12, 19, 20, 21, 2**32, 2**63, 2**64 - 1]))
    args[2] = triples
    args[7] = data.draw(st.sampled_from([0, 4, 8, 1 << 20]))
    args[4], args[5] = data.draw(st.sampled_from([(0, 0), (0, 1), (1, 0)]))
    _both_to_the_end(*args)


def test_a_mapped_source_is_released_even_on_error(impl: str, tmp_path: object) -> None:
    """The flush maps a big layer and closes the map after each call: the call must not
    keep it exported, also when it fails (a BufferError on close would hide the error)."""
    import pathlib

    path = pathlib.Path(str(tmp_path)) / "src"
    path.write_bytes(bytes(range(20)))
    mod = kernel(impl, L0)
    with open(path, "rb") as f:
        m = mmap.mmap(f.fileno(), 20, prot=mmap.PROT_READ)
        args = _good()
        args[3] = m
        assert mod.pack_values(*args)[0] == bytes(range(12))
        args[2] = array("Q", [10, 0, 4, 11, 9, 4, 10, 40, 4])
        with pytest.raises(ValueError, match="outside the layer's 20 bytes"):
            mod.pack_values(*args)
        m.close()  # no BufferError: nothing holds it


def test_fuzz_harness_accepts_its_seeds_and_catches_a_planted_difference(tmp_path: object) -> None:
    import pathlib
    from types import SimpleNamespace

    from bench import fuzz
    from pageserver.storage import _l0_py

    seeds = pathlib.Path(str(tmp_path)) / "corpus"
    seeds.mkdir()
    fuzz.write_seeds("pack-values", seeds)
    same = fuzz._harness("pack-values", kernel("native", L0), _l0_py)

    def lying(*args: object) -> tuple[bytes, bytes, int, int]:
        data, entries, key_at, sub = _l0_py.pack_values(*args)  # type: ignore[arg-type]
        return data, entries[:-1] + b"\x00" if entries else entries, key_at, sub

    broken = fuzz._harness("pack-values", SimpleNamespace(pack_values=lying), _l0_py)  # type: ignore[arg-type]
    packed = 0
    for seed in sorted(seeds.iterdir()):
        data = seed.read_bytes()
        same(data)
        steps = fuzz.pack_outcome(_l0_py, data)
        assert steps is not None and steps[-1][0] == "ok", steps and steps[-1][:3]
        packed += len(steps)
        with pytest.raises(AssertionError, match="pack_values differs"):
            broken(data)
    assert packed >= 3


@pytest.mark.native
def test_same_names_and_the_writers_entry_size() -> None:
    """Kernel and twin export the same names, and their entries are the layer writer's."""
    from pageserver.storage import _l0_py
    from pageserver.storage.layer_file import ENTRY as WRITER_ENTRY

    native = kernel("native", L0)
    assert native.__all__ == _l0_py.__all__
    assert native.ENTRY_SIZE == _l0_py.ENTRY_SIZE == ENTRY.size == WRITER_ENTRY.size
