"""Fixtures of the cluster tests: ``cluster_dir``, one local cluster directory per test.

A test module that needs a different cluster overrides ``cluster_init_args`` (more
``pagestore init`` arguments: ``--remote-storage seaweedfs``, ``--pageservers 2``, ...)::

    @pytest.fixture
    def cluster_init_args() -> list[str]:
        return ["--remote-storage", "seaweedfs"]
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from control_plane import cli


@pytest.fixture
def cluster_init_args() -> list[str]:
    """What ``cluster_dir`` adds to ``pagestore init --free-ports --no-sync`` (auth on, the
    default; one pageserver, three safekeepers, no remote storage)."""
    return []


@pytest.fixture
def cluster_dir(pg_tmp_path: Path, cluster_init_args: list[str]) -> Iterator[Path]:
    """``pagestore init`` into ``pg_tmp_path/cluster`` (usable by the postgres user); its
    nodes and endpoints are stopped (``stop --immediate``) after the test, pass or fail."""
    workdir = pg_tmp_path / "cluster"
    assert cli.main(["init", "--workdir", str(workdir), "--free-ports", "--no-sync", *cluster_init_args]) == 0
    try:
        yield workdir
    finally:
        cli.main(["stop", "--workdir", str(workdir), "--immediate"])
