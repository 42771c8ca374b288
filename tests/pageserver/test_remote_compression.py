"""The codec of compressed layer objects (``pageserver.remote_compression``): a round trip for
any content, and hostile objects (truncated anywhere, bytes after the frame, a flipped bit, a
header that lies about the size, no checksum, a huge window, not zstd at all) are each a
``LayerCorruptionError`` that never leaves more than the index's ``file_size`` bytes behind;
no mutation of an object ever decompresses to other content. The probe that stores an
incompressible layer as it is without a full pass of the codec."""

from __future__ import annotations

import random
import struct
from pathlib import Path

import pytest
import trio
import zstandard
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from prometheus_client import REGISTRY

from pageserver import remote_compression as rc
from pageserver.remote_timeline import RemoteTimelineClient
from pageserver.storage.index_part import IndexPart
from pageserver.storage.layer_file import LayerCorruptionError
from protocol.ids import TenantId, TimelineId
from protocol.lsn import Lsn
from remote_storage import LocalStorageConfig, make_remote_storage

# compressible (repeated runs), incompressible (random) and mixed content, up to a few blocks
contents = st.one_of(
    st.binary(max_size=4096),
    st.lists(st.tuples(st.binary(min_size=1, max_size=64), st.integers(1, 5000)), max_size=40).map(
        lambda runs: b"".join(chunk * n for chunk, n in runs)[: 1 << 19]),
)
SETTINGS = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])


def layer_like(n: int = 600_000) -> bytes:
    """Half text-like (compresses), half random, so frames have compressed and raw blocks."""
    text = b"".join(b"aid=%08d bid=%04d filler=%s|" % (i, i % 97, b" " * (i % 84)) for i in range(n // 200))
    # deterministic: hypothesis replays its draws against the same object
    return (text + random.Random(n).randbytes(n // 2))[:n]


def compressed(tmp: Path, data: bytes, level: int = 1, **kw: object) -> Path:
    src, dst = tmp / "layer", tmp / "layer.zst"
    src.write_bytes(data)
    if kw:
        cctx = zstandard.ZstdCompressor(level=level, **kw)  # type: ignore[arg-type]
        dst.write_bytes(cctx.compress(data))
    else:
        read, written = rc.compress_file(src, dst, level)
        assert read == len(data) and written == dst.stat().st_size
    return dst


def refused(tmp: Path, obj: bytes, file_size: int, match: str | None = None) -> LayerCorruptionError:
    src, dst = tmp / "hostile.zst", tmp / "out"
    src.write_bytes(obj)
    with pytest.raises(LayerCorruptionError, match=match) as info:
        rc.decompress_file(src, dst, file_size, "tenants/t/timelines/tl/layer-00000001")
    assert "tenants/t/timelines/tl/layer-00000001" in str(info.value)
    assert info.value.sqlstate == "XX001"
    # never more than the index's size on disk, whatever the object claims
    assert not dst.exists() or dst.stat().st_size <= file_size
    return info.value


@SETTINGS
@given(data=contents, level=st.sampled_from([-7, -3, -1, 1, 2, 3]))
def test_round_trip(tmp_path: Path, data: bytes, level: int) -> None:
    obj = compressed(tmp_path, data, level)
    out = tmp_path / "out"
    assert rc.decompress_file(obj, out, len(data), "k") == len(data)
    assert out.read_bytes() == data


def test_a_layer_sized_file_round_trips_in_bounded_chunks(tmp_path: Path) -> None:
    data = layer_like(3 * rc.CHUNK + 12345)
    obj = compressed(tmp_path, data)
    assert obj.stat().st_size < len(data)
    out = tmp_path / "out"
    assert rc.decompress_file(obj, out, len(data), "k") == len(data)
    assert out.read_bytes() == data


@pytest.mark.parametrize("cut", [1, 2, 3, 4, 5, 100, "half", "header"])
def test_a_truncated_object_is_refused(tmp_path: Path, cut: int | str) -> None:
    data = layer_like()
    obj = compressed(tmp_path, data).read_bytes()
    keep = {"half": len(obj) // 2, "header": 10}[cut] if isinstance(cut, str) else len(obj) - cut
    # cut 1-4: only (part of) the content checksum is missing; the decoder would stop quietly
    refused(tmp_path, obj[:keep], len(data))


def test_bytes_after_the_frame_are_refused(tmp_path: Path) -> None:
    data = layer_like()
    obj = compressed(tmp_path, data).read_bytes()
    refused(tmp_path, obj + b"\0", len(data), "its zstd frame")
    refused(tmp_path, obj + obj, len(data), "its zstd frame")


def test_a_flipped_bit_in_the_data_is_refused(tmp_path: Path) -> None:
    data = layer_like()
    obj = bytearray(compressed(tmp_path, data).read_bytes())
    for pos in (len(obj) // 3, len(obj) // 2, len(obj) - 2):
        bad = bytearray(obj)
        bad[pos] ^= 0x10
        refused(tmp_path, bytes(bad), len(data))


def test_a_header_that_disagrees_with_the_index_is_refused(tmp_path: Path) -> None:
    data = layer_like()
    obj = compressed(tmp_path, data).read_bytes()
    refused(tmp_path, obj, len(data) - 1, "by its header")
    refused(tmp_path, obj, len(data) + 1, "by its header")


def test_a_header_that_claims_less_than_the_frame_holds_is_refused(tmp_path: Path) -> None:
    data = b"x" * 200_000
    obj = bytearray(compressed(tmp_path, data).read_bytes())
    # frame header: magic, descriptor (its top two bits: the size of the content-size field)
    fhd = obj[4]
    assert fhd >> 6 == 2 and fhd & 0x20  # 4-byte content size, single segment: it follows at 5
    obj[5:9] = struct.pack("<I", 1000)
    refused(tmp_path, bytes(obj), 1000)


def test_frames_without_checksum_or_size_or_with_a_huge_window_are_refused(tmp_path: Path) -> None:
    data = layer_like()
    refused(tmp_path, compressed(tmp_path, data, write_checksum=False).read_bytes(), len(data), "checksum")
    refused(tmp_path, compressed(tmp_path, data, write_checksum=True, write_content_size=False).read_bytes(),
            len(data), "by its header")
    # a 128 MiB window (the decoder would allocate it): streamed, so no size shrinks it
    params = zstandard.ZstdCompressionParameters.from_level(1, window_log=27, write_checksum=1)
    cctx = zstandard.ZstdCompressor(compression_params=params)
    with open(tmp_path / "big.zst", "wb") as f, cctx.stream_writer(f, closefd=False) as w:
        w.write(data)
    big = (tmp_path / "big.zst").read_bytes()
    assert zstandard.get_frame_parameters(big).window_size == 1 << 27
    refused(tmp_path, big, len(data), "window")


def test_empty_blocks_before_the_last_are_refused(tmp_path: Path) -> None:
    """No encoder writes them; a hostile object made of them would keep the frame walk busy."""
    data = layer_like()
    obj = compressed(tmp_path, data).read_bytes()
    at = zstandard.frame_header_size(obj)
    empty_raw_block = b"\0\0\0"  # not last, raw, 0 bytes
    refused(tmp_path, obj[:at] + empty_raw_block * 1000 + obj[at:], len(data), "empty zstd block")


def test_an_object_that_is_not_zstd_is_refused(tmp_path: Path) -> None:
    data = layer_like()
    refused(tmp_path, data, len(data), "not a zstd frame")  # an uncompressed layer named zstd
    refused(tmp_path, b"", len(data), "not a zstd frame")
    refused(tmp_path, b"\x28\xb5\x2f\xfd", len(data))


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.data())
def test_no_mutation_decompresses_to_other_content(tmp_path: Path, data: st.DataObject) -> None:
    original = layer_like(200_000)
    obj = bytearray(compressed(tmp_path, original).read_bytes())
    for _ in range(data.draw(st.integers(1, 3))):
        pos = data.draw(st.integers(0, len(obj) - 1))
        obj[pos] ^= data.draw(st.integers(1, 255))  # never the same byte
    src, out = tmp_path / "m.zst", tmp_path / "out"
    src.write_bytes(bytes(obj))
    try:
        rc.decompress_file(src, out, len(original), "k")
    except LayerCorruptionError:
        assert not out.exists() or out.stat().st_size <= len(original)
    else:
        assert out.read_bytes() == original


def test_the_probe_tells_incompressible_files_from_compressible_ones(tmp_path: Path) -> None:
    path = tmp_path / "layer"
    path.write_bytes(random.Random(1).randbytes(3 << 20))  # random pages: ~0 % saved
    assert not rc.worth_compressing(path, 1)
    text = layer_like(3 << 20)[: (3 << 20) // 2]  # the text-like half only
    path.write_bytes(text * 2)
    assert rc.worth_compressing(path, 1)
    # compressible only past the start: the sample has pieces from later quarters too
    path.write_bytes(random.Random(2).randbytes(256 << 10) + b"\0" * (4 << 20))
    assert rc.worth_compressing(path, 1)
    # a real layer of random page images: its key index at the end compresses, the pages not
    # (stored as it is, though the whole file would shrink by a fraction of a percent)
    path.write_bytes(random.Random(4).randbytes(4 << 20) + bytes(range(256)) * 4096)
    assert not rc.worth_compressing(path, 1)
    path.write_bytes(b"")
    assert not rc.worth_compressing(path, 1)
    path.write_bytes(b"x" * 1000)  # smaller than the sample: all of it
    assert rc.worth_compressing(path, 1)


async def test_an_incompressible_layer_goes_up_as_it_is_without_a_full_pass(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The upload queue stores a layer whose sample does not compress as it is, without
    compressing the whole file; a compressible one as zstd; with the probe off, both are
    compressed (and the random one then stored as it is, the frame being no smaller)."""
    (tmp_path / "random").write_bytes(random.Random(3).randbytes(2 << 20))
    (tmp_path / "text").write_bytes(layer_like(2 << 20)[: 1 << 20] * 2)
    full_passes: list[str] = []
    real = rc.compress_file

    def counting(src: Path, dst: Path, level: int, codec: rc.Codec = "zstd") -> tuple[int, int]:
        full_passes.append(src.name)
        return real(src, dst, level, codec)

    monkeypatch.setattr(rc, "compress_file", counting)
    storage = make_remote_storage(LocalStorageConfig(path=tmp_path / "remote"))
    for probe in (True, False):
        full_passes.clear()
        skipped0 = REGISTRY.get_sample_value("pageserver_remote_skipped_compressions_total") or 0.0
        client = RemoteTimelineClient(storage, TenantId.generate(), TimelineId.generate(), 1, tmp_path,
                                      compression_probe=probe)
        async with trio.open_nursery() as nursery:
            nursery.start_soon(client.run)
            client.activate()
            client.schedule_index_upload(IndexPart(layers={"random": 2 << 20, "text": 2 << 20},
                                                   disk_consistent_lsn=Lsn(0x100)))
            await client.wait_uploaded()
            nursery.cancel_scope.cancel()
        assert client.uploaded_index is not None
        assert client.uploaded_index.stored_layer("random").compression == "none"
        assert client.uploaded_index.stored_layer("text").compression == "zstd"
        skipped = (REGISTRY.get_sample_value("pageserver_remote_skipped_compressions_total") or 0.0) - skipped0
        assert sorted(full_passes) == (["text"] if probe else ["random", "text"])
        assert skipped == (1 if probe else 0)
    await storage.aclose()
