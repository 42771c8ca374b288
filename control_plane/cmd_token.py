"""``pagestore token``: print a JWT signed with the cluster's key (docs/auth.md).

    PGPASSWORD=$(pagestore token --tenant-id T) psql "host=127.0.0.1 port=64000 user=x" ...
    curl -H "Authorization: Bearer $(pagestore token --scope pageserverapi)" .../v1/tenant
    curl -H "Authorization: Bearer $(pagestore token --scope admin)" .../control/v1/tenant
"""

from __future__ import annotations

import argparse
import re

from common.auth import Scope
from control_plane.cmd_common import add_workdir, guarded, load_env
from control_plane.local_env import LocalEnvError

_TTL = re.compile(r"^(\d+)([smhd]?)$")
_UNITS = {"": 1, "s": 1, "m": 60, "h": 3600, "d": 86400}


def parse_ttl(text: str) -> float | None:
    """``90``, ``90s``, ``15m``, ``1h``, ``7d``; ``never``: no ``exp`` claim."""
    if text == "never":
        return None
    match = _TTL.match(text.strip())
    if not match or int(match.group(1)) == 0:
        raise argparse.ArgumentTypeError(f"bad --ttl {text!r}: use e.g. 90s, 15m, 1h, 7d or never")
    return float(int(match.group(1)) * _UNITS[match.group(2)])


def configure(parser: argparse.ArgumentParser) -> None:
    add_workdir(parser)
    parser.add_argument("--tenant-id", default=None,
                        help="the tenant a `tenant` token is for (default: the cluster's default tenant)")
    parser.add_argument("--scope", default="tenant", choices=[s.value for s in Scope],
                        help="tenant (a compute's or user's, one tenant), pageserverapi (all of the "
                             "pageserver), safekeeperdata (all of the safekeepers), admin (the "
                             "storage controller's control API), generations_api (its pageserver "
                             "upcalls); default tenant")
    parser.add_argument("--ttl", type=parse_ttl, default=3600.0,
                        help="lifetime: 90s, 15m, 1h (default), 7d, or never (no exp claim)")


@guarded
def run(args: argparse.Namespace) -> int:
    env = load_env(args)
    scope = Scope(args.scope)
    tenant = env.resolve_tenant(args.tenant_id) if scope is Scope.TENANT else None
    token = env.token(scope, tenant, ttl_s=args.ttl)
    if token is None:
        raise LocalEnvError(f"{env.workdir} was initialized with --no-auth: its nodes take no tokens")
    print(token)
    return 0
