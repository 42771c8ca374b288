"""The blob gather of a vectored read (kernel 3): compiled (pageserver/storage/_blobs_c.pyx)
against the pure-Python twin, on real files.

Both read the planned reads, check every blob's bounds and CRC-32C, and hand out images as
bare pages and other values whole; on hostile plans (blobs outside their read, wrong CRCs,
reads past the end of the file, spans that do not follow each other, negative lengths, a
closed descriptor) both fail with the same error class naming the same read and slot.
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Sequence
from pathlib import Path
from types import ModuleType

import pytest
from crc32c import crc32c
from hypothesis import given, settings
from hypothesis import strategies as st

from pageserver.storage import _blobs_py
from pageserver.storage.value import TAG_IMAGE
from tests.conftest import kernel

BLOBS = "pageserver.storage._blobs_c"


def _fd(reader: object) -> int:
    """The tests' readers are their descriptors; the string "closed" a closed layer."""
    if reader == "closed":
        raise LookupError("the layer's file is closed")
    assert isinstance(reader, int)
    return reader


def _gather(
    mod: ModuleType, jobs: Sequence[tuple[object, int, int]], spans: Sequence[tuple[int, int]],
    blobs: Sequence[tuple[int, int, int]], probe: bool,
) -> tuple[list[bytes], bytes, int, bool, int]:
    """``gather_blobs`` of the planner's reads made from (fd, offset, total) jobs and their
    (first slot, count) spans (a read without a span has none: what the planner never makes)."""
    reads = [(j[0], j[1], j[2], *span) for j, span in zip(jobs, spans, strict=False)]
    return mod.gather_blobs(reads, blobs, _fd, probe)  # type: ignore[no-any-return]


def _outcome(mod: ModuleType, *args: object) -> tuple[object, ...]:
    try:
        values, kinds, _calls, supported, nbytes = _gather(mod, *args)  # type: ignore[arg-type]
    except Exception as exc:
        return ("err", type(exc).__name__, exc.args)
    return ("ok", values, kinds, supported, nbytes)


@pytest.fixture
def blob_file(tmp_path: Path) -> Iterator[tuple[int, list[tuple[int, int, int]], bytes]]:
    """A file of 4096 header bytes, then blobs: images (tag 0 + 8192) and other values."""
    data = bytearray(b"\xee" * 4096)
    blobs = []
    for i in range(12):
        body = bytes([TAG_IMAGE]) + bytes([i]) * 8192 if i % 3 else bytes([1 + i % 4]) + b"rec" * (i + 1)
        blobs.append((len(data), len(body), crc32c(body)))
        data += body
    path = tmp_path / "blobs"
    path.write_bytes(bytes(data))
    fd = os.open(path, os.O_RDONLY)
    try:
        yield fd, blobs, bytes(data)
    finally:
        os.close(fd)


def _plan(fd: int, blobs: list[tuple[int, int, int]], groups: list[int]) -> tuple[list[tuple[int, int, int]], list[tuple[int, int]]]:
    jobs, spans, slot = [], [], 0
    for size in groups:
        if slot + size > len(blobs):
            break
        first, last = blobs[slot], blobs[slot + size - 1]
        jobs.append((fd, first[0], last[0] + last[1] - first[0]))
        spans.append((slot, size))
        slot += size
    return jobs, spans


def test_twin_tag_is_the_value_format_s() -> None:
    assert _blobs_py.TAG_IMAGE == TAG_IMAGE


@pytest.mark.parametrize("probe", [True, False])
def test_images_come_out_bare_and_values_whole(impl: str, blob_file: tuple[int, list[tuple[int, int, int]], bytes], probe: bool) -> None:
    fd, blobs, data = blob_file
    jobs, spans = _plan(fd, blobs, [3, 1, 5, 3])
    values, kinds, calls, supported, nbytes = _gather(kernel(impl, BLOBS), jobs, spans, blobs, probe)
    assert calls >= len(jobs) and supported
    assert nbytes == sum(total for _, _, total in jobs)
    for (off, length, _), value, kind in zip(blobs, values, kinds, strict=True):
        blob = data[off : off + length]
        assert (value, kind) == ((blob[1:], 1) if blob[0] == TAG_IMAGE else (blob, 0))


def _hostile(fd: int, blobs: list[tuple[int, int, int]], size: int) -> dict[str, tuple[object, ...]]:
    jobs, spans = _plan(fd, blobs, [4, 4, 4])
    bad_crc = list(blobs)
    bad_crc[5] = (bad_crc[5][0], bad_crc[5][1], bad_crc[5][2] ^ 1)
    outside = list(blobs)
    outside[7] = (outside[7][0] + 10, outside[7][1], outside[7][2])  # the last of read 1
    before = list(blobs)
    before[4] = (before[4][0] - 1, before[4][1], before[4][2])
    past_end = [(fd, size - 100, 200)]
    return {
        "bad_crc": (jobs, spans, bad_crc, True),
        "outside": (jobs, spans, outside, True),
        "before": (jobs, spans, before, False),
        "past_end": (past_end, [(0, 0)], [], True),
        "gap": (jobs, [(0, 4), (5, 4), (8, 4)], blobs, True),
        "short_spans": (jobs, spans[:2], blobs, True),
        "extra_blobs": (jobs[:2], spans[:2], blobs, True),
        "negative_length": ([(fd, 4096, -1)], [(0, 0)], [], True),
        "negative_blob": (jobs[:1], spans[:1], [(blobs[0][0], -5, 0), *blobs[1:4]], True),
        "closed_fd": ([(987654, 4096, 10)], [(0, 0)], [], False),
        "closed_layer": ([*jobs[:2], ("closed", 4096, 10)], [*spans[:2], (8, 0)], blobs[:8], True),
    }


@pytest.mark.parametrize(
    ("case", "error"),
    [
        ("bad_crc", "BlobChecksumError"),
        ("outside", "BlobOutsideRead"),
        ("before", "BlobOutsideRead"),
        ("past_end", "ShortRead"),
        ("gap", "ValueError"),
        ("short_spans", "ValueError"),
        ("extra_blobs", "ValueError"),
        ("negative_length", "ValueError"),
        ("negative_blob", "BlobOutsideRead"),
        ("closed_fd", "OSError"),
        ("closed_layer", "LookupError"),
    ],
)
def test_hostile_plans(impl: str, blob_file: tuple[int, list[tuple[int, int, int]], bytes], case: str, error: str) -> None:
    fd, blobs, data = blob_file
    mod = kernel(impl, BLOBS)
    args = _hostile(fd, blobs, len(data))[case]
    with pytest.raises(Exception) as info:
        _gather(mod, *args)  # type: ignore[arg-type]
    assert type(info.value).__name__ == error
    if case == "bad_crc":
        assert info.value.args == (1, 5)


@pytest.mark.native
@pytest.mark.parametrize("case", ["bad_crc", "outside", "before", "past_end", "gap", "short_spans", "extra_blobs",
                                  "negative_length", "negative_blob", "closed_fd", "closed_layer"])
def test_native_equals_twin_on_hostile_plans(blob_file: tuple[int, list[tuple[int, int, int]], bytes], case: str) -> None:
    fd, blobs, data = blob_file
    args = _hostile(fd, blobs, len(data))[case]
    assert _outcome(kernel("native", BLOBS), *args) == _outcome(kernel("python", BLOBS), *args)


@settings(max_examples=150, deadline=None)
@given(
    groups=st.lists(st.integers(1, 5), min_size=1, max_size=6),
    shifts=st.lists(st.tuples(st.integers(0, 11), st.integers(-20, 20), st.integers(-3, 3)), max_size=2),
    probe=st.booleans(),
)
@pytest.mark.native
def test_native_equals_twin_on_mutated_plans(
    tmp_path_factory: pytest.TempPathFactory, groups: list[int],
    shifts: list[tuple[int, int, int]], probe: bool,
) -> None:
    path = tmp_path_factory.mktemp("blobs") / "f"
    data = bytearray(4096)
    blobs = []
    for i in range(12):
        # some of page size: a read of one of them alone is split by the native kernel
        body = bytes([TAG_IMAGE if i % 2 else 2]) + bytes([i]) * (8192 if i % 3 == 0 else 100 + 37 * i)
        blobs.append((len(data), len(body), crc32c(body)))
        data += body
    path.write_bytes(bytes(data))
    for which, d_off, d_len in shifts:
        off, length, crc = blobs[which]
        blobs[which] = (off + d_off, length + d_len, crc)
    fd = os.open(path, os.O_RDONLY)
    try:
        jobs, spans = _plan(fd, blobs, groups)
        used = sum(c for _, c in spans)
        args = (jobs, spans, blobs[:used], probe)
        assert _outcome(kernel("native", BLOBS), *args) == _outcome(kernel("python", BLOBS), *args)
    finally:
        os.close(fd)


@pytest.fixture
def page_file(tmp_path: Path) -> Iterator[tuple[int, list[tuple[int, int, int]], bytes]]:
    """Blobs of page size and more, each read alone (the native kernel reads the page of such
    a read straight into the bytes it hands out): images, a long WAL value, short values."""
    data = bytearray(b"\xee" * 4096)
    bodies = [
        bytes([TAG_IMAGE]) + bytes([7]) * 8192,
        bytes([2]) + b"long record " * 700,
        bytes([TAG_IMAGE]) + os.urandom(8192),
        bytes([1]) + b"x" * 4095,  # exactly the split size
        bytes([TAG_IMAGE]) + b"y" * 4094,  # one byte short of it
        bytes([3]) + b"z" * 40,
    ]
    blobs = []
    for body in bodies:
        blobs.append((len(data), len(body), crc32c(body)))
        data += body
    path = tmp_path / "pages"
    path.write_bytes(bytes(data))
    fd = os.open(path, os.O_RDONLY)
    try:
        yield fd, blobs, bytes(data)
    finally:
        os.close(fd)


@pytest.mark.parametrize("probe", [True, False])
def test_page_reads_come_out_whole(impl: str, page_file: tuple[int, list[tuple[int, int, int]], bytes], probe: bool) -> None:
    fd, blobs, data = page_file
    jobs, spans = _plan(fd, blobs, [1] * len(blobs))
    values, kinds, _calls, _, _ = _gather(kernel(impl, BLOBS), jobs, spans, blobs, probe)
    for (off, length, _), value, kind in zip(blobs, values, kinds, strict=True):
        blob = data[off : off + length]
        assert type(value) is bytes
        assert (value, kind) == ((blob[1:], 1) if blob[0] == TAG_IMAGE else (blob, 0))
    # the same blobs two to a read (no read is split) give the same values
    jobs2, spans2 = _plan(fd, blobs, [2] * (len(blobs) // 2))
    assert _gather(kernel(impl, BLOBS), jobs2, spans2, blobs, probe)[:2] == (values, kinds)


@pytest.mark.native
@pytest.mark.parametrize("case", ["bad_crc_image", "bad_crc_value", "bad_crc_tag", "short", "shifted", "longer"])
def test_native_equals_twin_on_hostile_page_reads(page_file: tuple[int, list[tuple[int, int, int]], bytes], case: str) -> None:
    fd, blobs, data = page_file
    plan = list(blobs)
    jobs, spans = _plan(fd, plan, [1] * len(plan))
    if case == "bad_crc_image":
        plan[2] = (plan[2][0], plan[2][1], plan[2][2] ^ 0x80000000)
    elif case == "bad_crc_value":
        plan[1] = (plan[1][0], plan[1][1], plan[1][2] ^ 1)
    elif case == "bad_crc_tag":  # the CRC of the page without its tag byte
        off, length, _ = plan[0]
        plan[0] = (off, length, crc32c(data[off + 1 : off + length]))
    elif case == "short":  # the last page read runs past the end of the file
        jobs[-1] = (fd, len(data) - 100, 8193)
        plan[-1] = (len(data) - 100, 8193, 0)
    elif case == "shifted":  # a page's read starts a byte early: not split, same answer
        jobs[0] = (fd, plan[0][0] - 1, plan[0][1] + 1)
    elif case == "longer":  # the read is longer than its one blob
        jobs[2] = (fd, plan[2][0], plan[2][1] + 10)
    args = (jobs, spans, plan, True)
    assert _outcome(kernel("native", BLOBS), *args) == _outcome(kernel("python", BLOBS), *args)


def test_the_descriptor_is_asked_once_per_run_of_one_reader(
    impl: str, blob_file: tuple[int, list[tuple[int, int, int]], bytes]
) -> None:
    fd, blobs, _data = blob_file
    jobs, spans = _plan(fd, blobs, [2, 2, 2, 2])
    a, b = object(), object()  # two layers: a, a, b, a
    owners = [a, a, b, a]
    asked: list[object] = []

    def fd_of(reader: object) -> int:
        asked.append(reader)
        return fd

    reads = [(o, j[1], j[2], *span) for o, j, span in zip(owners, jobs, spans, strict=True)]
    values, _kinds, _calls, _supported, nbytes = kernel(impl, BLOBS).gather_blobs(reads, blobs[:8], fd_of, False)
    assert asked == [a, b, a]
    assert len(values) == 8 and nbytes == sum(j[2] for j in jobs)


@pytest.mark.native
@pytest.mark.parametrize("bad", ["short_tuple", "long_tuple", "not_a_tuple", "fd_not_int"])
def test_native_equals_twin_on_malformed_reads(
    blob_file: tuple[int, list[tuple[int, int, int]], bytes], bad: str
) -> None:
    fd, blobs, _data = blob_file
    read: object = {
        "short_tuple": (fd, blobs[0][0], blobs[0][1], 0),
        "long_tuple": (fd, blobs[0][0], blobs[0][1], 0, 1, 9),
        "not_a_tuple": 17,
        "fd_not_int": ("x", blobs[0][0], blobs[0][1], 0, 1),
    }[bad]

    def outcome(mod: ModuleType) -> tuple[object, ...]:
        try:
            return ("ok", mod.gather_blobs([read], blobs[:1], lambda r: r, False)[:2])
        except Exception as exc:
            return ("err", type(exc).__name__)

    assert outcome(kernel("native", BLOBS)) == outcome(kernel("python", BLOBS))
