"""``pagestore tenant migrate [--tenant-id T] --to pageserver_N``: move a tenant to another
pageserver with a new generation; its endpoints follow (``control_plane.cluster.migrate_tenant``)."""

from __future__ import annotations

import argparse

from control_plane import cluster
from control_plane.cmd_common import add_json, add_tenant, add_workdir, emit, guarded, load_env
from control_plane.local_env import LocalEnvError


def configure(parser: argparse.ArgumentParser) -> None:
    add_workdir(parser)
    add_tenant(parser)
    parser.add_argument("tenant", nargs="?", default=None, help="the tenant (same as --tenant-id)")
    parser.add_argument("--to", required=True, metavar="pageserver_N", help="the pageserver to move it to")
    add_json(parser)


@guarded
def run(args: argparse.Namespace) -> int:
    if args.tenant and args.tenant_id and args.tenant != args.tenant_id:
        raise LocalEnvError(f"two different tenants given ({args.tenant}, {args.tenant_id})")
    data = cluster.migrate_tenant(load_env(args), args.tenant or args.tenant_id, args.to,
                                  log=(lambda _msg: None) if args.json else print)
    emit(args, data, lambda d: f"tenant {d['tenant_id']} moved from {d['from']} to {d['to']} (generation "
         f"{d['generation']}, endpoints {', '.join(d['endpoints']) or 'none'}) in {d['seconds']:.1f} s")
    return 0
