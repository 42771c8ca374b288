"""PostgreSQL's data directory mapped onto a timeline's keys (Neon's ``pgdatadir_mapping``).

Everything a PostgreSQL data directory holds that the pageserver serves lives in keys
(storage.md §1.2, constructors in ``pageserver.storage.key``):

| object | key | value (pagestore's encoding) |
|---|---|---|
| database directory | ``DBDIR_KEY`` | u32 n, then n x (spc u32, db u32, has_relmap u8), sorted |
| relation directory of (spc, db) | ``rel_dir_key`` | u32 n, then n x (relnode u32, fork u8), sorted |
| relation fork size | ``rel_size_key`` | u32 nblocks |
| relation block | ``rel_block_key`` | 8 KiB page (image or WAL records) |
| relmapper file of (spc, db) | ``relmap_file_key`` | the 512-byte ``pg_filenode.map`` |
| SLRU directory of a kind | ``slru_dir_key`` | u32 n, then n x segno u32, sorted |
| SLRU segment size | ``slru_segment_size_key`` | u32 nblocks |
| SLRU block | ``slru_block_key`` | 8 KiB page |
| two-phase directory | ``TWOPHASEDIR_KEY`` | u32 n, then n x xid u32, sorted |
| two-phase file | ``twophase_file_key(xid)`` | file bytes |
| pg_control | ``CONTROLFILE_KEY`` | the 8192-byte file as imported |
| checkpoint | ``CHECKPOINT_KEY`` | the 88-byte ``CheckPoint`` (``pageserver.pg_control``) |

All integers little-endian. Directories are rewritten whole on every change. The global
tablespace's shared catalogs are ``(1664, 0)``; it is in the database directory (it has a
relmapper file) like every database.

Reading: ``Datadir(timeline)`` answers at any LSN (``list_dbs``, ``list_rels``,
``get_rel_size``, ``rel_exists``, ``get_page``/``get_pages``, SLRU, relmap, control file,
checkpoint, two-phase). Existence is decided by the directories, because the engine has no
deletion: a dropped relation's blocks and size key stay behind but it leaves its directory.
A block at or past the fork's size reads as zeros; a missing FSM or VM fork has size 0.

Writing: ``DatadirWriter(timeline)`` keeps the latest directories and sizes cached (the
ingest path consults them per block reference) and hands out one ``DatadirModification`` per
LSN. Page values go to the timeline at once; directory, size and checkpoint changes collect
in the modification and are put at ``commit()``, which then calls ``finish_write(lsn)`` and
only then folds the changes into the caches (a failed record leaves the caches untouched).
"""

from __future__ import annotations

import struct
from collections.abc import Iterable, Sequence

import attrs

from pageserver.pg_control import CheckPoint, ControlFileData, parse_control_file
from pageserver.storage.key import (
    CHECKPOINT_KEY,
    CONTROLFILE_KEY,
    DBDIR_KEY,
    FSM_FORKNUM,
    TWOPHASEDIR_KEY,
    VISIBILITYMAP_FORKNUM,
    Key,
    rel_block_key,
    rel_dir_key,
    rel_size_key,
    relmap_file_key,
    slru_block_key,
    slru_dir_key,
    slru_segment_size_key,
    twophase_file_key,
)
from pageserver.storage.reconstruct import MissingKeyError, PageReconstructError
from pageserver.storage.value import Image, Value
from pageserver.timeline import Timeline
from pageserver.walredo.clog import SLRU_PAGES_PER_SEGMENT
from protocol.errors import RemoteProtocolError
from protocol.lsn import Lsn, format_lsn
from protocol.pgwire.sqlstate import DATA_CORRUPTED
from protocol.wal.record import BLCKSZ

ZERO_PAGE = bytes(BLCKSZ)
GLOBALTABLESPACE_OID = 1664
DEFAULTTABLESPACE_OID = 1663
# catversion.h of PostgreSQL 15: the per-version directory inside a tablespace
# (pg_tblspc/<spc oid>/PG_15_202209061/<db oid>/<relfilenode>)
TABLESPACE_VERSION_DIRECTORY = "PG_15_202209061"

_U32 = struct.Struct("<I")
_DB_ENTRY = struct.Struct("<IIB")
_REL_ENTRY = struct.Struct("<IB")

RelKey = tuple[int, int, int, int]  # (spc, db, rel, fork): the hot-path form of a RelTag


@attrs.frozen(slots=True, order=True)
class RelTag:
    """One fork of one relation."""

    spc: int
    db: int
    rel: int
    fork: int

    @property
    def tuple(self) -> RelKey:
        return (self.spc, self.db, self.rel, self.fork)

    def __str__(self) -> str:
        suffix = ("", "_fsm", "_vm", "_init")[self.fork] if 0 <= self.fork < 4 else f"_{self.fork}"
        return f"{self.spc}/{self.db}/{self.rel}{suffix}"


class RelNotFoundError(LookupError):
    """The relation fork does not exist at that LSN."""


# --- value codecs ---------------------------------------------------------------------------


def _corrupt(what: str) -> RemoteProtocolError:
    return RemoteProtocolError(f"corrupt datadir value: {what}", sqlstate=DATA_CORRUPTED)


def _count(buf: bytes, entry: int, what: str) -> int:
    if len(buf) < 4:
        raise _corrupt(f"{what} has {len(buf)} bytes")
    (n,) = _U32.unpack_from(buf)
    if len(buf) != 4 + n * entry:
        raise _corrupt(f"{what} with {n} entries has {len(buf)} bytes")
    return int(n)


def encode_db_dir(dbs: dict[tuple[int, int], bool]) -> bytes:
    parts = [_U32.pack(len(dbs))]
    parts.extend(_DB_ENTRY.pack(spc, db, 1 if m else 0) for (spc, db), m in sorted(dbs.items()))
    return b"".join(parts)


def decode_db_dir(buf: bytes) -> dict[tuple[int, int], bool]:
    _count(buf, _DB_ENTRY.size, "database directory")
    out: dict[tuple[int, int], bool] = {}
    for spc, db, m in _DB_ENTRY.iter_unpack(buf[4:]):
        if m > 1:
            raise _corrupt("database directory has a bad relmap flag")
        out[(spc, db)] = bool(m)
    return out


def encode_rel_dir(rels: Iterable[tuple[int, int]]) -> bytes:
    items = sorted(rels)
    return _U32.pack(len(items)) + b"".join(_REL_ENTRY.pack(r, f) for r, f in items)


# Above this many changes, patch_rel_dir encodes the directory afresh.
_PATCH_MAX = 64


def _rel_entry_index(buf: bytes | bytearray, rel: int, fork: int) -> int:
    """Where ``(rel, fork)`` is, or would go, in an encoded relation directory (its entries
    sorted): a binary search over the fixed-size entries, no decode of the others."""
    lo, hi = 0, (len(buf) - 4) // _REL_ENTRY.size
    unpack = _REL_ENTRY.unpack_from
    want = (rel, fork)
    while lo < hi:
        mid = (lo + hi) // 2
        if unpack(buf, 4 + mid * _REL_ENTRY.size) < want:
            lo = mid + 1
        else:
            hi = mid
    return lo


def patch_rel_dir(
    buf: bytes, added: Iterable[tuple[int, int]], removed: Iterable[tuple[int, int]], rels: set[tuple[int, int]]
) -> bytes:
    """``encode_rel_dir(rels)`` from ``buf``, the encoding of the directory before ``added``
    (not in it) were added and ``removed`` (in it) removed: each entry spliced in or out at its
    sorted place, O(log n) Python work and one byte move each, instead of sorting and packing
    every entry (a CREATE in a database of thousands of forks otherwise costs milliseconds).
    Many changes at once (a dropped database): encoded afresh."""
    add = sorted(added)
    gone = list(removed)
    if len(add) + len(gone) > _PATCH_MAX:
        return encode_rel_dir(rels)
    out = bytearray(buf)
    size = _REL_ENTRY.size
    for r, f in gone:
        i = _rel_entry_index(out, r, f)
        at = 4 + i * size
        if _REL_ENTRY.unpack_from(out, at) != (r, f):
            raise AssertionError(f"relation directory patch: {(r, f)} is not in it")
        del out[at : at + size]
    for r, f in add:
        at = 4 + _rel_entry_index(out, r, f) * size
        if at < len(out) and _REL_ENTRY.unpack_from(out, at) == (r, f):
            raise AssertionError(f"relation directory patch: {(r, f)} is in it already")
        out[at:at] = _REL_ENTRY.pack(r, f)
    _U32.pack_into(out, 0, len(rels))
    if len(out) != 4 + len(rels) * size:
        raise AssertionError("relation directory patch: the entry count disagrees")
    return bytes(out)


def decode_rel_dir(buf: bytes) -> set[tuple[int, int]]:
    _count(buf, _REL_ENTRY.size, "relation directory")
    return {(r, f) for r, f in _REL_ENTRY.iter_unpack(buf[4:])}


def encode_u32_set(items: Iterable[int]) -> bytes:
    vals = sorted(items)
    return _U32.pack(len(vals)) + struct.pack(f"<{len(vals)}I", *vals)


def decode_u32_set(buf: bytes, what: str = "directory") -> set[int]:
    n = _count(buf, 4, what)
    return set(struct.unpack_from(f"<{n}I", buf, 4))


def encode_nblocks(n: int) -> bytes:
    return _U32.pack(n)


def decode_nblocks(buf: bytes) -> int:
    if len(buf) != 4:
        raise _corrupt(f"a size value has {len(buf)} bytes")
    return int(_U32.unpack(buf)[0])


# --- reading at an LSN ------------------------------------------------------------------------


class Datadir:
    """Read PostgreSQL objects from a timeline at any LSN."""

    def __init__(self, timeline: Timeline) -> None:
        self.tl = timeline

    async def _get_opt(self, key: Key, lsn: Lsn) -> bytes | None:
        try:
            return await self.tl.get(key, lsn)
        except MissingKeyError:
            return None

    async def list_dbs(self, lsn: Lsn) -> dict[tuple[int, int], bool]:
        """``{(spc, db): has_relmap_file}``, the global tablespace ``(1664, 0)`` included."""
        raw = await self._get_opt(DBDIR_KEY, lsn)
        return {} if raw is None else decode_db_dir(raw)

    async def list_rels(self, spc: int, db: int, lsn: Lsn) -> set[RelTag]:
        raw = await self._get_opt(rel_dir_key(spc, db), lsn)
        if raw is None:
            return set()
        return {RelTag(spc, db, r, f) for r, f in decode_rel_dir(raw)}

    async def rel_exists(self, rel: RelTag, lsn: Lsn) -> bool:
        raw = await self._get_opt(rel_dir_key(rel.spc, rel.db), lsn)
        return raw is not None and (rel.rel, rel.fork) in decode_rel_dir(raw)

    async def get_rel_sizes(self, spc: int, db: int, rels: Sequence[tuple[int, int]], lsn: Lsn) -> list[int]:
        """``get_rel_size`` of each (relnode, forknum) of one database, in one read of the
        relation directory and every size key."""
        dkey = rel_dir_key(spc, db)
        skeys = [rel_size_key(spc, db, r, f) for r, f in rels]
        got = await self.tl.get_vectored_results([dkey, *skeys], lsn)
        rdir = got[dkey]
        if not isinstance(rdir, bytes) and not isinstance(rdir, MissingKeyError):
            raise rdir
        present = decode_rel_dir(rdir) if isinstance(rdir, bytes) else set()
        out: list[int] = []
        for (r, f), skey in zip(rels, skeys, strict=True):
            if (r, f) not in present:
                if f in (FSM_FORKNUM, VISIBILITYMAP_FORKNUM):
                    out.append(0)
                    continue
                raise RelNotFoundError(f"relation {RelTag(spc, db, r, f)} does not exist at {format_lsn(lsn)}")
            size = got[skey]
            if not isinstance(size, bytes):
                raise size
            out.append(decode_nblocks(size))
        return out

    async def get_rel_size(self, rel: RelTag, lsn: Lsn) -> int:
        """Blocks in the fork; 0 for a missing FSM/VM fork; ``RelNotFoundError`` otherwise."""
        dkey = rel_dir_key(rel.spc, rel.db)
        skey = rel_size_key(rel.spc, rel.db, rel.rel, rel.fork)
        got = await self.tl.get_vectored_results([dkey, skey], lsn)
        rdir, size = got[dkey], got[skey]
        exists = isinstance(rdir, bytes) and (rel.rel, rel.fork) in decode_rel_dir(rdir)
        if not isinstance(rdir, bytes) and not isinstance(rdir, MissingKeyError):
            raise rdir
        if not exists:
            if rel.fork in (FSM_FORKNUM, VISIBILITYMAP_FORKNUM):
                return 0
            raise RelNotFoundError(f"relation {rel} does not exist at {format_lsn(lsn)}")
        if not isinstance(size, bytes):
            raise size
        return decode_nblocks(size)

    async def get_page(self, rel: RelTag, blkno: int, lsn: Lsn) -> bytes:
        return (await self.get_pages(rel, [blkno], lsn))[0]

    async def get_pages(self, rel: RelTag, blknos: Sequence[int], lsn: Lsn) -> list[bytes]:
        """Pages of one fork through one vectored read; blocks past the end are zeros."""
        if rel.rel == 0:
            raise RelNotFoundError("relnode 0 is not a relation")
        # One walk for the directory, the size and the pages; results for blocks past the
        # end are dropped (they read as zeros).
        dkey = rel_dir_key(rel.spc, rel.db)
        skey = rel_size_key(rel.spc, rel.db, rel.rel, rel.fork)
        bkeys = [rel_block_key(rel.spc, rel.db, rel.rel, rel.fork, b) for b in blknos]
        got = await self.tl.get_vectored_results([dkey, skey, *bkeys], lsn)
        rdir, size = got[dkey], got[skey]
        if not isinstance(rdir, bytes) and not isinstance(rdir, MissingKeyError):
            raise rdir
        if not isinstance(rdir, bytes) or (rel.rel, rel.fork) not in decode_rel_dir(rdir):
            if rel.fork in (FSM_FORKNUM, VISIBILITYMAP_FORKNUM):
                return [ZERO_PAGE] * len(blknos)
            raise RelNotFoundError(f"relation {rel} does not exist at {format_lsn(lsn)}")
        if not isinstance(size, bytes):
            raise size
        nblocks = decode_nblocks(size)
        out: list[bytes] = []
        for b, key in zip(blknos, bkeys, strict=True):
            if b >= nblocks:
                out.append(ZERO_PAGE)
                continue
            page = got[key]
            if not isinstance(page, bytes):
                raise page
            out.append(page)
        return out

    async def get_db_size(self, spc: int, db: int, lsn: Lsn) -> int:
        """Bytes of all relation forks of the database (PostgreSQL's pg_database_size)."""
        rels = await self.list_rels(spc, db, lsn)
        keys = [rel_size_key(r.spc, r.db, r.rel, r.fork) for r in rels]
        got = await self.tl.get_vectored(keys, lsn) if keys else {}
        return sum(decode_nblocks(v) for v in got.values()) * BLCKSZ

    async def list_slru_segments(self, kind: int, lsn: Lsn) -> set[int]:
        raw = await self._get_opt(slru_dir_key(kind), lsn)
        return set() if raw is None else decode_u32_set(raw, "SLRU directory")

    async def get_slru_segment_size(self, kind: int, segno: int, lsn: Lsn) -> int:
        return decode_nblocks(await self.tl.get(slru_segment_size_key(kind, segno), lsn))

    async def get_slru_segment(self, kind: int, segno: int, lsn: Lsn) -> bytes:
        """The whole segment file: its blocks concatenated."""
        n = await self.get_slru_segment_size(kind, segno, lsn)
        keys = [slru_block_key(kind, segno, b) for b in range(n)]
        got = await self.tl.get_vectored(keys, lsn) if keys else {}
        return b"".join(got[k] for k in keys)

    async def get_slru_page(self, kind: int, segno: int, blkno: int, lsn: Lsn) -> bytes:
        return await self.tl.get(slru_block_key(kind, segno, blkno), lsn)

    async def get_relmap_file(self, spc: int, db: int, lsn: Lsn) -> bytes:
        return await self.tl.get(relmap_file_key(spc, db), lsn)

    async def get_control_file(self, lsn: Lsn) -> bytes:
        """The pg_control bytes as imported (its checkpoint is the import's, not ``lsn``'s)."""
        return await self.tl.get(CONTROLFILE_KEY, lsn)

    async def get_control_data(self, lsn: Lsn) -> ControlFileData:
        return parse_control_file(await self.get_control_file(lsn))

    async def get_checkpoint_bytes(self, lsn: Lsn) -> bytes:
        return await self.tl.get(CHECKPOINT_KEY, lsn)

    async def get_checkpoint(self, lsn: Lsn) -> CheckPoint:
        return CheckPoint.decode(await self.get_checkpoint_bytes(lsn))

    async def list_twophase_files(self, lsn: Lsn) -> set[int]:
        raw = await self._get_opt(TWOPHASEDIR_KEY, lsn)
        return set() if raw is None else decode_u32_set(raw, "two-phase directory")

    async def get_twophase_file(self, xid: int, lsn: Lsn) -> bytes:
        return await self.tl.get(twophase_file_key(xid), lsn)


# --- writing ----------------------------------------------------------------------------------


class DatadirWriter:
    """The single writer of a timeline's datadir keys, with the latest state cached."""

    def __init__(self, timeline: Timeline) -> None:
        self.tl = timeline
        self.reader = Datadir(timeline)
        self.rel_sizes: dict[RelKey, int] = {}
        self.rel_dirs: dict[tuple[int, int], set[tuple[int, int]]] = {}
        # the stored encoding of a cached directory that a modification committed (patched,
        # not re-encoded, by the next one: patch_rel_dir)
        self.rel_dir_codes: dict[tuple[int, int], bytes] = {}
        self.db_dir: dict[tuple[int, int], bool] | None = None
        self.slru_dirs: dict[int, set[int]] = {}
        self.slru_sizes: dict[tuple[int, int], int] = {}
        self.twophase: set[int] | None = None
        self.checkpoint: CheckPoint | None = None

    @property
    def lsn(self) -> Lsn:
        return self.tl.last_record_lsn

    def begin(self, lsn: Lsn) -> DatadirModification:
        if lsn <= self.tl.last_record_lsn:
            raise ValueError(
                f"modification at {format_lsn(lsn)} not above last_record_lsn "
                f"{format_lsn(self.tl.last_record_lsn)}"
            )
        return DatadirModification(self, lsn)

    def invalidate(self) -> None:
        """Forget every cached value (after a failed record or a reload)."""
        self.rel_sizes.clear()
        self.rel_dirs.clear()
        self.rel_dir_codes.clear()
        self.db_dir = None
        self.slru_dirs.clear()
        self.slru_sizes.clear()
        self.twophase = None
        self.checkpoint = None

    # loaders of the committed state (at last_record_lsn)

    async def load_rel_dir(self, spc: int, db: int) -> set[tuple[int, int]]:
        d = self.rel_dirs.get((spc, db))
        if d is None:
            raw = await self.reader._get_opt(rel_dir_key(spc, db), self.lsn)
            d = self.rel_dirs[(spc, db)] = set() if raw is None else decode_rel_dir(raw)
        return d

    async def load_rel_size(self, rel: RelKey) -> int | None:
        n = self.rel_sizes.get(rel)
        if n is not None:
            return n
        spc, db, relnode, fork = rel
        if (relnode, fork) not in await self.load_rel_dir(spc, db):
            return None
        n = decode_nblocks(await self.tl.get(rel_size_key(*rel), self.lsn))
        self.rel_sizes[rel] = n
        return n

    async def load_db_dir(self) -> dict[tuple[int, int], bool]:
        if self.db_dir is None:
            self.db_dir = await self.reader.list_dbs(self.lsn)
        return self.db_dir

    async def load_slru_dir(self, kind: int) -> set[int]:
        d = self.slru_dirs.get(kind)
        if d is None:
            d = self.slru_dirs[kind] = await self.reader.list_slru_segments(kind, self.lsn)
        return d

    async def load_slru_size(self, kind: int, segno: int) -> int | None:
        n = self.slru_sizes.get((kind, segno))
        if n is not None:
            return n
        if segno not in await self.load_slru_dir(kind):
            return None
        n = await self.reader.get_slru_segment_size(kind, segno, self.lsn)
        self.slru_sizes[(kind, segno)] = n
        return n

    async def load_twophase(self) -> set[int]:
        if self.twophase is None:
            self.twophase = await self.reader.list_twophase_files(self.lsn)
        return self.twophase

    async def load_checkpoint(self) -> CheckPoint:
        if self.checkpoint is None:
            self.checkpoint = await self.reader.get_checkpoint(self.lsn)
        return self.checkpoint


class DatadirModification:
    """All changes at one LSN; ``commit()`` makes them visible (``finish_write``)."""

    def __init__(self, writer: DatadirWriter, lsn: Lsn) -> None:
        self.w = writer
        self.tl = writer.tl
        self.lsn = lsn
        self.sizes: dict[RelKey, int] = {}
        self.rel_dirs: dict[tuple[int, int], set[tuple[int, int]]] = {}
        self.db_dir: dict[tuple[int, int], bool] | None = None
        self.slru_dirs: dict[int, set[int]] = {}
        self.slru_sizes: dict[tuple[int, int], int] = {}
        self.twophase: set[int] | None = None
        self.checkpoint: CheckPoint | None = None
        self.values = 0

    async def put(self, key: Key, value: Value) -> None:
        self.values += 1
        await self.tl.put(key, self.lsn, value)

    # -- relations --

    async def get_rel_size(self, rel: RelKey) -> int | None:
        """Current size (this modification's changes included); ``None`` if it doesn't exist."""
        n = self.sizes.get(rel)
        if n is not None:
            return n
        spc, db, relnode, fork = rel
        d = self.rel_dirs.get((spc, db))
        if d is not None:
            if (relnode, fork) not in d:
                return None
            n = self.w.rel_sizes.get(rel)
            if n is None:
                n = await self.w.load_rel_size(rel)
            if n is None:  # created by this modification
                return 0
            return n
        n = self.w.rel_sizes.get(rel)
        if n is not None:
            return n
        return await self.w.load_rel_size(rel)

    async def _rel_dir_for_update(self, spc: int, db: int) -> set[tuple[int, int]]:
        d = self.rel_dirs.get((spc, db))
        if d is None:
            d = self.rel_dirs[(spc, db)] = set(await self.w.load_rel_dir(spc, db))
        return d

    async def _db_dir_for_update(self) -> dict[tuple[int, int], bool]:
        if self.db_dir is None:
            self.db_dir = dict(await self.w.load_db_dir())
        return self.db_dir

    async def put_rel_creation(self, rel: RelKey, nblocks: int = 0) -> None:
        """Create the fork (idempotent like PostgreSQL's smgrcreate in redo: an existing fork
        keeps its size)."""
        spc, db, relnode, fork = rel
        if await self.get_rel_size(rel) is not None:
            if nblocks:
                await self.put_rel_extend(rel, nblocks)
            return
        dbdir = await self._db_dir_for_update()
        if (spc, db) not in dbdir:
            dbdir[(spc, db)] = False
        d = await self._rel_dir_for_update(spc, db)
        d.add((relnode, fork))
        self.sizes[rel] = nblocks

    async def put_rel_extend(self, rel: RelKey, nblocks: int) -> None:
        self.sizes[rel] = nblocks

    async def put_rel_truncation(self, rel: RelKey, nblocks: int) -> None:
        self.sizes[rel] = nblocks

    async def put_rel_drop(self, rel: RelKey) -> None:
        spc, db, relnode, fork = rel
        d = await self._rel_dir_for_update(spc, db)
        d.discard((relnode, fork))
        self.sizes.pop(rel, None)

    async def put_rel_page(self, rel: RelKey, blkno: int, value: Value) -> None:
        await self.put(rel_block_key(rel[0], rel[1], rel[2], rel[3], blkno), value)

    # -- databases and relmapper files --

    async def put_relmap_file(self, spc: int, db: int, data: bytes) -> None:
        dbdir = await self._db_dir_for_update()
        dbdir[(spc, db)] = True
        await self._rel_dir_for_update(spc, db)  # make sure the rel dir exists
        await self.put(relmap_file_key(spc, db), Image(bytes(data)))

    async def put_dbdir_creation(self, spc: int, db: int) -> None:
        dbdir = await self._db_dir_for_update()
        if (spc, db) not in dbdir:
            dbdir[(spc, db)] = False
        await self._rel_dir_for_update(spc, db)

    async def list_dbdirs(self) -> set[tuple[int, int]]:
        """``(spc, db)`` of every database directory as of this modification."""
        return set(await self._db_dir_for_update())

    async def drop_dbdir(self, spc: int, db: int) -> list[RelKey]:
        """Remove the database and all its relations; returns the dropped forks."""
        dbdir = await self._db_dir_for_update()
        dbdir.pop((spc, db), None)
        d = await self._rel_dir_for_update(spc, db)
        dropped = [(spc, db, r, f) for r, f in sorted(d)]
        d.clear()
        for rel in dropped:
            self.sizes.pop(rel, None)
        return dropped

    # -- SLRUs --

    async def get_slru_segment_size(self, kind: int, segno: int) -> int | None:
        n = self.slru_sizes.get((kind, segno))
        if n is not None:
            return n
        d = self.slru_dirs.get(kind)
        if d is not None and segno not in d:
            return None
        return await self.w.load_slru_size(kind, segno)

    async def _slru_dir_for_update(self, kind: int) -> set[int]:
        d = self.slru_dirs.get(kind)
        if d is None:
            d = self.slru_dirs[kind] = set(await self.w.load_slru_dir(kind))
        return d

    async def put_slru_segment_creation(self, kind: int, segno: int, nblocks: int) -> None:
        d = await self._slru_dir_for_update(kind)
        d.add(segno)
        self.slru_sizes[(kind, segno)] = nblocks

    async def put_slru_extend(self, kind: int, segno: int, nblocks: int) -> None:
        self.slru_sizes[(kind, segno)] = nblocks

    async def drop_slru_segment(self, kind: int, segno: int) -> None:
        d = await self._slru_dir_for_update(kind)
        d.discard(segno)
        self.slru_sizes.pop((kind, segno), None)

    async def list_slru_segments(self, kind: int) -> set[int]:
        d = self.slru_dirs.get(kind)
        return set(d) if d is not None else set(await self.w.load_slru_dir(kind))

    async def put_slru_page(self, kind: int, segno: int, blkno: int, value: Value) -> None:
        await self.put(slru_block_key(kind, segno, blkno), value)

    # -- two-phase, control file, checkpoint --

    async def put_twophase_file(self, xid: int, data: bytes) -> None:
        if self.twophase is None:
            self.twophase = set(await self.w.load_twophase())
        self.twophase.add(xid)
        await self.put(twophase_file_key(xid), Image(bytes(data)))

    async def drop_twophase_file(self, xid: int) -> None:
        if self.twophase is None:
            self.twophase = set(await self.w.load_twophase())
        self.twophase.discard(xid)

    async def put_control_file(self, data: bytes) -> None:
        await self.put(CONTROLFILE_KEY, Image(bytes(data)))

    async def get_checkpoint(self) -> CheckPoint:
        if self.checkpoint is not None:
            return self.checkpoint
        return await self.w.load_checkpoint()

    def put_checkpoint(self, cp: CheckPoint) -> None:
        self.checkpoint = cp

    # -- commit --

    async def commit(self) -> None:
        """Put the collected metadata at ``lsn``, ``finish_write(lsn)``, update the caches."""
        lsn = self.lsn
        tl = self.tl
        put = tl.put
        for rel, n in self.sizes.items():
            await put(rel_size_key(*rel), lsn, Image(_U32.pack(n)))
        w = self.w
        codes: dict[tuple[int, int], bytes] = {}
        for (spc, db), d in self.rel_dirs.items():
            before = w.rel_dirs.get((spc, db))
            code = w.rel_dir_codes.get((spc, db)) if before is not None else None
            if code is None or before is None:
                code = encode_rel_dir(d)
            else:
                code = patch_rel_dir(code, d - before, before - d, d)
            codes[(spc, db)] = code
            await put(rel_dir_key(spc, db), lsn, Image(code))
        if self.db_dir is not None:
            await put(DBDIR_KEY, lsn, Image(encode_db_dir(self.db_dir)))
        for (kind, segno), n in self.slru_sizes.items():
            await put(slru_segment_size_key(kind, segno), lsn, Image(_U32.pack(n)))
        for kind, sd in self.slru_dirs.items():
            await put(slru_dir_key(kind), lsn, Image(encode_u32_set(sd)))
        if self.twophase is not None:
            await put(TWOPHASEDIR_KEY, lsn, Image(encode_u32_set(self.twophase)))
        if self.checkpoint is not None:
            await put(CHECKPOINT_KEY, lsn, Image(self.checkpoint.encode()))
        tl.finish_write(lsn)
        if self.sizes:
            w.rel_sizes.update(self.sizes)
        if self.rel_dirs:
            # Forgotten: the cached sizes of forks no longer in their directory. The cache
            # holds only forks of the cached directory (load_rel_size checks it, commits keep
            # it so), so those are the forks this modification removed from it, plus any it
            # sized and removed; a walk of the whole cache per change instead cost O(all forks)
            # per CREATE or DROP (the regression suite's WAL: tens of thousands of them).
            sizes = w.rel_sizes
            for key, d in self.rel_dirs.items():
                before = w.rel_dirs.get(key)
                spc, db = key
                if before is None:  # (not cached: walk the cache)
                    gone = [k for k in sizes if k[0] == spc and k[1] == db and (k[2], k[3]) not in d]
                else:
                    gone = [(spc, db, r, f) for r, f in before - d]
                    gone += [k for k in self.sizes if k[0] == spc and k[1] == db and (k[2], k[3]) not in d]
                for rel in gone:
                    sizes.pop(rel, None)
            w.rel_dirs.update(self.rel_dirs)
            w.rel_dir_codes.update(codes)
        if self.db_dir is not None:
            w.db_dir = self.db_dir
        if self.slru_dirs:
            w.slru_dirs.update(self.slru_dirs)
            for kind, sd in self.slru_dirs.items():
                for k in [k for k in w.slru_sizes if k[0] == kind and k[1] not in sd]:
                    del w.slru_sizes[k]
        if self.slru_sizes:
            w.slru_sizes.update(self.slru_sizes)
        if self.twophase is not None:
            w.twophase = self.twophase
        if self.checkpoint is not None:
            w.checkpoint = self.checkpoint


__all__ = [
    "BLCKSZ",
    "DEFAULTTABLESPACE_OID",
    "GLOBALTABLESPACE_OID",
    "SLRU_PAGES_PER_SEGMENT",
    "ZERO_PAGE",
    "Datadir",
    "DatadirModification",
    "DatadirWriter",
    "PageReconstructError",
    "RelNotFoundError",
    "RelTag",
]
