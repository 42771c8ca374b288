"""The pageserver's ingest kernel: compiled (protocol/_ingest_c.pyx) against the pure-Python twin.

- Parity: the same ``__all__``, parameter names and defaults; the build matches its sources
  (stubtest over every compiled module is in test_native_wal.py).
- ``same_run`` on runs of like records: the whole run, and a run cut at the record where any
  one thing differs (length, xid, info, rmid, padding, a layout byte, ``xl_prev``, the VM bit,
  the CRC, a payload byte), for both implementations.
- Bad arguments (outside the buffer, short records, overflowing LSNs): the same ValueError.
- Differential hypothesis tests: twin and native give the same outcome (result, or the same
  error class and message) on runs with random bytes changed and random arguments, and on
  random bytes.
- The fuzz harness accepts its seeds and catches a planted difference.
"""

from __future__ import annotations

import inspect
import struct
from collections.abc import Callable
from pathlib import Path
from types import ModuleType, SimpleNamespace

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from bench.fuzz import RUN_LSN, like_records
from protocol import _native
from tests.conftest import kernel
from tests.fuzz_helpers import harness_takes_its_seeds_and_catches

INGEST = "protocol._ingest_c"
POS = RUN_LSN


def _outcome(fn: Callable[..., object], *args: object) -> tuple[object, ...]:
    try:
        return ("ok", fn(*args))
    except Exception as exc:
        return ("err", type(exc).__name__, str(exc))


@pytest.fixture(scope="module")
def both() -> tuple[ModuleType, ModuleType]:
    return kernel("native", INGEST), kernel("python", INGEST)


@pytest.mark.native
def test_same_names_and_signatures(both: tuple[ModuleType, ModuleType]) -> None:
    c, py = both
    assert c.__all__ == py.__all__ == ["IMPL", "WALK_INPUT", "WALK_OTHER", "WALK_REL", "append_triples", "fused_walk", "same_run"]
    for name in py.__all__:
        if callable(getattr(py, name)):
            want = [(p.name, p.default) for p in inspect.signature(getattr(py, name)).parameters.values()]
            assert [(p.name, p.default) for p in inspect.signature(getattr(c, name)).parameters.values()] == want


@pytest.mark.native
def test_the_build_matches_the_sources_on_disk() -> None:
    assert _native._expected_hash(INGEST) == _native.load_native(INGEST).SOURCE_HASH


def test_the_public_module_runs_the_selected_implementation() -> None:
    from protocol.wal import ingest_kernel

    assert ingest_kernel.IMPL == _native.IMPL


@pytest.mark.parametrize(("tot_len", "count", "extra"), [(59, 130, 0), (203, 40, 0), (203, 30, 16), (4000, 6, 0)])
def test_a_run_of_like_records_is_taken_whole(impl: str, tot_len: int, count: int, extra: int) -> None:
    same_run = kernel(impl, INGEST).same_run
    stride = ((tot_len + 7) & ~7) + extra
    buf = like_records(count, tot_len, stride, POS, vm_at=tot_len - 3)
    m, raws = same_run(buf, 0, POS, tot_len, stride, count - 1, tot_len - 3)
    assert m == count - 1
    assert list(raws) == [buf[i * stride : i * stride + tot_len] for i in range(count)]
    # from any record of it, as many as are asked for
    m, raws = same_run(buf, 3 * stride, POS + 3 * stride, tot_len, stride, 2, 0)
    assert (m, raws) == (2, tuple(buf[i * stride : i * stride + tot_len] for i in (3, 4, 5)))
    assert same_run(buf, 0, POS, tot_len, stride, 0, 0) == (0, (buf[:tot_len],))


def _fix_crc(buf: bytearray, at: int, tot_len: int) -> None:
    from protocol._wal_py import crc32c

    crc = crc32c(bytes(buf[at : at + 20]), crc32c(bytes(buf[at + 24 : at + tot_len])))
    buf[at + 20 : at + 24] = crc.to_bytes(4, "little")


# (what, byte offset in the record, whether the CRC is made right again afterwards)
_DAMAGE = [
    ("tot_len", 0, True), ("xid", 5, True), ("prev", 9, True), ("info", 16, True), ("rmid", 17, True),
    ("padding", 18, True), ("crc", 21, False), ("layout", 24, True), ("layout_end", 45, True),
    ("payload", 50, False), ("payload_crc_ok", 50, True),
]


@pytest.mark.parametrize(("what", "at", "recrc"), _DAMAGE)
@pytest.mark.parametrize("victim", [1, 7, 20])
def test_the_run_stops_at_the_first_record_that_differs(impl: str, what: str, at: int, recrc: bool, victim: int) -> None:
    same_run = kernel(impl, INGEST).same_run
    tot_len, count = 120, 25
    stride = 120
    buf = bytearray(like_records(count, tot_len, stride, POS))
    r = victim * stride
    buf[r + at] ^= 0x10
    if recrc:
        _fix_crc(buf, r, tot_len)
    m, raws = same_run(bytes(buf), 0, POS, tot_len, stride, count - 1, 0)
    want = count - 1 if what == "payload_crc_ok" else victim - 1
    assert m == want
    assert len(raws) == m + 1


def test_the_vm_bit_stops_the_run_only_when_asked(impl: str) -> None:
    same_run = kernel(impl, INGEST).same_run
    tot_len = stride = 96
    buf = bytearray(like_records(10, tot_len, stride, POS, vm_at=90))
    buf[4 * stride + 90] |= 0x01
    _fix_crc(buf, 4 * stride, tot_len)
    assert same_run(bytes(buf), 0, POS, tot_len, stride, 9, 90)[0] == 3
    assert same_run(bytes(buf), 0, POS, tot_len, stride, 9, 0)[0] == 9
    assert same_run(bytes(buf), 0, POS, tot_len, stride, 9, -1)[0] == 9


_BUF = like_records(6, 100, 104, POS)


@pytest.mark.parametrize(
    "args",
    [
        (-1, POS, 100, 104, 2, 0),  # negative offset
        (0, POS, 100, 104, -1, 0),  # negative count
        (0, POS, 45, 104, 2, 0),  # shorter than what a run compares
        (0, POS, 100, 99, 2, 0),  # stride below the length
        (0, POS, 100, 104, 2, 100),  # VM byte outside the record
        (0, POS, 100, 104, 6, 0),  # one stride too many
        (105, POS, 100, 104, 5, 0),  # from the second record: one too many
        (len(_BUF) + 8, POS, 100, 104, 0, 0),  # offset past the end
        (0, -1, 100, 104, 2, 0),  # negative LSN
        (0, (1 << 64) - 200, 100, 104, 2, 0),  # LSNs past 64 bits
    ],
)
def test_bad_arguments_are_the_same_value_error(both: tuple[ModuleType, ModuleType], args: tuple[int, ...]) -> None:
    c, py = both
    a, b = _outcome(c.same_run, _BUF, *args), _outcome(py.same_run, _BUF, *args)
    assert a == b
    assert a[:2] == ("err", "ValueError")


def test_any_buffer_is_accepted(impl: str) -> None:
    same_run = kernel(impl, INGEST).same_run
    for buf in (_BUF, bytearray(_BUF), memoryview(_BUF)):
        assert same_run(buf, 0, POS, 100, 104, 5, 0)[0] == 5
    with pytest.raises(TypeError):
        same_run("not bytes", 0, POS, 100, 104, 0, 0)


@settings(max_examples=300, deadline=None)
@given(
    tot_len=st.integers(46, 400),
    extra=st.integers(0, 24),
    count=st.integers(1, 60),
    o_rec=st.integers(0, 5),
    k_cut=st.integers(-3, 3),
    vm=st.integers(-2, 3),
    flips=st.lists(st.tuples(st.integers(0, 1 << 20), st.integers(1, 255)), max_size=4),
    pos_shift=st.sampled_from([0, 0, 8, -8]),
    seed=st.integers(0, 1 << 16),
)
def test_same_run_native_equals_twin_on_damaged_runs(
    both: tuple[ModuleType, ModuleType], tot_len: int, extra: int, count: int, o_rec: int, k_cut: int,
    vm: int, flips: list[tuple[int, int]], pos_shift: int, seed: int,
) -> None:
    c, py = both
    stride = tot_len + extra
    vm_at = {-2: -1, -1: 0}.get(vm, tot_len - 1 - vm)
    buf = bytearray(like_records(count, tot_len, stride, POS, max(vm_at, 0), seed=seed))
    for at, x in flips:
        buf[at % len(buf)] ^= x
    o = (o_rec % count) * stride
    k = max(0, count - 1 - o_rec % count + k_cut)
    args = (bytes(buf), o, POS + o + pos_shift, tot_len, stride, k, vm_at)
    assert _outcome(c.same_run, *args) == _outcome(py.same_run, *args)


@settings(max_examples=300, deadline=None)
@given(
    data=st.binary(max_size=3000),
    o=st.integers(-2, 100),
    pos=st.integers(-1, 1 << 64),
    tot_len=st.integers(0, 300),
    stride=st.integers(0, 400),
    k=st.integers(-1, 70),
    vm_at=st.integers(-1, 300),
)
@example(data=bytes(46), o=0, pos=0, tot_len=46, stride=46, k=0, vm_at=0)
@example(data=bytes(92), o=0, pos=(1 << 64) - 46, tot_len=46, stride=46, k=1, vm_at=0)
def test_same_run_native_equals_twin_on_random_bytes(
    both: tuple[ModuleType, ModuleType], data: bytes, o: int, pos: int, tot_len: int, stride: int, k: int, vm_at: int
) -> None:
    c, py = both
    args = (data, o, pos, tot_len, stride, k, vm_at)
    assert _outcome(c.same_run, *args) == _outcome(py.same_run, *args)


def test_fuzz_harness_accepts_its_seeds_and_catches_a_planted_difference(tmp_path: Path) -> None:
    twin = kernel("python", INGEST)
    liar = SimpleNamespace(same_run=lambda *a: (0, ()))
    for data in harness_takes_its_seeds_and_catches("same-run", tmp_path, twin, liar, seeds=3):
        # the seed is a whole run: the twin takes all of it
        tot_len = struct.unpack_from("<I", data, 4)[0]
        assert twin.same_run(data[4:], 0, RUN_LSN, tot_len, (tot_len + 7) & ~7, data[2], data[3])[0] == data[2]
