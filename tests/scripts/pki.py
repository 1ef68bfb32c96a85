"""Test certificates for the parameter server's TLS tests, made with ``cryptography``: a CA, a
server certificate for 127.0.0.1 / localhost and client certificates signed by it, and a second
("rogue") CA with its own client certificate. Files are PEM, written under a directory."""

from __future__ import annotations

import datetime
import ipaddress
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID


@dataclass(frozen=True)
class CertFiles:
    """Paths of one certificate and its key (and the CA that signed it)."""

    cert: str
    key: str
    ca: str


def _name(common: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common)])


def _write_key(key: ec.EllipticCurvePrivateKey, path: Path) -> None:
    path.write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
    )


def _builder(subject: str, issuer: x509.Name, public_key: object) -> x509.CertificateBuilder:
    now = datetime.datetime.now(datetime.timezone.utc)
    return (
        x509.CertificateBuilder()
        .subject_name(_name(subject))
        .issuer_name(issuer)
        .public_key(public_key)
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
    )


def make_ca(directory: Path, name: str) -> tuple[Path, ec.EllipticCurvePrivateKey]:
    """A self-signed CA: (its PEM path, its key)."""
    key = ec.generate_private_key(ec.SECP256R1())
    cert = (
        _builder(name, _name(name), key.public_key())
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .add_extension(
            x509.KeyUsage(
                digital_signature=True,
                key_cert_sign=True,
                crl_sign=True,
                content_commitment=False,
                key_encipherment=False,
                data_encipherment=False,
                key_agreement=False,
                encipher_only=False,
                decipher_only=False,
            ),
            critical=True,
        )
        .sign(key, hashes.SHA256())
    )
    path = directory / f"{name}.pem"
    path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    return path, key


def make_leaf(
    directory: Path, name: str, ca: tuple[Path, ec.EllipticCurvePrivateKey], server: bool
) -> CertFiles:
    """A certificate signed by ``ca``: for a server (SAN 127.0.0.1, localhost) or a client."""
    ca_path, ca_key = ca
    ca_cert = x509.load_pem_x509_certificate(ca_path.read_bytes())
    key = ec.generate_private_key(ec.SECP256R1())
    usage = ExtendedKeyUsageOID.SERVER_AUTH if server else ExtendedKeyUsageOID.CLIENT_AUTH
    builder = (
        _builder(name, ca_cert.subject, key.public_key())
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(x509.ExtendedKeyUsage([usage]), critical=False)
    )
    if server:
        builder = builder.add_extension(
            x509.SubjectAlternativeName(
                [x509.IPAddress(ipaddress.ip_address("127.0.0.1")), x509.DNSName("localhost")]
            ),
            critical=False,
        )
    cert = builder.sign(ca_key, hashes.SHA256())
    cert_path, key_path = directory / f"{name}.pem", directory / f"{name}.key"
    cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    _write_key(key, key_path)
    return CertFiles(str(cert_path), str(key_path), str(ca_path))


def make_test_pki(directory: Path) -> dict[str, CertFiles]:
    """``server``, ``client`` (both from CA ``ca``) and ``rogue_client`` (from CA ``rogue``)."""
    directory.mkdir(parents=True, exist_ok=True)
    ca, rogue = make_ca(directory, "ca"), make_ca(directory, "rogue")
    return {
        "server": make_leaf(directory, "server", ca, server=True),
        "client": make_leaf(directory, "client", ca, server=False),
        "rogue_client": make_leaf(directory, "rogue_client", rogue, server=False),
    }
