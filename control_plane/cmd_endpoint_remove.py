"""``pagestore endpoint remove NAME``: remove a stopped endpoint's directory and its entry
(``control_plane.endpoint.remove_endpoint``); refused while it runs. What is left after
``timeline delete``/``tenant delete`` (their ``stopped_endpoints_left``) goes this way."""

from __future__ import annotations

import argparse

from control_plane import endpoint
from control_plane.cmd_common import add_json, add_workdir, emit, guarded, load_env


def configure(parser: argparse.ArgumentParser) -> None:
    add_workdir(parser)
    parser.add_argument("name", help="endpoint name")
    add_json(parser)


@guarded
def run(args: argparse.Namespace) -> int:
    data = endpoint.remove_endpoint(load_env(args), args.name)
    emit(args, data, lambda d: f"endpoint {d['name']} removed ({d['removed']})")
    return 0
