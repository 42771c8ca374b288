"""``pagestore endpoint remove NAME``: remove a stopped endpoint's directory and its entry
(``control_plane.endpoint.remove_endpoint``); refused while it runs. What is left after
``timeline delete``/``tenant delete`` (their ``stopped_endpoints_left``) goes this way."""

from __future__ import annotations

import argparse

from control_plane import endpoint
from control_plane.cmd_common import add_one_name, guarded, report


def configure(parser: argparse.ArgumentParser) -> None:
    add_one_name(parser, "name", "endpoint name")


@guarded
def run(args: argparse.Namespace) -> int:
    return report(args, lambda env: endpoint.remove_endpoint(env, args.name),
                  lambda d: f"endpoint {d['name']} removed ({d['removed']})")
