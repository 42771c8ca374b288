"""``pagestore timeline import``: a new timeline from a stopped PostgreSQL 15 data directory or tar."""

from __future__ import annotations

import argparse
from pathlib import Path

from control_plane import cluster
from control_plane.cmd_common import add_json, add_tenant, add_workdir, emit, guarded, load_env


def configure(parser: argparse.ArgumentParser) -> None:
    add_workdir(parser)
    add_tenant(parser)
    src = parser.add_mutually_exclusive_group(required=True)
    src.add_argument("--pgdata", type=Path, help="data directory of a cleanly stopped PostgreSQL 15")
    src.add_argument("--tar", type=Path, help="tar of one (pg_basebackup -Ft base.tar)")
    parser.add_argument("--wal-tar", type=Path, default=None,
                        help="with --tar: the pg_wal.tar pg_basebackup -Ft wrote next to base.tar")
    parser.add_argument("--branch-name", required=True, help="name of the new branch")
    parser.add_argument("--timeline-id", default=None, help="32 hex chars (default: random)")
    add_json(parser)


@guarded
def run(args: argparse.Namespace) -> int:
    data = cluster.import_timeline(load_env(args), args.tenant_id, args.branch_name, pgdata=args.pgdata,
                                   tar=args.tar, timeline_id=args.timeline_id,
                                   wal_tar=args.wal_tar)
    emit(args, data, lambda d: f"branch {d['branch']} = timeline {d['timeline_id']} at {d['last_record_lsn']}")
    return 0
