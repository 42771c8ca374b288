"""Basebackup: a tar of a PostgreSQL 15 data directory at an LSN, which vanilla PostgreSQL
boots from with no other WAL.

What goes in (``write_basebackup``), in this order:

- directories PostgreSQL needs (``pg_notify``, ``pg_tblspc``, ``pg_logical/*``, ...), config
  stubs (empty ``postgresql.conf``, a ``pg_hba.conf`` trusting 127.0.0.1 and ::1, an empty
  ``pg_ident.conf``) and ``PG_VERSION``;
- per database of the database directory: ``PG_VERSION``, ``pg_filenode.map`` (the relmapper
  file) and every relation fork materialized page by page at the LSN through
  ``get_vectored``, split into 1 GiB segment files (``16384``, ``16384.1``, ``16384_fsm``...);
  the shared catalogs (spcnode 1664) go to ``global/``; a tablespace's (``CREATE
  TABLESPACE``) to ``pg_tblspc/<spc>/PG_15_202209061/<db>/``, the tablespace in place (a
  directory, as ``allow_in_place_tablespaces`` makes: the original location is on the
  primary's machine, and two computes must not share files);
- the SLRU segments (``pg_xact``, ``pg_multixact/offsets``, ``pg_multixact/members``) and the
  two-phase state files;
- ``global/pg_control``: the stored control file with the checkpoint key's ``CheckPoint``
  (nextXid, nextOid, multixacts, oldestXid...) as its ``checkPointCopy``, ``redo`` and
  ``checkPoint`` pointing at the new checkpoint record, state DB_SHUTDOWNED, no
  minRecoveryPoint or backup markers;
- ``pg_wal/<segment>``: a 16 MiB segment with a long page header at its start, the page header
  of the page holding the checkpoint, and one XLOG CHECKPOINT_SHUTDOWN record (what
  ``pg_resetwal`` leaves behind). The rest is zeros, the end of WAL.

The LSN rule. The backup is taken at X, the end of a record (``last_record_lsn`` or an
earlier record boundary); pages are those of Get@X. The checkpoint record starts at X when X
is inside a page, or right after the page header when X is a page boundary (X + 24, or X + 40
at a segment start). PostgreSQL finds a clean shutdown checkpoint, skips recovery, and writes
its next record at the checkpoint record's end (X + 120 for a record inside one page). Its WAL
therefore continues the timeline's WAL at X, and a walproposer must stream the compute's WAL
from X: the safekeepers and the pageserver then receive the checkpoint record itself first
(the pageserver's ingest is at X). ``xl_prev`` of the record is the start of the record
ending at X when the caller knows it (``prev_lsn``: fullbackup's argument, or what the tenant
manager saw its WAL receiver ingest last), else 0 as ``pg_resetwal`` writes; PostgreSQL
accepts either (it only requires xl_prev < the record's position when it starts reading at a
checkpoint).

``--replica`` adds an empty ``standby.signal``, so the server starts as a read-only hot
standby (no primary_conninfo: it stays at X). That is how a past LSN is looked at: the data as
of X, and no WAL written that would fork the timeline's history.

``--lazy`` leaves the relation data out: the tar of a lazy endpoint, whose ``base/`` and
``global/`` are a page filesystem reading pages from the page service (``compute/pagefs``). It
keeps the directory skeleton (``base/<db>/``), ``PG_VERSION``, the relmapper files, the SLRUs,
pg_control and the WAL segment, and of the relations only the init forks of unlogged relations
(WAL-logged, tiny), each also written as the relation's main fork: unlogged relations live only on
the compute, and a fresh compute starts them empty from their init fork as PostgreSQL does after
a crash. Its size does not grow with the data (``relation_listing`` gives the rest: the relation
files and their sizes at the LSN, through the HTTP API).

``fullbackup`` produces the same tar (uncompressed); it exists for neon compatibility.

The data comes from a ``BackupSource``: the timeline seen as a data directory (relation and
database directories, sizes, SLRUs, relmap and control files). ``TimelineBackupSource`` adapts
the real timeline through ``pageserver.pgdatadir``.
"""

from __future__ import annotations

import contextlib
import tarfile
import time
import zlib
from collections.abc import Awaitable, Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Final, Protocol

import attrs
import structlog

from common.pgserver import PgConnection
from pageserver.pg_control import (
    CheckPoint,
    DBState,
    encode_control_file,
    parse_control_file,
)
from pageserver.pgdatadir import (
    BLCKSZ,
    DEFAULTTABLESPACE_OID,
    GLOBALTABLESPACE_OID,
    TABLESPACE_VERSION_DIRECTORY,
    Datadir,
    RelTag,
)
from pageserver.storage.key import (
    CHECKPOINT_KEY,
    CONTROLFILE_KEY,
    DBDIR_KEY,
    SLRU_CLOG,
    SLRU_COMMIT_TS,
    SLRU_MULTIXACT_MEMBERS,
    SLRU_MULTIXACT_OFFSETS,
    TWOPHASEDIR_KEY,
    Key,
    KeyRange,
    KeySpace,
    is_rel_block_key,
    key_add,
    rel_block_key,
    rel_dir_key,
    rel_size_key,
    relmap_file_key,
    slru_block_key,
    slru_dir_key,
    slru_segment_size_key,
)
from pageserver.storage.reconstruct import MissingKeyError
from pageserver.timeline import Timeline
from protocol.errors import LocalProtocolError, RemoteProtocolError
from protocol.ids import TenantId, TimelineId
from protocol.lsn import (
    WAL_SEGMENT_SIZE,
    XLOG_BLCKSZ,
    Lsn,
    format_lsn,
    parse_lsn,
    segment_file_name,
)
from protocol.pagestream import RelTag as PagestreamRelTag
from protocol.pgwire import sqlstate
from protocol.pgwire.errors import PgError
from protocol.wal.encoder import WalEncoder
from protocol.wal.page import (
    SIZE_OF_LONG_PHD,
    SIZE_OF_SHORT_PHD,
    XLP_BKP_REMOVABLE,
    XLP_FIRST_IS_CONTRECORD,
    encode_page_header,
)
from protocol.wal.rmgr import XLOG_CHECKPOINT_SHUTDOWN, RmgrId

log = structlog.get_logger("pageserver.basebackup")

RELSEG_SIZE: Final = 131072  # blocks per 1 GiB relation segment file
MAIN_FORKNUM: Final = 0
INIT_FORKNUM: Final = 3
PG_MAJORVERSION: Final = "15"
PG_TLI: Final = 1
FORK_SUFFIX: Final = {0: "", 1: "_fsm", 2: "_vm", 3: "_init"}
FORK_NAMES: Final = {0: "main", 1: "fsm", 2: "vm", 3: "init"}
SLRU_DIRS: Final = {
    SLRU_CLOG: "pg_xact",
    SLRU_COMMIT_TS: "pg_commit_ts",
    SLRU_MULTIXACT_OFFSETS: "pg_multixact/offsets",
    SLRU_MULTIXACT_MEMBERS: "pg_multixact/members",
}
EMPTY_DIRS: Final = (
    "global",
    "base",
    "pg_commit_ts",
    "pg_dynshmem",
    "pg_logical",
    "pg_logical/mappings",
    "pg_logical/snapshots",
    "pg_multixact",
    "pg_multixact/members",
    "pg_multixact/offsets",
    "pg_notify",
    "pg_replslot",
    "pg_serial",
    "pg_snapshots",
    "pg_stat",
    "pg_stat_tmp",
    "pg_subtrans",
    "pg_tblspc",
    "pg_twophase",
    "pg_xact",
    "pg_wal",
    "pg_wal/archive_status",
)
PG_HBA_CONF: Final = b"""\
# written by pagestore basebackup: trust local connections only
local   all             all                                     trust
host    all             all             127.0.0.1/32            trust
host    all             all             ::1/128                 trust
local   replication     all                                     trust
host    replication     all             127.0.0.1/32            trust
host    replication     all             ::1/128                 trust
"""
# Pages fetched per get_vectored call while materializing a relation.
PAGES_PER_READ: Final = 256
# CopyData payloads are at most this size.
CHUNK_BYTES: Final = 256 * 1024
CHECKPOINT_RECORD_LEN: Final = 24 + 2 + 88  # header, short main-data header, CheckPoint


class BasebackupError(Exception):
    """The timeline cannot produce a data directory at this LSN (missing or bad metadata)."""


@attrs.frozen
class RelFork:
    spcnode: int
    dbnode: int
    relnode: int
    forknum: int


class BackupSource(Protocol):
    """The timeline as a PostgreSQL data directory at one LSN (``pageserver.pgdatadir``)."""

    async def list_dbdirs(self, lsn: Lsn) -> Sequence[tuple[int, int]]:
        """(spcnode, dbnode) of every database directory, including (1664, 0) for global."""
        ...

    async def list_rels(self, spcnode: int, dbnode: int, lsn: Lsn) -> Iterable[tuple[int, int]]:
        """(relnode, forknum) of every relation fork in one database directory."""
        ...

    async def get_rel_size(self, rel: RelFork, lsn: Lsn) -> int: ...

    async def get_rel_sizes(self, spcnode: int, dbnode: int, rels: Sequence[tuple[int, int]],
                            lsn: Lsn) -> list[int]:
        """``get_rel_size`` of many (relnode, forknum) of one database at once (the listing)."""
        ...

    async def get_relmap_file(self, spcnode: int, dbnode: int, lsn: Lsn) -> bytes | None:
        """The 512-byte pg_filenode.map, or None when the directory has none."""
        ...

    async def list_slru_segments(self, kind: int, lsn: Lsn) -> Iterable[int]: ...

    async def get_slru_segment_blocks(self, kind: int, segno: int, lsn: Lsn) -> int: ...

    async def get_slru_segment(self, kind: int, segno: int, lsn: Lsn) -> bytes: ...

    async def list_twophase_files(self, lsn: Lsn) -> Iterable[int]: ...

    async def get_twophase_file(self, xid: int, lsn: Lsn) -> bytes: ...

    async def get_control_file(self, lsn: Lsn) -> bytes: ...

    async def get_checkpoint(self, lsn: Lsn) -> bytes: ...

    async def get_pages(self, keys: Sequence[Key], lsn: Lsn) -> dict[Key, bytes]:
        """One vectored read (``Timeline.get_vectored``)."""
        ...


def rel_file_path(rel: RelFork | PagestreamRelTag, segno: int = 0) -> str:
    """Path of a relation segment file inside the data directory."""
    if rel.spcnode == GLOBALTABLESPACE_OID:
        base = f"global/{rel.relnode}"
    elif rel.spcnode == DEFAULTTABLESPACE_OID:
        base = f"base/{rel.dbnode}/{rel.relnode}"
    else:
        base = f"pg_tblspc/{rel.spcnode}/{TABLESPACE_VERSION_DIRECTORY}/{rel.dbnode}/{rel.relnode}"
    suffix = FORK_SUFFIX.get(rel.forknum)
    if suffix is None:
        raise BasebackupError(f"relation {rel.relnode} has unknown fork {rel.forknum}")
    return f"{base}{suffix}" + (f".{segno}" if segno else "")


def read_datadir_block(datadir: Path, rel: RelFork | PagestreamRelTag, blkno: int) -> bytes:
    """Block ``blkno`` of ``rel`` as a PostgreSQL data directory on disk holds it (the
    verification tools compare it with what the pageserver serves)."""
    segno, off = divmod(blkno, RELSEG_SIZE)
    path = datadir / rel_file_path(rel, segno)
    with open(path, "rb") as f:
        f.seek(off * BLCKSZ)
        data = f.read(BLCKSZ)
    if len(data) != BLCKSZ:
        raise EOFError(f"{path}: block {blkno} is short ({len(data)} bytes)")
    return data


def checkpoint_record_lsn(lsn: int, segment_size: int = WAL_SEGMENT_SIZE) -> Lsn:
    """Where the shutdown checkpoint record of a backup at ``lsn`` starts (module docstring)."""
    if lsn % 8:
        raise BasebackupError(f"{format_lsn(lsn)} is not a record boundary (not 8-byte aligned)")
    if lsn % XLOG_BLCKSZ:
        return Lsn(lsn)
    return Lsn(lsn + (SIZE_OF_LONG_PHD if lsn % segment_size == 0 else SIZE_OF_SHORT_PHD))


def wal_segment_with_checkpoint(
    lsn: Lsn, checkpoint: CheckPoint, *, system_identifier: int, prev_lsn: int = 0,
    segment_size: int = WAL_SEGMENT_SIZE,
) -> tuple[str, bytes, Lsn, Lsn]:
    """(file name, segment bytes, record start, record end) of the pg_wal segment that holds
    ``checkpoint`` as a CHECKPOINT_SHUTDOWN record for a backup at ``lsn``. The checkpoint's
    ``redo`` must already be the record start (``checkpoint_record_lsn``)."""
    rec_lsn = checkpoint_record_lsn(lsn, segment_size)
    if checkpoint.redo != rec_lsn:
        raise LocalProtocolError(
            f"checkpoint redo {format_lsn(checkpoint.redo)} is not its record's start {format_lsn(rec_lsn)}"
        )
    if prev_lsn >= rec_lsn:
        raise LocalProtocolError(f"xl_prev {format_lsn(prev_lsn)} is not before {format_lsn(rec_lsn)}")
    segno = lsn // segment_size
    seg_start = segno * segment_size
    seg = bytearray(segment_size)
    page = lsn - lsn % XLOG_BLCKSZ
    hdr_size = SIZE_OF_LONG_PHD if page == seg_start else SIZE_OF_SHORT_PHD
    # Bytes between the page header and the record belong to WAL this segment does not have.
    # Flag them as the tail of a continued record so that a reader scanning the page from its
    # start (pg_waldump, XLogFindNextRecord) skips them and finds the checkpoint, as neon does.
    prefix = lsn - page - hdr_size if lsn != page else 0
    info = XLP_BKP_REMOVABLE | (XLP_FIRST_IS_CONTRECORD if prefix > 0 else 0)
    # The reader validates the segment's first page header before any other page of it.
    first = encode_page_header(
        seg_start, info=XLP_BKP_REMOVABLE if page != seg_start else info,
        rem_len=prefix if page == seg_start else 0,
        tli=PG_TLI, sysid=system_identifier, segment_size=segment_size,
    )
    seg[: len(first)] = first
    if page != seg_start and lsn != page:
        hdr = encode_page_header(page, info=info, rem_len=prefix, tli=PG_TLI, sysid=system_identifier,
                                 segment_size=segment_size)
        seg[page - seg_start : page - seg_start + len(hdr)] = hdr
    enc = WalEncoder(lsn, prev_lsn=prev_lsn, timeline=PG_TLI, system_identifier=system_identifier,
                     segment_size=segment_size)
    start, end = enc.append(RmgrId.XLOG, XLOG_CHECKPOINT_SHUTDOWN, main_data=checkpoint.encode())
    if start != rec_lsn:
        raise LocalProtocolError(f"checkpoint record landed at {format_lsn(start)}, expected {format_lsn(rec_lsn)}")
    body = enc.take()
    if lsn + len(body) > seg_start + segment_size:
        raise BasebackupError(f"the checkpoint record at {format_lsn(start)} would cross a segment boundary")
    seg[lsn - seg_start : lsn - seg_start + len(body)] = body
    return segment_file_name(segno, PG_TLI, segment_size), bytes(seg), start, end


class TarWriter:
    """Builds a tar (GNU format) incrementally and hands out chunks, optionally gzipped."""

    def __init__(self, send: Callable[[bytes], Awaitable[None]], *, gzip: bool = False,
                 mtime: int | None = None) -> None:
        self._send = send
        self._buf = bytearray()
        self._gzip = zlib.compressobj(1, zlib.DEFLATED, 31) if gzip else None
        self.mtime = int(time.time()) if mtime is None else mtime
        self.bytes_raw = 0
        self.files = 0

    async def _emit(self, data: bytes | bytearray | memoryview) -> None:
        self.bytes_raw += len(data)
        if self._gzip is not None:
            data = self._gzip.compress(data)
        self._buf += data
        if len(self._buf) >= CHUNK_BYTES:
            # Whole chunks only: a 16 MiB WAL segment must not become one huge CopyData.
            cut = len(self._buf) - len(self._buf) % CHUNK_BYTES
            view = memoryview(self._buf)
            try:
                chunks = [bytes(view[i : i + CHUNK_BYTES]) for i in range(0, cut, CHUNK_BYTES)]
            finally:
                view.release()
            del self._buf[:cut]
            for chunk in chunks:
                await self._send(chunk)

    def _header(self, name: str, size: int, kind: bytes, mode: int) -> bytes:
        info = tarfile.TarInfo(name)
        info.size = size
        info.type = kind
        info.mode = mode
        info.mtime = self.mtime
        info.uname = info.gname = "postgres"
        return info.tobuf(format=tarfile.GNU_FORMAT)

    async def add_dir(self, name: str) -> None:
        await self._emit(self._header(name, 0, tarfile.DIRTYPE, 0o700))

    async def add_file(self, name: str, data: bytes) -> None:
        await self.begin_file(name, len(data))
        await self.file_data(data)
        await self.end_file(len(data))

    async def add_sparse_file(self, name: str, data: bytes | bytearray, *, granule: int = 8192) -> None:
        """``data`` as a GNU sparse member (old GNU format, type ``S``): only its ``granule``-
        aligned runs that are not all zeros are stored; an extractor (GNU tar, Python's
        tarfile) writes those and makes the file ``len(data)`` bytes long, the rest a hole."""
        runs: list[tuple[int, int]] = []
        zero = bytes(granule)
        view = memoryview(data)
        for off in range(0, len(data), granule):
            # slicing bytes and == is a memcmp; comparing a memoryview is element by element
            if data[off : off + granule] != zero[: min(granule, len(data) - off)]:
                if runs and runs[-1][0] + runs[-1][1] == off:
                    runs[-1] = (runs[-1][0], runs[-1][1] + min(granule, len(data) - off))
                else:
                    runs.append((off, min(granule, len(data) - off)))
        if not runs or runs[-1][0] + runs[-1][1] != len(data):
            runs.append((len(data), 0))  # GNU tar's convention: a last empty run at the end
        stored = sum(n for _, n in runs)
        self.files += 1
        header = bytearray(self._header(name, stored, tarfile.REGTYPE, 0o600))
        blk = len(header) - tarfile.BLOCKSIZE  # a long name comes first as its own blocks
        header[blk + 156 : blk + 157] = tarfile.GNUTYPE_SPARSE
        extra: list[bytes] = []
        for i, (off, n) in enumerate(runs):
            entry = _octal12(off) + _octal12(n)
            if i < 4:  # four runs in the header itself, 21 per extension block after it
                header[blk + 386 + 24 * i : blk + 410 + 24 * i] = entry
            else:
                j = (i - 4) % 21
                if j == 0:
                    extra.append(b"")
                extra[-1] += entry
        header[blk + 482] = 1 if extra else 0
        header[blk + 483 : blk + 495] = _octal12(len(data))
        header[blk + 148 : blk + 156] = b" " * 8
        header[blk + 148 : blk + 156] = b"%06o\0 " % sum(header[blk : blk + tarfile.BLOCKSIZE])
        await self._emit(header)
        for k, part in enumerate(extra):
            block = bytearray(part.ljust(504, b"\0") + bytes(8))
            block[504] = 1 if k < len(extra) - 1 else 0
            await self._emit(block)
        for off, n in runs:
            await self._emit(view[off : off + n])
        await self.end_file(stored)

    async def begin_file(self, name: str, size: int) -> None:
        self.files += 1
        await self._emit(self._header(name, size, tarfile.REGTYPE, 0o600))

    async def file_data(self, data: bytes | bytearray | memoryview) -> None:
        await self._emit(data)

    async def end_file(self, size: int) -> None:
        pad = -size % tarfile.BLOCKSIZE
        if pad:
            await self._emit(bytes(pad))

    async def close(self) -> None:
        await self._emit(bytes(2 * tarfile.BLOCKSIZE))
        if self._gzip is not None:
            self._buf += self._gzip.flush()
        out, self._buf = bytes(self._buf), bytearray()
        for i in range(0, len(out), CHUNK_BYTES):
            await self._send(out[i : i + CHUNK_BYTES])


def _octal12(n: int) -> bytes:
    """A 12-byte tar number field: 11 octal digits and a NUL."""
    return b"%011o\0" % n


@attrs.frozen
class BackupResult:
    lsn: Lsn
    checkpoint_lsn: Lsn  # where the CHECKPOINT_SHUTDOWN record starts
    wal_end_lsn: Lsn  # its end: where PostgreSQL writes its next record
    files: int
    raw_bytes: int


async def _write_relation(tar: TarWriter, source: BackupSource, rel: RelFork, lsn: Lsn,
                          *, as_fork: int | None = None) -> None:
    """The fork's segment files; ``as_fork`` names them as another fork of the relation (the
    lazy backup's main fork of an unlogged relation is its init fork)."""
    nblocks = await source.get_rel_size(rel, lsn)
    nsegs = max(1, -(-nblocks // RELSEG_SIZE))
    named = rel if as_fork is None else attrs.evolve(rel, forknum=as_fork)
    for segno in range(nsegs):
        first = segno * RELSEG_SIZE
        count = min(RELSEG_SIZE, nblocks - first)
        path = rel_file_path(named, segno)
        await tar.begin_file(path, count * BLCKSZ)
        for start in range(first, first + count, PAGES_PER_READ):
            keys = [
                rel_block_key(rel.spcnode, rel.dbnode, rel.relnode, rel.forknum, blk)
                for blk in range(start, min(start + PAGES_PER_READ, first + count))
            ]
            pages = await source.get_pages(keys, lsn)
            for key in keys:
                page = pages.get(key)
                if page is None or len(page) != BLCKSZ:
                    got = "nothing" if page is None else f"{len(page)} bytes"
                    raise BasebackupError(f"{path}: page {key.hex()} at {format_lsn(lsn)} read as {got}")
                await tar.file_data(page)
        await tar.end_file(count * BLCKSZ)


def checkpoint_for_backup(stored: bytes, rec_lsn: Lsn, now: int | None = None) -> CheckPoint:
    """The checkpoint key's CheckPoint turned into the shutdown checkpoint of the backup."""
    ckpt = CheckPoint.decode(stored)
    return attrs.evolve(
        ckpt,
        redo=rec_lsn,
        this_timeline_id=PG_TLI,
        prev_timeline_id=PG_TLI,
        time=int(time.time()) if now is None else now,
        # A shutdown checkpoint has no running transactions.
        oldest_active_xid=0,
    )


async def write_basebackup(
    source: BackupSource,
    lsn: Lsn,
    send: Callable[[bytes], Awaitable[None]],
    *,
    gzip: bool = False,
    prev_lsn: int = 0,
    replica: bool = False,
    lazy: bool = False,
    now: int | None = None,
) -> BackupResult:
    """Stream the data directory at ``lsn`` as a tar through ``send`` (see the module doc).
    ``replica`` adds ``standby.signal``: PostgreSQL then starts as a read-only hot standby.
    ``lazy`` leaves out relation data but the unlogged relations' init forks (module doc)."""
    control_raw = await source.get_control_file(lsn)
    control = parse_control_file(control_raw)
    if control.xlog_seg_size != WAL_SEGMENT_SIZE or control.xlog_blcksz != XLOG_BLCKSZ:
        raise BasebackupError(
            f"pg_control has WAL segment size {control.xlog_seg_size} / page {control.xlog_blcksz}; "
            f"only {WAL_SEGMENT_SIZE} / {XLOG_BLCKSZ} are supported"
        )
    rec_lsn = checkpoint_record_lsn(lsn)
    if now is None:
        now = int(time.time())  # pg_control's and the checkpoint's time; mtime of the files
    ckpt = checkpoint_for_backup(await source.get_checkpoint(lsn), rec_lsn, now)
    if control.track_commit_timestamp and ckpt.oldest_commit_ts_xid:
        # every xid below nextXid that committed has its entry in pg_commit_ts (the stored
        # checkpoint's newest is the last checkpoint's): one without an entry reads as NULL
        ckpt = attrs.evolve(ckpt, newest_commit_ts_xid=max(3, ((ckpt.next_xid & 0xFFFF_FFFF) - 1)))
    wal_name, wal_seg, _, wal_end = wal_segment_with_checkpoint(
        lsn, ckpt, system_identifier=control.system_identifier, prev_lsn=prev_lsn
    )
    new_control = attrs.evolve(
        control,
        state=DBState.SHUTDOWNED,
        time=now,
        checkpoint=rec_lsn,
        checkpoint_copy=ckpt,
        min_recovery_point=0,
        min_recovery_point_tli=0,
        backup_start_point=0,
        backup_end_point=0,
        backup_end_required=False,
    )

    tar = TarWriter(send, gzip=gzip, mtime=now)
    for d in EMPTY_DIRS:
        await tar.add_dir(d)
    await tar.add_file("PG_VERSION", f"{PG_MAJORVERSION}\n".encode())
    await tar.add_file("postgresql.conf", b"")
    await tar.add_file("postgresql.auto.conf", b"")
    await tar.add_file("pg_hba.conf", PG_HBA_CONF)
    await tar.add_file("pg_ident.conf", b"")
    if replica:
        await tar.add_file("standby.signal", b"")

    dbdirs = sorted(await source.list_dbdirs(lsn))
    if (GLOBALTABLESPACE_OID, 0) not in dbdirs:
        raise BasebackupError(f"no global directory at {format_lsn(lsn)}: the timeline holds no data directory")
    tablespaces: set[int] = set()
    for spcnode, dbnode in dbdirs:
        relmap_path: str | None = None
        if spcnode == GLOBALTABLESPACE_OID:
            relmap_path = "global/pg_filenode.map"
        elif spcnode == DEFAULTTABLESPACE_OID:
            await tar.add_dir(f"base/{dbnode}")
            await tar.add_file(f"base/{dbnode}/PG_VERSION", f"{PG_MAJORVERSION}\n".encode())
            relmap_path = f"base/{dbnode}/pg_filenode.map"
        else:
            # A tablespace is in place: a directory inside pg_tblspc, not a symlink. The
            # location it had on the primary's machine is not the compute's to write to.
            if spcnode not in tablespaces:
                tablespaces.add(spcnode)
                await tar.add_dir(f"pg_tblspc/{spcnode}")
                await tar.add_dir(f"pg_tblspc/{spcnode}/{TABLESPACE_VERSION_DIRECTORY}")
            if dbnode == 0:
                continue  # the tablespace itself (CREATE TABLESPACE), no database in it yet
            db_path = f"pg_tblspc/{spcnode}/{TABLESPACE_VERSION_DIRECTORY}/{dbnode}"
            await tar.add_dir(db_path)
            if await source.get_relmap_file(spcnode, dbnode, lsn) is not None:
                # the database's own tablespace (CREATE DATABASE ... TABLESPACE): its directory
                # is a database directory, PG_VERSION and relmapper file included
                await tar.add_file(f"{db_path}/PG_VERSION", f"{PG_MAJORVERSION}\n".encode())
                relmap_path = f"{db_path}/pg_filenode.map"
        relmap = await source.get_relmap_file(spcnode, dbnode, lsn) if relmap_path else None
        if relmap is not None and relmap_path is not None:
            await tar.add_file(relmap_path, relmap)
        for relnode, forknum in sorted(await source.list_rels(spcnode, dbnode, lsn)):
            if not lazy:
                await _write_relation(tar, source, RelFork(spcnode, dbnode, relnode, forknum), lsn)
            elif forknum == INIT_FORKNUM:
                init = RelFork(spcnode, dbnode, relnode, INIT_FORKNUM)
                await _write_relation(tar, source, init, lsn)
                await _write_relation(tar, source, init, lsn, as_fork=MAIN_FORKNUM)

    for kind, dirname in SLRU_DIRS.items():
        for segno in sorted(await source.list_slru_segments(kind, lsn)):
            await tar.add_file(f"{dirname}/{segno:04X}", await source.get_slru_segment(kind, segno, lsn))
    for xid in sorted(await source.list_twophase_files(lsn)):
        await tar.add_file(f"pg_twophase/{xid:08X}", await source.get_twophase_file(xid, lsn))

    await tar.add_file("global/pg_control", encode_control_file(new_control))
    if lazy:
        # A lazy endpoint's start waits for this tar: the segment's zeros (all but a page or
        # two of its 16 MiB) go as a hole.
        await tar.add_sparse_file(f"pg_wal/{wal_name}", wal_seg)
    else:
        await tar.add_file(f"pg_wal/{wal_name}", wal_seg)
    await tar.close()
    return BackupResult(lsn, rec_lsn, wal_end, tar.files, tar.bytes_raw)


async def collect_keyspace(source: BackupSource, lsn: Lsn) -> KeySpace:
    """Every key of the data directory at ``lsn`` (for the keyspace API and benchmarks)."""
    keys: list[Key] = [DBDIR_KEY, CONTROLFILE_KEY, CHECKPOINT_KEY, TWOPHASEDIR_KEY]
    ranges: list[KeyRange] = []
    for spcnode, dbnode in await source.list_dbdirs(lsn):
        keys.append(rel_dir_key(spcnode, dbnode))
        keys.append(relmap_file_key(spcnode, dbnode))
        for relnode, forknum in await source.list_rels(spcnode, dbnode, lsn):
            rel = RelFork(spcnode, dbnode, relnode, forknum)
            nblocks = await source.get_rel_size(rel, lsn)
            first = rel_block_key(spcnode, dbnode, relnode, forknum, 0)
            if nblocks:
                ranges.append(KeyRange(first, key_add(first, nblocks)))
            keys.append(rel_size_key(spcnode, dbnode, relnode, forknum))
    for kind in SLRU_DIRS:
        keys.append(slru_dir_key(kind))
        for segno in await source.list_slru_segments(kind, lsn):
            nblocks = await source.get_slru_segment_blocks(kind, segno, lsn)
            first = slru_block_key(kind, segno, 0)
            if nblocks:
                ranges.append(KeyRange(first, key_add(first, nblocks)))
            keys.append(slru_segment_size_key(kind, segno))
    ranges.extend(KeyRange.single(k) for k in keys)
    return KeySpace.from_ranges(ranges)


@attrs.frozen
class ListedRelation:
    """One relation of a database directory: block count per fork present, by fork name
    (``main``, ``fsm``, ``vm``, ``init``)."""

    relnode: int
    forks: dict[str, int]


@attrs.frozen
class ListedDatabase:
    spcnode: int
    dbnode: int
    has_relmap: bool
    relations: list[ListedRelation]


@attrs.frozen
class RelationListing:
    """Every relation file of the data directory at ``lsn`` and its size: what a lazy endpoint's
    page filesystem lists and reports (the basebackup ``--lazy`` holds no relation files)."""

    lsn: str
    databases: list[ListedDatabase]


async def relation_listing(source: BackupSource, lsn: Lsn) -> RelationListing:
    """The databases, relations and fork sizes at ``lsn`` (no page is read)."""
    dbs: list[ListedDatabase] = []
    for spcnode, dbnode in sorted(await source.list_dbdirs(lsn)):
        has_map = await source.get_relmap_file(spcnode, dbnode, lsn) is not None
        rels: dict[int, dict[str, int]] = {}
        forks = sorted(await source.list_rels(spcnode, dbnode, lsn))
        for relnode, forknum in forks:
            if forknum not in FORK_NAMES:
                raise BasebackupError(f"relation {relnode} has unknown fork {forknum}")
        # one read of every size key of the database: a lazy endpoint's start waits for this
        sizes = await source.get_rel_sizes(spcnode, dbnode, forks, lsn)
        for (relnode, forknum), nblocks in zip(forks, sizes, strict=True):
            rels.setdefault(relnode, {})[FORK_NAMES[forknum]] = nblocks
        dbs.append(ListedDatabase(spcnode, dbnode, has_map,
                                  [ListedRelation(r, f) for r, f in sorted(rels.items())]))
    return RelationListing(format_lsn(lsn), dbs)


def rel_block_ranges(keyspace: KeySpace) -> list[KeyRange]:
    """Only the relation-block ranges of a keyspace (what a getpage benchmark reads)."""
    return [r for r in keyspace.ranges if is_rel_block_key(r.start)]



class TimelineBackupSource:
    """``BackupSource`` over a real timeline, through ``pageserver.pgdatadir.Datadir``."""

    def __init__(self, timeline: Timeline) -> None:
        self.timeline = timeline
        self.datadir = Datadir(timeline)
        self._relmaps: dict[tuple[int, int], bool] = {}

    async def list_dbdirs(self, lsn: Lsn) -> Sequence[tuple[int, int]]:
        dbs = await self.datadir.list_dbs(lsn)
        self._relmaps = dbs
        return sorted(dbs)

    async def list_rels(self, spcnode: int, dbnode: int, lsn: Lsn) -> Iterable[tuple[int, int]]:
        return [(r.rel, r.fork) for r in await self.datadir.list_rels(spcnode, dbnode, lsn)]

    async def get_rel_size(self, rel: RelFork, lsn: Lsn) -> int:
        return await self.datadir.get_rel_size(RelTag(rel.spcnode, rel.dbnode, rel.relnode, rel.forknum), lsn)

    async def get_rel_sizes(self, spcnode: int, dbnode: int, rels: Sequence[tuple[int, int]],
                            lsn: Lsn) -> list[int]:
        return await self.datadir.get_rel_sizes(spcnode, dbnode, rels, lsn)

    async def get_relmap_file(self, spcnode: int, dbnode: int, lsn: Lsn) -> bytes | None:
        if not self._relmaps.get((spcnode, dbnode), False):
            return None
        return await self.datadir.get_relmap_file(spcnode, dbnode, lsn)

    async def list_slru_segments(self, kind: int, lsn: Lsn) -> Iterable[int]:
        return await self.datadir.list_slru_segments(kind, lsn)

    async def get_slru_segment_blocks(self, kind: int, segno: int, lsn: Lsn) -> int:
        return await self.datadir.get_slru_segment_size(kind, segno, lsn)

    async def get_slru_segment(self, kind: int, segno: int, lsn: Lsn) -> bytes:
        return await self.datadir.get_slru_segment(kind, segno, lsn)

    async def list_twophase_files(self, lsn: Lsn) -> Iterable[int]:
        return await self.datadir.list_twophase_files(lsn)

    async def get_twophase_file(self, xid: int, lsn: Lsn) -> bytes:
        return await self.datadir.get_twophase_file(xid, lsn)

    async def get_control_file(self, lsn: Lsn) -> bytes:
        return await self.datadir.get_control_file(lsn)

    async def get_checkpoint(self, lsn: Lsn) -> bytes:
        return await self.datadir.get_checkpoint_bytes(lsn)

    async def get_pages(self, keys: Sequence[Key], lsn: Lsn) -> dict[Key, bytes]:
        return await self.timeline.get_vectored(keys, lsn)


# -- the libpq commands ------------------------------------------------------------------------


@attrs.frozen
class BackupCommand:
    """``basebackup <tenant> <timeline> [<lsn>|latest] [--gzip] [--replica] [--lazy]`` or
    ``fullbackup <tenant> <timeline> [<lsn> [<prev_lsn>]]`` (protocols.md §1.5)."""

    full: bool
    tenant_id: TenantId
    timeline_id: TimelineId
    lsn: Lsn | None = None
    prev_lsn: Lsn | None = None
    gzip: bool = False
    replica: bool = False
    lazy: bool = False


def parse_backup_command(name: str, args: Sequence[str]) -> BackupCommand:
    """Parse the arguments; ``PgError`` (XX000, as neon) naming what is wrong."""
    if len(args) < 2:
        raise PgError(f"{name} needs at least 2 arguments: <tenant_id> <timeline_id>")
    try:
        tenant_id, timeline_id = TenantId.parse(args[0]), TimelineId.parse(args[1])
    except RemoteProtocolError as exc:
        raise PgError(f"{name}: {exc.msg}") from None

    def lsn_arg(text: str, what: str) -> Lsn:
        try:
            return parse_lsn(text)
        except RemoteProtocolError as exc:
            raise PgError(f"{name}: bad {what}: {exc.msg}") from None

    rest = list(args[2:])
    if name == "fullbackup":
        if len(rest) > 2:
            raise PgError("fullbackup takes at most 4 arguments: <tenant> <timeline> [<lsn> [<prev_lsn>]]")
        lsn = lsn_arg(rest[0], "lsn") if rest else None
        prev = lsn_arg(rest[1], "prev_lsn") if len(rest) > 1 else None
        return BackupCommand(True, tenant_id, timeline_id, lsn, prev)
    lsn = None
    if rest and not rest[0].startswith("--"):
        word = rest.pop(0)
        lsn = None if word.lower() == "latest" else lsn_arg(word, "lsn")
    flags: set[str] = set()
    for flag in rest:
        if flag not in ("--gzip", "--replica", "--lazy"):
            raise PgError(f"basebackup: unknown argument {flag!r}")
        if flag in flags:
            raise PgError(f"basebackup: duplicate flag {flag}")
        flags.add(flag)
    return BackupCommand(False, tenant_id, timeline_id, lsn, None, "--gzip" in flags, "--replica" in flags,
                         "--lazy" in flags)


def gc_refusal(tl: Timeline, lsn: Lsn) -> str | None:
    """Why a read of ``tl`` at ``lsn`` could need what GC removed (``None``: it cannot).

    A read at or below a branch point goes on to the ancestor at that LSN; the ancestor keeps
    everything at or above its own GC cutoff, and its children's branch points, nothing else.
    Call with no await between it and ``hold_lsn`` (GC moves cutoffs)."""
    if lsn < tl.latest_gc_cutoff_lsn:
        return f"{format_lsn(lsn)} is below the GC cutoff {format_lsn(tl.latest_gc_cutoff_lsn)}"
    t = tl
    while t.ancestor is not None and lsn <= t.ancestor_lsn:
        anc = t.ancestor
        if lsn != t.ancestor_lsn and lsn < anc.latest_gc_cutoff_lsn:
            return (
                f"{format_lsn(lsn)} is below the branch point {format_lsn(t.ancestor_lsn)} of timeline "
                f"{t.timeline_id.hex} and below the GC cutoff {format_lsn(anc.latest_gc_cutoff_lsn)} "
                f"of its ancestor {anc.timeline_id.hex}"
            )
        t = anc
    return None


@contextmanager
def hold_lsn(tl: Timeline, lsn: Lsn) -> Iterator[None]:
    """Keep GC of ``tl`` and of every ancestor a read at ``lsn`` reaches from moving its
    cutoff above ``lsn`` while the block runs (a basebackup reads for a long time)."""
    with contextlib.ExitStack() as stack:
        t: Timeline | None = tl
        while t is not None:
            stack.enter_context(t.reads_held_at(lsn))
            t = t.ancestor if t.ancestor is not None and lsn <= t.ancestor_lsn else None
        yield


TimelineGetter = Callable[[TenantId, TimelineId], Timeline]
PrevLsnLookup = Callable[[Timeline, Lsn], "Lsn | None"]


class BackupCommandHandler:
    """Serves ``basebackup`` and ``fullbackup`` on the page service port (an extra command of
    ``PageServiceHandler``)."""

    def __init__(
        self,
        get_timeline: TimelineGetter,
        *,
        wait_lsn_timeout_s: float = 60.0,
        prev_record_lsn: PrevLsnLookup | None = None,
    ) -> None:
        self._get_timeline = get_timeline
        self.wait_lsn_timeout_s = wait_lsn_timeout_s
        self._prev_record_lsn = prev_record_lsn

    async def basebackup(self, conn: PgConnection, args: tuple[str, ...]) -> None:
        await self._run(conn, parse_backup_command("basebackup", args))

    async def fullbackup(self, conn: PgConnection, args: tuple[str, ...]) -> None:
        await self._run(conn, parse_backup_command("fullbackup", args))

    async def _run(self, conn: PgConnection, cmd: BackupCommand) -> None:
        conn.bind_log(tenant_id=cmd.tenant_id.hex, timeline_id=cmd.timeline_id.hex)
        try:
            tl = self._get_timeline(cmd.tenant_id, cmd.timeline_id)
        except LookupError as exc:
            raise PgError(f"not found: {exc}") from None
        lsn = tl.last_record_lsn if cmd.lsn is None else cmd.lsn
        if lsn % 8:
            raise PgError(f"basebackup LSN {format_lsn(lsn)} is not a record boundary (8-byte aligned)")
        if cmd.lsn is not None and lsn > tl.last_record_lsn:
            try:
                await tl.wait_lsn(lsn, self.wait_lsn_timeout_s)
            except TimeoutError as exc:
                raise PgError(f"basebackup at {format_lsn(lsn)}: {exc}") from None
        refusal = gc_refusal(tl, lsn)
        if refusal is not None:
            raise PgError(f"basebackup at {refusal}: GC removed what it needs", sqlstate.INVALID_PARAMETER_VALUE)
        with hold_lsn(tl, lsn):
            await self._send(conn, cmd, tl, lsn)

    async def _send(self, conn: PgConnection, cmd: BackupCommand, tl: Timeline, lsn: Lsn) -> None:
        prev = cmd.prev_lsn
        if prev is None and self._prev_record_lsn is not None:
            prev = self._prev_record_lsn(tl, lsn)
        if prev is not None and prev >= checkpoint_record_lsn(lsn):
            raise PgError(f"prev_lsn {format_lsn(prev)} is not before {format_lsn(lsn)}")
        xl_prev = prev if prev is not None else 0
        copy = await conn.enter_copy_out(command_tag="SELECT 1")
        started = time.monotonic()
        try:
            result = await write_basebackup(
                TimelineBackupSource(tl), lsn, copy.send, gzip=cmd.gzip, prev_lsn=xl_prev, replica=cmd.replica,
                lazy=cmd.lazy,
            )
        except MissingKeyError as exc:
            raise PgError(f"no data directory at {format_lsn(lsn)} on this timeline: {exc}") from None
        except BasebackupError as exc:
            raise PgError(f"basebackup at {format_lsn(lsn)}: {exc}") from None
        log.info("basebackup sent", lsn=format_lsn(lsn), checkpoint=format_lsn(result.checkpoint_lsn),
                 files=result.files, bytes=result.raw_bytes, gzip=cmd.gzip, full=cmd.full, lazy=cmd.lazy,
                 seconds=round(time.monotonic() - started, 3))
