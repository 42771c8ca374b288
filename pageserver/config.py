"""Pageserver node configuration: one TOML file structured into ``PageserverConfig``.

    id = 1
    listen_pg_addr = "127.0.0.1:64000"
    listen_http_addr = "127.0.0.1:9898"
    workdir = "/var/lib/pagestore/pageserver"
    page_service_pipelining = { mode = "pipelined", max_batch_size = 32, batching = "scattered-lsn" }
    wait_lsn_timeout_s = 60.0
    safekeepers = ["127.0.0.1:5454", "127.0.0.1:5455", "127.0.0.1:5456"]
    log_file = "pageserver.log"     # relative paths are inside workdir
    log_level = "info"
    validate_redo = false         # check redo against wal_consistency_checking images
    pg_auth_type = "NeonJWT"      # or "Trust"; http_auth_type likewise (docs/auth.md)
    auth_validation_public_key_path = "auth_public_key.pem"   # a file or a directory of keys
    ssl_cert_file = "server.crt"  # with ssl_key_file: TLS on both ports
    ssl_ca_file = "ca.crt"        # the WAL receivers verify the safekeepers against it

    [tenant_config]               # default storage settings of every tenant (storage.md §2.10)
    checkpoint_distance = 268435456
    io_engine = "threadpool"

Unknown keys and bad values stop start-up with a message naming the key (``common.config``);
a key that was removed (``REMOVED_KEYS``) is refused with what to do instead.
``page_service_pipelining`` is the page service's tagged union (``pageserver.page_service.config``);
``tenant_config`` is ``pageserver.storage.config.StorageConfig``. ``io_engine`` and
``wait_lsn_timeout_s`` at the top level override the tenant defaults (they are node-wide knobs
in Neon).
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal

import attrs
import cattrs

from common.config import dump_config, load_config, make_converter, structure_config
from pageserver.page_service.config import (
    DEFAULT_PIPELINING,
    MAX_GET_VECTORED_KEYS,
    PagePipelining,
    PageServiceConfig,
    register_hooks,
)
from pageserver.storage.config import StorageConfig
from remote_storage import LocalStorageConfig, RemoteStorageConfig
from remote_storage import register_hooks as register_remote_hooks

AuthType = Literal["Trust", "NeonJWT"]
AUTH_TYPES = ("Trust", "NeonJWT")

DEFAULT_PG_PORT = 64000
DEFAULT_HTTP_PORT = 9898
_NO_PRECHECK = (
    "removed: the pageserver no longer has a WAL pre-check child (the ingest checks every "
    "record itself, in one process); delete this key"
)
# Keys older pageservers took: a file that still sets one is refused with this text, not
# ignored (a setting that silently does nothing would mislead whoever reads the file).
REMOVED_KEYS = {
    "wal_precheck_min_bytes": _NO_PRECHECK,
    "wal_precheck_max_children": _NO_PRECHECK,
}


def _addr_ok(value: str) -> bool:
    host, sep, port = value.rpartition(":")
    return bool(sep and host and port.isdigit() and 0 <= int(port) <= 65535)


def _check_addr(_inst: object, attr: attrs.Attribute[str], value: str) -> None:
    if not _addr_ok(value):
        raise ValueError(f"{attr.name} must be HOST:PORT, got {value!r}")


def _check_addrs(_inst: object, attr: attrs.Attribute[tuple[str, ...]], value: tuple[str, ...]) -> None:
    for item in value:
        if not _addr_ok(item):
            raise ValueError(f"{attr.name} entries must be HOST:PORT, got {item!r}")


def _positive(_inst: object, attr: attrs.Attribute[float], value: float) -> None:
    if value <= 0:
        raise ValueError(f"{attr.name} must be positive, got {value}")


def split_addr(addr: str) -> tuple[str, int]:
    host, _, port = addr.rpartition(":")
    return host, int(port)


@attrs.frozen(kw_only=True)
class PageserverConfig:
    workdir: Path
    id: int = 1
    listen_pg_addr: str = attrs.field(default=f"127.0.0.1:{DEFAULT_PG_PORT}", validator=_check_addr)
    listen_http_addr: str = attrs.field(default=f"127.0.0.1:{DEFAULT_HTTP_PORT}", validator=_check_addr)
    page_service_pipelining: PagePipelining = DEFAULT_PIPELINING
    max_get_vectored_keys: int = MAX_GET_VECTORED_KEYS
    wait_lsn_timeout_s: float = attrs.field(default=60.0, validator=_positive)
    io_engine: Literal["blocking", "threadpool"] | None = attrs.field(
        default=None, validator=attrs.validators.optional(attrs.validators.in_(("blocking", "threadpool")))
    )
    tenant_config: StorageConfig = attrs.field(factory=StorageConfig)
    # WAL receivers pull each timeline's WAL from these (host:port); empty = no WAL receivers.
    safekeepers: tuple[str, ...] = attrs.field(default=(), validator=_check_addrs)
    log_file: Path | None = None
    log_level: Literal["debug", "info", "warning", "error"] = "info"
    # Seconds a stopping node gives open connections before cancelling them.
    shutdown_timeout_s: float = attrs.field(default=5.0, validator=_positive)
    # Redo compares every replayed page with the wal_consistency_checking image its record
    # carries (masked); a difference fails the read (docs/redo.md). Costs CPU: tests only.
    validate_redo: bool = False
    # Authentication (docs/auth.md): "NeonJWT" checks a JWT on that port against the keys at
    # auth_validation_public_key_path (a PEM file or a directory of them); "Trust" admits all.
    pg_auth_type: AuthType = attrs.field(default="Trust", validator=attrs.validators.in_(AUTH_TYPES))
    http_auth_type: AuthType = attrs.field(default="Trust", validator=attrs.validators.in_(AUTH_TYPES))
    auth_validation_public_key_path: Path | None = None
    # TLS on both ports when set (libpq: SSLRequest answered S, plaintext refused; HTTP: https).
    ssl_cert_file: Path | None = None
    ssl_key_file: Path | None = None
    # CA the WAL receivers verify the safekeepers' certificates with (TLS to them when set),
    # and the upcalls the storage controller's (when control_plane_api is https).
    ssl_ca_file: Path | None = None
    # The durable tier (remote-storage.md): {kind = "local", path = "..."} or {kind = "s3",
    # endpoint, bucket, prefix, region}; None: layers live on this node's disk only.
    remote_storage: RemoteStorageConfig | None = None
    # The storage controller's upcall API (e.g. "http://127.0.0.1:1234/upcall/v1/"): it hands
    # out each tenant's generation at start-up and validates it before deletions and before
    # remote_consistent_lsn is reported. None: this node issues its own generations.
    control_plane_api: str | None = None

    def __attrs_post_init__(self) -> None:
        if (self.ssl_cert_file is None) != (self.ssl_key_file is None):
            raise ValueError("ssl_cert_file and ssl_key_file go together: set both or neither")

    def _in_workdir(self, path: Path) -> Path:
        return path if path.is_absolute() else self.workdir / path

    @property
    def auth_enabled(self) -> bool:
        return "NeonJWT" in (self.pg_auth_type, self.http_auth_type)

    @property
    def auth_key_path(self) -> Path:
        """Neon's default when unset: ``<workdir>/auth_public_key.pem``."""
        path = self.auth_validation_public_key_path or Path("auth_public_key.pem")
        return self._in_workdir(path)

    @property
    def ssl_paths(self) -> tuple[Path, Path] | None:
        if self.ssl_cert_file is None or self.ssl_key_file is None:
            return None
        return self._in_workdir(self.ssl_cert_file), self._in_workdir(self.ssl_key_file)

    @property
    def ssl_ca_path(self) -> Path | None:
        return None if self.ssl_ca_file is None else self._in_workdir(self.ssl_ca_file)

    @property
    def tenants_dir(self) -> Path:
        return self.workdir / "tenants"

    @property
    def log_path(self) -> Path | None:
        if self.log_file is None:
            return None
        return self.log_file if self.log_file.is_absolute() else self.workdir / self.log_file

    @property
    def pg_addr(self) -> tuple[str, int]:
        return split_addr(self.listen_pg_addr)

    @property
    def http_addr(self) -> tuple[str, int]:
        return split_addr(self.listen_http_addr)

    def storage_config(self) -> StorageConfig:
        """Tenant defaults with the node-wide overrides applied."""
        cfg = attrs.evolve(self.tenant_config, wait_lsn_timeout_s=self.wait_lsn_timeout_s)
        if self.io_engine is not None:
            cfg = attrs.evolve(cfg, io_engine=self.io_engine)
        return cfg

    def page_service_config(self) -> PageServiceConfig:
        return PageServiceConfig(
            max_get_vectored_keys=self.max_get_vectored_keys,
            page_service_pipelining=self.page_service_pipelining,
            wait_lsn_timeout_s=self.wait_lsn_timeout_s,
        )


def make_pageserver_converter() -> cattrs.Converter:
    conv = make_converter()
    register_hooks(conv)
    register_remote_hooks(conv)
    return conv


def load_pageserver_config(path: Path) -> PageserverConfig:
    """Read ``path``; ``common.config.ConfigError`` names every bad key. A relative ``workdir``
    is relative to the file's directory."""
    cfg = load_config(PageserverConfig, path, converter=make_pageserver_converter(),
                      removed=REMOVED_KEYS)
    if not cfg.workdir.is_absolute():
        cfg = attrs.evolve(cfg, workdir=(path.parent / cfg.workdir).resolve())
    rs = cfg.remote_storage
    if isinstance(rs, LocalStorageConfig) and not rs.path.is_absolute():
        cfg = attrs.evolve(cfg, remote_storage=attrs.evolve(rs, path=cfg.workdir / rs.path))
    return cfg


def parse_pageserver_config(text: str) -> PageserverConfig:
    import tomllib

    return structure_config(PageserverConfig, tomllib.loads(text), converter=make_pageserver_converter(),
                            removed=REMOVED_KEYS)


def dump_pageserver_config(cfg: PageserverConfig) -> str:
    return dump_config(cfg, converter=make_pageserver_converter())
