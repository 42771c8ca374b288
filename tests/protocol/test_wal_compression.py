"""Compressed full-page images: pglz (our own codec), lz4 and zstd, restored with their hole."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from protocol.errors import RemoteProtocolError
from protocol.wal.encoder import BlockSpec, build_record
from protocol.wal.pglz import PglzError, pglz_compress, pglz_decompress
from protocol.wal.record import (
    BKPIMAGE_COMPRESS_LZ4,
    BKPIMAGE_COMPRESS_ZSTD,
    RelFileNode,
    decode_record,
    restore_block_image,
)
from tests.protocol.wal_strategies import make_page

RN = RelFileNode(1663, 5, 16384)


def test_pglz_hand_made_stream() -> None:
    # Control byte 0b1000: three literals, then a tag with len 9 (0x06 + 3) and offset 3,
    # which overlaps its own output: a run.
    assert pglz_decompress(bytes([0x08, 0x61, 0x62, 0x63, 0x06, 0x03]), 12) == b"abcabcabcabc"
    # An extended-length tag: low nibble 0x0F means 18 + the next byte.
    stream = bytes([0x02, 0x7A, 0x0F, 0x01, 0x02])  # 'z', then len 18+2=20 at offset 1
    assert pglz_decompress(stream, 21) == b"z" * 21
    # A non-overlapping copy from further back.
    stream = bytes([0x10, 0x31, 0x32, 0x33, 0x34, 0x01, 0x04])  # "1234" then len 4 off 4
    assert pglz_decompress(stream, 8) == b"12341234"


@pytest.mark.parametrize(
    ("stream", "size"),
    [
        (bytes([0x01, 0x00, 0x05]), 3),  # back-reference before any output
        (bytes([0x02, 0x61, 0x00, 0x00]), 4),  # offset 0
        (bytes([0x02, 0x61, 0x0F]), 20),  # truncated tag
        (bytes([0x00, 0x61, 0x62]), 3),  # too short output
        (bytes([0x00, 0x61, 0x62, 0x63]), 2),  # input left over
        (b"", 1),
    ],
)
def test_pglz_corrupt(stream: bytes, size: int) -> None:
    with pytest.raises(PglzError):
        pglz_decompress(stream, size)
    assert issubclass(PglzError, RemoteProtocolError)


@settings(max_examples=200)
@given(st.binary(max_size=3000) | st.builds(lambda s, n: s * n, st.binary(min_size=1, max_size=20), st.integers(1, 500)))
def test_pglz_roundtrip(raw: bytes) -> None:
    assert pglz_decompress(pglz_compress(raw), len(raw)) == raw


@settings(max_examples=100)
@given(st.binary(max_size=200), st.integers(0, 300))
def test_pglz_garbage_never_crashes(data: bytes, size: int) -> None:
    try:
        out = pglz_decompress(data, size)
    except PglzError:
        return
    assert len(out) == size


@pytest.mark.parametrize("method", ["pglz", "lz4", "zstd"])
@pytest.mark.parametrize(("lower", "upper"), [(200, 6000), (24, 24), (8000, 8192)])
def test_compressed_image_restores(method: str, lower: int, upper: int) -> None:
    page = make_page(11, lower, upper)
    raw = build_record(
        prev=0, rmid=0, info=0xB0, blocks=[BlockSpec(RN, 9, image=page, compression=method)]
    )
    blk = decode_record(raw, 0x1000028).blocks[0]
    assert blk.compression == method and blk.apply_image
    assert blk.hole_offset == (lower if upper > lower else 0)
    assert blk.hole_length == upper - lower
    assert blk.bimg_len < 8192 - blk.hole_length
    assert blk.image == page


@pytest.mark.parametrize("bit", [BKPIMAGE_COMPRESS_LZ4, BKPIMAGE_COMPRESS_ZSTD])
def test_corrupt_lz4_zstd(bit: int) -> None:
    for junk in (b"", b"\x00" * 10, b"\xff" * 50, bytes(range(256))):
        with pytest.raises(RemoteProtocolError):
            restore_block_image(junk, bit, 0, 0)


def test_wrong_decompressed_size_is_refused() -> None:
    page = make_page(5, 100, 4000)
    raw = build_record(
        prev=0, rmid=0, info=0xB0, blocks=[BlockSpec(RN, 1, image=page, compression="lz4")]
    )
    blk = decode_record(raw, 0x1000028).blocks[0]
    assert blk.image_data is not None
    with pytest.raises(RemoteProtocolError):
        restore_block_image(blk.image_data, blk.bimg_info, blk.hole_offset, blk.hole_length + 8)
