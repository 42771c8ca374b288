"""How a layer file is stored as a remote object: as it is (``none``), as one zstd frame
(``zstd``) or as one LZ4 frame (``lz4``), and the blocking codecs between them (run in worker
threads).

The remote index records the choice per layer (``IndexPart.stored``): ``"compression": "zstd"``
(or ``"lz4"``) and the object's ``compressed_size`` beside the layer's ``file_size``. A layer without them is
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

LZ4 (``compression = "lz4"``) is written as one frame of the LZ4 frame format (``lz4.frame``)
with the content size and an XXH32 content checksum in it, 1 MiB linked blocks, each with its
own XXH32 (on real layers 0.03 ms of CPU per MiB: a damaged block is refused before its output
is written, not only at the frame's end). Its reader meets the same bar:

- the frame header must be LZ4's magic, version 01, no dictionary id or reserved bit, a block
  size code of 64 KiB-4 MiB, a content checksum and a content size equal to ``file_size``
  (only an empty file's frame may omit the size: LZ4 writes none for 0 bytes); the header's
  own checksum is checked by the decoder;
- every block header is walked (4-byte size with the uncompressed bit) to the end mark: a block
  of 0 bytes or larger than the frame's block size is refused before anything is decompressed,
  and the end mark with the content checksum after it must end exactly at the object's end;
- the decoder's output is taken ``CHUNK`` at a time and may never exceed ``file_size``; the
  content checksum (and block checksums, if a frame has them) is checked by the decoder.

Any failure is a ``LayerCorruptionError`` naming the object: the download fails with it (it is
not retried: the same bytes would fail again), never a wrong page. The layer format's own
checks (summary CRC-32C and size when the downloaded file is opened, each blob's CRC-32C when
read) still run on the decompressed file.

Staging (``begin_staging``, ``stage_layer``, ``adopt_staged``): the L0 writer process
(``pageserver.storage.l0_worker``) compresses the L0 it has just written, while the file is in
the page cache, into ``<layer>.___temp_staged`` beside it (the same frame as above, made by the
same ``compress_file``). Before it answers that the L0 is durable it creates
``<layer>.___temp_staging`` and holds an exclusive ``flock`` on it; it compresses into that
file after answering (so the roll, which waits for the L0, does not wait for the codec), renames
it to the staged name and only then lets the lock go. The upload (``adopt_staged``) first waits
for that lock (a worker that dies lets it go too), then sends the staged file as it is instead
of compressing in the pageserver's process, after checking it: the layer file is the size the
index says and no newer than the staged object, and the object is one whole frame of the
configured codec whose content size is the layer's (its headers walked to its end, as a
download does). Anything else (missing, torn, another codec, a layer rewritten since) is
removed and the upload compresses the layer itself. Staged files are not fsynced: a node that
restarts deletes every file its index does not name, these included (``*.___temp*``), so a
staged object never outlives the process run that made it.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import struct
import time
from pathlib import Path
from typing import BinaryIO, Final, Literal

import attrs
import lz4.frame
import zstandard

from pageserver.storage.layer_file import LayerCorruptionError

Codec = Literal["zstd", "lz4"]


def codec_of(compression: str) -> Codec:
    """The codec of a stored object's or a config's ``compression`` ("none" has none)."""
    if compression == "zstd":
        return "zstd"
    if compression == "lz4":
        return "lz4"
    raise ValueError(f"no codec for compression {compression!r}")

@attrs.frozen
class StageSpec:
    """How the L0 writer stages a layer's object: what ``RemoteTimelineClient._compress``
    would do with it (codec, level, whether the sample probe may skip it)."""

    codec: Codec
    level: int
    probe: bool


CHUNK: Final = 1 << 20  # read and write size of the codec (its memory, with the window)
MAX_WINDOW: Final = 1 << 23  # levels 1-9 use at most 8 MiB windows on layer-sized inputs
_MAGIC: Final = b"\x28\xb5\x2f\xfd"
_BLOCK_HEADER: Final = 3
_CHECKSUM: Final = 4


PROBE_PIECE: Final = 256 << 10
PROBE_PIECES: Final = 4
MIN_SAVING: Final = 0.03  # a sample saving less than this: stored as it is


def worth_compressing(src: Path, level: int, codec: Codec = "zstd") -> bool:
    """Whether a sample of ``src`` (a piece at the start of each quarter of it) compresses by
    at least ``MIN_SAVING`` with ``codec`` at ``level``. Not the file's last bytes: a layer
    ends in its key index, which compresses well however incompressible the values before it
    are."""
    with open(src, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        if size <= PROBE_PIECE * PROBE_PIECES:
            sample = f.read()
        else:
            step = size // PROBE_PIECES
            sample = b"".join(os.pread(f.fileno(), PROBE_PIECE, i * step) for i in range(PROBE_PIECES))
    if not sample:
        return False
    if codec == "lz4":
        packed = lz4.frame.compress(sample, compression_level=_lz4_level(level), store_size=False)
    else:
        packed = zstandard.ZstdCompressor(level=level).compress(sample)
    return len(packed) <= len(sample) * (1 - MIN_SAVING)


def compress_file(src: Path, dst: Path, level: int, codec: Codec = "zstd") -> tuple[int, int]:
    """``src`` as one ``codec`` frame into ``dst`` (created or truncated, fsynced by nobody:
    it is a temp file to upload). Returns (bytes read, bytes written)."""
    if codec == "lz4":
        return _lz4_compress_file(src, dst, level)
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


def decompress_file(src: Path, dst: Path, file_size: int, what: str, codec: Codec = "zstd") -> int:
    """The ``codec`` object in ``src`` into ``dst`` (created or truncated), which must come
    out as ``file_size`` bytes; every check of the module docstring. Returns the bytes
    written."""
    if codec == "lz4":
        return _lz4_decompress_file(src, dst, file_size, what)
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


# --- LZ4 frames ---------------------------------------------------------------------------

_LZ4_MAGIC: Final = b"\x04\x22\x4d\x18"
_LZ4_HEADER: Final = 15  # magic, FLG, BD, 8-byte content size, header checksum
_LZ4_FLG_VERSION: Final = 0x40  # bits 7-6 = 01
_LZ4_FLG_BLOCK_CHECKSUM: Final = 0x10
_LZ4_FLG_CONTENT_SIZE: Final = 0x08
_LZ4_FLG_CONTENT_CHECKSUM: Final = 0x04
_LZ4_FLG_RESERVED: Final = 0x02
_LZ4_FLG_DICT_ID: Final = 0x01
_LZ4_UNCOMPRESSED: Final = 1 << 31
_LZ4_BLOCK_SIZES: Final = {4: 64 << 10, 5: 256 << 10, 6: 1 << 20, 7: 4 << 20}
LZ4_BLOCK: Final = 1 << 20  # the writer's block size (BD 6)
_U32: Final = struct.Struct("<I")
_U64: Final = struct.Struct("<Q")


def _lz4_level(level: int) -> int:
    # Config levels 1-2 are LZ4's fast mode (its level 0), 3-16 its HC levels.
    return 0 if level < lz4.frame.COMPRESSIONLEVEL_MINHC else level


def _lz4_compress_file(src: Path, dst: Path, level: int) -> tuple[int, int]:
    with open(src, "rb") as fin, open(dst, "wb") as fout:
        size = os.fstat(fin.fileno()).st_size
        cctx = lz4.frame.LZ4FrameCompressor(
            block_size=lz4.frame.BLOCKSIZE_MAX1MB, compression_level=_lz4_level(level),
            content_checksum=True, block_checksum=True, return_bytearray=False)
        written = fout.write(cctx.begin(source_size=size))
        read = 0
        while chunk := fin.read(CHUNK):
            read += len(chunk)
            written += fout.write(cctx.compress(chunk))
        written += fout.write(cctx.flush())
    if read != size:
        raise OSError(f"{src}: read {read} bytes to compress, the file has {size}")
    return read, written


def _lz4_frame(f: BinaryIO, what: str, object_size: int, empty: bool) -> tuple[int, int]:
    """The content size and byte length of the LZ4 frame at the start of ``f``, from its
    headers alone: the flags we write (content size and content checksum; no dictionary, no
    reserved bit), every block header walked to the end mark, each block no larger than the
    frame's block size."""
    head = f.read(_LZ4_HEADER)
    if len(head) < 7 or head[:4] != _LZ4_MAGIC:
        raise LayerCorruptionError(what, "the remote object is not an LZ4 frame")
    flg, bd = head[4], head[5]
    if flg & 0xC0 != _LZ4_FLG_VERSION or flg & (_LZ4_FLG_RESERVED | _LZ4_FLG_DICT_ID) or bd & 0x8F:
        raise LayerCorruptionError(what, f"the remote object's LZ4 frame header is invalid (FLG {flg:#x}, BD {bd:#x})")
    if not flg & _LZ4_FLG_CONTENT_CHECKSUM:
        raise LayerCorruptionError(what, "the remote object's LZ4 frame has no content checksum")
    if flg & _LZ4_FLG_CONTENT_SIZE:
        if len(head) < _LZ4_HEADER:
            raise LayerCorruptionError(what, f"the remote object ends inside its LZ4 frame (at {object_size})")
        (content_size,) = _U64.unpack_from(head, 6)
        pos = _LZ4_HEADER
    elif empty:
        # LZ4 writes no content size for 0 bytes (its "unknown"): only an empty file's frame
        # may omit it, and its output is then bounded by that 0.
        content_size, pos = 0, _LZ4_HEADER - 8
    else:
        raise LayerCorruptionError(what, "the remote object's LZ4 frame has no content size")
    block_max = _LZ4_BLOCK_SIZES.get((bd >> 4) & 7)
    if block_max is None:
        raise LayerCorruptionError(what, f"the remote object's LZ4 frame has an invalid block size code (BD {bd:#x})")
    block_checksum = 4 if flg & _LZ4_FLG_BLOCK_CHECKSUM else 0
    while True:
        f.seek(pos)
        raw = f.read(4)
        if len(raw) < 4:
            raise LayerCorruptionError(what, f"the remote object ends inside its LZ4 frame (at {object_size})")
        (word,) = _U32.unpack(raw)
        if word == 0:  # the end mark, then the content checksum
            return content_size, pos + 4 + 4
        size = word & ~_LZ4_UNCOMPRESSED
        if size == 0 or size > block_max:
            # An empty block (the walk would crawl 4 bytes at a time) or one larger than the
            # frame's block size (the decoder's buffer): no encoder writes either.
            raise LayerCorruptionError(
                what, f"the remote object has an LZ4 block of {size} bytes at {pos} (at most {block_max})")
        pos += 4 + size + block_checksum
        if pos > object_size:
            raise LayerCorruptionError(what, f"the remote object ends inside its LZ4 frame (at {object_size})")


def _lz4_decompress_file(src: Path, dst: Path, file_size: int, what: str) -> int:
    with open(src, "rb") as fin:
        object_size = os.fstat(fin.fileno()).st_size
        content_size, frame = _lz4_frame(fin, what, object_size, file_size == 0)
        if frame != object_size:
            raise LayerCorruptionError(what, f"the remote object is {object_size} bytes, its LZ4 frame {frame}")
        if content_size != file_size:
            raise LayerCorruptionError(
                what, f"the remote object decompresses to {content_size} bytes by its header, "
                      f"the index says {file_size}")
        fin.seek(0)
        dctx = lz4.frame.LZ4FrameDecompressor(return_bytearray=False)
        written = 0
        try:
            with open(dst, "wb") as fout:
                while not dctx.eof:
                    data = fin.read(CHUNK) if dctx.needs_input else b""
                    if not data and dctx.needs_input:
                        raise LayerCorruptionError(
                            what, f"the remote object ends inside its LZ4 frame (at {object_size})")
                    chunk = dctx.decompress(data, max_length=CHUNK)
                    written += len(chunk)
                    if written > file_size:
                        raise LayerCorruptionError(
                            what, f"the remote object decompresses to more than {file_size} bytes")
                    fout.write(chunk)
        except RuntimeError as exc:  # what lz4.frame raises for a bad frame or checksum
            raise LayerCorruptionError(what, f"the remote object does not decompress: {exc}") from exc
        if dctx.unused_data or fin.read(1):
            raise LayerCorruptionError(what, "the remote object has bytes after its LZ4 frame")
    if written != file_size:
        raise LayerCorruptionError(what, f"the remote object decompresses to {written} bytes, the index says {file_size}")
    return written


# --- staged objects (made by the L0 writer process, sent by the upload) -------------------

STAGED_SUFFIX: Final = ".___temp_staged"
_STAGING_SUFFIX: Final = ".___temp_staging"


def staged_path(layer: Path) -> Path:
    """Where the L0 writer leaves the compressed object of ``layer``."""
    return layer.with_name(layer.name + STAGED_SUFFIX)


def discard_staged(layer: Path) -> None:
    """Remove ``layer``'s staged object and a staging temp file, if any."""
    staged_path(layer).unlink(missing_ok=True)
    layer.with_name(layer.name + _STAGING_SUFFIX).unlink(missing_ok=True)


STAGING_WAIT_S: Final = 60.0  # an upload waits this long for a staging, then compresses itself


def begin_staging(layer: Path) -> int:
    """Claim ``layer``'s staging (the L0 writer, before it answers): the staging temp file,
    created empty and locked; the descriptor holds the lock until it is closed (after
    ``stage_layer``), and an upload of the layer waits for that (``wait_staging``)."""
    discard_staged(layer)
    fd = os.open(layer.with_name(layer.name + _STAGING_SUFFIX), os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC,
                 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
    except BaseException:
        os.close(fd)
        raise
    return fd


def wait_staging(layer: Path, timeout_s: float = STAGING_WAIT_S) -> bool:
    """Wait (blocking, in a worker thread) until no staging of ``layer`` runs: its staging
    temp file gone or unlocked. False if one still runs after ``timeout_s``."""
    try:
        fd = os.open(layer.with_name(layer.name + _STAGING_SUFFIX), os.O_RDONLY | os.O_CLOEXEC)
    except FileNotFoundError:
        return True  # none begun, or done (renamed to the staged name, or removed)
    try:
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
                return True
            except BlockingIOError:
                if time.monotonic() >= deadline:
                    return False
                time.sleep(0.005)
    finally:
        os.close(fd)


def stage_layer(layer: Path, spec: StageSpec) -> int | None:
    """Compress the just-written ``layer`` into its staged object as ``spec`` says (the L0
    writer process, blocking; into the staging temp file ``begin_staging`` made, or a new one);
    its size, or None when nothing is staged (the sample does not compress, or the frame is not
    smaller: the upload then decides as usual)."""
    tmp = layer.with_name(layer.name + _STAGING_SUFFIX)
    staged_path(layer).unlink(missing_ok=True)
    if spec.probe and not worth_compressing(layer, spec.level, spec.codec):
        tmp.unlink(missing_ok=True)
        return None
    try:
        read, written = compress_file(layer, tmp, spec.level, spec.codec)
        if written >= read:
            tmp.unlink()
            return None
        os.rename(tmp, staged_path(layer))
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return written


def _check_staged(f: BinaryIO, what: str, object_size: int, file_size: int, codec: Codec) -> None:
    if codec == "lz4":
        content_size, frame = _lz4_frame(f, what, object_size, file_size == 0)
    else:
        frame = _frame_length(f, what, object_size)
        f.seek(0)
        content_size = zstandard.get_frame_parameters(f.read(18)).content_size
    if frame != object_size:
        raise LayerCorruptionError(what, f"the staged object is {object_size} bytes, its frame {frame}")
    if content_size != file_size:
        raise LayerCorruptionError(what, f"the staged object holds {content_size} bytes, the layer {file_size}")


def adopt_staged(layer: Path, file_size: int, codec: Codec, dst: Path) -> tuple[int | None, str | None]:
    """``layer``'s staged object, once its staging is done (``wait_staging``), checked (see the
    module docstring) and renamed to ``dst``: (its size, None); (None, None) if there is none;
    (None, why) if it does not pass (it is removed then)."""
    if not wait_staging(layer):
        return None, f"its staging did not finish within {STAGING_WAIT_S} s"
    staged = staged_path(layer)
    try:
        f = open(staged, "rb")  # noqa: SIM115 - closed below, before the rename
    except FileNotFoundError:
        return None, None
    except OSError as exc:  # (not a file, unreadable: not ours to send)
        f = None
        why = f"{type(exc).__name__}: {exc}"
    if f is None:
        with contextlib.suppress(OSError):
            discard_staged(layer)
        return None, why
    try:
        with f:
            st, lst = os.fstat(f.fileno()), os.stat(layer)
            if lst.st_size != file_size:
                raise LayerCorruptionError(staged, f"the layer is {lst.st_size} bytes, the index says {file_size}")
            if st.st_mtime_ns < lst.st_mtime_ns:
                raise LayerCorruptionError(staged, "the layer file is newer than its staged object")
            _check_staged(f, os.fspath(staged), st.st_size, file_size, codec)
        os.rename(staged, dst)
    except (LayerCorruptionError, zstandard.ZstdError, OSError) as exc:
        with contextlib.suppress(OSError):
            discard_staged(layer)
        return None, f"{type(exc).__name__}: {exc}"
    return st.st_size, None
