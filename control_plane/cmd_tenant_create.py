"""``pagestore tenant create``: a tenant and its first timeline (initdb), branch ``main``."""

from __future__ import annotations

import argparse

from control_plane import cluster
from control_plane.cmd_common import add_json, add_workdir, emit, guarded, load_env


def configure(parser: argparse.ArgumentParser) -> None:
    add_workdir(parser)
    parser.add_argument("--tenant-id", default=None, help="32 hex chars (default: random)")
    parser.add_argument("--timeline-id", default=None, help="id of the main timeline (default: random)")
    parser.add_argument("--set-default", action="store_true",
                        help="make it the default tenant (the first tenant always is)")
    add_json(parser)


@guarded
def run(args: argparse.Namespace) -> int:
    data = cluster.create_tenant(load_env(args), args.tenant_id, args.timeline_id,
                                 set_default=args.set_default)
    emit(args, data, lambda d: f"tenant {d['tenant_id']}: branch main = timeline {d['timeline_id']} "
         f"at {d['last_record_lsn']}")
    return 0
