"""The LZ4 codec of compressed layer objects (``pageserver.remote_compression``,
``compression = "lz4"``): a round trip for any content, and hostile frames (truncated at every
block boundary and inside blocks, bytes after the frame, flipped bits, a content size that lies
either way, a huge declared block size, no checksum or no size, not LZ4 at all) are each a
``LayerCorruptionError`` that never leaves more than the index's ``file_size`` bytes behind; no
mutation of up to 3 bytes ever decompresses to other content."""

from __future__ import annotations

import itertools
import random
import struct
from pathlib import Path

import lz4.frame
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pageserver import remote_compression as rc
from pageserver.storage.layer_file import LayerCorruptionError
from tests.pageserver.test_remote_compression import SETTINGS, contents, layer_like

HEADER = 15  # magic, FLG, BD, 8-byte content size, header checksum: what the writer makes


def compressed(tmp: Path, data: bytes, level: int = 1) -> bytes:
    src, dst = tmp / "layer", tmp / "layer.lz4"
    src.write_bytes(data)
    read, written = rc.compress_file(src, dst, level, "lz4")
    assert read == len(data) and written == dst.stat().st_size
    return dst.read_bytes()


def blocks(obj: bytes) -> list[int]:
    """The offsets of the frame's block headers and of its end mark (the test's own walk)."""
    assert obj[4] & 0x08 and obj[4] & 0x10 and obj[4] & 0x04  # content size, block and content checksums
    out, pos = [], HEADER
    while (word := struct.unpack_from("<I", obj, pos)[0]) != 0:
        out.append(pos)
        pos += 4 + (word & 0x7FFFFFFF) + 4
    return [*out, pos]


def refused(tmp: Path, obj: bytes, file_size: int, match: str | None = None) -> LayerCorruptionError:
    src, dst = tmp / "hostile.lz4", tmp / "out"
    src.write_bytes(obj)
    dst.unlink(missing_ok=True)
    with pytest.raises(LayerCorruptionError, match=match) as info:
        rc.decompress_file(src, dst, file_size, "tenants/t/timelines/tl/layer-00000001", "lz4")
    assert "tenants/t/timelines/tl/layer-00000001" in str(info.value)
    assert info.value.sqlstate == "XX001"
    assert not dst.exists() or dst.stat().st_size <= file_size
    return info.value


@SETTINGS
@given(data=contents, level=st.sampled_from([1, 3]))
def test_round_trip(tmp_path: Path, data: bytes, level: int) -> None:
    obj = compressed(tmp_path, data, level)
    (tmp_path / "obj").write_bytes(obj)
    out = tmp_path / "out"
    assert rc.decompress_file(tmp_path / "obj", out, len(data), "k", "lz4") == len(data)
    assert out.read_bytes() == data


def test_a_layer_sized_file_round_trips_in_blocks(tmp_path: Path) -> None:
    data = layer_like(3 * rc.CHUNK + 12345)
    obj = compressed(tmp_path, data)
    # blocks of at most 1 MiB, then the end mark
    assert len(obj) < len(data) and len(blocks(obj)) == -(-len(data) // rc.LZ4_BLOCK) + 1 >= 4
    # the same frame as the library's own one-shot decoder reads it
    assert lz4.frame.decompress(obj) == data
    (tmp_path / "obj").write_bytes(obj)
    assert rc.decompress_file(tmp_path / "obj", tmp_path / "out", len(data), "k", "lz4") == len(data)
    assert (tmp_path / "out").read_bytes() == data


def test_a_truncation_at_every_block_boundary_and_inside_is_refused(tmp_path: Path) -> None:
    data = layer_like(3 * rc.LZ4_BLOCK)
    obj = compressed(tmp_path, data)
    marks = blocks(obj)
    assert len(marks) >= 3
    cuts = {0, 3, 4, 6, 10, HEADER - 1, HEADER, len(obj) - 1, len(obj) - 3, len(obj) - 4}
    for at in marks:
        cuts |= {at, at + 1, at + 3, at + 4, at + 100}  # at, inside its header, just after it
    for a, b in itertools.pairwise(marks):
        cuts.add((a + b) // 2)  # inside the block
    for cut in sorted(c for c in cuts if c < len(obj)):
        refused(tmp_path, obj[:cut], len(data))
    # cut 1-4 bytes: only (part of) the content checksum is missing
    refused(tmp_path, obj[:-4], len(data), "its LZ4 frame")


def test_bytes_after_the_frame_are_refused(tmp_path: Path) -> None:
    data = layer_like()
    obj = compressed(tmp_path, data)
    refused(tmp_path, obj + b"\0", len(data), "its LZ4 frame")
    refused(tmp_path, obj + obj, len(data), "its LZ4 frame")
    refused(tmp_path, obj + b"\0\0\0\0\0\0\0\0", len(data), "its LZ4 frame")


def test_flipped_bits_are_refused(tmp_path: Path) -> None:
    data = layer_like()
    obj = compressed(tmp_path, data)
    marks = blocks(obj)
    # the header (flags, block size code, content size, its checksum), a block's size, a
    # block's data (a literal, a match offset), a block's checksum, the end mark, the content
    # checksum
    for pos in (4, 5, 6, 13, 14, marks[0], marks[0] + 2, marks[0] + 50, marks[1] - 1, len(obj) // 2,
                marks[-1],
                len(obj) - 1):
        for bit in (0x01, 0x10, 0x80):
            bad = bytearray(obj)
            bad[pos] ^= bit
            refused(tmp_path, bytes(bad), len(data))


def _spliced(tmp: Path, head_of: bytes, body_of: bytes) -> bytes:
    """A frame whose header (with its valid checksum) is ``head_of``'s and whose blocks and
    content checksum are ``body_of``'s: a content size that lies, as an encoder could write."""
    return compressed(tmp, head_of)[:HEADER] + compressed(tmp, body_of)[HEADER:]


def test_a_content_size_that_disagrees_is_refused(tmp_path: Path) -> None:
    data = layer_like()
    obj = compressed(tmp_path, data)
    refused(tmp_path, obj, len(data) - 1, "by its header")
    refused(tmp_path, obj, len(data) + 1, "by its header")
    # the header says less than the blocks hold: the output stops at the index's size
    short = data[: len(data) - 70_000]
    refused(tmp_path, _spliced(tmp_path, short, data), len(short))
    # the header says more than the blocks hold
    refused(tmp_path, _spliced(tmp_path, data, short), len(data))
    # a patched content size (its header checksum no longer matches)
    bad = bytearray(obj)
    bad[6:14] = struct.pack("<Q", 1000)
    refused(tmp_path, bytes(bad), 1000)


def test_a_huge_or_empty_declared_block_is_refused_before_decompressing(tmp_path: Path) -> None:
    data = layer_like()
    obj = compressed(tmp_path, data)
    first = blocks(obj)[0]
    for word in (0x7FFFFFFF, 0xFFFFFFFF, rc.LZ4_BLOCK + 1, 0x80000000 | (rc.LZ4_BLOCK + 1)):
        bad = obj[:first] + struct.pack("<I", word) + obj[first + 4:]
        refused(tmp_path, bad, len(data), "LZ4 block of")
    # an uncompressed block of 0 bytes (not the end mark): no encoder writes one
    refused(tmp_path, obj[:first] + struct.pack("<I", 0x80000000) * 1000 + obj[first:], len(data), "LZ4 block of 0")


def test_frames_without_checksum_or_size_or_with_other_flags_are_refused(tmp_path: Path) -> None:
    data = layer_like()
    refused(tmp_path, lz4.frame.compress(data, content_checksum=False), len(data), "no content checksum")
    refused(tmp_path, lz4.frame.compress(data, content_checksum=True, store_size=False), len(data),
            "no content size")
    # block checksums alone do not replace the content checksum
    refused(tmp_path, lz4.frame.compress(data, block_checksum=True, content_checksum=False), len(data),
            "no content checksum")
    # the library's own frames with what the reader needs read (block checksums are optional)
    for kw in ({}, {"block_checksum": True}, {"block_size": lz4.frame.BLOCKSIZE_MAX4MB, "block_linked": False}):
        (tmp_path / "ok").write_bytes(lz4.frame.compress(data, content_checksum=True, **kw))
        assert rc.decompress_file(tmp_path / "ok", tmp_path / "out", len(data), "k", "lz4") == len(data)
        assert (tmp_path / "out").read_bytes() == data
    obj = compressed(tmp_path, data)
    for flg_bit in (0x01, 0x02, 0x80):  # a dictionary id, the reserved bit, another version
        refused(tmp_path, obj[:4] + bytes([obj[4] | flg_bit]) + obj[5:], len(data), "header is invalid")
    for bd in (0x00, 0x10, 0x61, 0xE0):  # block size codes 0/1, reserved bits
        refused(tmp_path, obj[:5] + bytes([bd]) + obj[6:], len(data))


def test_an_object_that_is_not_lz4_is_refused(tmp_path: Path) -> None:
    data = layer_like()
    refused(tmp_path, data, len(data), "not an LZ4 frame")  # an uncompressed layer named lz4
    refused(tmp_path, b"", len(data), "not an LZ4 frame")
    refused(tmp_path, b"\x04\x22\x4d\x18", len(data), "not an LZ4 frame")
    (tmp_path / "layer").write_bytes(data)
    rc.compress_file(tmp_path / "layer", tmp_path / "z", 1, "zstd")
    refused(tmp_path, (tmp_path / "z").read_bytes(), len(data), "not an LZ4 frame")
    # and a skippable frame (magic 0x184D2A5x) is not a layer either
    refused(tmp_path, b"\x50\x2a\x4d\x18" + struct.pack("<I", 4) + b"abcd" + compressed(tmp_path, data), len(data))


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.data())
def test_no_mutation_decompresses_to_other_content(tmp_path: Path, data: st.DataObject) -> None:
    original = layer_like(200_000)
    obj = bytearray(compressed(tmp_path, original))
    for _ in range(data.draw(st.integers(1, 3))):
        pos = data.draw(st.integers(0, len(obj) - 1))
        obj[pos] ^= data.draw(st.integers(1, 255))
    src, out = tmp_path / "m.lz4", tmp_path / "out"
    src.write_bytes(bytes(obj))
    out.unlink(missing_ok=True)
    try:
        rc.decompress_file(src, out, len(original), "k", "lz4")
    except LayerCorruptionError:
        assert not out.exists() or out.stat().st_size <= len(original)
    else:
        assert out.read_bytes() == original


def test_the_probe_with_lz4(tmp_path: Path) -> None:
    path = tmp_path / "layer"
    path.write_bytes(random.Random(1).randbytes(3 << 20))
    assert not rc.worth_compressing(path, 1, "lz4")
    path.write_bytes(layer_like(3 << 20)[: (3 << 20) // 2] * 2)
    assert rc.worth_compressing(path, 1, "lz4")
