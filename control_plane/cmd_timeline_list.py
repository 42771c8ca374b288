"""``pagestore timeline list``: a tenant's timelines with their branch names and LSNs."""

from __future__ import annotations

import argparse

from control_plane import cluster
from control_plane.cmd_common import (
    add_json,
    add_tenant,
    add_workdir,
    emit,
    guarded,
    load_env,
    table,
)


def configure(parser: argparse.ArgumentParser) -> None:
    add_workdir(parser)
    add_tenant(parser)
    add_json(parser)


@guarded
def run(args: argparse.Namespace) -> int:
    data = cluster.list_timelines(load_env(args), args.tenant_id)
    by_id = {t["timeline_id"]: t["branch"] for t in data}
    emit(args, data, lambda d: table(
        [[t["branch"] or "-", t["timeline_id"],
          f"{by_id.get(t['ancestor_timeline_id']) or t['ancestor_timeline_id'][:12]}@{t['ancestor_lsn']}"
          if t["ancestor_timeline_id"] else "-", t["last_record_lsn"], t["disk_consistent_lsn"]]
         for t in d],
        ["branch", "timeline", "ancestor", "last_record_lsn", "disk_consistent_lsn"]))
    return 0
