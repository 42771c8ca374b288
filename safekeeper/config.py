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
    wal_removal_period_s = 10.0  # how often old WAL segments are removed; 0 = never
"""

from __future__ import annotations

from pathlib import Path

import attrs

from common.config import ConfigError, structure_config
from common.config import load_config as _load_config
from common.logging import LEVELS

__all__ = ["ConfigError", "SafekeeperConfig", "load_config", "parse_config"]

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
    wal_removal_period_s: float = attrs.field(default=10.0, validator=_non_negative_float)
    log_level: str = attrs.field(default="info", validator=attrs.validators.in_(LEVELS))
    log_file: str | None = None

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


def parse_config(data: dict[str, object]) -> SafekeeperConfig:
    return structure_config(SafekeeperConfig, data, source="safekeeper config")


def load_config(path: Path) -> SafekeeperConfig:
    return _load_config(SafekeeperConfig, path)
