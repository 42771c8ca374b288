"""Which TLS suite the nodes and their clients negotiate (docs/auth.md, "TLS"): TLS 1.3 with
AES-256-GCM by default, an ECDHE + AEAD suite for a TLS 1.2-only client, and, with an OpenSSL
config naming TLS 1.3 suites (``OPENSSL_CONF``, the operator's knob: Python 3.11's ``ssl`` has no
call for them), the suite the *server's* config puts first, whatever order the client offers:
the server context keeps OpenSSL's server preference and does not override the suites."""

from __future__ import annotations

import json
import os
import socket
import ssl
import subprocess
import sys
from pathlib import Path

import pytest

from bench.getpage import _AES128_CONF
from common.tls import client_context, handshake_in_memory, server_context
from tests.auth_helpers import TlsKit

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def tls(tmp_path_factory: pytest.TempPathFactory) -> TlsKit:
    return TlsKit.create(tmp_path_factory.mktemp("tls"))


def _negotiate(server: ssl.SSLContext, client: ssl.SSLContext) -> tuple[str | None, str | None]:
    """(version, suite) of a handshake between the two contexts, over memory BIOs."""
    s, c, _ = handshake_in_memory(server, client)
    cipher = c.cipher()
    assert cipher == s.cipher()
    return c.version(), cipher[0] if cipher else None


def test_default_is_tls13_aes256_gcm(tls: TlsKit) -> None:
    server = server_context(tls.cert, tls.key)
    assert server.options & ssl.OP_CIPHER_SERVER_PREFERENCE
    assert _negotiate(server, client_context(tls.ca_cert)) == ("TLSv1.3", "TLS_AES_256_GCM_SHA384")


def test_a_tls12_only_client_gets_forward_secret_aead(tls: TlsKit) -> None:
    client = client_context(tls.ca_cert)
    client.maximum_version = ssl.TLSVersion.TLSv1_2
    version, suite = _negotiate(server_context(tls.cert, tls.key), client)
    assert version == "TLSv1.2"
    assert suite is not None and suite.startswith("ECDHE-ECDSA-") and "GCM" in suite


# A server in its own process (OpenSSL reads OPENSSL_CONF once, at start-up) with the nodes'
# server context: it accepts one connection and prints what it negotiated.
_SERVER = """
import json, socket, sys
from pathlib import Path
from common.tls import server_context
ctx = server_context(Path(sys.argv[1]), Path(sys.argv[2]))
listener = socket.create_server(("127.0.0.1", 0))
print(json.dumps({"port": listener.getsockname()[1]}), flush=True)
conn, _ = listener.accept()
with ctx.wrap_socket(conn, server_side=True) as tls:
    print(json.dumps({"version": tls.version(), "cipher": tls.cipher()[0]}), flush=True)
    tls.recv(1)
"""


@pytest.mark.parametrize("server_conf", [False, True], ids=["default", "aes128-conf"])
def test_the_servers_openssl_config_chooses_the_suite(
    tls: TlsKit, tmp_path: Path, server_conf: bool
) -> None:
    """Both sides report the same suite; with the config only on the server, a client that
    offers AES-256-GCM first (this process: no config) still gets AES-128-GCM."""
    conf = tmp_path / "openssl.cnf"
    conf.write_text(_AES128_CONF)
    env = {k: v for k, v in os.environ.items() if k != "OPENSSL_CONF"}
    if server_conf:
        env["OPENSSL_CONF"] = str(conf)
    client = client_context(tls.ca_cert)
    assert client.get_ciphers()[0]["name"] == "TLS_AES_256_GCM_SHA384"
    proc = subprocess.Popen(
        [sys.executable, "-c", _SERVER, str(tls.cert), str(tls.key)],
        stdout=subprocess.PIPE, text=True, cwd=REPO, env=env,
    )
    try:
        assert proc.stdout is not None
        port = json.loads(proc.stdout.readline())["port"]
        with socket.create_connection(("127.0.0.1", port), timeout=20) as raw, \
                client.wrap_socket(raw, server_hostname="localhost") as conn:
            ours = (conn.version(), conn.cipher()[0])  # type: ignore[index]
            theirs = json.loads(proc.stdout.readline())
            conn.sendall(b"x")
    finally:
        proc.wait(timeout=20)
    want = "TLS_AES_128_GCM_SHA256" if server_conf else "TLS_AES_256_GCM_SHA384"
    assert ours == ("TLSv1.3", want)
    assert (theirs["version"], theirs["cipher"]) == ours


def test_the_bench_cipher_floor_measures_each_suite_it_names(tmp_path: Path) -> None:
    """``bench getpage``'s cipher floor (memory BIOs, the AES-128 row from a child process
    with the OpenSSL config): one row per suite, each with the suite it names negotiated."""
    from bench.getpage import _cipher_floor, _write_security

    _write_security(tmp_path, [("00" * 16, "11" * 16)])
    rows = _cipher_floor(tmp_path, pages=2, batches=1)
    assert [(r["cipher"], r["tls_version"]) for r in rows] == [
        ("TLS_AES_256_GCM_SHA384", "TLSv1.3"),
        ("ECDHE-ECDSA-AES128-GCM-SHA256", "TLSv1.2"),
        ("ECDHE-ECDSA-CHACHA20-POLY1305", "TLSv1.2"),
        ("TLS_AES_128_GCM_SHA256", "TLSv1.3"),
    ]
    assert all(r["encrypt_us_per_page"] > 0 and r["decrypt_us_per_page"] > 0 for r in rows)
