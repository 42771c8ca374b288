"""``pagestore init`` (keys, auth on by default, --no-auth, --tls) and ``pagestore token``."""

from __future__ import annotations

import os
import stat
import time
import tomllib
from pathlib import Path

import pytest

from common.auth import JwtVerifier, Scope
from control_plane import cli
from protocol.ids import TenantId


def pagestore(*args: str) -> int:
    return cli.main(list(args))


def mode(path: Path) -> int:
    return stat.S_IMODE(os.stat(path).st_mode)


def test_init_turns_auth_on_and_token_prints_one(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    wd = tmp_path / "c"
    assert pagestore("init", "-D", str(wd), "--free-ports") == 0
    assert mode(wd / "auth_private_key.pem") == 0o600
    ps = tomllib.loads((wd / "pageserver" / "pageserver.toml").read_text())
    sk = tomllib.loads((wd / "safekeeper_1" / "safekeeper.toml").read_text())
    for conf in (ps, sk):
        assert conf["pg_auth_type"] == conf["http_auth_type"] == "NeonJWT"
        assert conf["auth_validation_public_key_path"] == str(wd / "auth_public_key.pem")
    verifier = JwtVerifier.from_key_path(wd / "auth_public_key.pem")
    tenant = TenantId.generate()
    capsys.readouterr()

    assert pagestore("token", "-D", str(wd), "--tenant-id", tenant.hex) == 0
    claims = verifier.decode(capsys.readouterr().out.strip())
    assert claims.scope is Scope.TENANT and claims.tenant_id == tenant
    assert claims.exp is not None and abs(claims.exp - (time.time() + 3600)) < 60

    assert pagestore("token", "-D", str(wd), "--scope", "pageserverapi", "--ttl", "15m") == 0
    claims = verifier.decode(capsys.readouterr().out.strip())
    assert claims.scope is Scope.PAGESERVERAPI and claims.exp is not None
    assert abs(claims.exp - (time.time() + 900)) < 60

    assert pagestore("token", "-D", str(wd), "--scope", "safekeeperdata", "--ttl", "never") == 0
    assert verifier.decode(capsys.readouterr().out.strip()).exp is None

    # A tenant token needs a tenant: none given and no default tenant yet.
    assert pagestore("token", "-D", str(wd)) == 1
    assert "no tenant" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        pagestore("token", "-D", str(wd), "--scope", "pageserverapi", "--ttl", "soon")


def test_init_no_auth_and_tls(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    plain = tmp_path / "plain"
    assert pagestore("init", "-D", str(plain), "--free-ports", "--no-auth") == 0
    assert not (plain / "auth_private_key.pem").exists()
    assert "pg_auth_type" not in tomllib.loads((plain / "pageserver" / "pageserver.toml").read_text())
    capsys.readouterr()
    assert pagestore("token", "-D", str(plain), "--scope", "pageserverapi") == 1
    assert "--no-auth" in capsys.readouterr().err

    tls = tmp_path / "tls"
    assert pagestore("init", "-D", str(tls), "--free-ports", "--tls") == 0
    assert mode(tls / "ca" / "ca.key") == 0o600
    ps = tomllib.loads((tls / "pageserver" / "pageserver.toml").read_text())
    assert ps["ssl_cert_file"] == str(tls / "pageserver" / "server.crt")
    assert ps["ssl_ca_file"] == str(tls / "ca" / "ca.crt")
    for node in ("pageserver", "safekeeper_1", "safekeeper_2", "safekeeper_3"):
        assert mode(tls / node / "server.key") == 0o600
    sk = tomllib.loads((tls / "safekeeper_2" / "safekeeper.toml").read_text())
    assert sk["ssl_key_file"] == str(tls / "safekeeper_2" / "server.key")
