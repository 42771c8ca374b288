"""``pagestore endpoint list``."""

from __future__ import annotations

import argparse

from control_plane import endpoint
from control_plane.cmd_common import add_json, add_workdir, emit, guarded, load_env, table


def configure(parser: argparse.ArgumentParser) -> None:
    add_workdir(parser)
    add_json(parser)


@guarded
def run(args: argparse.Namespace) -> int:
    data = [ep.describe() for ep in endpoint.list_endpoints(load_env(args))]
    emit(args, data, lambda d: table(
        [[e["name"], e["branch"] or "-", str(e["port"]), "running" if e["running"] else "stopped",
          "read-only@" + e["basebackup_lsn"] if e["read_only"] else "primary", e["storage"], e["dsn"]]
         for e in d],
        ["endpoint", "branch", "port", "state", "kind", "storage", "connect"]))
    return 0
