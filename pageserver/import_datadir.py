"""Importing a PostgreSQL 15 data directory into a timeline, and bootstrapping timelines.

``import_datadir(timeline, source)`` puts everything the pageserver serves as images at one
LSN, the checkpoint's redo point (``pg_control``; for a ``pg_basebackup`` the backup_label's
START WAL LOCATION): every relation block with its fork sizes and directories, the database
directory, relmapper files, SLRU segments (pg_xact, pg_multixact/offsets, members), two-phase
files, pg_control and the checkpoint. It then ingests the WAL the source carries (``pg_wal/``)
from that point to the end of valid WAL, as Neon does: for a cleanly shut down cluster that is
the shutdown checkpoint record itself, so the timeline ends where the server's next record
begins; for a base backup it is the WAL that makes its fuzzy pages consistent (with
full_page_writes every page changed after the redo point is re-imaged by that WAL).

Sources: a directory, or a tar file (``pg_basebackup -Ft`` ``base.tar``, optionally with a
``pg_wal.tar`` next to it, or any tar of a data directory). Tablespaces other than the two
built-in ones are refused.

``bootstrap_timeline(tenant, timeline_id)`` runs ``initdb`` (as the postgres user) into a
scratch directory, creates the timeline, imports the directory and flushes, so the new
timeline is durable. Pass ``pgdata`` to keep the initdb directory (tests start a PostgreSQL on
a copy of it).
"""

from __future__ import annotations

import abc
import functools
import gzip
import os
import re
import shutil
import tarfile
import tempfile
import zlib
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import IO

import attrs
import structlog
import trio

from compute import postgres
from pageserver.basebackup import RELSEG_SIZE, SLRU_DIRS
from pageserver.pg_control import ControlFileData, DBState, parse_control_file
from pageserver.pgdatadir import (
    BLCKSZ,
    DEFAULTTABLESPACE_OID,
    GLOBALTABLESPACE_OID,
    DatadirModification,
    DatadirWriter,
    RelKey,
)
from pageserver.storage.value import Image
from pageserver.tenant import Tenant
from pageserver.timeline import Timeline
from pageserver.walingest import WalIngest, read_wal_segments
from protocol.errors import RemoteProtocolError
from protocol.ids import TimelineId
from protocol.lsn import WAL_SEGMENT_SIZE, Lsn, format_lsn, parse_lsn, segment_file_name
from protocol.wal.reader import EndOfWal
from protocol.wal.record import DecodedRecord
from protocol.wal.rmgr import XLOG_BACKUP_END, XLR_RMGR_INFO_MASK, RmgrId

log = structlog.get_logger(__name__)

# ASCII digits only: str.isdigit() and a Unicode \d also take "²" or "٣", which int() then
# refuses or reads as another number.
_REL_FILE = re.compile(r"^([0-9]+)(?:_(fsm|vm|init))?(?:\.([0-9]+))?$")
_OID = re.compile(r"[0-9]+")
_MAX_OID = 0xFFFF_FFFF
_MAX_BLOCK_NUMBER = 0xFFFF_FFFE  # PostgreSQL's MaxBlockNumber
_FORKS = {None: 0, "fsm": 1, "vm": 2, "init": 3}
_SLRU_DIRS = {path: kind for kind, path in SLRU_DIRS.items()}
_READ_CHUNK = 64 * BLCKSZ


class DatadirImportError(Exception):
    """The source is not an importable PostgreSQL 15 data directory."""


# What a damaged source raises while it is read: a truncated or corrupt tar (or compressed
# tar). These can only come from the source, so they become DatadirImportError (a 400, not an
# internal error). OSError in general is left alone: it may be our own disk failing.
_DAMAGED_SOURCE = (tarfile.TarError, EOFError, zlib.error, gzip.BadGzipFile)


@attrs.frozen
class ImportResult:
    base_lsn: Lsn  # where the images are
    end_lsn: Lsn  # the timeline's last_record_lsn after the WAL that came along
    relations: int
    blocks: int
    control: ControlFileData


# --- sources ----------------------------------------------------------------------------------


class _Source(abc.ABC):
    """Files of a data directory by relative path (``/``-separated)."""

    @abc.abstractmethod
    def files(self) -> Iterator[tuple[str, Callable[[], IO[bytes]]]]: ...

    @abc.abstractmethod
    def read(self, path: str) -> bytes | None: ...

    @abc.abstractmethod
    def dirs(self) -> Iterator[str]: ...

    def wal_segment(self, segno: int) -> bytes | None:
        return self.read("pg_wal/" + segment_file_name(segno))

    def close(self) -> None:  # noqa: B027 - optional hook: a directory holds nothing open
        pass


class _DirSource(_Source):
    def __init__(self, root: Path) -> None:
        self.root = root

    def files(self) -> Iterator[tuple[str, Callable[[], IO[bytes]]]]:
        for dirpath, dirnames, filenames in os.walk(self.root):
            dirnames.sort()
            for name in sorted(filenames):
                full = Path(dirpath) / name
                rel = full.relative_to(self.root).as_posix()
                yield rel, functools.partial(_open_file, full)

    def dirs(self) -> Iterator[str]:
        for dirpath, dirnames, _ in os.walk(self.root):
            for d in dirnames:
                yield (Path(dirpath) / d).relative_to(self.root).as_posix()

    def read(self, path: str) -> bytes | None:
        full = self.root / path
        return full.read_bytes() if full.is_file() else None


class _TarSource(_Source):
    def __init__(self, path: Path, wal_tar: Path | None) -> None:
        self.tar = tarfile.open(path)  # noqa: SIM115 (closed by close())
        self.members = {_norm(m.name): m for m in self.tar.getmembers()}
        self.wal_tar = tarfile.open(wal_tar) if wal_tar is not None else None  # noqa: SIM115
        self.wal_members = (
            {_norm(m.name): m for m in self.wal_tar.getmembers()} if self.wal_tar else {}
        )

    def files(self) -> Iterator[tuple[str, Callable[[], IO[bytes]]]]:
        for name in sorted(self.members):
            m = self.members[name]
            if m.isfile():
                yield name, functools.partial(self._open, m)

    def _open(self, m: tarfile.TarInfo) -> IO[bytes]:
        f = self.tar.extractfile(m)
        if f is None:
            raise DatadirImportError(f"cannot read {m.name} from the tar")
        return f

    def dirs(self) -> Iterator[str]:
        seen = set()
        for name, m in self.members.items():
            if m.isdir():
                seen.add(name)
            parts = name.split("/")
            for i in range(1, len(parts)):
                seen.add("/".join(parts[:i]))
        yield from sorted(seen)

    def read(self, path: str) -> bytes | None:
        m = self.members.get(path)
        if m is None or not m.isfile():
            return None
        with self._open(m) as f:
            return f.read()

    def wal_segment(self, segno: int) -> bytes | None:
        name = segment_file_name(segno)
        data = self.read("pg_wal/" + name)
        if data is None and self.wal_tar is not None:
            m = self.wal_members.get(name) or self.wal_members.get("pg_wal/" + name)
            if m is not None:
                f = self.wal_tar.extractfile(m)
                data = f.read() if f is not None else None
        return data

    def close(self) -> None:
        self.tar.close()
        if self.wal_tar is not None:
            self.wal_tar.close()


def _open_file(path: Path) -> IO[bytes]:
    return path.open("rb")


def _norm(name: str) -> str:
    name = name.lstrip("/")
    while name.startswith("./"):
        name = name[2:]
    return name.rstrip("/")


def _open_source(source: Path, wal_tar: Path | None) -> _Source:
    if source.is_dir():
        return _DirSource(source)
    if source.is_file() and tarfile.is_tarfile(source):
        if wal_tar is None and (source.parent / "pg_wal.tar").exists():
            wal_tar = source.parent / "pg_wal.tar"
        return _TarSource(source, wal_tar)
    raise DatadirImportError(f"{source} is neither a data directory nor a tar file")


# --- the import -------------------------------------------------------------------------------


def _state_name(state: int) -> str:
    try:
        return DBState(state).name
    except ValueError:
        return f"unknown {state}"


@attrs.frozen
class _BackupLabel:
    start: Lsn
    from_standby: bool


def _backup_label(src: _Source) -> _BackupLabel | None:
    label = src.read("backup_label")
    if label is None:
        return None
    m = re.search(rb"^START WAL LOCATION: ([0-9A-Fa-f]+/[0-9A-Fa-f]+)", label, re.M)
    if m is None:
        raise DatadirImportError("backup_label has no START WAL LOCATION")
    try:
        start = parse_lsn(m.group(1).decode())
    except RemoteProtocolError as exc:
        raise DatadirImportError(f"backup_label: {exc.msg}") from None
    return _BackupLabel(start, re.search(rb"^BACKUP FROM: standby$", label, re.M) is not None)


def _start_lsn(label: _BackupLabel | None, cf: ControlFileData) -> Lsn:
    if label is not None:
        return label.start
    if cf.state not in (DBState.SHUTDOWNED, DBState.SHUTDOWNED_IN_RECOVERY):
        raise DatadirImportError(
            f"the cluster was not shut down cleanly (state {_state_name(cf.state)}); "
            "stop it with pg_ctl stop -m fast or import a pg_basebackup"
        )
    return Lsn(cf.checkpoint_copy.redo)


async def _read_all(opener: Callable[[], IO[bytes]]) -> bytes:
    def read() -> bytes:
        with opener() as f:
            return f.read()

    return await trio.to_thread.run_sync(read)


def _oid(text: str, path: str) -> int:
    value = int(text)
    if value > _MAX_OID:
        raise DatadirImportError(f"{path}: {text} is not an OID (above {_MAX_OID})")
    return value


async def _import_rel_file(
    mod: DatadirModification, rel: RelKey, segno: int, opener: Callable[[], IO[bytes]], path: str
) -> int:
    base = segno * RELSEG_SIZE
    if base > _MAX_BLOCK_NUMBER:
        raise DatadirImportError(f"{path}: segment {segno} is beyond PostgreSQL's MaxBlockNumber")
    blk = base
    # File reads leave the trio thread: an import must not stall the page service.
    with await trio.to_thread.run_sync(opener) as f:
        while True:
            chunk = await trio.to_thread.run_sync(f.read, _READ_CHUNK)
            if not chunk:
                break
            if len(chunk) % BLCKSZ:
                raise DatadirImportError(f"{path}: size is not a multiple of {BLCKSZ}")
            if blk + len(chunk) // BLCKSZ > _MAX_BLOCK_NUMBER:
                raise DatadirImportError(f"{path}: blocks beyond PostgreSQL's MaxBlockNumber")
            for off in range(0, len(chunk), BLCKSZ):
                await mod.put_rel_page(rel, blk, Image(chunk[off : off + BLCKSZ]))
                blk += 1
            await trio.lowlevel.checkpoint()
    current = await mod.get_rel_size(rel)
    if current is None:
        await mod.put_rel_creation(rel, blk)
    elif blk > current:
        await mod.put_rel_extend(rel, blk)
    return blk - base


async def _import_slru(
    mod: DatadirModification, kind: int, segno: int, opener: Callable[[], IO[bytes]], path: str
) -> None:
    data = await _read_all(opener)
    if len(data) % BLCKSZ:
        raise DatadirImportError(f"{path}: size is not a multiple of {BLCKSZ}")
    n = len(data) // BLCKSZ
    await mod.put_slru_segment_creation(kind, segno, n)
    for b in range(n):
        await mod.put_slru_page(kind, segno, b, Image(data[b * BLCKSZ : (b + 1) * BLCKSZ]))


async def import_datadir(
    timeline: Timeline,
    source: Path,
    *,
    wal_tar: Path | None = None,
    ingest: WalIngest | None = None,
) -> ImportResult:
    """Import ``source`` (directory or tar) into an empty ``timeline``; see the module doc.

    Anything wrong with the source (damaged tar, corrupt pg_control, WAL that stops short of
    consistency, out-of-range file names) raises ``DatadirImportError``.
    """
    try:
        src = await trio.to_thread.run_sync(_open_source, source, wal_tar)
        try:
            return await _import(timeline, src, ingest)
        finally:
            src.close()
    except _DAMAGED_SOURCE as exc:
        raise DatadirImportError(f"{source}: damaged archive: {type(exc).__name__}: {exc}") from None


class _SegmentPrefetch:
    """WAL segments of the source, each read in a worker thread before the decoder asks for
    it: ``read_wal_segments`` wants them synchronously, and a 16 MiB read (from a tar member,
    perhaps) must not stall the trio thread. The next segment is read as soon as a record ends
    in the current one, so at most two are held."""

    def __init__(self, src: _Source, first: int) -> None:
        self._src = src
        self._ready: dict[int, bytes | None] = {}
        self._next = first  # lowest segment not read yet

    async def read_through(self, segno: int) -> None:
        while self._next <= segno:
            self._ready[self._next] = await trio.to_thread.run_sync(self._src.wal_segment, self._next)
            self._next += 1

    def get(self, segno: int) -> bytes | None:
        if segno in self._ready:
            return self._ready.pop(segno)
        # Only a single record spanning more than a whole segment gets here: correct, slower.
        log.warning("WAL segment read on the trio thread", segno=segno)
        self._next = max(self._next, segno + 1)
        return self._src.wal_segment(segno)


async def _ingest_source_wal(
    wal: WalIngest, src: _Source, start: Lsn, watch: _BackupEndWatch
) -> EndOfWal | None:
    """Ingest the source's WAL from ``start`` to its end (the ``EndOfWal``, returned)."""
    segments = _SegmentPrefetch(src, start // WAL_SEGMENT_SIZE)
    await segments.read_through(start // WAL_SEGMENT_SIZE + 1)
    for item in watch.observe(read_wal_segments(segments.get, start)):
        if isinstance(item, EndOfWal):
            return item
        await wal.ingest_record(item)
        await segments.read_through(item.end_lsn // WAL_SEGMENT_SIZE + 1)
        await trio.lowlevel.checkpoint_if_cancelled()
    return None


class _BackupEndWatch:
    """Passes records through, noting PostgreSQL's end-of-backup record for ``start``: a base
    backup's files are consistent only once WAL up to it has been replayed (PostgreSQL refuses
    to start otherwise: "WAL ends before end of online backup")."""

    def __init__(self, start: Lsn) -> None:
        self._start = start.to_bytes(8, "little")
        self.end_of_backup: Lsn | None = None

    def observe(self, records: Iterator[DecodedRecord | EndOfWal]) -> Iterator[DecodedRecord | EndOfWal]:
        for item in records:
            if (
                self.end_of_backup is None
                and isinstance(item, DecodedRecord)
                and item.xl_rmid == RmgrId.XLOG
                and item.xl_info & XLR_RMGR_INFO_MASK == XLOG_BACKUP_END
                and item.main_data[:8] == self._start
            ):
                self.end_of_backup = item.end_lsn
            yield item


async def _import(timeline: Timeline, src: _Source, ingest: WalIngest | None) -> ImportResult:
    raw_control = await trio.to_thread.run_sync(src.read, "global/pg_control")
    if raw_control is None:
        raise DatadirImportError("no global/pg_control: not a PostgreSQL data directory")
    try:
        cf = parse_control_file(raw_control)
    except RemoteProtocolError as exc:
        raise DatadirImportError(f"global/pg_control: {exc.msg}") from None
    label = await trio.to_thread.run_sync(_backup_label, src)
    lsn = _start_lsn(label, cf)
    if timeline.last_record_lsn >= lsn:
        raise DatadirImportError(
            f"timeline is at {format_lsn(timeline.last_record_lsn)}, cannot import at {format_lsn(lsn)}"
        )
    writer = ingest.w if ingest is not None else DatadirWriter(timeline)
    mod = writer.begin(lsn)
    nrels = nblocks = 0
    for d in await trio.to_thread.run_sync(lambda: list(src.dirs())):
        parts = d.split("/")
        if parts[0] == "pg_tblspc" and len(parts) == 2:
            raise DatadirImportError(f"tablespace {parts[1]} is not supported")
        if len(parts) == 2 and parts[0] == "base" and _OID.fullmatch(parts[1]):
            await mod.put_dbdir_creation(DEFAULTTABLESPACE_OID, _oid(parts[1], d))
    for path, opener in await trio.to_thread.run_sync(lambda: list(src.files())):
        parts = path.split("/")
        name = parts[-1]
        where: tuple[int, int] | None = None
        if len(parts) == 2 and parts[0] == "global":
            where = (GLOBALTABLESPACE_OID, 0)
        elif len(parts) == 3 and parts[0] == "base" and _OID.fullmatch(parts[1]):
            where = (DEFAULTTABLESPACE_OID, _oid(parts[1], path))
        elif parts[0] == "pg_tblspc":
            raise DatadirImportError(f"tablespaces are not supported ({path})")
        if where is not None:
            if name == "pg_filenode.map":
                await mod.put_relmap_file(where[0], where[1], await _read_all(opener))
                continue
            m = _REL_FILE.match(name)
            if m is None:
                continue  # PG_VERSION, pg_internal.init, pg_control (below), ...
            rel: RelKey = (where[0], where[1], _oid(m.group(1), path), _FORKS[m.group(2)])
            segno = int(m.group(3) or 0)
            nblocks += await _import_rel_file(mod, rel, segno, opener, path)
            nrels += segno == 0
            continue
        slru_dir = "/".join(parts[:-1])
        kind = _SLRU_DIRS.get(slru_dir)
        if kind is not None and re.fullmatch(r"[0-9A-F]{4,6}", name):
            await _import_slru(mod, kind, int(name, 16), opener, path)
        elif slru_dir == "pg_twophase" and re.fullmatch(r"[0-9A-F]{8}", name):
            await mod.put_twophase_file(int(name, 16), await _read_all(opener))
    await mod.put_control_file(raw_control)
    mod.put_checkpoint(cf.checkpoint_copy)
    await mod.commit()
    log.info(
        "imported data directory",
        lsn=format_lsn(lsn),
        relations=nrels,
        blocks=nblocks,
        timeline_id=timeline.timeline_id.hex,
    )
    wal = ingest if ingest is not None else WalIngest(timeline, writer)
    watch = _BackupEndWatch(lsn)
    end = await _ingest_source_wal(wal, src, lsn, watch)
    why = f" ({end.reason})" if end is not None else ""
    ends_at = format_lsn(timeline.last_record_lsn)
    # The checkpoint record itself must be in: the timeline then ends where the source's next
    # record begins, and that is where streaming resumes.
    if timeline.last_record_lsn <= cf.checkpoint:
        raise DatadirImportError(
            f"the WAL in the source ends at {ends_at}, before the end of the checkpoint record "
            f"at {format_lsn(cf.checkpoint)}{why}"
        )
    if label is not None and label.from_standby:
        if timeline.last_record_lsn < cf.min_recovery_point:
            raise DatadirImportError(
                f"the WAL in the backup ends at {ends_at}, before its minimum recovery point "
                f"{format_lsn(cf.min_recovery_point)}{why}"
            )
    elif label is not None and watch.end_of_backup is None:
        raise DatadirImportError(
            f"the WAL in the backup ends at {ends_at} without the end-of-backup record for "
            f"{format_lsn(lsn)}: its files are not consistent{why}"
        )
    return ImportResult(lsn, timeline.last_record_lsn, nrels, nblocks, cf)


# --- bootstrap ----------------------------------------------------------------------------------


def _scratch_dir() -> Path:
    path = Path(tempfile.mkdtemp(prefix="pagestore-initdb-", dir="/tmp"))
    os.chmod(path, 0o755)
    return path


async def run_initdb(pgdata: Path) -> None:
    """``initdb`` as the postgres user (in a worker thread)."""
    await trio.to_thread.run_sync(postgres.initdb, pgdata)


async def bootstrap_timeline(
    tenant: Tenant,
    timeline_id: TimelineId,
    *,
    pgdata: Path | None = None,
) -> tuple[Timeline, ImportResult]:
    """A new timeline without ancestor: initdb, import, flush (durable when this returns)."""
    scratch = None
    if pgdata is None:
        scratch = await trio.to_thread.run_sync(_scratch_dir)
        pgdata = scratch / "pgdata"
    try:
        await run_initdb(pgdata)
        tl = await tenant.create_timeline(timeline_id)
        result = await import_datadir(tl, pgdata)
        await tl.flush()
    finally:
        if scratch is not None:
            await trio.to_thread.run_sync(lambda: shutil.rmtree(scratch, ignore_errors=True))
    log.info(
        "bootstrapped timeline",
        timeline_id=timeline_id.hex,
        lsn=format_lsn(result.end_lsn),
    )
    return tl, result


__all__ = [
    "DatadirImportError",
    "ImportResult",
    "bootstrap_timeline",
    "import_datadir",
    "run_initdb",
]
