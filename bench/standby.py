"""PostgreSQL's own redo as a reference: a streaming hot standby of an endpoint.

Where pagestore's pages may legitimately differ from the primary's files because PostgreSQL's
redo itself does not reproduce them (VM bits on pages logged as standard-layout full-page
images, e.g. CREATE DATABASE's WAL_LOG copy, whose bits sit in the "hole" the image leaves
out), the verification tools compare with what a real standby of the same build replayed
from the same WAL. ``Standby.start`` takes ``pg_basebackup -X stream -R`` of the primary and
starts it; ``replay_to(lsn)`` waits until it has replayed through ``lsn`` and runs a
restartpoint (CHECKPOINT on a standby) so its data files hold the replayed pages.

A lazy endpoint's ``base/`` and ``global/`` are symbolic links into its page filesystem, which
``pg_basebackup`` skips (only ``pg_tblspc`` may hold links): its standby starts instead from the
data directory the endpoint itself started from, a cold copy of a cleanly shut down cluster
(``from_tar``: the pageserver's full basebackup at the endpoint's start LSN, what a ``full``
endpoint unpacks), and streams every later record from the endpoint as any standby does.
"""

from __future__ import annotations

import os
import tarfile
import time
from pathlib import Path

import attrs
import psycopg

from compute import postgres
from protocol.lsn import Lsn, format_lsn, parse_lsn


class StandbyError(RuntimeError):
    """The reference standby could not be made or did not catch up."""


@attrs.define
class Standby:
    pg: postgres.PostgresInstance

    @property
    def root(self) -> Path:
        return self.pg.datadir

    @classmethod
    def start(cls, datadir: Path, primary_port: int, *, from_tar: Path | None = None) -> Standby:
        """``from_tar``: a basebackup tar of the primary's start (its pg_control a clean
        shutdown at that LSN) instead of ``pg_basebackup`` of the running primary."""
        postgres.make_postgres_dir(datadir)
        if from_tar is None:
            postgres.run_as_postgres(
                [postgres.pg_binary("pg_basebackup"), "-h", "127.0.0.1", "-p", str(primary_port), "-U",
                 postgres.PG_USER, "-D", str(datadir), "-X", "stream", "-R", "-c", "fast", "--no-sync"],
                timeout=600)
        else:
            with tarfile.open(from_tar) as tar:
                tar.extractall(datadir, filter="data")
        # Settings of the primary that a standby must not take over (the walproposer's name,
        # the bridge's replication settings) are overridden in the auto.conf it gets.
        pg = postgres.PostgresInstance(datadir=datadir, settings={
            "listen_addresses": "127.0.0.1", "hot_standby": "on", "fsync": "off",
            "allow_in_place_tablespaces": "on",
            "synchronous_standby_names": "", "max_wal_senders": "10", "max_replication_slots": "10",
            "primary_conninfo": f"host=127.0.0.1 port={primary_port} user={postgres.PG_USER}",
            "shared_buffers": "128MB", "log_line_prefix": "%m [%p] "})
        (datadir / "standby.signal").touch()
        (datadir / "server.log").unlink(missing_ok=True)  # the primary's, copied with its files
        os.chmod(datadir, 0o700)
        postgres.chown_to_postgres(datadir)
        try:
            pg.start()
        except postgres.PostgresError as exc:
            log = datadir / "server.log"
            tail = log.read_text(errors="replace")[-3000:] if log.exists() else ""
            raise StandbyError(f"the reference standby did not start: {exc}\n--- server.log ---\n{tail}") from None
        return cls(pg)

    def replay_to(self, lsn: Lsn, timeout: float = 600) -> None:
        deadline = time.monotonic() + timeout
        with psycopg.connect(self.pg.dsn, autocommit=True) as conn:
            while True:
                row = conn.execute("SELECT pg_last_wal_replay_lsn()").fetchone()
                at = parse_lsn(str(row[0])) if row and row[0] else 0
                if at >= lsn:
                    break
                if time.monotonic() > deadline:
                    raise StandbyError(f"the reference standby replayed to {format_lsn(at)} in {timeout:.0f} s, "
                                       f"not to {format_lsn(lsn)}")
                time.sleep(0.2)
            conn.execute("CHECKPOINT")  # a restartpoint: the replayed pages reach the files

    def stop(self) -> None:
        self.pg.stop("immediate")
