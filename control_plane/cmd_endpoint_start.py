"""``pagestore endpoint start NAME``: a PostgreSQL 15 compute on a branch (see control_plane.endpoint)."""

from __future__ import annotations

import argparse

from control_plane import endpoint
from control_plane.cmd_common import add_json, add_tenant, add_workdir, emit, guarded, load_env


def configure(parser: argparse.ArgumentParser) -> None:
    add_workdir(parser)
    add_tenant(parser)
    parser.add_argument("name", help="endpoint name (its directory is endpoints/NAME)")
    parser.add_argument("--branch-name", default="main", help="branch to run on (default main)")
    parser.add_argument("--lsn", default=None,
                        help="X/Y: a read-only endpoint showing the branch as of this LSN")
    parser.add_argument("--port", type=int, default=None, help="PostgreSQL port (default 55431+i)")
    parser.add_argument("--storage", choices=["lazy", "full"], default="lazy",
                        help="lazy (the default): relation pages read from the page service through a "
                             "FUSE page filesystem (needs /dev/fuse); full: a copy of every relation file")
    add_json(parser)


@guarded
def run(args: argparse.Namespace) -> int:
    ep = endpoint.start_endpoint(load_env(args), args.name, tenant_id=args.tenant_id,
                                 branch=args.branch_name, lsn=args.lsn, port=args.port,
                                 storage=args.storage,
                                 log=(lambda _msg: None) if args.json else print)
    if args.json:
        emit(args, ep.describe(), str)
    return 0
