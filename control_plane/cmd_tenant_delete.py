"""``pagestore tenant delete TENANT``: delete a tenant on its pageserver and every safekeeper,
with its objects in remote storage (``control_plane.cluster.delete_tenant``)."""

from __future__ import annotations

import argparse

from control_plane import cluster
from control_plane.cmd_common import (
    add_json,
    add_workdir,
    emit,
    guarded,
    load_env,
    stale_endpoints_hint,
)


def configure(parser: argparse.ArgumentParser) -> None:
    add_workdir(parser)
    parser.add_argument("tenant", help="the tenant id (named explicitly: no default here)")
    add_json(parser)


@guarded
def run(args: argparse.Namespace) -> int:
    data = cluster.delete_tenant(load_env(args), args.tenant)
    emit(args, data, lambda d: f"tenant {d['tenant_id']} deleted" + stale_endpoints_hint(d["stopped_endpoints_left"]))
    return 0
