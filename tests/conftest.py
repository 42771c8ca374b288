"""Shared test configuration: hypothesis profiles and fixtures every room uses."""

from __future__ import annotations

import importlib
import os
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING

import pytest
from hypothesis import HealthCheck, settings

from protocol import _native
from protocol._native_sources import NATIVE_MODULES, TWINS
from tests.auth_helpers import AuthKit
from tests.tmpdirs import pg_tmpdir

if TYPE_CHECKING:
    from remote_storage import RemoteStorage

# validate_get defaults to this variable: the whole suite runs both read paths and fails loudly on
# any difference (issue 3). Child processes (nodes started by tests) inherit it.
os.environ["PAGESTORE_VALIDATE_GET"] = "1"

settings.register_profile(
    "ci",
    deadline=None,
    max_examples=100,
    suppress_health_check=[HealthCheck.too_slow],
)
# too_slow is a health check on data generation speed, which depends on machine load, not on
# the code under test: suppressed in both profiles (CI may run without CI set).
settings.register_profile(
    "dev", deadline=None, max_examples=50, suppress_health_check=[HealthCheck.too_slow]
)
settings.load_profile("ci" if os.environ.get("CI") else os.environ.get("HYPOTHESIS_PROFILE", "dev"))

@pytest.fixture
def pg_tmp_path() -> Iterator[Path]:
    """A temporary directory the postgres user can traverse (pytest's tmp_path is 0700 root)."""
    with pg_tmpdir() as path:
        yield path


@pytest.fixture(scope="session")
def seaweedfs(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """One SeaweedFS S3 server for the whole test session (started on first use); its
    endpoint URL. Tests make their own bucket (``s3_config`` below) so they never share keys."""
    from remote_storage.seaweedfs import SeaweedServer

    server = SeaweedServer(tmp_path_factory.mktemp("seaweedfs"), volume_size_limit_mb=64)
    server.start()
    try:
        yield server.endpoint
    finally:
        server.stop(grace_s=1.0)


_BUCKETS = iter(range(1, 1 << 30))


@pytest.fixture
def s3_config(seaweedfs: str) -> object:
    """An ``S3StorageConfig`` for a fresh prefix in the session's SeaweedFS bucket. One bucket
    for all: SeaweedFS gives every bucket its own collection of volumes, and dozens of them
    exhausted the test machine's disk (uploads then failed and were retried for ever)."""
    from remote_storage.config import S3StorageConfig

    return S3StorageConfig(
        bucket="pagestore-tests", endpoint=seaweedfs, prefix=f"test-{os.getpid()}-{next(_BUCKETS)}",
        access_key_id="test", secret_access_key="test", create_bucket=True, timeout_s=30.0,
    )


@pytest.fixture(params=["local", "s3"])
async def remote_store(request: pytest.FixtureRequest, tmp_path: Path) -> AsyncIterator[RemoteStorage]:
    """A ``RemoteStorage`` of each kind tests run over: the local one in ``tmp_path`` and the
    session's SeaweedFS (a fresh prefix, ``s3_config``); closed after the test."""
    from remote_storage import LocalStorageConfig, S3StorageConfig, make_remote_storage

    if request.param == "local":
        store = make_remote_storage(LocalStorageConfig(path=tmp_path / "remote"))
    else:
        cfg = request.getfixturevalue("s3_config")
        assert isinstance(cfg, S3StorageConfig)
        store = make_remote_storage(cfg)
    try:
        yield store
    finally:
        await store.aclose()


@pytest.fixture
def kit(tmp_path: Path) -> AuthKit:
    """A keypair for tokens and a second one for forged tokens (``tests.auth_helpers``)."""
    return AuthKit.create(tmp_path)


def pytest_report_header() -> str:
    return f"pagestore kernels: {_native.IMPL} ({_native.describe()})"


@pytest.fixture(
    scope="session",
    params=[pytest.param("native", marks=pytest.mark.native), "python"],
)
def impl(request: pytest.FixtureRequest) -> str:
    """Both implementations of the kernels in one process (native.md §7): tests take
    ``impl`` and load the module pair with ``kernel(impl, "protocol._wal_c")``. The native
    one is marked ``native``; deselecting it (``-m "not native"``) is allowed only with
    PAGESTORE_PURE_PYTHON=1 (CI's pure-Python pass), so a missing build never hides."""
    return str(request.param)


def kernel(impl: str, native_name: str) -> ModuleType:
    """The compiled module ``native_name`` (checked: built, not stale) or its twin."""
    if native_name not in NATIVE_MODULES:
        raise LookupError(native_name)
    if impl == "native":
        return _native.load_native(native_name)
    return importlib.import_module(TWINS[native_name])


# Test files that run longest, started first: with ``./scripts/test``'s workers (pytest-xdist,
# ``--dist loadfile``) the regression-suite test runs on one worker while the rest of the suite
# runs on the other, instead of being the last file handed out and running alone at the end.
LONGEST_FIRST = ("tests/integration/test_pg_regress.py",)


def pytest_configure(config: pytest.Config) -> None:
    # xdist hands out files in collection order only without its "loadscope reorder" (on by
    # default: files with the most tests first), which put the one-test regression file last,
    # to run alone after everything else: the default run was the sum of the two, not the max.
    if hasattr(config.option, "loadscopereorder"):
        config.option.loadscopereorder = False


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    first = {path: i for i, path in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: first.get(item.nodeid.split("::", 1)[0], len(first)))  # stable
    markexpr = str(config.getoption("-m") or "")
    if "not native" in markexpr and _native.IMPL != "python":
        raise pytest.UsageError(
            '-m "not native" skips the compiled kernels: only allowed with PAGESTORE_PURE_PYTHON=1'
        )
