"""The on-disk layer file format shared by delta and image layers (docs/storage-format.md).

Layout (all integers big-endian)::

    [0, 4096)                 summary (SUMMARY.size bytes used, rest zero)
    [4096, data_end)          blobs: encoded Values, in (key, lsn) order, back to back
    [data_end, fence_start)   index blocks, INDEX_BLOCK_SIZE each: u32 crc32c(rest), u16 n, u16 0,
                              n entries of ENTRY (key 18 | lsn 8 | pos 8 | len 4 | crc32c 4),
                              pos = offset << 1 | will_init
    [fence_start, file_size)  fences: the first (key, lsn) of every index block, 26 bytes each

The summary has its own crc32c and records the crc32c of the fence section and the file size,
so opening a layer checks magic, version, size (truncation) and both checksums without touching
the data. Index blocks are checked when read, each blob when read (its crc32c is in its index
entry), so a flipped bit anywhere gives ``LayerCorruptionError`` naming the file, never a wrong
page. Blobs of neighbouring (key, lsn) entries are physically adjacent: the vectored reader reads
a run of them with one ``preadv``.

Image layers use the same format with every entry at the image LSN and ``lsn_range =
[L, L+1)``; only the magic differs.
"""

from __future__ import annotations

import bisect
import itertools
import os
import struct
from collections import OrderedDict
from collections.abc import Awaitable, Callable, Iterable, Sequence
from functools import cache
from itertools import accumulate, compress, islice, repeat
from operator import ge, lshift, or_
from pathlib import Path
from typing import Final

import attrs
import crc32c
import trio

from pageserver.storage.buffered_writer import BufferedWriter
from pageserver.storage.io_engine import IoEngine, IoFile, durable_rename, unlink_if_present
from pageserver.storage.key import KEY_SIZE, Key, KeyRange, key_hex, key_parse_hex
from protocol.errors import RemoteProtocolError
from protocol.lsn import Lsn
from protocol.pgwire.sqlstate import DATA_CORRUPTED

DELTA_MAGIC: Final = b"PSDL"
IMAGE_MAGIC: Final = b"PSIM"
FORMAT_VERSION: Final = 1
DATA_START: Final = 4096
INDEX_BLOCK_SIZE: Final = 8192

# magic, version, flags, key start, key end, lsn start, lsn end, data_end, index_start,
# n_index_blocks, n_entries, fence_start, file_size, fences_crc; then crc32c of all that.
_SUMMARY_BODY = struct.Struct(">4sHH18s18sQQQQIQQQI")
_SUMMARY_CRC = struct.Struct(">I")
SUMMARY_SIZE: Final = _SUMMARY_BODY.size + _SUMMARY_CRC.size

ENTRY = struct.Struct(">26sQII")
_BLOCK_HDR = struct.Struct(">IHH")
ENTRIES_PER_BLOCK: Final = (INDEX_BLOCK_SIZE - _BLOCK_HDR.size) // ENTRY.size
_PREFIX = KEY_SIZE + 8
_LSN = struct.Struct(">Q")


_FLAG_VALUES: Final = frozenset((0, 1))


@cache
def _entries_struct(count: int) -> struct.Struct:
    """``count`` index entries as one struct (the writer's ``put_many``): ENTRY's bytes, with
    the 26-byte (key, lsn) prefix as ``18s`` + ``Q`` so no prefix is built per entry."""
    if KEY_SIZE != 18 or ENTRY.size != 42:
        raise AssertionError("index entry layout changed: update _entries_struct")
    return struct.Struct(">" + "18sQQII" * count)

# read size when copying spilled index blocks behind the data (a multiple of the block size)
_COPY_CHUNK: Final = 32 * INDEX_BLOCK_SIZE
# readahead hints are a Linux/POSIX nicety; without them a cold read is only slower
_FADVISE: Final = hasattr(os, "posix_fadvise")


class LayerCorruptionError(RemoteProtocolError):
    """A layer file failed a check; the message names the file. SQLSTATE XX001."""

    def __init__(self, path: Path | str, what: str) -> None:
        super().__init__(f"layer file {path}: {what}", sqlstate=DATA_CORRUPTED)
        self.path = Path(path)


class LayerClosedError(Exception):
    """A read found its layer file closed under it (a timeline shut down meanwhile): the read
    stops, its descriptor number (maybe another file's by now) is never used."""

    def __init__(self, path: Path) -> None:
        super().__init__(f"layer file {path} was closed during the read")
        self.path = path


@attrs.frozen
class LayerDesc:
    """What a layer covers; its file name is derived from this (storage.md §2.5)."""

    key_range: KeyRange
    lsn_start: Lsn
    lsn_end: Lsn  # exclusive; an image at L has lsn_end = L + 1
    is_delta: bool

    @property
    def image_lsn(self) -> Lsn:
        return self.lsn_start

    @property
    def is_l0(self) -> bool:
        return self.is_delta and self.key_range == KeyRange.full()

    def file_name(self) -> str:
        keys = f"{key_hex(self.key_range.start)}-{key_hex(self.key_range.end)}"
        if self.is_delta:
            return f"{keys}__{self.lsn_start:016X}-{self.lsn_end:016X}"
        return f"{keys}__{self.lsn_start:016X}"

    @classmethod
    def parse_file_name(cls, name: str) -> LayerDesc | None:
        """Inverse of ``file_name``; None for names that are not layer files."""
        keys, sep, lsns = name.partition("__")
        start, dash, end = keys.partition("-")
        if not sep or not dash or len(start) != 36 or len(end) != 36:
            return None
        try:
            kr = KeyRange(key_parse_hex(start), key_parse_hex(end))
            if "-" in lsns:
                lo, _, hi = lsns.partition("-")
                if len(lo) != 16 or len(hi) != 16:
                    return None
                return cls(kr, Lsn(int(lo, 16)), Lsn(int(hi, 16)), True)
            if len(lsns) != 16:
                return None
            lsn = int(lsns, 16)
            return cls(kr, Lsn(lsn), Lsn(lsn + 1), False)
        except ValueError:
            return None

    def __str__(self) -> str:
        return self.file_name()


@attrs.frozen
class Summary:
    magic: bytes
    key_range: KeyRange
    lsn_start: Lsn
    lsn_end: Lsn
    data_end: int
    index_start: int
    n_index_blocks: int
    n_entries: int
    fence_start: int
    file_size: int
    fences_crc: int

    def encode(self) -> bytes:
        body = _SUMMARY_BODY.pack(
            self.magic,
            FORMAT_VERSION,
            0,
            self.key_range.start,
            self.key_range.end,
            self.lsn_start,
            self.lsn_end,
            self.data_end,
            self.index_start,
            self.n_index_blocks,
            self.n_entries,
            self.fence_start,
            self.file_size,
            self.fences_crc,
        )
        return body + _SUMMARY_CRC.pack(crc32c.crc32c(body))

    @classmethod
    def decode(cls, path: Path, raw: bytes) -> Summary:
        if len(raw) < SUMMARY_SIZE:
            raise LayerCorruptionError(path, f"truncated summary ({len(raw)} bytes)")
        body = raw[: _SUMMARY_BODY.size]
        (crc,) = _SUMMARY_CRC.unpack_from(raw, _SUMMARY_BODY.size)
        fields = _SUMMARY_BODY.unpack(body)
        magic, version = fields[0], fields[1]
        if magic not in (DELTA_MAGIC, IMAGE_MAGIC):
            raise LayerCorruptionError(path, f"bad magic {magic!r}: not a pagestore layer file")
        if version != FORMAT_VERSION:
            raise LayerCorruptionError(path, f"unsupported format version {version}")
        if crc != crc32c.crc32c(body):
            raise LayerCorruptionError(path, "summary checksum mismatch")
        s = cls(
            magic=magic,
            key_range=KeyRange(Key(fields[3]), Key(fields[4])),
            lsn_start=Lsn(fields[5]),
            lsn_end=Lsn(fields[6]),
            data_end=fields[7],
            index_start=fields[8],
            n_index_blocks=fields[9],
            n_entries=fields[10],
            fence_start=fields[11],
            file_size=fields[12],
            fences_crc=fields[13],
        )
        if not (
            DATA_START <= s.data_end == s.index_start
            and s.fence_start == s.index_start + s.n_index_blocks * INDEX_BLOCK_SIZE
            and s.file_size == s.fence_start + s.n_index_blocks * _PREFIX
            and s.n_entries <= s.n_index_blocks * ENTRIES_PER_BLOCK
        ):
            raise LayerCorruptionError(path, "inconsistent summary offsets")
        return s


@attrs.frozen(slots=True)
class IndexEntry:
    key: Key
    lsn: Lsn
    offset: int
    length: int
    will_init: bool
    crc: int


class IndexBlock:
    """A decoded index block: parallel lists, bisectable by the 26-byte (key, lsn) prefix."""

    __slots__ = ("crcs", "keys", "lengths", "lsns", "positions", "prefixes", "raw")

    def __init__(self, raw: bytes | memoryview, n: int) -> None:
        # the entries as stored: what the compiled planning kernel (_plan_c) searches
        self.raw = bytes(raw[_BLOCK_HDR.size : _BLOCK_HDR.size + n * ENTRY.size])
        rows = list(ENTRY.iter_unpack(self.raw))
        self.prefixes: list[bytes] = [r[0] for r in rows]
        # split once per (cached) block, so the read paths' inner loops do no slicing
        self.keys: list[Key] = [Key(p[:KEY_SIZE]) for p in self.prefixes]
        self.lsns: list[Lsn] = [Lsn(int.from_bytes(p[KEY_SIZE:], "big")) for p in self.prefixes]
        self.positions: list[int] = [r[1] for r in rows]
        self.lengths: list[int] = [r[2] for r in rows]
        self.crcs: list[int] = [r[3] for r in rows]

    def entry(self, i: int) -> IndexEntry:
        prefix = self.prefixes[i]
        pos = self.positions[i]
        return IndexEntry(
            Key(prefix[:KEY_SIZE]),
            Lsn(_LSN.unpack_from(prefix, KEY_SIZE)[0]),
            pos >> 1,
            self.lengths[i],
            bool(pos & 1),
            self.crcs[i],
        )


class IndexBlockCache:
    """Bounded LRU of decoded index blocks of all layer files (like Neon's B-tree page cache)."""

    def __init__(self, capacity_blocks: int) -> None:
        self.capacity = capacity_blocks
        self._blocks: OrderedDict[tuple[int, int], IndexBlock] = OrderedDict()
        self.hits = 0
        self.misses = 0

    def get(self, file_id: int, blkno: int) -> IndexBlock | None:
        block = self._blocks.get((file_id, blkno))
        if block is None:
            self.misses += 1
            return None
        self.hits += 1
        self._blocks.move_to_end((file_id, blkno))
        return block

    def peek(self, file_id: int, blkno: int) -> IndexBlock | None:
        """``get`` that counts no miss (the caller then reads the block with ``get``'s
        accounting, or not at all)."""
        block = self._blocks.get((file_id, blkno))
        if block is not None:
            self.hits += 1
            self._blocks.move_to_end((file_id, blkno))
        return block

    def put(self, file_id: int, blkno: int, block: IndexBlock) -> None:
        if self.capacity <= 0:
            return
        self._blocks[(file_id, blkno)] = block
        while len(self._blocks) > self.capacity:
            self._blocks.popitem(last=False)

    def forget_file(self, file_id: int) -> None:
        for k in [k for k in self._blocks if k[0] == file_id]:
            del self._blocks[k]

    def clear(self) -> None:
        self._blocks.clear()


_next_file_id = 0


def _new_file_id() -> int:
    global _next_file_id
    _next_file_id += 1
    return _next_file_id


def prefix_of(key: bytes, lsn: int) -> bytes:
    return key + _LSN.pack(lsn)


class LayerFileReader:
    """An open, checked layer file. Index blocks are read on demand through the block cache."""

    def __init__(
        self,
        path: Path,
        file: IoFile,
        summary: Summary,
        fences: list[bytes],
        cache: IndexBlockCache,
    ) -> None:
        self.path = path
        self.file = file
        self.summary = summary
        self.fences = fences
        self.cache = cache
        self.file_id = _new_file_id()

    @classmethod
    async def open(cls, engine: IoEngine, path: Path, cache: IndexBlockCache) -> LayerFileReader:
        try:
            file = await engine.open_file(path, "r")
        except FileNotFoundError:
            raise LayerCorruptionError(path, "file is missing") from None
        try:
            size = await file.size()
            head = await file.read_at(0, SUMMARY_SIZE)
            summary = Summary.decode(path, head)
            if size != summary.file_size:
                raise LayerCorruptionError(
                    path, f"file has {size} bytes, summary says {summary.file_size} (truncated?)"
                )
            raw = await file.read_at(summary.fence_start, summary.file_size - summary.fence_start)
            if crc32c.crc32c(raw) != summary.fences_crc:
                raise LayerCorruptionError(path, "fence section checksum mismatch")
            fences = [raw[i : i + _PREFIX] for i in range(0, len(raw), _PREFIX)]
            if any(a > b for a, b in itertools.pairwise(fences)):
                raise LayerCorruptionError(path, "fences out of order")
        except BaseException:
            await file.aclose()
            raise
        return cls(path, file, summary, fences, cache)

    async def aclose(self) -> None:
        self.cache.forget_file(self.file_id)
        await self.file.aclose()

    @property
    def engine(self) -> IoEngine:
        return self.file.engine

    async def block(self, blkno: int) -> IndexBlock:
        cached = self.cache.get(self.file_id, blkno)
        if cached is not None:
            return cached
        self._check_open()
        s = self.summary
        raw = await self.file.read_at(s.index_start + blkno * INDEX_BLOCK_SIZE, INDEX_BLOCK_SIZE)
        if len(raw) != INDEX_BLOCK_SIZE:
            raise LayerCorruptionError(self.path, f"index block {blkno} is truncated")
        crc, n, _ = _BLOCK_HDR.unpack_from(raw)
        if crc != crc32c.crc32c(memoryview(raw)[4:]) or n > ENTRIES_PER_BLOCK:
            raise LayerCorruptionError(self.path, f"index block {blkno} checksum mismatch")
        block = IndexBlock(raw, n)
        if not block.prefixes or block.prefixes[0] != self.fences[blkno]:
            raise LayerCorruptionError(self.path, f"index block {blkno} disagrees with its fence")
        self.cache.put(self.file_id, blkno, block)
        return block

    def first_block_for(self, prefix: bytes) -> int:
        """The index block holding the first entry >= prefix (may be one past it)."""
        return max(0, bisect.bisect_right(self.fences, prefix) - 1)

    async def scan(self, start: bytes, end: bytes) -> list[tuple[IndexBlock, int, int]]:
        """Runs ``(block, lo, hi)`` of the entries with ``start <= prefix < end``, in order."""
        fences = self.fences
        blkno = bisect.bisect_right(fences, start) - 1  # first_block_for, inlined (hot)
        if blkno < 0:
            blkno = 0
        n_blocks = self.summary.n_index_blocks
        out: list[tuple[IndexBlock, int, int]] = []
        cache_get = self.cache.get
        file_id = self.file_id
        lo = -1
        while blkno < n_blocks:
            if lo == 0 and fences[blkno] >= end:
                break
            cached = cache_get(file_id, blkno)
            block = cached if cached is not None else await self.block(blkno)
            prefixes = block.prefixes
            lo = bisect.bisect_left(prefixes, start) if lo < 0 else 0
            hi = bisect.bisect_left(prefixes, end, lo)
            if hi > lo:
                out.append((block, lo, hi))
            if hi < len(prefixes):
                break
            lo = 0
            blkno += 1
        return out

    async def load_blocks(
        self, bounds: Iterable[tuple[bytes, bytes]]
    ) -> dict[tuple[int, int], IndexBlock]:
        """Every index block the planning kernel's search visits for each ``[start, end)`` of
        ``bounds`` (the blocks ``scan`` reads), read through the block cache and keyed as the
        cache keys them: the kernel's block mapping when the cache lacks some, which holds
        them all even when the bounded cache cannot."""
        out: dict[tuple[int, int], IndexBlock] = {}
        fences = self.fences
        n_blocks = self.summary.n_index_blocks
        file_id = self.file_id
        for start, end in bounds:
            # the kernel's walk: the first block by the fences, then on while the range
            # fills a block and the next block's fence is below its end
            blkno = bisect.bisect_right(fences, start) - 1
            if blkno < 0:
                blkno = 0
            block = out[(file_id, blkno)] = await self.block(blkno)
            prefixes = block.prefixes
            hi = bisect.bisect_left(prefixes, end, bisect.bisect_left(prefixes, start))
            while hi == len(prefixes) and blkno + 1 < n_blocks and fences[blkno + 1] < end:
                blkno += 1
                block = out[(file_id, blkno)] = await self.block(blkno)
                prefixes = block.prefixes
                hi = bisect.bisect_left(prefixes, end)
        return out

    def prefetch_index(self, start: bytes, end: bytes) -> None:
        """Ask the kernel to start reading the index blocks that ``scan(start, end)`` would
        read and the block cache lacks (``POSIX_FADV_WILLNEED``: returns at once; a cold
        walk prefetches the blocks of all the layers it will visit, so the disk serves them
        concurrently instead of one round trip per layer)."""
        fences = self.fences
        first = max(0, bisect.bisect_right(fences, start) - 1)
        last = max(first, bisect.bisect_left(fences, end) - 1)
        blocks = self.cache._blocks
        missing = [b for b in range(first, last + 1) if (self.file_id, b) not in blocks]
        if missing and _FADVISE and not self.file.closed:
            index_start = self.summary.index_start
            os.posix_fadvise(
                self.file.fd,
                index_start + missing[0] * INDEX_BLOCK_SIZE,
                (missing[-1] - missing[0] + 1) * INDEX_BLOCK_SIZE,
                os.POSIX_FADV_WILLNEED,
            )

    def check_blob(self, offset: int, length: int, crc: int, data: bytes | bytearray | memoryview) -> None:
        if len(data) != length:
            raise LayerCorruptionError(
                self.path, f"blob at offset {offset} truncated: {len(data)} of {length} bytes"
            )
        if crc32c.crc32c(data) != crc:
            raise LayerCorruptionError(self.path, f"blob at offset {offset} checksum mismatch")

    def _check_open(self) -> None:
        if self.file.closed:
            raise LayerClosedError(self.path)

    def check_entry(self, offset: int, length: int) -> None:
        if offset < DATA_START or offset + length > self.summary.data_end:
            raise LayerCorruptionError(self.path, f"index entry points outside the data section: {offset}+{length}")

    async def read_blob(self, offset: int, length: int, crc: int) -> bytes:
        """One blob, one pread (the legacy path's way)."""
        self.check_entry(offset, length)
        self._check_open()
        data = await self.file.read_at(offset, length)
        self.check_blob(offset, length, crc, data)
        return data

    async def _read_span(self, offset: int, total: int) -> bytearray:
        """``total`` bytes of adjacent blobs at ``offset``, in one ``preadv``."""
        self.check_entry(offset, total)
        self._check_open()
        buffer = bytearray(total)
        got = await self.engine.preadv(self.file.fd, [buffer], offset)
        if got != total:
            raise LayerCorruptionError(self.path, f"short read at {offset}: {got} of {total} bytes")
        return buffer

    async def read_blob_copies(self, offset: int, lengths: Sequence[int]) -> list[bytes]:
        """``read_blobs`` as ``bytes`` (compaction keeps them): one ``preadv``, then the
        blobs cut out by C loops (a ``bytes`` per blob either way; no view in between)."""
        data = bytes(await self._read_span(offset, sum(lengths)))
        ends = list(accumulate(lengths))
        return list(map(data.__getitem__, map(slice, [0, *ends[:-1]], ends)))

    async def read_blobs(self, offset: int, lengths: Sequence[int]) -> list[memoryview]:
        """Physically adjacent blobs starting at ``offset``: one ``preadv`` into one buffer,
        returned as one view per blob (one iovec keeps the syscall and its setup cheap)."""
        view = memoryview(await self._read_span(offset, sum(lengths)))
        out: list[memoryview] = []
        pos = 0
        for n in lengths:
            out.append(view[pos : pos + n])
            pos += n
        return out


@attrs.frozen
class WriteOptions:
    """How layer files are written (pageserver config ``write_buffer_size``/``double_buffering``;
    double buffering needs the nursery its background flushes run in)."""

    buffer_size: int = 64 * 1024
    double_buffering: bool = False
    nursery: trio.Nursery | None = None


class LayerFileWriter:
    """Builds a layer file under a temp name; ``finish`` makes it durable under its final name.

    Blobs, then index and fences, go through the ``BufferedWriter``
    (``write_buffer_size``, ``double_buffering``; the background flush runs in ``nursery``).
    Entries must arrive in strictly increasing (key, lsn) order (invariant 1, storage.md §6).

    The index goes behind the data. When the data's size is announced (``create(data_size=)``,
    the L0 flush) the finished index blocks are written there right away; otherwise the data's
    end is only known at ``finish``, so finished index blocks are spilled to a scratch file ``<name>.___temp.index`` in the same directory (own
    ``BufferedWriter``) and copied behind the data in ``finish``: the writer holds one 8 KiB
    block and the fences (26 bytes per 194 entries), not 42 bytes per entry. The scratch file is
    deleted on success and on abort; after a crash it is an unlisted file, which
    ``Tenant.load`` deletes like every other file index_part.json does not list.
    """

    def __init__(self, engine: IoEngine, file: IoFile, writer: BufferedWriter, tmp_path: Path,
                 final_path: Path, desc: LayerDesc, index_file: IoFile, index_writer: BufferedWriter,
                 index_path: Path | None) -> None:
        self.engine = engine
        self.file = file
        self.writer = writer
        self.tmp_path = tmp_path
        self.final_path = final_path
        self.desc = desc
        self.index_file = index_file
        self.index_writer = index_writer
        self.index_path = index_path
        self._offset = DATA_START
        self._block = bytearray(INDEX_BLOCK_SIZE)
        self._n_blocks = 0
        self._fences: list[bytes] = []
        self._n_entries = 0
        self._n_in_block = 0
        self._last_prefix = b""
        # the announced data size (``create(data_size=)``): the index is written in place
        self._data_size: int | None = None

    @classmethod
    async def create(cls, engine: IoEngine, directory: Path, desc: LayerDesc,
                     opts: WriteOptions | None = None, *, data_size: int | None = None) -> LayerFileWriter:
        """A writer for ``desc`` in ``directory``. With ``data_size`` (the L0 flush knows the
        sum of its values' lengths before the first), the index blocks are written straight to
        their place behind the data (offset ``DATA_START + data_size``, a second writer on the
        same file) instead of through the scratch file: ``finish`` then refuses a data section
        of any other size. Not with O_DIRECT, whose padded last data write would overwrite the
        first index block."""
        opts = opts or WriteOptions()
        if data_size is not None and data_size < 0:
            raise ValueError(f"data_size {data_size} is negative")
        final = directory / desc.file_name()
        tmp = directory / (desc.file_name() + ".___temp")
        index_tmp = directory / (desc.file_name() + ".___temp.index")
        for stale in (tmp, index_tmp):
            await engine.unlink(stale)
        file = await engine.open_file(tmp, "x+")
        index_file: IoFile | None = None
        try:
            writer = BufferedWriter(file, buffer_size=opts.buffer_size,
                                    double_buffering=opts.double_buffering,
                                    nursery=opts.nursery, start_offset=DATA_START)
            if data_size is not None and not file.direct:
                index_writer = BufferedWriter(file, buffer_size=opts.buffer_size, double_buffering=False,
                                              start_offset=DATA_START + data_size)
                writer_ = cls(engine, file, writer, tmp, final, desc, file, index_writer, None)
                writer_._data_size = data_size
                return writer_
            # Scratch, never made durable (the final file is fsynced after the copy), so
            # O_DSYNC would only cost; O_DIRECT is kept so the page cache is spared as configured.
            index_file = await engine.open_file(
                index_tmp, "x+", sync_mode="direct" if file.direct else "none"
            )
            # Index blocks are ~1/6 of the bytes of small values: one buffer is enough.
            index_writer = BufferedWriter(index_file, buffer_size=opts.buffer_size,
                                          double_buffering=False)
        except BaseException:
            await file.aclose()
            os.unlink(tmp)
            if index_file is not None:
                await index_file.aclose()
                os.unlink(index_tmp)
            raise
        return cls(engine, file, writer, tmp, final, desc, index_file, index_writer, index_tmp)

    @property
    def n_entries(self) -> int:
        return self._n_entries

    @property
    def data_size(self) -> int:
        return self._offset - DATA_START

    async def put(self, key: Key, lsn: int, blob: bytes | bytearray | memoryview, will_init: bool) -> None:
        prefix = key + _LSN.pack(lsn)
        if prefix <= self._last_prefix:
            raise ValueError(f"{self.final_path.name}: entries out of order at {key_hex(key)}@{lsn:X}")
        if key not in self.desc.key_range or not self.desc.lsn_start <= lsn < self.desc.lsn_end:
            raise ValueError(f"{self.final_path.name}: ({key_hex(key)}, {lsn:X}) outside the layer")
        self._last_prefix = prefix
        length = len(blob)
        if self._n_in_block == ENTRIES_PER_BLOCK:
            await self._spill_block()
        if self._n_in_block == 0:
            self._fences.append(prefix)
        ENTRY.pack_into(self._block, _BLOCK_HDR.size + self._n_in_block * ENTRY.size, prefix,
                        (self._offset << 1) | will_init, length, crc32c.crc32c(blob))
        self._n_in_block += 1
        self._n_entries += 1
        # no coroutine per value while the blob fits in the write buffer
        if self.writer.try_write(blob) < 0:
            await self.writer.write(blob)
        self._offset += length

    async def put_many(
        self,
        runs: Sequence[tuple[Key, int]],
        lsns: Sequence[int],
        blobs: Sequence[bytes | bytearray | memoryview],
        will_inits: Sequence[int],
    ) -> None:
        """``put`` of many entries in one call (the L0 flush's way).

        ``runs`` are ``(key, count)``: the next ``count`` entries belong to ``key``; ``lsns``,
        ``blobs`` and ``will_inits`` (0/1 or bools) have one item per entry, in the same
        strictly increasing (key, lsn) order ``put`` requires (a key may continue in the next
        run). The file is byte for byte what a ``put`` loop over the same entries writes
        (tests/pageserver/test_layer_writer_fast.py), with the same checks, but the per-entry
        work is done by C loops: the order and range checks per run (LSNs compared with one
        ``map``), the crc32c of the blobs with one ``map``, the blobs appended with one buffer
        write, and the index entries packed with one ``struct`` call per index block.
        Nothing is written when a check fails.
        """
        n = len(lsns)
        if len(blobs) != n or len(will_inits) != n:
            raise ValueError(f"{self.final_path.name}: put_many of {n} LSNs, {len(blobs)} blobs, "
                             f"{len(will_inits)} will_init flags")
        if n == 0:
            if runs:
                raise ValueError(f"{self.final_path.name}: put_many runs do not add up to 0 entries")
            return
        desc = self.desc
        key_range = desc.key_range
        lsn_start, lsn_end = desc.lsn_start, desc.lsn_end
        keys: list[Key] = []
        starts: set[int] = set()
        last_prefix = self._last_prefix
        i = 0
        for key, count in runs:
            if len(key) != KEY_SIZE:
                raise ValueError(f"{self.final_path.name}: key of {len(key)} bytes")
            if count <= 0 or i + count > n:
                raise ValueError(f"{self.final_path.name}: put_many runs do not add up to {n} entries")
            prefix = key + _LSN.pack(lsns[i])
            if prefix <= last_prefix:
                raise ValueError(f"{self.final_path.name}: entries out of order at {key_hex(key)}@{lsns[i]:X}")
            # (a run's first and last LSN bound it once the rise check below has passed)
            first, last = lsns[i], lsns[i + count - 1]
            if key not in key_range or first < lsn_start or last >= lsn_end:
                bad = first if first < lsn_start or last < lsn_end else last
                raise ValueError(f"{self.final_path.name}: ({key_hex(key)}, {bad:X}) outside the layer")
            starts.add(i)
            keys += repeat(key, count)
            i += count
            last_prefix = key + _LSN.pack(last)
        if i != n:
            raise ValueError(f"{self.final_path.name}: put_many runs do not add up to {n} entries")
        # inside a run the LSNs must rise; a step that does not rise may only start a run
        for at in compress(range(1, n), map(ge, islice(lsns, 0, n - 1), islice(lsns, 1, None))):
            if at not in starts:
                raise ValueError(f"{self.final_path.name}: entries out of order at {key_hex(keys[at])}@{lsns[at]:X}")
        if not _FLAG_VALUES.issuperset(will_inits):  # (they are or-ed into the positions)
            raise ValueError(f"{self.final_path.name}: will_init flags must be 0/1 or bools")
        self._last_prefix = last_prefix

        lengths = list(map(len, blobs))
        offsets = list(accumulate(lengths, initial=self._offset))
        positions = list(map(or_, map(lshift, offsets, repeat(1)), will_inits))
        crcs = list(map(crc32c.crc32c, blobs))
        data = b"".join(blobs)
        if self.writer.try_write(data) < 0:
            await self.writer.write(data)
        self._offset = offsets[-1]
        self._n_entries += n

        # one flat argument list (key, lsn, pos, len, crc per entry: ENTRY's bytes, with the
        # 26-byte prefix as 18s + Q), then one pack_into per (part of an) index block
        flat: list[object] = [None] * (5 * n)
        flat[0::5] = keys
        flat[1::5] = lsns
        flat[2::5] = positions
        flat[3::5] = lengths
        flat[4::5] = crcs
        i = 0
        while i < n:
            if self._n_in_block == ENTRIES_PER_BLOCK:
                await self._spill_block()
            if self._n_in_block == 0:
                self._fences.append(keys[i] + _LSN.pack(lsns[i]))
            k = min(ENTRIES_PER_BLOCK - self._n_in_block, n - i)
            _entries_struct(k).pack_into(self._block, _BLOCK_HDR.size + self._n_in_block * ENTRY.size,
                                         *flat[5 * i : 5 * (i + k)])
            self._n_in_block += k
            i += k

    @property
    def next_offset(self) -> int:
        """The file offset the next blob goes to."""
        return self._offset

    async def put_packed(self, data: bytes | memoryview, entries: bytes | memoryview) -> None:
        """``put`` of entries already packed (the L0 writer's way: ``_l0_select.pack_values``
        cut ``data`` out of the in-memory layer and made ``entries``, 42-byte ``ENTRY`` records
        whose positions start at ``next_offset``, in strictly increasing (key, lsn) order, LSNs
        inside the layer). The file is byte for byte what a ``put`` loop over the same values
        writes (tests/pageserver/test_layer_writer_fast.py): ``data`` goes to the writer as one
        write, the entries into the index blocks with one copy per (part of a) block.

        Checked here, before anything is written: whole entries, the first above the last entry
        written, the first and last keys inside the layer's key range, the first entry at
        ``next_offset`` and the last ending where ``data`` does (the packer checked the rest)."""
        size = ENTRY.size
        n, rest = divmod(len(entries), size)
        if rest:
            raise ValueError(f"{self.final_path.name}: packed entries of {len(entries)} bytes")
        if n == 0:
            if len(data):
                raise ValueError(f"{self.final_path.name}: {len(data)} packed bytes without an entry")
            return
        view = memoryview(entries)
        first = bytes(view[:_PREFIX])
        last_at = (n - 1) * size
        last = bytes(view[last_at : last_at + _PREFIX])
        if first <= self._last_prefix:
            raise ValueError(f"{self.final_path.name}: entries out of order at {key_hex(first[:KEY_SIZE])}")
        key_range = self.desc.key_range
        if not (key_range.start <= first[:KEY_SIZE] and last[:KEY_SIZE] < key_range.end):
            raise ValueError(f"{self.final_path.name}: packed keys outside the layer's {key_range}")
        _, pos0, _, _ = ENTRY.unpack_from(view, 0)
        _, pos_n, len_n, _ = ENTRY.unpack_from(view, last_at)
        end = self._offset + len(data)
        if pos0 >> 1 != self._offset or (pos_n >> 1) + len_n != end:
            raise ValueError(f"{self.final_path.name}: packed entries do not place the data at {self._offset}")
        if self.writer.try_write(data) < 0:
            await self.writer.write(data)
        self._offset = end
        self._n_entries += n
        self._last_prefix = last
        i = 0
        block = self._block
        while i < n:
            if self._n_in_block == ENTRIES_PER_BLOCK:
                await self._spill_block()
            if self._n_in_block == 0:
                self._fences.append(bytes(view[i * size : i * size + _PREFIX]))
            k = min(ENTRIES_PER_BLOCK - self._n_in_block, n - i)
            at = _BLOCK_HDR.size + self._n_in_block * size
            block[at : at + k * size] = view[i * size : (i + k) * size]
            self._n_in_block += k
            i += k

    async def _spill_block(self) -> None:
        """Seal the current index block (header, crc, zero tail) and append it to the scratch
        index file; the block buffer is reused for the next one."""
        block = self._block
        used = _BLOCK_HDR.size + self._n_in_block * ENTRY.size
        block[used:] = bytes(INDEX_BLOCK_SIZE - used)
        _BLOCK_HDR.pack_into(block, 0, 0, self._n_in_block, 0)
        _SUMMARY_CRC.pack_into(block, 0, crc32c.crc32c(memoryview(block)[4:]))
        if self.index_writer.try_write(block) < 0:
            await self.index_writer.write(block)
        self._n_blocks += 1
        self._n_in_block = 0

    @property
    def first_key(self) -> Key | None:
        return Key(self._fences[0][:KEY_SIZE]) if self._fences else None

    @property
    def last_key(self) -> Key | None:
        return Key(self._last_prefix[:KEY_SIZE]) if self._last_prefix else None

    async def finish(self, key_range: KeyRange | None = None) -> Path:
        """Write index, fences and summary, fsync, rename into place, fsync the directory.

        ``key_range`` narrows the layer's key range (and so its name) to what was written, for
        writers that only learn it at the end (compaction); it must cover every written key.
        """
        if key_range is not None:
            first, last = self.first_key, self.last_key
            if first is not None and last is not None and not (key_range.start <= first and last < key_range.end):
                raise ValueError(f"{self.tmp_path}: key range {key_range} does not cover the written keys")
            self.desc = attrs.evolve(self.desc, key_range=key_range)
            self.final_path = self.final_path.with_name(self.desc.file_name())
        try:
            if self._data_size is not None and self._offset != DATA_START + self._data_size:
                raise ValueError(f"{self.tmp_path}: {self._offset - DATA_START} bytes of data written, "
                                 f"{self._data_size} announced")
            if self._n_in_block:
                await self._spill_block()
            index_start = self._offset
            n_blocks = self._n_blocks
            fences = b"".join(self._fences)
            fence_start = index_start + n_blocks * INDEX_BLOCK_SIZE
            summary = Summary(
                magic=DELTA_MAGIC if self.desc.is_delta else IMAGE_MAGIC,
                key_range=self.desc.key_range,
                lsn_start=self.desc.lsn_start,
                lsn_end=self.desc.lsn_end,
                data_end=index_start,
                index_start=index_start,
                n_index_blocks=n_blocks,
                n_entries=self._n_entries,
                fence_start=fence_start,
                file_size=fence_start + len(fences),
                fences_crc=crc32c.crc32c(fences),
            )
            if self._data_size is None:
                await self._copy_index()
                await self.writer.write(fences)
                if await self.writer.close() != summary.file_size:
                    raise AssertionError(f"{self.tmp_path}: written length disagrees with the summary")
            else:
                await self.index_writer.write(fences)
                if await self.writer.close() != index_start or await self.index_writer.close() != summary.file_size:
                    raise AssertionError(f"{self.tmp_path}: written length disagrees with the summary")
            header = summary.encode()
            await self.file.write_at(0, header + bytes(DATA_START - len(header)))
            await self.file.aclose()
            # fsync of the layer, rename, fsync of the directory: visible only when durable
            await durable_rename(self.engine, self.tmp_path, self.final_path)
        except BaseException:
            await self.abort()
            raise
        return self.final_path

    async def _copy_index(self) -> None:
        """Append the spilled index blocks behind the data, ``_COPY_CHUNK`` bytes at a time,
        then drop the scratch file."""
        size = await self.index_writer.close()
        if size != self._n_blocks * INDEX_BLOCK_SIZE:
            raise AssertionError(f"{self.index_path}: {size} bytes for {self._n_blocks} index blocks")
        for offset in range(0, size, _COPY_CHUNK):
            chunk = await self.index_file.read_exact_at(offset, min(_COPY_CHUNK, size - offset))
            await self.writer.write(chunk)
        await self._drop_index_file()

    async def _drop_index_file(self) -> None:
        if self.index_path is None:
            return  # (no scratch file: the index went into the layer file itself)
        # unlink first, shielded: a cancelled close must not leave the scratch file behind;
        # the engine's way, because unlinking a large scratch file can block.
        with trio.CancelScope(shield=True):
            await self.engine.unlink(self.index_path)
        await self.index_file.aclose()

    async def abort(self) -> None:
        try:
            await self.index_writer.abort()
            await self._drop_index_file()
        finally:
            await self.writer.abort()
            await self.file.aclose()
            unlink_if_present(self.tmp_path)  # inline: an abort may run in a cancelled scope


async def write_layer_file(
    engine: IoEngine,
    directory: Path,
    desc: LayerDesc,
    opts: WriteOptions | None,
    fill: Callable[[LayerFileWriter], Awaitable[None]],
    *,
    data_size: int | None = None,
) -> Path | None:
    """Create a layer file for ``desc``, let ``fill`` put its entries, finish it; ``None``
    (and nothing left on disk) when ``fill`` put nothing, the temp files removed when it fails.
    ``data_size``: the sum of the blobs' lengths ``fill`` will put, if known
    (``LayerFileWriter.create``)."""
    writer = await LayerFileWriter.create(engine, directory, desc, opts, data_size=data_size)
    try:
        await fill(writer)
    except BaseException:
        await writer.abort()
        raise
    if writer.n_entries == 0:
        await writer.abort()
        return None
    return await writer.finish()
