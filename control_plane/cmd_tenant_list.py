"""``pagestore tenant list``."""

from __future__ import annotations

import argparse

from control_plane import cluster
from control_plane.cmd_common import add_json, add_workdir, emit, guarded, load_env, table


def configure(parser: argparse.ArgumentParser) -> None:
    add_workdir(parser)
    add_json(parser)


@guarded
def run(args: argparse.Namespace) -> int:
    data = cluster.list_tenants(load_env(args))
    emit(args, data, lambda d: table(
        [[t["tenant_id"], str(len(t["timelines"])), "*" if t["default"] else ""] for t in d],
        ["tenant", "timelines", "default"]))
    return 0
