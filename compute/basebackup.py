"""A basebackup from the page service, fetched and unpacked into a data directory: what
``endpoint start`` does for a full endpoint, and the page filesystem (``compute.pagefs``) for
a lazy one (``--lazy``: no relation data).

``fetch`` runs ``basebackup <tenant> <timeline> <lsn> [--lazy]`` on the pageserver's libpq port
and writes the tar to a binary file; ``unpack`` extracts it into the data directory, refusing a
member that points outside it, and gives everything to the postgres user.
"""

from __future__ import annotations

import os
import tarfile
from collections.abc import Mapping
from pathlib import Path
from typing import BinaryIO

from common import pgclient
from compute import postgres
from protocol.lsn import Lsn, format_lsn


class BasebackupError(Exception):
    """A basebackup that cannot be unpacked; the message names the member."""


async def fetch(host: str, port: int, tenant_id: str, timeline_id: str, lsn: Lsn, out: BinaryIO, *,
                lazy: bool = False, params: Mapping[str, str] | None = None) -> int:
    """Write the tar to ``out``; returns its size. ``params``: libpq keywords (``password``:
    a tenant token, ``sslrootcert``) beside ``user=pagestore``."""
    # The default message limit holds: basebackup sends CopyData of at most 256 KiB
    # (pageserver.basebackup.CHUNK_BYTES), also for the 16 MiB WAL segment.
    conn = await pgclient.connect_with_params(host, port, {"user": "pagestore", **(params or {})})
    try:
        flags = " --lazy" if lazy else ""
        copy = await conn.copy_out(f"basebackup {tenant_id} {timeline_id} {format_lsn(lsn)}{flags}")
        size = 0
        while True:
            chunk = await copy.receive()
            if chunk is None:
                break
            out.write(chunk)
            size += len(chunk)
        await conn.finish_copy()
    finally:
        await conn.aclose()
    return size


def unpack(tar: BinaryIO, pgdata: Path) -> None:
    """Extract the tar read from ``tar`` into ``pgdata`` (owned by postgres, mode 0700)."""
    root = pgdata.resolve()
    with tarfile.open(fileobj=tar) as t:
        for member in t.getmembers():
            target = (pgdata / member.name).resolve()
            if not (target == root or root in target.parents):
                raise BasebackupError(f"basebackup member {member.name!r} points outside the data directory")
        t.extractall(pgdata, filter="data")
    postgres.chown_to_postgres(pgdata)
    os.chmod(pgdata, 0o700)
