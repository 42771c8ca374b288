"""Temporary directories for tests that run PostgreSQL binaries as the postgres user."""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path


@contextmanager
def pg_tmpdir(prefix: str = "pagestore-test-") -> Iterator[Path]:
    """A fresh directory under /tmp that the postgres user can traverse (pytest's ``tmp_path`` is
    0700 root), removed afterwards. Module-scoped fixtures use it directly; function-scoped
    tests use the ``pg_tmp_path`` fixture."""
    path = Path(tempfile.mkdtemp(prefix=prefix, dir="/tmp"))
    os.chmod(path, 0o755)
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)
