"""Temporary directories for tests that run PostgreSQL binaries as the postgres user."""

from __future__ import annotations

from contextlib import AbstractContextManager
from pathlib import Path

from compute.postgres import postgres_tmpdir


def pg_tmpdir(prefix: str = "pagestore-test-") -> AbstractContextManager[Path]:
    """A fresh directory under /tmp that the postgres user can traverse (pytest's ``tmp_path`` is
    0700 root), removed afterwards. Module-scoped fixtures use it directly; function-scoped
    tests use the ``pg_tmp_path`` fixture."""
    return postgres_tmpdir(prefix)
