"""``pagestore tenant delete TENANT``: delete a tenant on its pageserver and every safekeeper,
with its objects in remote storage (``control_plane.cluster.delete_tenant``)."""

from __future__ import annotations

import argparse

from control_plane import cluster
from control_plane.cmd_common import add_one_name, guarded, report, stale_endpoints_hint


def configure(parser: argparse.ArgumentParser) -> None:
    add_one_name(parser, "tenant", "the tenant id (named explicitly: no default here)")


@guarded
def run(args: argparse.Namespace) -> int:
    return report(args, lambda env: cluster.delete_tenant(env, args.tenant),
                  lambda d: f"tenant {d['tenant_id']} deleted" + stale_endpoints_hint(d["stopped_endpoints_left"]))
