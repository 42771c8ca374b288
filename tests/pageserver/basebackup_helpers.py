"""Test helpers for basebackup: a ``BackupSource`` read straight from a PostgreSQL data
directory, and unpacking a basebackup tar into a directory PostgreSQL can start from."""

from __future__ import annotations

import io
import os
import re
import tarfile
from collections.abc import Iterable, Sequence
from pathlib import Path

from compute.postgres import chown_to_postgres, make_postgres_dir
from pageserver.basebackup import RELSEG_SIZE, RelFork, rel_file_path
from pageserver.pg_control import parse_control_file
from pageserver.pgdatadir import DEFAULTTABLESPACE_OID, GLOBALTABLESPACE_OID
from pageserver.storage.key import (
    SLRU_CLOG,
    SLRU_COMMIT_TS,
    SLRU_MULTIXACT_MEMBERS,
    SLRU_MULTIXACT_OFFSETS,
    Key,
    key_fields,
)
from protocol.lsn import Lsn

_REL_FILE = re.compile(r"^(\d+)(_fsm|_vm|_init)?(\.\d+)?$")
_FORKS = {None: 0, "_fsm": 1, "_vm": 2, "_init": 3}
_SLRU = {
    SLRU_CLOG: "pg_xact",
    SLRU_COMMIT_TS: "pg_commit_ts",
    SLRU_MULTIXACT_OFFSETS: "pg_multixact/offsets",
    SLRU_MULTIXACT_MEMBERS: "pg_multixact/members",
}


class DirectorySource:
    """A stopped data directory as a ``BackupSource`` (one snapshot: ``lsn`` is ignored)."""

    def __init__(self, datadir: Path) -> None:
        self.dir = datadir

    def _db_path(self, spc: int, db: int) -> Path:
        return self.dir / "global" if spc == GLOBALTABLESPACE_OID else self.dir / "base" / str(db)

    async def list_dbdirs(self, lsn: Lsn) -> Sequence[tuple[int, int]]:
        dbs = [(GLOBALTABLESPACE_OID, 0)]
        dbs += [(DEFAULTTABLESPACE_OID, int(p.name)) for p in (self.dir / "base").iterdir()]
        return dbs

    async def list_rels(self, spcnode: int, dbnode: int, lsn: Lsn) -> Iterable[tuple[int, int]]:
        out = set()
        for p in self._db_path(spcnode, dbnode).iterdir():
            m = _REL_FILE.match(p.name)
            if m:
                out.add((int(m.group(1)), _FORKS[m.group(2)]))
        return out

    async def get_rel_size(self, rel: RelFork, lsn: Lsn) -> int:
        total, segno = 0, 0
        while (path := self.dir / rel_file_path(rel, segno)).exists():
            total += path.stat().st_size // 8192
            segno += 1
        return total

    async def get_rel_sizes(self, spcnode: int, dbnode: int, rels: Sequence[tuple[int, int]],
                            lsn: Lsn) -> list[int]:
        return [await self.get_rel_size(RelFork(spcnode, dbnode, r, f), lsn) for r, f in rels]

    async def get_relmap_file(self, spcnode: int, dbnode: int, lsn: Lsn) -> bytes | None:
        path = self._db_path(spcnode, dbnode) / "pg_filenode.map"
        return path.read_bytes() if path.exists() else None

    async def list_slru_segments(self, kind: int, lsn: Lsn) -> Iterable[int]:
        return [int(p.name, 16) for p in (self.dir / _SLRU[kind]).iterdir()]

    async def get_slru_segment_blocks(self, kind: int, segno: int, lsn: Lsn) -> int:
        return (self.dir / _SLRU[kind] / f"{segno:04X}").stat().st_size // 8192

    async def get_slru_segment(self, kind: int, segno: int, lsn: Lsn) -> bytes:
        return (self.dir / _SLRU[kind] / f"{segno:04X}").read_bytes()

    async def list_twophase_files(self, lsn: Lsn) -> Iterable[int]:
        return [int(p.name, 16) for p in (self.dir / "pg_twophase").iterdir()]

    async def get_twophase_file(self, xid: int, lsn: Lsn) -> bytes:
        return (self.dir / "pg_twophase" / f"{xid:08X}").read_bytes()

    async def get_control_file(self, lsn: Lsn) -> bytes:
        return (self.dir / "global" / "pg_control").read_bytes()

    async def get_checkpoint(self, lsn: Lsn) -> bytes:
        return parse_control_file(await self.get_control_file(lsn)).checkpoint_copy.encode()

    async def get_pages(self, keys: Sequence[Key], lsn: Lsn) -> dict[Key, bytes]:
        out = {}
        for key in keys:
            _, spc, db, rel, fork, blk = key_fields(key)
            path = self.dir / rel_file_path(RelFork(spc, db, rel, fork), blk // RELSEG_SIZE)
            with path.open("rb") as f:
                f.seek((blk % RELSEG_SIZE) * 8192)
                out[key] = f.read(8192)
        return out


def unpack_tar(data: bytes, dest: Path) -> list[str]:
    """Extract a basebackup into ``dest`` owned by postgres (mode 0700); returns the names."""
    make_postgres_dir(dest)
    with tarfile.open(fileobj=io.BytesIO(data)) as tf:
        names = tf.getnames()
        tf.extractall(dest, filter="data")
    os.chmod(dest, 0o700)
    chown_to_postgres(dest)
    return names
