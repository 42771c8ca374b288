"""``PageReader`` over the real storage engine: ``pageserver.timeline.Timeline`` read through
``pageserver.pgdatadir.Datadir`` (relation directories, sizes, SLRU segments).

The one thing this adds over calling ``Datadir`` per request is the batch shape: a GetPage batch
becomes one vectored read of every (directory, size) key the batch needs per distinct LSN, then
one ``Timeline.get_pages`` for all in-range blocks (one walk for the whole batch, whatever
the mix of LSNs). Blocks at or past
the fork's size are zero pages without touching the engine; a missing relation is a per-request
``NotFound``; a page that cannot be reconstructed is a per-request ``ReadError``.

Error mapping: ``RelNotFoundError`` / ``MissingKeyError`` -> ``NotFound``;
``PageReconstructError`` -> ``ReadError``; the engine's LSN timeout -> ``LsnTimeout``; a read
the timeline's shutdown cut short (``TimelineShutdownError``) -> ``Shutdown`` (57P01); the
``shutdown`` event -> ``wait_shutdown`` returns (the stream then ends with 57P01).
"""

from __future__ import annotations

import operator
import struct
from collections.abc import Callable, Sequence
from itertools import repeat
from typing import Final, cast

import trio

from pageserver.page_service.reader import (
    LsnTimeout,
    NotFound,
    PageRead,
    PageRequestError,
    ReadError,
    Shutdown,
)
from pageserver.pgdatadir import (
    DEFAULTTABLESPACE_OID,
    ZERO_PAGE,
    Datadir,
    RelNotFoundError,
    decode_nblocks,
    decode_rel_dir,
)
from pageserver.pgdatadir import RelTag as DatadirRel
from pageserver.storage.key import (
    FSM_FORKNUM,
    VISIBILITYMAP_FORKNUM,
    Key,
    rel_block_key,
    rel_dir_key,
    rel_size_key,
)
from pageserver.storage.reconstruct import MissingKeyError, PageReconstructError
from pageserver.timeline import Timeline, TimelineShutdownError
from protocol.errors import RemoteProtocolError
from protocol.lsn import Lsn, format_lsn
from protocol.pagestream import GetPageRequest, RelTag, SlruKind

SIZE_CACHE_ENTRIES = 4096


def _rel(rel: RelTag) -> DatadirRel:
    return DatadirRel(rel.spcnode, rel.dbnode, rel.relnode, rel.forknum)


class TimelinePageReader:
    """The page service's view of one timeline."""

    def __init__(self, timeline: Timeline, shutdown: trio.Event | None = None) -> None:
        self.timeline = timeline
        self.datadir = Datadir(timeline)
        self._shutdown = shutdown if shutdown is not None else trio.Event()
        # (fork, lsn) -> nblocks. History at or below last_record_lsn never changes (and reads
        # below the GC cutoff are refused before they get here), so a size read once at an LSN
        # stays true; this saves the second engine read per batch on a hot timeline.
        self._sizes_at: dict[tuple[RelTag, Lsn], int] = {}

    @property
    def last_record_lsn(self) -> Lsn:
        return self.timeline.last_record_lsn

    @property
    def gc_cutoff_lsn(self) -> Lsn:
        return self.timeline.latest_gc_cutoff_lsn

    async def wait_lsn(self, lsn: Lsn, timeout_s: float) -> None:
        try:
            await self.timeline.wait_lsn(lsn, timeout_s)
        except TimeoutError as exc:  # the engine's LsnTimeoutError
            raise LsnTimeout(str(exc)) from None

    async def get_rel_exists(self, rel: RelTag, lsn: Lsn) -> bool:
        try:
            return await self.datadir.rel_exists(_rel(rel), lsn)
        except (PageReconstructError, RemoteProtocolError) as exc:
            raise ReadError(str(exc)) from None
        except TimelineShutdownError as exc:
            raise Shutdown(str(exc)) from None

    async def get_rel_size(self, rel: RelTag, lsn: Lsn) -> int:
        try:
            return await self.datadir.get_rel_size(_rel(rel), lsn)
        except RelNotFoundError as exc:
            raise NotFound(str(exc)) from None
        except (PageReconstructError, RemoteProtocolError) as exc:
            raise ReadError(str(exc)) from None
        except TimelineShutdownError as exc:
            raise Shutdown(str(exc)) from None

    async def get_db_size(self, dbnode: int, lsn: Lsn) -> int:
        try:
            return await self.datadir.get_db_size(DEFAULTTABLESPACE_OID, dbnode, lsn)
        except RelNotFoundError as exc:
            raise NotFound(str(exc)) from None
        except (PageReconstructError, RemoteProtocolError) as exc:
            raise ReadError(str(exc)) from None
        except TimelineShutdownError as exc:
            raise Shutdown(str(exc)) from None

    async def get_slru_segment(self, kind: SlruKind, segno: int, lsn: Lsn) -> bytes:
        try:
            return await self.datadir.get_slru_segment(int(kind), segno, lsn)
        except MissingKeyError:
            raise NotFound(
                f"SLRU segment {kind.name} {segno} not found at {format_lsn(lsn)}"
            ) from None
        except (PageReconstructError, RemoteProtocolError) as exc:
            raise ReadError(str(exc)) from None
        except TimelineShutdownError as exc:
            raise Shutdown(str(exc)) from None

    async def _sizes(
        self, reads: Sequence[PageRead]
    ) -> dict[tuple[RelTag, Lsn], int | PageRequestError]:
        """Size of every (fork, LSN) the batch touches: one vectored read per distinct LSN."""
        by_lsn: dict[Lsn, set[RelTag]] = {}
        sizes: dict[tuple[RelTag, Lsn], int | PageRequestError] = {}
        known = self._sizes_at
        for read in reads:
            cached = known.get((read.rel, read.lsn))
            if cached is not None:
                sizes[(read.rel, read.lsn)] = cached
            else:
                by_lsn.setdefault(read.lsn, set()).add(read.rel)
        final = self.timeline.last_record_lsn
        for lsn, rels in by_lsn.items():
            keys: set[Key] = set()
            for r in rels:
                keys.add(rel_dir_key(r.spcnode, r.dbnode))
                keys.add(rel_size_key(r.spcnode, r.dbnode, r.relnode, r.forknum))
            got = await self.timeline.get_vectored_results(sorted(keys), lsn)
            for r in rels:
                size = sizes[(r, lsn)] = _size_of(r, lsn, got)
                if isinstance(size, int) and lsn <= final:
                    if len(known) >= SIZE_CACHE_ENTRIES:
                        known.clear()  # crude but bounded; refills from the next batches
                    known[(r, lsn)] = size
        return sizes

    async def get_pages(self, reads: Sequence[PageRead]) -> list[bytes | PageRequestError]:
        known = self._sizes_at
        if reads:
            # The usual batch: one fork at one LSN, its size cached, every block inside it:
            # the keys made by C loops and one ``Timeline.get_pages_at`` (the image kernel).
            lsn = reads[0].lsn
            keys = self._one_fork(list(map(_rel_of, reads)), lsn, list(map(_lsn_of, reads)),
                                  list(map(_blkno_of, reads)))
            if keys is not None:
                return await self._read_at(keys, lsn, None)  # type: ignore[return-value]  # (no None without into)
        by_key: dict[tuple[RelTag, Lsn], int | PageRequestError] | None = None
        out: list[bytes | PageRequestError] = [ZERO_PAGE] * len(reads)
        wanted: list[int] = []
        keyed: list[tuple[Key, Lsn]] = []
        # One pass per read: its fork's size, then its key. A batch is usually one fork at one
        # LSN, and the decoder hands out one RelTag object per fork: the size lookup (a tuple
        # and an attrs hash) and the key's first 14 bytes are made once per run of reads of
        # the same fork and LSN, not once per read.
        prev_rel: RelTag | None = None
        prev_lsn = Lsn(-1)
        size: int | PageRequestError = 0
        prefix = b""
        for i, read in enumerate(reads):
            rel, lsn = read.rel, read.lsn
            if rel is not prev_rel or lsn != prev_lsn:
                prev_rel, prev_lsn = rel, lsn
                got = known.get((rel, lsn)) if by_key is None else by_key[(rel, lsn)]
                if got is None:
                    # A hot timeline has every (fork, LSN) cached: this is the cold start
                    try:
                        by_key = await self._sizes(reads)
                    except TimelineShutdownError as exc:
                        raise Shutdown(str(exc)) from None
                    got = by_key[(rel, lsn)]
                size = got
                prefix = _rel_prefix(rel)
            if isinstance(size, PageRequestError):
                out[i] = size
            elif read.blkno < size:
                wanted.append(i)
                keyed.append((_block_key(prefix, read.blkno), lsn))
        if keyed:
            try:
                results = await self.timeline.get_pages(keyed)
            except TimelineShutdownError as exc:
                raise Shutdown(str(exc)) from None
            for i, result in zip(wanted, results, strict=True):
                out[i] = result if isinstance(result, bytes) else ReadError(str(result))
        return out

    async def get_pages_into(
        self, requests: Sequence[GetPageRequest], lsn: Lsn, out: bytearray, dest: int, stride: int
    ) -> list[bytes | PageRequestError | None] | None:
        """``get_pages`` of the GetPages ``requests``, every one at the effective LSN ``lsn``,
        with each page the image kernel reads put straight into ``out`` at ``dest + i *
        stride`` (the response buffer's page slots) and None in its place; None for a batch
        that is not one fork with its size cached and every block inside it (the caller then
        takes ``get_pages``)."""
        if not requests:
            return None
        keys = self._one_fork(list(map(_rel_of, requests)), lsn, None, list(map(_blkno_of, requests)))
        if keys is None:
            return None
        return await self._read_at(keys, lsn, (out, dest, stride))

    def _one_fork(
        self, rels: list[RelTag], lsn: Lsn, lsns: list[Lsn] | None, blknos: list[int]
    ) -> list[Key] | None:
        """The keys of a batch of one fork at ``lsn`` (``lsns``: every read's, checked), its
        size cached and every block inside it; else None (the batch path decides)."""
        n = len(rels)
        rel = rels[0]
        nblocks = self._sizes_at.get((rel, lsn))
        if nblocks is None or rels.count(rel) != n or (lsns is not None and lsns.count(lsn) != n) or (
                max(blknos) >= nblocks):
            return None
        return list(map(_block_key, repeat(_rel_prefix(rel), n), blknos))

    async def _read_at(
        self, keys: list[Key], lsn: Lsn, into: tuple[bytearray, int, int] | None
    ) -> list[bytes | PageRequestError | None]:
        try:
            results = await self.timeline.get_pages_at(keys, lsn, into=into)
        except TimelineShutdownError as exc:
            raise Shutdown(str(exc)) from None
        if set(map(type, results)) <= _PAGES_OR_PLACED:
            return results  # type: ignore[return-value]  # (bytes or None)
        return [r if r is None or isinstance(r, bytes) else ReadError(str(r)) for r in results]

    async def get_page(self, read: PageRead) -> bytes | PageRequestError:
        """``get_pages([read])[0]`` for a lone request: with its fork's size cached (a hot
        timeline), one ``Timeline.get_page``; no lists, no run tracking. Otherwise (the first
        read of a fork at an LSN) the batch path, which reads and caches the size."""
        size = self._sizes_at.get((read.rel, read.lsn))
        if size is None:
            return (await self.get_pages((read,)))[0]
        if read.blkno >= size:
            return ZERO_PAGE
        rel = read.rel
        try:
            result = await self.timeline.get_page(
                rel_block_key(rel.spcnode, rel.dbnode, rel.relnode, rel.forknum, read.blkno),
                read.lsn,
            )
        except TimelineShutdownError as exc:
            raise Shutdown(str(exc)) from None
        return result if isinstance(result, bytes) else ReadError(str(result))

    async def wait_shutdown(self) -> None:
        await self._shutdown.wait()


# A relation block's key is its fork's 14 bytes then the block number (big-endian u32): what
# ``rel_block_key`` packs, split so a batch packs the fork's part once.
_KEY_TAIL: Final = struct.Struct(">14sI")
_block_key: Final = cast(Callable[[bytes, int], Key], _KEY_TAIL.pack)


# (C loops over a batch; PageRead and GetPageRequest both have rel and blkno)
_rel_of: Final[Callable[[PageRead | GetPageRequest], RelTag]] = operator.attrgetter("rel")
_lsn_of: Final[Callable[[PageRead], Lsn]] = operator.attrgetter("lsn")
_blkno_of: Final[Callable[[PageRead | GetPageRequest], int]] = operator.attrgetter("blkno")
_PAGES_OR_PLACED: Final = frozenset((bytes, type(None)))


def _rel_prefix(rel: RelTag) -> bytes:
    return rel_block_key(rel.spcnode, rel.dbnode, rel.relnode, rel.forknum, 0)[:14]


def _size_of(
    rel: RelTag, lsn: Lsn, got: dict[Key, bytes | PageReconstructError]
) -> int | PageRequestError:
    rdir = got[rel_dir_key(rel.spcnode, rel.dbnode)]
    size = got[rel_size_key(rel.spcnode, rel.dbnode, rel.relnode, rel.forknum)]
    try:
        if isinstance(rdir, bytes):
            exists = (rel.relnode, rel.forknum) in decode_rel_dir(rdir)
        elif isinstance(rdir, MissingKeyError):
            exists = False
        else:
            return ReadError(str(rdir))
        if not exists:
            if rel.forknum in (FSM_FORKNUM, VISIBILITYMAP_FORKNUM):
                return 0
            return NotFound(f"relation {_rel(rel)} does not exist at {format_lsn(lsn)}")
        if not isinstance(size, bytes):
            return ReadError(str(size))
        return decode_nblocks(size)
    except RemoteProtocolError as exc:  # a corrupt directory or size value
        return ReadError(str(exc))
