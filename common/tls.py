"""TLS for pagestore's ports: server and client contexts, and a local CA for ``pagestore init
--tls`` (docs/auth.md).

Servers: ``server_context(cert, key)`` for ``ssl_cert_file``/``ssl_key_file`` (libpq ports
answer ``S`` to SSLRequest and wrap the stream; HTTP ports speak TLS from the first byte).
Clients: ``client_context(ca_file)`` verifies the chain up to that CA and the host name
(psql's ``sslmode=verify-full``); there is no unverified mode.

``make_local_ca`` / ``make_node_cert``: an Ed25519 CA ("pagestore local CA") and per-node
certificates with SAN ``localhost`` and ``127.0.0.1``, written with the cryptography library;
private keys are mode 0600.
"""

from __future__ import annotations

import datetime
import ipaddress
import ssl
from pathlib import Path
from typing import TYPE_CHECKING

from common.auth import write_secret

if TYPE_CHECKING:
    from cryptography.hazmat.primitives.asymmetric import ec

# cryptography is imported by the functions that make keys and certificates (``init``), not
# here: a command that only needs an SSL context does not pay for it.

CA_CERT_NAME = "ca.crt"
CA_KEY_NAME = "ca.key"
CERT_NAME = "server.crt"
KEY_NAME = "server.key"
DEFAULT_SAN = ("localhost", "127.0.0.1")
VALID_DAYS = 3650


def server_context(cert_file: Path, key_file: Path) -> ssl.SSLContext:
    ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    ctx.load_cert_chain(str(cert_file), str(key_file))
    return ctx


def reload_server_context(ctx: ssl.SSLContext, cert_file: Path, key_file: Path) -> None:
    """Load a new certificate chain and key into the live ``ctx`` (``server_context``'s):
    connections made from now on present them, open ones keep theirs. The files are read
    once and the pair is checked on a scratch context first, so a missing file, a bad PEM or a
    key that does not match the certificate raises ``ssl.SSLError``/``OSError`` and leaves
    ``ctx`` serving the old pair (OpenSSL would otherwise keep a new certificate beside the
    old key)."""
    import tempfile

    cert, key = cert_file.read_bytes(), key_file.read_bytes()
    with tempfile.TemporaryDirectory(prefix="pagestore-tls-") as tmp:
        cert_copy, key_copy = Path(tmp) / "server.crt", Path(tmp) / "server.key"
        cert_copy.write_bytes(cert)
        key_copy.touch(0o600)
        key_copy.write_bytes(key)
        server_context(cert_copy, key_copy)  # the pair loads and matches
        ctx.load_cert_chain(str(cert_copy), str(key_copy))


def client_context(ca_file: Path) -> ssl.SSLContext:
    """Verify the server's chain up to ``ca_file`` and its name (SAN) against the host."""
    ctx = ssl.create_default_context(ssl.Purpose.SERVER_AUTH, cafile=str(ca_file))
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    return ctx


def handshake_in_memory(
    server: ssl.SSLContext, client: ssl.SSLContext, server_hostname: str = "localhost", rounds: int = 10
) -> tuple[ssl.SSLObject, ssl.SSLObject, list[ssl.MemoryBIO]]:
    """Both ends of one TLS connection over memory BIOs, handshaken, without a socket (the
    cipher floor of ``bench getpage``, the suite tests): ``(server, client, bios)``, ``bios``
    being the server's incoming and outgoing BIO, then the client's. ``RuntimeError`` if the
    handshake has not finished after ``rounds`` exchanges."""
    bios = [ssl.MemoryBIO() for _ in range(4)]
    s = server.wrap_bio(bios[0], bios[1], server_side=True)
    c = client.wrap_bio(bios[2], bios[3], server_hostname=server_hostname)
    for _ in range(rounds):
        done = 0
        for obj in (c, s):
            try:
                obj.do_handshake()
                done += 1
            except ssl.SSLWantReadError:
                pass
        bios[0].write(bios[3].read())
        bios[2].write(bios[1].read())
        if done == 2:
            return s, c, bios
    raise RuntimeError(f"the TLS handshake did not finish in {rounds} exchanges")


def _write_key(path: Path, key: ec.EllipticCurvePrivateKey) -> None:
    from cryptography.hazmat.primitives import serialization

    write_secret(path, key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    ))


def _now() -> datetime.datetime:
    return datetime.datetime.now(datetime.UTC)


def make_local_ca(directory: Path) -> tuple[Path, Path]:
    """A self-signed CA: ``ca.crt`` and ``ca.key`` (0600) in ``directory``."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    directory.mkdir(parents=True, exist_ok=True)
    # P-256 rather than Ed25519: psql/libpq and every OpenSSL client accept it.
    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "pagestore local CA")])
    cert = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(_now() - datetime.timedelta(minutes=5))
        .not_valid_after(_now() + datetime.timedelta(days=VALID_DAYS))
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(
            x509.KeyUsage(digital_signature=True, key_cert_sign=True, crl_sign=True,
                          content_commitment=False, key_encipherment=False,
                          data_encipherment=False, key_agreement=False,
                          encipher_only=False, decipher_only=False),
            critical=True,
        )
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
        .sign(key, hashes.SHA256())
    )
    cert_path, key_path = directory / CA_CERT_NAME, directory / CA_KEY_NAME
    _write_key(key_path, key)
    cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    return cert_path, key_path


def make_node_cert(
    ca_dir: Path, directory: Path, common_name: str, names: tuple[str, ...] = DEFAULT_SAN
) -> tuple[Path, Path]:
    """``server.crt`` / ``server.key`` (0600) in ``directory``, signed by the CA in ``ca_dir``."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

    ca_key = serialization.load_pem_private_key((ca_dir / CA_KEY_NAME).read_bytes(), password=None)
    assert isinstance(ca_key, ec.EllipticCurvePrivateKey)
    ca_cert = x509.load_pem_x509_certificate((ca_dir / CA_CERT_NAME).read_bytes())
    key = ec.generate_private_key(ec.SECP256R1())
    san: list[x509.GeneralName] = []
    for n in names:
        try:
            san.append(x509.IPAddress(ipaddress.ip_address(n)))
        except ValueError:
            san.append(x509.DNSName(n))
    cert = (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)]))
        .issuer_name(ca_cert.subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(_now() - datetime.timedelta(minutes=5))
        .not_valid_after(_now() + datetime.timedelta(days=VALID_DAYS))
        .add_extension(x509.SubjectAlternativeName(san), critical=False)
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
        .add_extension(
            x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key()), critical=False
        )
        .sign(ca_key, hashes.SHA256())
    )
    directory.mkdir(parents=True, exist_ok=True)
    cert_path, key_path = directory / CERT_NAME, directory / KEY_NAME
    _write_key(key_path, key)
    cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    return cert_path, key_path
