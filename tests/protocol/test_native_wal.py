"""The WAL kernels: compiled (protocol/_wal_c.pyx) against the pure-Python twin, and the selector.

- Selection: which implementation runs, the loud ImportErrors (bad variable, missing build,
  stale build), no silent fallback.
- Parity: the same ``__all__``, parameter names and defaults; stubtest on the compiled module.
- CRC-32C: the check value, a bitwise definition, chaining, alignments 0-7 and tails 0-15, both
  kernels (SSE4.2 and the forced table fallback).
- ``scan_records``: twin and native give the same outcome (result, or the same error class) on
  valid WAL cut anywhere, on mutated WAL and on random bytes.
"""

from __future__ import annotations

import inspect
import os
import random
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from types import ModuleType, SimpleNamespace

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from protocol import _native, _wal_py
from protocol.lsn import WAL_SEGMENT_SIZE, XLOG_BLCKSZ, Lsn
from protocol.wal import page as wal_page
from protocol.wal import record as wal_record
from protocol.wal import rmgr as wal_rmgr
from safekeeper.testing import synthetic_wal
from tests.conftest import kernel

WAL = "protocol._wal_c"
BASE = 0x2000000


def _bitwise_crc32c(data: bytes, value: int = 0) -> int:
    crc = value ^ 0xFFFFFFFF
    for b in data:
        crc ^= b
        for _ in range(8):
            crc = (crc >> 1) ^ (0x82F63B78 & -(crc & 1))
    return crc ^ 0xFFFFFFFF


def _outcome(fn: Callable[..., object], *args: object) -> tuple[object, ...]:
    try:
        return ("ok", fn(*args))
    except Exception as exc:  # the class is the contract; messages may differ in wording
        return ("err", type(exc).__name__)


@pytest.fixture(scope="module")
def both() -> tuple[ModuleType, ModuleType]:
    return kernel("native", WAL), kernel("python", WAL)


# --- selection --------------------------------------------------------------------------------


def test_the_native_kernels_run_unless_pure_python_is_asked_for() -> None:
    from protocol.wal import kernels

    expected = "python" if os.environ.get(_native.ENV_VAR) == "1" else "native"
    assert expected == _native.IMPL
    assert expected == kernels.IMPL
    assert _native.describe()["impl"] == expected


def _run(code: str, **env: str) -> subprocess.CompletedProcess[str]:
    full = {k: v for k, v in os.environ.items() if k not in (_native.ENV_VAR, "PAGESTORE_CRC32C_SW")}
    full.update(env)
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=full, check=False)


@pytest.mark.parametrize("value", ["0", "", "yes", "true", " 1"])
def test_any_other_value_than_1_is_an_import_error(value: str) -> None:
    out = _run("import protocol.wal.kernels", PAGESTORE_PURE_PYTHON=value)
    assert out.returncode != 0
    assert "ImportError" in out.stderr and "PAGESTORE_PURE_PYTHON" in out.stderr


def test_pure_python_selects_the_twin() -> None:
    out = _run("from protocol.wal import kernels; print(kernels.IMPL, kernels.crc32c.__module__)", PAGESTORE_PURE_PYTHON="1")
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["python", "protocol._wal_py"]


def test_a_missing_build_is_a_loud_import_error_not_a_fallback() -> None:
    # None in sys.modules makes the import fail exactly as a missing .so does.
    out = _run("import sys; sys.modules['protocol._wal_c'] = None; import protocol.wal.kernels")
    assert out.returncode != 0
    assert "protocol._wal_c" in out.stderr
    assert "pip install -e ." in out.stderr and "PAGESTORE_PURE_PYTHON=1" in out.stderr


@pytest.mark.native
def test_a_stale_build_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_native, "_expected_hash", lambda name: "0" * 32)
    with pytest.raises(ImportError, match=r"stale.*pip install -e"):
        _native.load_native(WAL)


@pytest.mark.native
def test_the_build_matches_the_sources_on_disk() -> None:
    module = _native.load_native(WAL)
    assert _native._expected_hash(WAL) == module.SOURCE_HASH


# --- parity -----------------------------------------------------------------------------------


@pytest.mark.native
def test_same_names_and_signatures(both: tuple[ModuleType, ModuleType]) -> None:
    c, py = both
    assert c.__all__ == py.__all__
    def params(fn: object) -> list[tuple[str, object]]:
        return [(p.name, p.default) for p in inspect.signature(fn).parameters.values()]  # type: ignore[arg-type]

    for name in py.__all__:
        obj = getattr(py, name)
        if isinstance(obj, type):
            # a cdef class has no signature of its own; its methods and public names do
            public = {m for m in dir(obj) if not m.startswith("_")} - set(getattr(obj, "__slots__", ()))
            assert public <= set(dir(getattr(c, name))), name
            for method in sorted(m for m in public if callable(getattr(obj, m))):
                assert params(getattr(getattr(c, name), method)) == params(getattr(obj, method)), (name, method)
        elif callable(obj):
            assert params(getattr(c, name)) == params(obj), name


@pytest.mark.native
def test_stubtest_agrees_with_every_compiled_module() -> None:
    from protocol._native_sources import NATIVE_MODULES

    out = subprocess.run(
        [sys.executable, "-m", "mypy.stubtest", *NATIVE_MODULES, "--ignore-missing-stub"],
        capture_output=True, text=True, check=False,
    )
    assert out.returncode == 0, out.stdout + out.stderr


def test_twin_constants_are_postgresql_s() -> None:
    assert _wal_py.XLOG_BLCKSZ == XLOG_BLCKSZ
    assert _wal_py.XLOG_PAGE_MAGIC == wal_page.XLOG_PAGE_MAGIC
    assert _wal_py.XLP_FIRST_IS_CONTRECORD == wal_page.XLP_FIRST_IS_CONTRECORD
    assert _wal_py.XLP_LONG_HEADER == wal_page.XLP_LONG_HEADER
    assert _wal_py.XLP_ALL_FLAGS == wal_page.XLP_ALL_FLAGS
    assert _wal_py.SHORT_PHD == wal_page.SIZE_OF_SHORT_PHD
    assert _wal_py.RECORD_HEADER == wal_record.SIZE_OF_XLOG_RECORD
    assert _wal_py.XLOG_SWITCH == wal_rmgr.XLOG_SWITCH
    assert int(wal_rmgr.RmgrId.XLOG) == _wal_py.RM_XLOG_ID
    payload = b"any message"
    crc = _bitwise_crc32c(payload).to_bytes(4, "little")
    assert _bitwise_crc32c(payload + crc) == _wal_py.CRC_RESIDUE


# --- CRC-32C ----------------------------------------------------------------------------------


def test_crc32c_check_value(impl: str) -> None:
    crc = kernel(impl, WAL).crc32c
    assert crc(b"123456789") == 0xE3069283
    assert crc(b"") == 0
    assert crc(b"", 0x12345678) == 0x12345678


def test_crc32c_alignments_tails_and_chaining(impl: str) -> None:
    crc = kernel(impl, WAL).crc32c
    rng = random.Random(17)
    block = rng.randbytes(200)
    for align in range(8):
        for tail in range(16):
            for length in (tail, 8 + tail, 64 + tail):
                piece = memoryview(block)[align : align + length]
                assert crc(piece) == _bitwise_crc32c(bytes(piece)), (align, length)
    a, b = block[:77], block[77:]
    assert crc(b, crc(a)) == crc(block) == _bitwise_crc32c(block)
    # around the SSE4.2 kernel's three-chain blocks (3 x 512 bytes)
    big = rng.randbytes(5000)
    for length in (1535, 1536, 1537, 3072, 3079, 4608, 5000):
        assert crc(big[:length], 0x1234) == _bitwise_crc32c(big[:length], 0x1234), length
    assert crc(bytearray(block)) == crc(memoryview(block)) == crc(block)


def test_crc32c_bad_arguments(impl: str) -> None:
    crc = kernel(impl, WAL).crc32c
    with pytest.raises(OverflowError):
        crc(b"x", -1)
    with pytest.raises(OverflowError):
        crc(b"x", 1 << 32)
    with pytest.raises(TypeError):
        crc("text")
    with pytest.raises((BufferError, TypeError, ValueError)):
        crc(memoryview(b"abcdef")[::2])


@settings(max_examples=200, deadline=None)
@given(data=st.binary(max_size=7000), seed=st.integers(0, 0xFFFFFFFF))
@example(data=b"", seed=0).via("edge")
@example(data=b"\xff" * 4, seed=0xFFFFFFFF).via("edge")
@pytest.mark.native
def test_crc32c_native_equals_twin(both: tuple[ModuleType, ModuleType], data: bytes, seed: int) -> None:
    c, py = both
    assert c.crc32c(data, seed) == py.crc32c(data, seed)


@pytest.mark.native
def test_the_table_kernel_forced_by_environment_equals_the_hardware_one() -> None:
    code = (
        "import random; from protocol import _wal_c as c; r = random.Random(5);"
        "print(c.crc32c_kernel(), [c.crc32c(r.randbytes(n), n) for n in (0, 1, 7, 8, 9, 100, 8192, 70000)])"
    )
    sw = _run(code, PAGESTORE_CRC32C_SW="1")
    hw = _run(code)
    assert sw.returncode == 0 and hw.returncode == 0, sw.stderr + hw.stderr
    assert sw.stdout.split()[0] == "table"
    assert sw.stdout.split(" ", 1)[1] == hw.stdout.split(" ", 1)[1]
    bad = _run("import protocol._wal_c", PAGESTORE_CRC32C_SW="yes")
    assert bad.returncode != 0 and "PAGESTORE_CRC32C_SW" in bad.stderr


# --- scan_records -----------------------------------------------------------------------------

_WALS: dict[int, bytes] = {}


def _wal(record_size: int) -> bytes:
    if record_size not in _WALS:
        _WALS[record_size] = synthetic_wal(Lsn(BASE), 60_000, record_size=record_size)
    return _WALS[record_size]


_STARTS: dict[int, list[int]] = {}


def _record_starts(record_size: int) -> list[int]:
    """Indices of the records of ``_wal(record_size)`` (never a page start: a header is there)."""
    from protocol.wal.reader import WalStreamDecoder

    if record_size not in _STARTS:
        decoder = WalStreamDecoder(Lsn(BASE))
        decoder.feed(_wal(record_size))
        _STARTS[record_size] = [rec.lsn - BASE for rec in decoder.records()]
    return _STARTS[record_size]


def _first_record_index(data: bytes) -> int:
    return 40  # synthetic_wal starts at a segment start: the long page header


def test_scan_records_walks_what_the_decoder_finds(impl: str) -> None:
    from protocol.wal.reader import WalStreamDecoder

    scan = kernel(impl, WAL).scan_records
    for size in (26, 200, 3000, 9000):
        data = _wal(size)
        decoder = WalStreamDecoder(Lsn(BASE))
        decoder.feed(data)
        ends = {rec.end_lsn - BASE for rec in decoder.records()}
        i, last, bad = scan(data, _first_record_index(data), len(data), BASE, WAL_SEGMENT_SIZE)
        assert bad == -1 and last > 0 and (last in ends or (last + BASE) % XLOG_BLCKSZ == 0 or last - i < 8)
        assert i <= len(data)


def test_scan_records_reports_a_bad_crc_after_the_good_records(impl: str) -> None:
    scan = kernel(impl, WAL).scan_records
    data = bytearray(_wal(200))
    data[40 + 200 + 30] ^= 1  # inside the second record (200 bytes, MAXALIGNed)
    i, last, bad = scan(data, 40, len(data), BASE, WAL_SEGMENT_SIZE)
    assert (i, last, bad) == (240, 240, 240)


@pytest.mark.parametrize(
    ("args", "error"),
    [
        ((41, 100, BASE, WAL_SEGMENT_SIZE), ValueError),  # not MAXALIGNed
        ((48, 10, BASE, WAL_SEGMENT_SIZE), ValueError),  # i > n
        ((40, 10**9, BASE, WAL_SEGMENT_SIZE), ValueError),  # n past the buffer
        ((-8, 100, BASE, WAL_SEGMENT_SIZE), ValueError),
        ((40, 100, BASE, 1000), ValueError),  # not a multiple of the page size
        ((40, 100, BASE, 0), ValueError),
        ((40, 100, -BASE, WAL_SEGMENT_SIZE), ValueError),
        ((40, 100, (1 << 64) - 64, WAL_SEGMENT_SIZE), ValueError),
    ],
)
def test_scan_records_rejects_bad_arguments(impl: str, args: tuple[int, ...], error: type[Exception]) -> None:
    scan = kernel(impl, WAL).scan_records
    with pytest.raises(error):
        scan(_wal(200), *args)


@settings(max_examples=300, deadline=None)
@given(
    size=st.sampled_from([26, 64, 200, 1000, 8000, 9000, 20000]),
    start_rec=st.integers(0, 50),
    cut=st.integers(0, 60_000),
    flips=st.lists(st.tuples(st.integers(0, 60_000), st.integers(1, 255)), max_size=3),
    as_view=st.booleans(),
)
@pytest.mark.native
def test_scan_records_native_equals_twin_on_cut_and_mutated_wal(
    both: tuple[ModuleType, ModuleType], size: int, start_rec: int, cut: int,
    flips: list[tuple[int, int]], as_view: bool,
) -> None:
    c, py = both
    data = bytearray(_wal(size))
    for at, mask in flips:
        data[at % len(data)] ^= mask
    starts = _record_starts(size)
    i = starts[start_rec % len(starts)]
    n = max(min(cut, len(data)), i)
    buf: object = memoryview(data) if as_view else bytes(data)
    assert _outcome(c.scan_records, buf, i, n, BASE, WAL_SEGMENT_SIZE) == _outcome(
        py.scan_records, buf, i, n, BASE, WAL_SEGMENT_SIZE
    )


@settings(max_examples=300, deadline=None)
@given(
    data=st.binary(min_size=0, max_size=20000),
    i=st.integers(0, 20000).map(lambda v: v & ~7),
    n=st.integers(-10, 20010),
    base_page=st.integers(0, 4096),
    seg_pages=st.sampled_from([1, 2, 2048]),
)
@example(data=b"\x18" + b"\0" * 100, i=8, n=100, base_page=0, seg_pages=2048).via("edge")
@example(data=b"\xff" * 64, i=8, n=64, base_page=1, seg_pages=1).via("edge")
@pytest.mark.native
def test_scan_records_native_equals_twin_on_random_bytes(
    both: tuple[ModuleType, ModuleType], data: bytes, i: int, n: int, base_page: int, seg_pages: int
) -> None:
    c, py = both
    base = base_page * XLOG_BLCKSZ
    args = (data, i, n, base, seg_pages * XLOG_BLCKSZ)
    assert _outcome(c.scan_records, *args) == _outcome(py.scan_records, *args)


# --- RecordTracker ----------------------------------------------------------------------------


def _tracker_trace(cls: type, data: bytes, start: int, cuts: list[int], seg_size: int) -> list[object]:
    """What a tracker does over ``data`` fed in pieces ending at ``cuts``: after each feed its
    (record_end, pos), and on an error its class, message, record_end and pos."""
    trace: list[object] = []
    try:
        tracker = cls(start, seg_size)
    except Exception as exc:
        return [("init-err", type(exc).__name__)]
    at = 0
    for cut in [*sorted(cuts), len(data)]:
        piece = data[at:max(at, cut)]
        at = max(at, cut)
        try:
            end = tracker.feed(piece)
        except Exception as exc:
            trace.append(("err", type(exc).__name__, str(exc), tracker.record_end, tracker.pos))
            return trace
        trace.append((end, tracker.record_end, tracker.pos))
    return trace


@settings(max_examples=200, deadline=None)
@given(
    size=st.sampled_from([26, 64, 200, 1000, 8000, 9000, 20000]),
    cuts=st.lists(st.integers(0, 60_000), max_size=8),
    flips=st.lists(st.tuples(st.integers(0, 60_000), st.integers(1, 255)), max_size=2),
    start_rec=st.integers(0, 50),
)
@pytest.mark.native
def test_tracker_native_equals_twin_on_chunked_and_mutated_wal(
    both: tuple[ModuleType, ModuleType], size: int, cuts: list[int],
    flips: list[tuple[int, int]], start_rec: int,
) -> None:
    c, py = both
    starts = _record_starts(size)
    first = starts[start_rec % len(starts)]
    data = bytearray(_wal(size))
    for at, mask in flips:
        data[at % len(data)] ^= mask
    piece = bytes(data[first:])
    args = (piece, BASE + first, [x % (len(piece) + 1) for x in cuts], WAL_SEGMENT_SIZE)
    assert _tracker_trace(c.RecordTracker, *args) == _tracker_trace(py.RecordTracker, *args)


@settings(max_examples=200, deadline=None)
@given(
    data=st.binary(max_size=20000),
    start=st.integers(0, 1 << 20).map(lambda v: v * 8),
    cuts=st.lists(st.integers(0, 20000), max_size=6),
    seg_pages=st.sampled_from([1, 2, 2048]),
)
@example(data=bytes(40), start=0, cuts=[], seg_pages=2048).via("edge")
@pytest.mark.native
def test_tracker_native_equals_twin_on_random_bytes(
    both: tuple[ModuleType, ModuleType], data: bytes, start: int, cuts: list[int], seg_pages: int
) -> None:
    c, py = both
    args = (data, start, cuts, seg_pages * XLOG_BLCKSZ)
    assert _tracker_trace(c.RecordTracker, *args) == _tracker_trace(py.RecordTracker, *args)


@pytest.mark.parametrize(("start", "seg"), [(4, WAL_SEGMENT_SIZE), (-8, WAL_SEGMENT_SIZE), (0, 0), (0, 1000), (1 << 64, WAL_SEGMENT_SIZE)])
def test_tracker_rejects_bad_arguments(impl: str, start: int, seg: int) -> None:
    with pytest.raises((ValueError, OverflowError)):
        kernel(impl, WAL).RecordTracker(start, seg)


# --- the fuzz harnesses (pagestore fuzz; atheris itself is not needed here) -------------------


@pytest.mark.parametrize("name", ["scan-records", "record-tracker", "crc32c"])
def test_fuzz_harness_accepts_its_seeds_and_catches_a_planted_difference(name: str, tmp_path: Path) -> None:
    from bench import fuzz

    twin = kernel("python", WAL)
    seeds = tmp_path / "corpus"
    seeds.mkdir()
    fuzz.write_seeds(name, seeds)
    same = fuzz._harness(name, twin, twin)
    broken = SimpleNamespace(
        scan_records=lambda *a: (0, -1, -1),
        RecordTracker=_LyingTracker,
        crc32c=lambda data, value=0: twin.crc32c(data, value) ^ 1,
    )
    lying = fuzz._harness(name, broken, twin)  # type: ignore[arg-type]
    for seed in seeds.iterdir():
        same(seed.read_bytes())
        with pytest.raises(AssertionError, match="differs"):
            lying(seed.read_bytes())


class _LyingTracker:
    def __init__(self, start: int, seg_size: int) -> None:
        self.pos = self.record_end = start

    def feed(self, data: bytes) -> int:
        self.pos += len(data)
        return self.record_end
