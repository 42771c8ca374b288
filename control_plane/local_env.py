"""The local cluster directory (``pagestore init``): its layout, its config and its state.

A cluster directory (default ``./.pagestore``, or ``$PAGESTORE_WORKDIR``) holds::

    pagestore.toml             ports of every node (LocalEnvConfig)
    branches.json              default tenant and branch name -> timeline id, per tenant
    auth_private_key.pem       Ed25519 key the CLI signs tokens with (mode 0600; auth on)
    auth_public_key.pem        what every node verifies tokens with
    ca/                        ca.crt, ca.key (0600): the local CA (``init --tls``)
    pageserver/                pageserver.toml, pageserver.log (JSON lines), stdout.log, pid,
                               tenants/ (the pageserver's own data), server.crt/key (TLS);
                               with ``init --pageservers N`` (N > 1) pageserver_1/ .. pageserver_N/
    storage_controller/        storage_controller.toml, generations.json, stdout.log, pid: which
                               pageserver holds each tenant, in which generation (N > 1 only)
    safekeeper_<i>/            safekeeper.toml, safekeeper.log, stdout.log, pid, data/,
                               server.crt/key (TLS)
    endpoints/<name>/          endpoint.json, pgdata/ (owned by postgres), bridge.log, bridge.pid,
                               bridge-status.json

Node configs hold only what differs per cluster (ids, ports, paths); ``init`` loads each one
back with the node's own loader (``pageserver.config``, ``safekeeper.config``), so it cannot
leave a file a node would refuse.
"""

from __future__ import annotations

import json
import os
import socket
import ssl
from pathlib import Path
from typing import Any

import attrs
import tomli_w

from common.auth import (
    PRIVATE_KEY_NAME,
    PUBLIC_KEY_NAME,
    AuthKeyError,
    Scope,
    encode_token,
    generate_keypair,
    load_private_key,
)
from common.config import ConfigError, dump_config, load_config
from common.ports import free_port
from common.tls import (
    CA_CERT_NAME,
    CERT_NAME,
    KEY_NAME,
    client_context,
    make_local_ca,
    make_node_cert,
)
from control_plane.http_client import register_credentials
from pageserver.config import PageserverConfig, load_pageserver_config
from protocol.ids import TenantId
from remote_storage.seaweedfs import SeaweedPorts
from safekeeper.config import SafekeeperConfig
from safekeeper.config import load_config as load_safekeeper_config

__all__ = [
    "DEFAULT_ENDPOINT_BASE_PORT",
    "ConfigError",
    "LocalEnv",
    "LocalEnvConfig",
    "LocalEnvError",
    "NodePorts",
    "default_workdir",
]

DEFAULT_PAGESERVER_PG_PORT = 64000  # pageserver i (from 1) listens on 64000 + i - 1
DEFAULT_PAGESERVER_HTTP_PORT = 9898  # ... and 9898 + i - 1
DEFAULT_STORAGE_CONTROLLER_PORT = 1234  # neon_local's
DEFAULT_SAFEKEEPER_PG_PORT = 5453  # safekeeper i (from 1) listens on 5453 + i
DEFAULT_SAFEKEEPER_HTTP_PORT = 7675  # ... and 7675 + i
DEFAULT_ENDPOINT_BASE_PORT = 55431  # endpoint i (from 1) on 55431 + i
CONFIG_NAME = "pagestore.toml"
STATE_NAME = "branches.json"


class LocalEnvError(Exception):
    """A cluster-directory problem the user must fix; the message says what."""


def default_workdir() -> Path:
    return Path(os.environ.get("PAGESTORE_WORKDIR", ".pagestore"))


@attrs.frozen
class NodePorts:
    pg: int
    http: int


@attrs.frozen(kw_only=True)
class LocalEnvConfig:
    """``pagestore.toml``: where every node listens. ``endpoint_base_port = 0`` means each
    endpoint takes a free port from the OS (what tests use)."""

    pageserver: NodePorts  # pageserver 1
    safekeepers: list[NodePorts]
    # Pageservers 2..N (`init --pageservers N`); they share the remote storage, and a storage
    # controller (on storage_controller_port, 0 = none) hands out the tenants' generations.
    more_pageservers: list[NodePorts] = attrs.field(factory=list)
    storage_controller_port: int = 0
    endpoint_base_port: int = DEFAULT_ENDPOINT_BASE_PORT
    # Safekeepers skip fsync: for tests on slow disks only; commits are then not durable.
    safekeeper_no_sync: bool = False
    # The pageserver checks its redo against wal_consistency_checking images (tests).
    validate_redo: bool = False
    # Bytes of written pages a lazy endpoint's page filesystem keeps before it evicts.
    local_cache_size: int = 1 << 30
    # Every node port checks JWTs (docs/auth.md); off only with `init --no-auth`.
    auth: bool = True
    # TLS on every node port, certificates from the cluster's local CA (`init --tls`).
    tls: bool = False
    # The pageserver's remote storage (docs/remote-storage.md): "none", "local" (a directory of
    # the cluster), "seaweedfs" (a SeaweedFS node of the cluster) or "s3" (s3_bucket/s3_prefix
    # at s3_endpoint, or AWS when that is empty).
    remote_storage: str = attrs.field(
        default="none", validator=attrs.validators.in_(("none", "local", "seaweedfs", "s3"))
    )
    s3_bucket: str = ""
    s3_prefix: str = ""
    s3_endpoint: str = ""
    seaweedfs: SeaweedPorts | None = None


def port_free(port: int) -> bool:
    with socket.socket() as s:
        # As the nodes' listeners do: a port with connections in TIME_WAIT is free for them.
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def _free_ports(n: int) -> list[int]:
    """``n`` distinct ports free now (see ``common.ports``: never handed out twice)."""
    return [free_port() for _ in range(n)]


def plan_ports(safekeepers: int, *, port_offset: int = 0, free_ports: bool = False,
               pageservers: int = 1) -> LocalEnvConfig:
    """Ports of ARCHITECTURE §2 shifted by ``port_offset``, or all picked free by the OS."""
    if safekeepers < 1:
        raise LocalEnvError(f"--safekeepers must be at least 1, got {safekeepers}")
    if pageservers < 1:
        raise LocalEnvError(f"--pageservers must be at least 1, got {pageservers}")
    if free_ports:
        ports = _free_ports(2 * pageservers + 2 * safekeepers + (pageservers > 1))
        sk = 2 * pageservers
        return LocalEnvConfig(
            pageserver=NodePorts(ports[0], ports[1]),
            more_pageservers=[NodePorts(ports[2 * i], ports[2 * i + 1]) for i in range(1, pageservers)],
            safekeepers=[NodePorts(ports[sk + 2 * i], ports[sk + 2 * i + 1]) for i in range(safekeepers)],
            storage_controller_port=ports[-1] if pageservers > 1 else 0,
            endpoint_base_port=0,
        )
    o = port_offset
    cfg = LocalEnvConfig(
        pageserver=NodePorts(DEFAULT_PAGESERVER_PG_PORT + o, DEFAULT_PAGESERVER_HTTP_PORT + o),
        more_pageservers=[NodePorts(DEFAULT_PAGESERVER_PG_PORT + i + o, DEFAULT_PAGESERVER_HTTP_PORT + i + o)
                          for i in range(1, pageservers)],
        safekeepers=[
            NodePorts(DEFAULT_SAFEKEEPER_PG_PORT + i + o, DEFAULT_SAFEKEEPER_HTTP_PORT + i + o)
            for i in range(1, safekeepers + 1)
        ],
        storage_controller_port=DEFAULT_STORAGE_CONTROLLER_PORT + o if pageservers > 1 else 0,
        endpoint_base_port=DEFAULT_ENDPOINT_BASE_PORT + o,
    )
    for p in _all_ports(cfg):
        if not 0 < p < 65536:
            raise LocalEnvError(f"port {p} is out of range (check --port-offset)")
    return cfg


def _all_ports(cfg: LocalEnvConfig) -> list[int]:
    nodes = [cfg.pageserver, *cfg.more_pageservers, *cfg.safekeepers]
    return [x for n in nodes for x in (n.pg, n.http)] + (
        [cfg.storage_controller_port] if cfg.storage_controller_port else [])


@attrs.define
class LocalEnv:
    """An initialized cluster directory."""

    workdir: Path
    config: LocalEnvConfig

    # -- layout ---------------------------------------------------------------------------------

    @property
    def pageserver_ids(self) -> list[int]:
        return list(range(1, 2 + len(self.config.more_pageservers)))

    def pageserver_name(self, ps_id: int) -> str:
        """``pageserver`` in a one-pageserver cluster, else ``pageserver_<id>``."""
        if ps_id not in self.pageserver_ids:
            raise LocalEnvError(f"no pageserver {ps_id} in this cluster (it has {len(self.pageserver_ids)})")
        return "pageserver" if len(self.pageserver_ids) == 1 else f"pageserver_{ps_id}"

    def pageserver_id(self, name: str) -> int:
        """The id of a pageserver named ``pageserver_<id>`` (or ``pageserver``: the first)."""
        raw = name.removeprefix("pageserver").removeprefix("_") or "1"
        if not raw.isdigit() or int(raw) not in self.pageserver_ids:
            names = ", ".join(self.pageserver_name(i) for i in self.pageserver_ids)
            raise LocalEnvError(f"no pageserver {name!r} in this cluster (pageservers: {names})")
        return int(raw)

    def pageserver_dir_of(self, ps_id: int) -> Path:
        return self.workdir / self.pageserver_name(ps_id)

    def pageserver_ports(self, ps_id: int) -> NodePorts:
        self.pageserver_name(ps_id)
        return self.config.pageserver if ps_id == 1 else self.config.more_pageservers[ps_id - 2]

    def pageserver_http_of(self, ps_id: int) -> str:
        return f"{self._scheme}://127.0.0.1:{self.pageserver_ports(ps_id).http}"

    def pageserver_config_path_of(self, ps_id: int) -> Path:
        return self.pageserver_dir_of(ps_id) / "pageserver.toml"

    @property
    def pageserver_dir(self) -> Path:
        return self.pageserver_dir_of(1)

    @property
    def storage_controller_dir(self) -> Path:
        return self.workdir / "storage_controller"

    @property
    def storage_controller_url(self) -> str | None:
        """The controller's HTTP API (None: a one-pageserver cluster issues its own generations)."""
        port = self.config.storage_controller_port
        return None if not port else f"{self._scheme}://127.0.0.1:{port}"

    def safekeeper_dir(self, sk_id: int) -> Path:
        return self.workdir / f"safekeeper_{sk_id}"

    @property
    def endpoints_dir(self) -> Path:
        return self.workdir / "endpoints"

    def node_dirs(self) -> list[tuple[str, Path]]:
        """(node name, directory) of every storage node: the pageservers first (in id order),
        then the safekeepers (in id order), then the storage controller and the SeaweedFS
        node if the cluster has them."""
        nodes = [(self.pageserver_name(i), self.pageserver_dir_of(i)) for i in self.pageserver_ids] + [
            (f"safekeeper_{i}", self.safekeeper_dir(i)) for i in self.safekeeper_ids
        ]
        if self.storage_controller_url is not None:
            nodes.append(("storage_controller", self.storage_controller_dir))
        if self.config.remote_storage == "seaweedfs":
            nodes.append(("seaweedfs", self.seaweedfs_dir))
        return nodes

    @property
    def seaweedfs_dir(self) -> Path:
        return self.workdir / "seaweedfs"

    @property
    def remote_storage_dir(self) -> Path:
        return self.workdir / "remote_storage"

    def remote_storage_table(self) -> dict[str, Any] | None:
        c = self.config
        if c.remote_storage == "local":
            return {"kind": "local", "path": str(self.remote_storage_dir)}
        if c.remote_storage == "seaweedfs":
            assert c.seaweedfs is not None
            # SeaweedFS without an identity config accepts any keys; boto3 needs some.
            return {"kind": "s3", "endpoint": c.seaweedfs.endpoint, "bucket": "pagestore",
                    "access_key_id": "pagestore", "secret_access_key": "pagestore", "create_bucket": True}
        if c.remote_storage == "s3":
            table: dict[str, Any] = {"kind": "s3", "bucket": c.s3_bucket, "prefix": c.s3_prefix}
            if c.s3_endpoint:
                table["endpoint"] = c.s3_endpoint
            return table
        return None

    @property
    def safekeeper_ids(self) -> list[int]:
        return list(range(1, len(self.config.safekeepers) + 1))

    def safekeeper_ports(self, sk_id: int) -> NodePorts:
        return self.config.safekeepers[sk_id - 1]

    @property
    def _scheme(self) -> str:
        return "https" if self.config.tls else "http"

    @property
    def pageserver_http(self) -> str:
        """Pageserver 1's HTTP API (tenants may be elsewhere: ``cluster.tenant_pageserver``)."""
        return self.pageserver_http_of(1)

    def safekeeper_http(self, sk_id: int) -> str:
        return f"{self._scheme}://127.0.0.1:{self.safekeeper_ports(sk_id).http}"

    # -- auth and TLS ---------------------------------------------------------------------------

    @property
    def private_key_path(self) -> Path:
        return self.workdir / PRIVATE_KEY_NAME

    @property
    def public_key_path(self) -> Path:
        return self.workdir / PUBLIC_KEY_NAME

    @property
    def ca_dir(self) -> Path:
        return self.workdir / "ca"

    @property
    def ca_file(self) -> Path | None:
        """The CA clients verify the nodes against (None: no TLS)."""
        return self.ca_dir / CA_CERT_NAME if self.config.tls else None

    def token(self, scope: Scope, tenant_id: str | None = None, *, ttl_s: float | None = None) -> str | None:
        """A token signed with the cluster's key (None when auth is off). Without ``ttl_s``
        it has no ``exp``: the nodes' and endpoints' own tokens, as neon_local mints them."""
        if not self.config.auth:
            return None
        try:
            key = load_private_key(self.private_key_path)
        except AuthKeyError as exc:
            raise LocalEnvError(f"cannot sign a token: {exc}") from None
        tenant = None if tenant_id is None else TenantId.parse(tenant_id)
        return encode_token(key, scope, tenant, ttl_s=ttl_s)

    def client_ssl_context(self) -> ssl.SSLContext | None:
        return None if self.ca_file is None else client_context(self.ca_file)

    def page_client_auth(self, tenant_id: str) -> dict[str, Any]:
        """``password`` / ``ssl_context`` keywords of ``compute.page_client`` for a tenant."""
        return {"password": self.token(Scope.TENANT, tenant_id), "ssl_context": self.client_ssl_context()}

    def pg_client_params(self, token: str | None) -> dict[str, str]:
        """``password`` / ``sslrootcert`` for ``common.pgclient.connect_with_params``."""
        params: dict[str, str] = {}
        if token is not None:
            params["password"] = token
        if self.ca_file is not None:
            params["sslrootcert"] = str(self.ca_file)
        return params

    def register_http_credentials(self) -> None:
        """Make the CLI's HTTP calls to these nodes carry their tokens and verify TLS."""
        ctx = self.client_ssl_context()
        for i in self.pageserver_ids:
            register_credentials(self.pageserver_http_of(i), self.token(Scope.PAGESERVERAPI), ctx)
        sk_token = self.token(Scope.SAFEKEEPERDATA)
        for i in self.safekeeper_ids:
            register_credentials(self.safekeeper_http(i), sk_token, ctx)
        if self.storage_controller_url is not None:
            register_credentials(self.storage_controller_url, self.token(Scope.ADMIN), ctx)

    def _create_credentials(self) -> None:
        if self.config.auth:
            generate_keypair(self.workdir)
        if self.config.tls:
            make_local_ca(self.ca_dir)
            for name, node_dir in self.node_dirs():
                make_node_cert(self.ca_dir, node_dir, name)

    @property
    def safekeeper_pg_addrs(self) -> list[str]:
        return [f"127.0.0.1:{p.pg}" for p in self.config.safekeepers]

    # -- create / load ----------------------------------------------------------------------------

    @classmethod
    def create(cls, workdir: Path, config: LocalEnvConfig, *, force: bool = False) -> LocalEnv:
        workdir = workdir.absolute()
        if (workdir / CONFIG_NAME).exists() and not force:
            raise LocalEnvError(f"{workdir} is already a pagestore cluster directory (remove it first)")
        if len(config.more_pageservers) > 0 and config.remote_storage == "none":
            raise LocalEnvError("several pageservers need a shared remote storage: add --remote-storage "
                                "local, seaweedfs or s3://BUCKET/PREFIX")
        if config.endpoint_base_port != 0:
            busy = [p for p in _all_ports(config) if not port_free(p)]
            if busy:
                raise LocalEnvError(
                    f"ports {', '.join(map(str, busy))} are in use; pick others with --port-offset N "
                    "or --free-ports"
                )
        workdir.mkdir(parents=True, exist_ok=True)
        # The postgres user runs the endpoints below this directory; it must be able to enter it.
        os.chmod(workdir, 0o755)
        env = cls(workdir, config)
        (workdir / CONFIG_NAME).write_text(dump_config(config))
        for i in env.pageserver_ids:
            env.pageserver_dir_of(i).mkdir(exist_ok=True)
            env.pageserver_config_path_of(i).write_text(tomli_w.dumps(env.pageserver_config_table(i)))
        if env.storage_controller_url is not None:
            env.storage_controller_dir.mkdir(exist_ok=True)
            env.storage_controller_config_path.write_text(tomli_w.dumps(env.storage_controller_config_table()))
        for i in env.safekeeper_ids:
            env.safekeeper_dir(i).mkdir(exist_ok=True)
            env.safekeeper_config_path(i).write_text(tomli_w.dumps(env.safekeeper_config_table(i)))
        env.check_node_configs()
        env._create_credentials()
        env.register_http_credentials()
        env.endpoints_dir.mkdir(exist_ok=True)
        os.chmod(env.endpoints_dir, 0o755)
        env.save_state({"default_tenant_id": None, "branches": {}})
        return env

    @classmethod
    def load(cls, workdir: Path) -> LocalEnv:
        workdir = workdir.absolute()
        path = workdir / CONFIG_NAME
        if not path.exists():
            raise LocalEnvError(f"{workdir} is not a pagestore cluster directory: run `pagestore init` first")
        env = cls(workdir, load_config(LocalEnvConfig, path))
        env.register_http_credentials()
        return env

    # -- node configs -----------------------------------------------------------------------------

    @property
    def pageserver_config_path(self) -> Path:
        return self.pageserver_config_path_of(1)

    @property
    def storage_controller_config_path(self) -> Path:
        return self.storage_controller_dir / "storage_controller.toml"

    def storage_controller_config_table(self) -> dict[str, Any]:
        d = self.storage_controller_dir
        table: dict[str, Any] = {"workdir": str(d),
                                 "listen_http_addr": f"127.0.0.1:{self.config.storage_controller_port}",
                                 "log_file": str(d / "storage_controller.log")}
        # Only its HTTP port: the pg keys of _auth_table are not the controller's.
        if self.config.auth:
            table.update(http_auth_type="NeonJWT", auth_validation_public_key_path=str(self.public_key_path))
        if self.config.tls:
            table.update(ssl_cert_file=str(d / CERT_NAME), ssl_key_file=str(d / KEY_NAME))
        return table

    def safekeeper_config_path(self, sk_id: int) -> Path:
        return self.safekeeper_dir(sk_id) / "safekeeper.toml"

    def pageserver_config_table(self, ps_id: int = 1) -> dict[str, Any]:
        """Only what differs per cluster: the node's own defaults stay the node's."""
        p = self.pageserver_ports(ps_id)
        d = self.pageserver_dir_of(ps_id)
        return {
            "id": ps_id,
            "workdir": str(d),
            "listen_pg_addr": f"127.0.0.1:{p.pg}",
            "listen_http_addr": f"127.0.0.1:{p.http}",
            "safekeepers": self.safekeeper_pg_addrs,
            "log_file": "pageserver.log",
            **({"validate_redo": True} if self.config.validate_redo else {}),
            **self._auth_table(d),
            **({"ssl_ca_file": str(self.ca_dir / CA_CERT_NAME)} if self.config.tls else {}),
            **({"remote_storage": rs} if (rs := self.remote_storage_table()) is not None else {}),
            **({"control_plane_api": f"{sc}/upcall/v1/"} if (sc := self.storage_controller_url) else {}),
        }

    def _auth_table(self, node_dir: Path) -> dict[str, str]:
        table: dict[str, str] = {}
        if self.config.auth:
            table.update(pg_auth_type="NeonJWT", http_auth_type="NeonJWT",
                         auth_validation_public_key_path=str(self.public_key_path))
        if self.config.tls:
            table.update(ssl_cert_file=str(node_dir / CERT_NAME), ssl_key_file=str(node_dir / KEY_NAME))
        return table

    def safekeeper_config_table(self, sk_id: int) -> dict[str, Any]:
        p = self.safekeeper_ports(sk_id)
        d = self.safekeeper_dir(sk_id)
        return {
            "id": sk_id,
            "data_dir": str(d / "data"),
            "listen_pg": f"127.0.0.1:{p.pg}",
            "listen_http": f"127.0.0.1:{p.http}",
            "no_sync": self.config.safekeeper_no_sync,
            "log_file": str(d / "safekeeper.log"),
            **self._auth_table(d),
            **self._wal_backup_table(sk_id),
        }

    def _wal_backup_table(self, sk_id: int) -> dict[str, Any]:
        """With remote storage: WAL backup to it (the election ranks every safekeeper), and the
        others' remote_consistent_lsn shared with this one (safekeeper.peers), so that every
        safekeeper trims what the backup and the pageserver both have."""
        rs = self.remote_storage_table()
        if rs is None:
            return {}
        return {
            "remote_storage": rs,
            "wal_backup_peers": self.safekeeper_ids,
            "peer_http": [self.safekeeper_http(i) for i in self.safekeeper_ids if i != sk_id],
            **({"ssl_ca_file": str(self.ca_dir / CA_CERT_NAME)} if self.config.tls else {}),
        }

    def check_node_configs(self) -> tuple[PageserverConfig, list[SafekeeperConfig]]:
        """Load every node config with the node's own loader (``ConfigError`` names a bad key)."""
        ps = load_pageserver_config(self.pageserver_config_path)
        for i in self.pageserver_ids[1:]:
            load_pageserver_config(self.pageserver_config_path_of(i))
        sks = [load_safekeeper_config(self.safekeeper_config_path(i)) for i in self.safekeeper_ids]
        return ps, sks

    # -- state: tenants and branch names ----------------------------------------------------------

    @property
    def state_path(self) -> Path:
        return self.workdir / STATE_NAME

    def load_state(self) -> dict[str, object]:
        try:
            data = json.loads(self.state_path.read_text())
        except (OSError, ValueError) as exc:
            raise LocalEnvError(f"cannot read {self.state_path}: {exc}") from None
        if not isinstance(data, dict) or not isinstance(data.get("branches"), dict):
            raise LocalEnvError(f"{self.state_path} is not a pagestore state file")
        return data

    def save_state(self, state: dict[str, object]) -> None:
        tmp = self.state_path.with_suffix(".tmp")
        tmp.write_text(json.dumps(state, indent=2, sort_keys=True) + "\n")
        os.replace(tmp, self.state_path)

    def branches(self, tenant_id: str) -> dict[str, str]:
        branches = self.load_state()["branches"]
        assert isinstance(branches, dict)
        found = branches.get(tenant_id, {})
        assert isinstance(found, dict)
        return dict(found)

    def default_tenant(self) -> str | None:
        value = self.load_state().get("default_tenant_id")
        return value if isinstance(value, str) else None

    def resolve_tenant(self, tenant_id: str | None) -> str:
        if tenant_id:
            return tenant_id
        default = self.default_tenant()
        if default is None:
            raise LocalEnvError("no tenant yet: run `pagestore tenant create` first")
        return default

    def add_branch(self, tenant_id: str, name: str, timeline_id: str, *, make_default: bool = False) -> None:
        state = self.load_state()
        branches = state["branches"]
        assert isinstance(branches, dict)
        per_tenant = branches.setdefault(tenant_id, {})
        if name in per_tenant and per_tenant[name] != timeline_id:
            raise LocalEnvError(f"branch {name!r} already exists for tenant {tenant_id}")
        per_tenant[name] = timeline_id
        if make_default or state.get("default_tenant_id") is None:
            state["default_tenant_id"] = tenant_id
        self.save_state(state)

    def remove_timeline_branches(self, tenant_id: str, timelines: set[str] | None) -> list[str]:
        """Forget the branch names of these timelines (None: the whole tenant, and it stops
        being the default); the names removed."""
        state = self.load_state()
        branches = state["branches"]
        assert isinstance(branches, dict)
        per_tenant = branches.get(tenant_id, {})
        assert isinstance(per_tenant, dict)
        gone = sorted(n for n, tl in per_tenant.items() if timelines is None or tl in timelines)
        for name in gone:
            del per_tenant[name]
        if timelines is None:
            branches.pop(tenant_id, None)
            if state.get("default_tenant_id") == tenant_id:
                state["default_tenant_id"] = None
        self.save_state(state)
        return gone

    def timeline_of_branch(self, tenant_id: str, name: str) -> str:
        branches = self.branches(tenant_id)
        if name not in branches:
            known = ", ".join(sorted(branches)) or "none"
            raise LocalEnvError(f"no branch {name!r} in tenant {tenant_id} (branches: {known})")
        return branches[name]

    def branch_of_timeline(self, tenant_id: str, timeline_id: str) -> str | None:
        for name, tl in self.branches(tenant_id).items():
            if tl == timeline_id:
                return name
        return None
