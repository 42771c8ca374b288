"""How a layer file is stored as a remote object: as it is (``none``) or as one zstd frame
(``zstd``), and the blocking codec between the two (run in worker threads).

The remote index records the choice per layer (``IndexPart.stored``): ``"compression": "zstd"``
and the object's ``compressed_size`` beside the layer's ``file_size``. A layer without them is
stored as it is, which is how every object written before compression existed reads, so old
indexes and objects need no migration. Layer objects are downloaded whole (on-demand download
fetches a whole layer; no read path does ranged GETs into a layer object), so a compressed
object never has to be read from the middle.

Writing: one frame with the content size and an XXH64 content checksum in it, at a fast level
(``remote_storage.compression_level``, default 1). If the frame is not smaller than the file,
the layer is stored as it is (nothing gained; a reader then skips the decoder). Before that,
``worth_compressing`` compresses a sample of the file (``PROBE_PIECES`` pieces of
``PROBE_PIECE`` bytes, one at the start of each quarter, about 1 ms of CPU): if the sample shrinks by less than
``MIN_SAVING``, the layer is stored as it is without compressing the whole file (random or
already compressed pages shrink by ~0.4 %: compressing them costs a full pass of the codec for
nothing; a real database's pages shrink 10-15x).

Reading (``decompress_file``) trusts nothing in the object:

- the object's size must be the index's ``compressed_size`` (checked by the caller, before);
- the frame header must be a zstd frame with a content checksum, a window of at most
  ``MAX_WINDOW`` (the decoder's memory) and a content size equal to the index's ``file_size``;
- the block headers are walked (without decoding) to the frame's end: the frame must end, with
  its checksum, exactly at the object's end (a truncated object, or bytes after the frame, are
  refused even where the decoder would stop quietly);
- the decoder's output is written in blocks of ``CHUNK`` and may never exceed ``file_size``
  (memory stays bounded whatever the object says); the checksum is checked at the frame's end.

Any failure is a ``LayerCorruptionError`` naming the object: the download fails with it (it is
not retried: the same bytes would fail again), never a wrong page. The layer format's own
checks (summary CRC-32C and size when the downloaded file is opened, each blob's CRC-32C when
read) still run on the decompressed file.
"""

from __future__ import annotations

import os
import struct
from pathlib import Path
from typing import BinaryIO, Final

import zstandard

from pageserver.storage.layer_file import LayerCorruptionError

CHUNK: Final = 1 << 20  # read and write size of the codec (its memory, with the window)
MAX_WINDOW: Final = 1 << 23  # levels 1-9 use at most 8 MiB windows on layer-sized inputs
_MAGIC: Final = b"\x28\xb5\x2f\xfd"
_BLOCK_HEADER: Final = 3
_CHECKSUM: Final = 4


PROBE_PIECE: Final = 256 << 10
PROBE_PIECES: Final = 4
MIN_SAVING: Final = 0.03  # a sample saving less than this: stored as it is


def worth_compressing(src: Path, level: int) -> bool:
    """Whether a sample of ``src`` (a piece at the start of each quarter of it) compresses by
    at least ``MIN_SAVING`` at ``level``. Not the file's last bytes: a layer ends in its key
    index, which compresses well however incompressible the values before it are."""
    with open(src, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        if size <= PROBE_PIECE * PROBE_PIECES:
            sample = f.read()
        else:
            step = size // PROBE_PIECES
            sample = b"".join(os.pread(f.fileno(), PROBE_PIECE, i * step) for i in range(PROBE_PIECES))
    if not sample:
        return False
    packed = zstandard.ZstdCompressor(level=level).compress(sample)
    return len(packed) <= len(sample) * (1 - MIN_SAVING)


def compress_file(src: Path, dst: Path, level: int) -> tuple[int, int]:
    """``src`` as one zstd frame into ``dst`` (created or truncated, fsynced by nobody: it is
    a temp file to upload). Returns (bytes read, bytes written)."""
    cctx = zstandard.ZstdCompressor(level=level, write_checksum=True, write_content_size=True)
    with open(src, "rb") as fin, open(dst, "wb") as fout:
        size = os.fstat(fin.fileno()).st_size
        read, written = cctx.copy_stream(fin, fout, size=size, read_size=CHUNK, write_size=CHUNK)
    if read != size:
        raise OSError(f"{src}: read {read} bytes to compress, the file has {size}")
    return int(read), int(written)


def _frame_length(f: BinaryIO, what: str, object_size: int) -> int:
    """The byte length of the zstd frame at the start of ``f``, from its headers alone."""
    head = f.read(18)  # the longest frame header
    if head[:4] != _MAGIC:
        raise LayerCorruptionError(what, "the remote object is not a zstd frame")
    try:
        header_size = zstandard.frame_header_size(head)
        params = zstandard.get_frame_parameters(head)
    except zstandard.ZstdError as exc:
        raise LayerCorruptionError(what, f"the remote object's zstd frame header is invalid: {exc}") from exc
    if not params.has_checksum:
        raise LayerCorruptionError(what, "the remote object's zstd frame has no content checksum")
    if params.window_size > MAX_WINDOW:
        raise LayerCorruptionError(
            what, f"the remote object's zstd frame asks for a {params.window_size}-byte window "
                  f"(at most {MAX_WINDOW})")
    pos = header_size
    while True:
        f.seek(pos)
        raw = f.read(_BLOCK_HEADER)
        if len(raw) < _BLOCK_HEADER:
            raise LayerCorruptionError(what, f"the remote object ends inside its zstd frame (at {object_size})")
        (header,) = struct.unpack("<I", raw + b"\0")
        last, kind, size = header & 1, (header >> 1) & 3, header >> 3
        if kind == 3:
            raise LayerCorruptionError(what, f"the remote object has a reserved zstd block type at {pos}")
        if size == 0 and not last:
            # No encoder writes an empty block before the last one; a hostile object made of
            # them would keep this walk busy 3 bytes at a time.
            raise LayerCorruptionError(what, f"the remote object has an empty zstd block at {pos}")
        pos += _BLOCK_HEADER + (1 if kind == 1 else size)  # an RLE block stores one byte
        if pos > object_size:
            raise LayerCorruptionError(what, f"the remote object ends inside its zstd frame (at {object_size})")
        if last:
            return pos + _CHECKSUM


def decompress_file(src: Path, dst: Path, file_size: int, what: str) -> int:
    """The zstd object in ``src`` into ``dst`` (created or truncated), which must come out as
    ``file_size`` bytes; every check of the module docstring. Returns the bytes written."""
    with open(src, "rb") as fin:
        object_size = os.fstat(fin.fileno()).st_size
        frame = _frame_length(fin, what, object_size)
        if frame != object_size:
            raise LayerCorruptionError(
                what, f"the remote object is {object_size} bytes, its zstd frame {frame}")
        fin.seek(0)
        params = zstandard.get_frame_parameters(fin.read(18))
        if params.content_size != file_size:
            raise LayerCorruptionError(
                what, f"the remote object decompresses to {params.content_size} bytes by its "
                      f"header, the index says {file_size}")
        fin.seek(0)
        dctx = zstandard.ZstdDecompressor(max_window_size=MAX_WINDOW)
        written = 0
        try:
            with dctx.stream_reader(fin, read_size=CHUNK, read_across_frames=False) as reader, \
                    open(dst, "wb") as fout:
                while chunk := reader.read(CHUNK):
                    written += len(chunk)
                    if written > file_size:
                        raise LayerCorruptionError(
                            what, f"the remote object decompresses to more than {file_size} bytes")
                    fout.write(chunk)
        except zstandard.ZstdError as exc:
            raise LayerCorruptionError(what, f"the remote object does not decompress: {exc}") from exc
    if written != file_size:
        raise LayerCorruptionError(what, f"the remote object decompresses to {written} bytes, the index says {file_size}")
    return written
