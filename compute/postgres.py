"""Run the installed vanilla PostgreSQL 15 as the ``postgres`` user.

Used by tests, benchmarks and the control plane's endpoints. PostgreSQL refuses to run as
root, so every server-side binary runs through ``runuser -u postgres`` on directories that
user owns. Everything here is synchronous (subprocess); async callers use
``trio.to_thread.run_sync``.
"""

from __future__ import annotations

import os
import pwd
import shutil
import subprocess
import tempfile
import time
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from pathlib import Path

import attrs

from common.ports import free_port as free_port  # re-exported: callers predate common.ports

PG_BIN = Path(os.environ.get("PAGESTORE_PG_BIN", "/usr/lib/postgresql/15/bin"))
PG_USER = "postgres"


class PostgresError(RuntimeError):
    """A PostgreSQL binary failed; the message carries its output."""


def pg_binary(name: str) -> str:
    path = PG_BIN / name
    if not path.exists():
        raise PostgresError(f"{path} not found: install PostgreSQL 15 (scripts/setup does)")
    return str(path)


def _as_postgres(cmd: Sequence[str]) -> list[str]:
    if os.geteuid() == 0:
        return ["runuser", "-u", PG_USER, "--", *cmd]
    return list(cmd)


def run_as_postgres(
    cmd: Sequence[str],
    *,
    check: bool = True,
    timeout: float = 300,
    input: bytes | None = None,
    env: Mapping[str, str] | None = None,
) -> subprocess.CompletedProcess[bytes]:
    full_env = dict(os.environ)
    full_env.update(env or {})
    proc = subprocess.run(
        _as_postgres(cmd),
        capture_output=True,
        timeout=timeout,
        input=input,
        env=full_env,
        check=False,
    )
    if check and proc.returncode != 0:
        raise PostgresError(
            f"{' '.join(cmd)} exited {proc.returncode}:\n"
            f"{proc.stdout.decode(errors='replace')}{proc.stderr.decode(errors='replace')}"
        )
    return proc


def chown_to_postgres(path: Path) -> None:
    """Give ``path`` (recursively) to the postgres user, so PostgreSQL may write there."""
    if os.geteuid() != 0:
        return
    pw = pwd.getpwnam(PG_USER)
    for root, dirs, files in os.walk(path):
        os.chown(root, pw.pw_uid, pw.pw_gid)
        for name in dirs + files:
            os.chown(os.path.join(root, name), pw.pw_uid, pw.pw_gid, follow_symlinks=False)


def make_postgres_dir(path: Path) -> Path:
    """Create ``path`` and its parents as needed, owned by postgres; parents stay traversable."""
    path.mkdir(parents=True, exist_ok=True)
    if os.geteuid() == 0:
        pw = pwd.getpwnam(PG_USER)
        os.chown(path, pw.pw_uid, pw.pw_gid)
        # The postgres user must be able to traverse into the directory.
        parent = path.parent
        while parent != parent.parent:
            mode = parent.stat().st_mode
            if not mode & 0o001:
                os.chmod(parent, mode | 0o711)
            parent = parent.parent
    return path


@contextmanager
def postgres_tmpdir(prefix: str) -> Iterator[Path]:
    """A fresh directory under /tmp that the postgres user can traverse (mode 0755), removed
    (with everything in it) on exit."""
    path = Path(tempfile.mkdtemp(prefix=prefix, dir="/tmp"))
    os.chmod(path, 0o755)
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


def initdb(datadir: Path, *, extra_args: Sequence[str] = ()) -> None:
    make_postgres_dir(datadir)
    run_as_postgres(
        [pg_binary("initdb"), "-D", str(datadir), "-U", PG_USER, "--no-sync", "-A", "trust",
         "-E", "UTF8", "--locale=C", *extra_args]
    )


@attrs.define
class PostgresInstance:
    """One PostgreSQL server on 127.0.0.1, its socket directory inside the data directory."""

    datadir: Path
    port: int = attrs.field(factory=free_port)
    settings: dict[str, str] = attrs.field(factory=dict)
    started: bool = False

    @classmethod
    def create(cls, datadir: Path, settings: Mapping[str, str] | None = None) -> PostgresInstance:
        initdb(datadir)
        return cls(datadir=datadir, settings=dict(settings or {}))

    @property
    def dsn(self) -> str:
        return f"host=127.0.0.1 port={self.port} user={PG_USER} dbname=postgres"

    def write_settings(self) -> None:
        lines = [f"{k} = '{v}'" for k, v in self.settings.items()]
        conf = self.datadir / "postgresql.auto.conf"
        conf.write_text("\n".join(["# written by pagestore", *lines]) + "\n")
        chown_to_postgres(conf)

    def start(self, timeout: float = 60) -> None:
        self.write_settings()
        opts = f"-p {self.port} -c listen_addresses=127.0.0.1 -c unix_socket_directories={self.datadir}"
        run_as_postgres(
            [pg_binary("pg_ctl"), "-D", str(self.datadir), "-o", opts, "-l",
             str(self.datadir / "server.log"), "-w", "-t", str(int(timeout)), "start"],
            timeout=timeout + 10,
        )
        self.started = True

    def stop(self, mode: str = "fast") -> None:
        if not self.started:
            return
        run_as_postgres(
            [pg_binary("pg_ctl"), "-D", str(self.datadir), "-m", mode, "-w", "stop"], check=False
        )
        self.started = False

    def psql(self, sql: str, *, dbname: str = "postgres", timeout: float = 300) -> str:
        """Run SQL with psql; returns unaligned, tuples-only output."""
        proc = run_as_postgres(
            [pg_binary("psql"), "-X", "-q", "-A", "-t", "-v", "ON_ERROR_STOP=1", "-h", "127.0.0.1",
             "-p", str(self.port), "-U", PG_USER, "-d", dbname, "-c", sql],
            timeout=timeout,
        )
        return proc.stdout.decode().strip()

    def pgbench(self, *args: str, timeout: float = 600) -> str:
        proc = run_as_postgres(
            [pg_binary("pgbench"), "-h", "127.0.0.1", "-p", str(self.port), "-U", PG_USER,
             *args, "postgres"],
            timeout=timeout,
        )
        return (proc.stdout + proc.stderr).decode()

    def wal_dir(self) -> Path:
        return self.datadir / "pg_wal"

    def wait_ready(self, timeout: float = 30) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            proc = run_as_postgres(
                [pg_binary("pg_isready"), "-h", "127.0.0.1", "-p", str(self.port)], check=False
            )
            if proc.returncode == 0:
                return
            time.sleep(0.1)
        raise PostgresError(f"PostgreSQL on port {self.port} not ready after {timeout}s")

    def destroy(self) -> None:
        self.stop("immediate")
        shutil.rmtree(self.datadir, ignore_errors=True)
