"""``pagestore tenant create``: a tenant and its first timeline (initdb), branch ``main``."""

from __future__ import annotations

import argparse

from control_plane import cluster
from control_plane.cmd_common import add_json, add_workdir, emit, guarded, load_env


def configure(parser: argparse.ArgumentParser) -> None:
    add_workdir(parser)
    parser.add_argument("--tenant-id", default=None, help="32 hex chars (default: random)")
    parser.add_argument("--timeline-id", default=None, help="id of the main timeline (default: random)")
    parser.add_argument("--pageserver", default="pageserver_1", metavar="pageserver_N",
                        help="the pageserver to create it on (default: the first)")
    parser.add_argument("--set-default", action="store_true",
                        help="make it the default tenant (the first tenant always is)")
    add_json(parser)


@guarded
def run(args: argparse.Namespace) -> int:
    env = load_env(args)
    data = cluster.create_tenant(env, args.tenant_id, args.timeline_id, set_default=args.set_default,
                                 pageserver=env.pageserver_id(args.pageserver))
    emit(args, data, lambda d: f"tenant {d['tenant_id']} on {d['pageserver']}: branch main = timeline "
         f"{d['timeline_id']} at {d['last_record_lsn']}")
    return 0
