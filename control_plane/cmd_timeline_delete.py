"""``pagestore timeline delete (--branch-name B | --timeline-id T) [--tenant-id T]``: delete a
timeline on its pageserver and every safekeeper, with its objects in remote storage (layers
and indexes; the WAL backup) (``control_plane.cluster.delete_timeline``)."""

from __future__ import annotations

import argparse

from control_plane import cluster
from control_plane.cmd_common import (
    add_json,
    add_tenant,
    add_workdir,
    guarded,
    report,
    stale_endpoints_hint,
)


def configure(parser: argparse.ArgumentParser) -> None:
    add_workdir(parser)
    add_tenant(parser)
    which = parser.add_mutually_exclusive_group(required=True)
    which.add_argument("--branch-name", default=None, help="the branch whose timeline goes")
    which.add_argument("--timeline-id", default=None, help="the timeline (with or without a branch name)")
    add_json(parser)


@guarded
def run(args: argparse.Namespace) -> int:
    return report(args, lambda env: cluster.delete_timeline(env, args.tenant_id, branch=args.branch_name,
                                                            timeline_id=args.timeline_id),
                  lambda d: f"timeline {d['timeline_id']} deleted"
                  + (f" (branches {', '.join(d['branches'])})" if d["branches"] else "")
                  + stale_endpoints_hint(d["stopped_endpoints_left"]))
