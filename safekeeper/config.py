"""Safekeeper node configuration: one TOML file, structured into attrs classes by cattrs.

Unknown keys and bad values stop start-up with a message naming the key.

    id = 1
    listen_pg = "127.0.0.1:5454"
    listen_http = "127.0.0.1:7676"
    data_dir = "/var/lib/pagestore/sk1"
    no_sync = false
    ingest_queue = 4096          # AppendRequests buffered between the reader and the writer
    max_write_bytes = 1048576    # coalesce up to this much WAL per write+fsync; 0 = off
    ingest_queue_bytes = 8388608 # WAL received but not yet written, at most (about)
    wal_io_engine = "writer-thread"  # or "threadpool": how WAL writes leave the event loop (safekeeper.wal_io)
    wal_direct_io = true         # write WAL segments with O_DIRECT (no page-cache copy; safekeeper.wal_storage)
    gil_switch_interval_s = 0.0005  # sys.setswitchinterval: how soon the WAL writer thread gets the GIL back
    wal_removal_period_s = 10.0  # how often old WAL segments are removed; 0 = never
    remote_storage = {kind = "local", path = "/var/lib/pagestore/remote_storage"}  # WAL backup
    wal_backup_peers = [1, 2, 3] # every safekeeper's id, for the backup election (docs/remote-storage.md)
    wal_backup_period_s = 1.0    # how often closed segments are looked for and uploaded
    peer_http = ["http://127.0.0.1:7677"]  # the other safekeepers' HTTP (safekeeper.peers)
    pg_auth_type = "NeonJWT"     # or "Trust"; http_auth_type likewise (docs/auth.md)
    auth_validation_public_key_path = "/var/lib/pagestore/auth_public_key.pem"
    ssl_cert_file = "/var/lib/pagestore/sk1/server.crt"   # with ssl_key_file: TLS on both ports
"""

from __future__ import annotations

from pathlib import Path

import attrs
import cattrs

from common.config import ConfigError, make_converter, structure_config
from common.config import load_config as _load_config
from common.logging import LEVELS
from protocol.lsn import WAL_SEGMENT_SIZE
from remote_storage import LocalStorageConfig, RemoteStorageConfig
from remote_storage import register_hooks as register_remote_hooks
from safekeeper.wal_io import ENGINES, WalIoEngine

__all__ = ["ConfigError", "SafekeeperConfig", "load_config", "parse_config"]

AUTH_TYPES = ("Trust", "NeonJWT")

DEFAULT_PG_PORT = 5454
DEFAULT_HTTP_PORT = 7676


def _check_addr(_inst: object, attr: attrs.Attribute[str], value: str) -> None:
    host, sep, port = value.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 <= int(port) <= 65535:
        raise ValueError(f"{attr.name} must be HOST:PORT, got {value!r}")


def _non_negative(_inst: object, attr: attrs.Attribute[int], value: int) -> None:
    if value < 0:
        raise ValueError(f"{attr.name} must be >= 0, got {value}")


def _non_negative_float(_inst: object, attr: attrs.Attribute[float], value: float) -> None:
    if not value >= 0:
        raise ValueError(f"{attr.name} must be >= 0, got {value}")


def _positive_float(_inst: object, attr: attrs.Attribute[float], value: float) -> None:
    if not value > 0:
        raise ValueError(f"{attr.name} must be > 0, got {value}")


def _switch_interval(_inst: object, attr: attrs.Attribute[float], value: float) -> None:
    # CPython reads back anything below 1 us, or absurdly large, as 0 and then switches every
    # microsecond: a value meant as "rarely" would become the most eager setting
    if not 1e-6 <= value <= 1.0:
        raise ValueError(f"{attr.name} must be between 1e-6 and 1.0 seconds, got {value}")


def _positive(_inst: object, attr: attrs.Attribute[int], value: int) -> None:
    if value < 1:
        raise ValueError(f"{attr.name} must be >= 1, got {value}")


@attrs.frozen
class SafekeeperConfig:
    data_dir: str
    id: int = attrs.field(default=1, validator=_non_negative)
    listen_pg: str = attrs.field(default=f"127.0.0.1:{DEFAULT_PG_PORT}", validator=_check_addr)
    listen_http: str = attrs.field(default=f"127.0.0.1:{DEFAULT_HTTP_PORT}", validator=_check_addr)
    no_sync: bool = False
    ingest_queue: int = attrs.field(default=4096, validator=_positive)
    max_write_bytes: int = attrs.field(default=1 << 20, validator=_non_negative)
    ingest_queue_bytes: int = attrs.field(default=8 << 20, validator=_positive)
    # "writer-thread": one thread per timeline takes the WAL writes in order without the
    # ingest loop waiting for each; "threadpool": one trio.to_thread call per write, awaited.
    wal_io_engine: WalIoEngine = attrs.field(
        default="writer-thread", validator=attrs.validators.in_(ENGINES)
    )
    # O_DIRECT writes of the WAL segments (safekeeper.wal_storage): no copy into new
    # page-cache pages, which under a sustained stream cost a buffered write most of its CPU
    # (docs/benchmarks.md, "O_DIRECT"). A filesystem without O_DIRECT fails the timeline's
    # load or creation with the reason; false writes through the page cache. With no_sync
    # (nothing is made durable: tests, CPU benchmarks) the page cache is used either way: a
    # direct write waits for the device, a buffered one without fsync never does.
    wal_direct_io: bool = True
    # sys.setswitchinterval for the node's process. The WAL writer thread needs the GIL back
    # after each pwritev/CRC call (both release it) to hand its result to the event loop;
    # with Python's 5 ms default it waits up to 5 ms behind the event loop's thread, longer
    # than a 1 MiB write group takes (docs/safekeeper.md, "the GIL").
    gil_switch_interval_s: float = attrs.field(default=0.0005, validator=_switch_interval)
    wal_removal_period_s: float = attrs.field(default=10.0, validator=_non_negative_float)
    log_level: str = attrs.field(default="info", validator=attrs.validators.in_(LEVELS))
    log_file: str | None = None
    # Authentication (docs/auth.md): "NeonJWT" checks a JWT against the keys at
    # auth_validation_public_key_path (a PEM file or a directory of them); "Trust" admits all.
    pg_auth_type: str = attrs.field(default="Trust", validator=attrs.validators.in_(AUTH_TYPES))
    http_auth_type: str = attrs.field(default="Trust", validator=attrs.validators.in_(AUTH_TYPES))
    auth_validation_public_key_path: str | None = None
    # TLS on both ports when set (libpq: SSLRequest answered S, plaintext refused; HTTP: https).
    ssl_cert_file: str | None = None
    ssl_key_file: str | None = None
    # WAL backup (safekeeper.wal_backup): closed segments go to this store; None = no backup,
    # and WAL removal then waits only for the pageserver and the peers (no backup_lsn term).
    remote_storage: RemoteStorageConfig | None = None
    # Every safekeeper of the cluster by id (this one included): the backup election ranks
    # them per timeline. Empty: this node alone (it is always the elected one).
    wal_backup_peers: list[int] = attrs.field(factory=list)
    wal_backup_period_s: float = attrs.field(default=1.0, validator=_positive_float)
    # A safekeeper of rank r > 0 uploads too once the remote is r * this many bytes of
    # closed WAL behind its own commit_lsn (the elected one is down or stuck).
    wal_backup_takeover_bytes: int = attrs.field(default=4 * WAL_SEGMENT_SIZE, validator=_positive)
    # The other safekeepers' HTTP base URLs: their remote_consistent_lsn is shared with this
    # node every peer_sync_period_s (safekeeper.peers); ssl_ca_file verifies https ones.
    peer_http: list[str] = attrs.field(factory=list)
    peer_sync_period_s: float = attrs.field(default=1.0, validator=_positive_float)
    ssl_ca_file: str | None = None

    def __attrs_post_init__(self) -> None:
        if (self.ssl_cert_file is None) != (self.ssl_key_file is None):
            raise ValueError("ssl_cert_file and ssl_key_file go together: set both or neither")
        if self.auth_enabled and not self.auth_validation_public_key_path:
            raise ValueError("auth_validation_public_key_path is required with NeonJWT auth")

    @property
    def auth_enabled(self) -> bool:
        return "NeonJWT" in (self.pg_auth_type, self.http_auth_type)

    @property
    def direct_io(self) -> bool:
        """Whether WAL segments are written with O_DIRECT: ``wal_direct_io``, for durable
        writes only (see the key)."""
        return self.wal_direct_io and not self.no_sync

    @property
    def data_path(self) -> Path:
        return Path(self.data_dir)

    @property
    def pg_addr(self) -> tuple[str, int]:
        host, _, port = self.listen_pg.rpartition(":")
        return host, int(port)

    @property
    def http_addr(self) -> tuple[str, int]:
        host, _, port = self.listen_http.rpartition(":")
        return host, int(port)


def _converter() -> cattrs.Converter:
    conv = make_converter()
    register_remote_hooks(conv)
    return conv


def _resolve(cfg: SafekeeperConfig) -> SafekeeperConfig:
    rs = cfg.remote_storage
    if isinstance(rs, LocalStorageConfig) and not rs.path.is_absolute():
        # Relative to the data directory, as the pageserver's is to its workdir.
        cfg = attrs.evolve(cfg, remote_storage=attrs.evolve(rs, path=cfg.data_path / rs.path))
    return cfg


def parse_config(data: dict[str, object]) -> SafekeeperConfig:
    return _resolve(structure_config(SafekeeperConfig, data, converter=_converter(),
                                     source="safekeeper config"))


def load_config(path: Path) -> SafekeeperConfig:
    return _resolve(_load_config(SafekeeperConfig, path, converter=_converter()))
