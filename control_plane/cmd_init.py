"""``pagestore init``: write a cluster directory: pageservers (a storage controller when there
are several), safekeepers, and optionally a remote storage."""

from __future__ import annotations

import argparse

from control_plane.cmd_common import add_json, add_workdir, emit, guarded, workdir_of
from control_plane.local_env import LocalEnv, LocalEnvConfig, LocalEnvError, plan_ports


def with_remote_storage(cfg: LocalEnvConfig, spec: str, endpoint: str, *, free_ports: bool,
                        port_offset: int) -> LocalEnvConfig:
    """``--remote-storage`` into the cluster config (ports for a SeaweedFS node as the others')."""
    import attrs

    from remote_storage.seaweedfs import PORT_NAMES, SeaweedPorts

    if spec in ("none", "local"):
        return attrs.evolve(cfg, remote_storage=spec)
    if spec == "seaweedfs":
        if free_ports:
            ports = SeaweedPorts.free()
        else:
            # weed's own defaults (S3 8333, master 9333, volume 8080, filer 8888), shifted
            base = {"master": 9333, "master_grpc": 19333, "volume": 8080, "volume_grpc": 18080,
                    "filer": 8888, "filer_grpc": 18888, "s3": 8333, "s3_grpc": 18333,
                    "s3_iceberg": 8181, "s3_lance": 8182, "metrics": 9327}
            ports = SeaweedPorts(*(base[n] + port_offset for n in PORT_NAMES))
        return attrs.evolve(cfg, remote_storage="seaweedfs", seaweedfs=ports)
    if spec.startswith("s3://"):
        bucket, _, prefix = spec.removeprefix("s3://").partition("/")
        if not bucket:
            raise LocalEnvError(f"--remote-storage {spec}: no bucket (want s3://BUCKET/PREFIX)")
        return attrs.evolve(cfg, remote_storage="s3", s3_bucket=bucket, s3_prefix=prefix.strip("/"),
                            s3_endpoint=endpoint)
    raise LocalEnvError(f"--remote-storage {spec!r}: want local, seaweedfs or s3://BUCKET/PREFIX")


def configure(parser: argparse.ArgumentParser) -> None:
    add_workdir(parser)
    parser.add_argument("--safekeepers", type=int, default=3, help="number of safekeepers (default 3)")
    parser.add_argument("--pageservers", type=int, default=1,
                        help="number of pageservers (default 1); more than one needs --remote-storage "
                             "and adds a storage controller node (tenant generations, `tenant migrate`)")
    ports = parser.add_mutually_exclusive_group()
    ports.add_argument("--port-offset", type=int, default=0,
                       help="add N to every default port (pageserver 64000/9898, safekeeper i "
                            "5453+i/7675+i, endpoint i 55431+i)")
    ports.add_argument("--free-ports", action="store_true",
                       help="let the OS pick free ports for every node and endpoint (tests)")
    parser.add_argument("--no-sync", action="store_true",
                        help="safekeepers skip fsync (tests on slow disks; commits are not durable)")
    parser.add_argument("--validate-redo", action="store_true",
                        help="the pageserver checks redo against wal_consistency_checking images (tests)")
    parser.add_argument("--no-auth", action="store_true",
                        help="a trusting cluster: no tokens on any port (default: every port checks "
                             "JWTs signed with the key init writes; see `pagestore token`)")
    parser.add_argument("--tls", action="store_true",
                        help="TLS on every port, certificates from a local CA written to <workdir>/ca")
    parser.add_argument("--remote-storage", default="none", metavar="local|seaweedfs|s3://BUCKET/PREFIX",
                        help="the pageserver's durable tier (docs/remote-storage.md): a directory of the "
                             "cluster, a SeaweedFS node of the cluster, or an S3 bucket (default: none)")
    parser.add_argument("--s3-endpoint", default="", help="S3 endpoint URL for s3://... (default: AWS)")
    parser.add_argument("--force", action="store_true", help="overwrite an existing pagestore.toml")
    add_json(parser)


@guarded
def run(args: argparse.Namespace) -> int:
    import attrs

    cfg = plan_ports(args.safekeepers, port_offset=args.port_offset, free_ports=args.free_ports,
                     pageservers=args.pageservers)
    if args.no_sync:
        cfg = attrs.evolve(cfg, safekeeper_no_sync=True)
    if args.validate_redo:
        cfg = attrs.evolve(cfg, validate_redo=True)
    cfg = attrs.evolve(cfg, auth=not args.no_auth, tls=args.tls)
    cfg = with_remote_storage(cfg, args.remote_storage, args.s3_endpoint, free_ports=args.free_ports,
                              port_offset=args.port_offset)
    env = LocalEnv.create(workdir_of(args), cfg, force=args.force)
    pageservers = [
        {"id": i, "name": env.pageserver_name(i), "pg_port": env.pageserver_ports(i).pg,
         "http_port": env.pageserver_ports(i).http, "config": str(env.pageserver_config_path_of(i))}
        for i in env.pageserver_ids
    ]
    data = {
        "workdir": str(env.workdir),
        "auth": cfg.auth,
        "tls": cfg.tls,
        "ca_file": None if env.ca_file is None else str(env.ca_file),
        "pageserver": {"pg_port": cfg.pageserver.pg, "http_port": cfg.pageserver.http,
                       "config": str(env.pageserver_config_path)},
        "pageservers": pageservers,
        "storage_controller": env.storage_controller_url,
        "safekeepers": [
            {"id": i, "pg_port": env.safekeeper_ports(i).pg, "http_port": env.safekeeper_ports(i).http,
             "config": str(env.safekeeper_config_path(i))}
            for i in env.safekeeper_ids
        ],
    }
    security = ("auth on (tokens: pagestore token --tenant-id T)" if cfg.auth else "auth off") + (
        f", TLS on (CA {env.ca_file})" if cfg.tls else "")
    listed = ", ".join(f"{p['name']} (libpq {p['pg_port']}, HTTP {p['http_port']})" for p in pageservers)
    controller = f", a storage controller ({env.storage_controller_url})" if env.storage_controller_url else ""
    emit(args, data, lambda d: f"initialized {d['workdir']}: {listed}{controller} and "
         f"{len(cfg.safekeepers)} safekeepers, {security}; next: pagestore start")
    return 0
