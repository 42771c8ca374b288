"""``pagestore timeline branch``: a new timeline branched from another at an LSN (copies nothing)."""

from __future__ import annotations

import argparse

from control_plane import cluster
from control_plane.cmd_common import add_json, add_tenant, add_workdir, emit, guarded, load_env


def configure(parser: argparse.ArgumentParser) -> None:
    add_workdir(parser)
    add_tenant(parser)
    parser.add_argument("--branch-name", required=True, help="name of the new branch")
    parser.add_argument("--ancestor-branch-name", default="main", help="branch to branch from (default main)")
    parser.add_argument("--ancestor-lsn", default=None,
                        help="X/Y record boundary to branch at (default: the ancestor's last record)")
    add_json(parser)


@guarded
def run(args: argparse.Namespace) -> int:
    data = cluster.branch(load_env(args), args.tenant_id, args.branch_name, args.ancestor_branch_name,
                          args.ancestor_lsn)
    emit(args, data, lambda d: f"branch {d['branch']} = timeline {d['timeline_id']} from "
         f"{d['ancestor_branch']} at {d['ancestor_lsn']}")
    return 0
