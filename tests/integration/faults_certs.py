"""Throwaway PEM certificates for the peer mTLS tests, made in the test's own directory.

    ca = make_ca(tmp_path, "job-ca")
    files = make_leaf(tmp_path, ca, "node0")   # {"--tls-cert": path, "--tls-key": path, ...}

Leaves name 127.0.0.1 (IP SAN) and localhost, and may act as server and client, so one
certificate serves a daemon's listener and its channel to the hub. Keys are written 0600 and
live only under the test's temporary directory: no private key is ever committed.
"""

from __future__ import annotations

import datetime
import ipaddress
import os
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID


@dataclass(frozen=True)
class Ca:
    cert: x509.Certificate
    key: ec.EllipticCurvePrivateKey
    path: Path


def _name(common_name: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)])


def _write_key(path: Path, key: ec.EllipticCurvePrivateKey) -> None:
    pem = key.private_bytes(
        serialization.Encoding.PEM,
        serialization.PrivateFormat.PKCS8,
        serialization.NoEncryption(),
    )
    path.write_bytes(pem)
    os.chmod(path, 0o600)


def _builder(subject: x509.Name, issuer: x509.Name, public_key: object) -> x509.CertificateBuilder:
    now = datetime.datetime.now(datetime.UTC)
    return (
        x509.CertificateBuilder()
        .subject_name(subject)
        .issuer_name(issuer)
        .public_key(public_key)  # type: ignore[arg-type]
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
    )


def make_ca(directory: Path, name: str) -> Ca:
    key = ec.generate_private_key(ec.SECP256R1())
    cert = (
        _builder(_name(name), _name(name), key.public_key())
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .sign(key, hashes.SHA256())
    )
    path = directory / f"{name}.pem"
    path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    return Ca(cert, key, path)


def make_leaf(directory: Path, ca: Ca, name: str) -> dict[str, Path]:
    """A daemon's certificate and key signed by `ca`, as --tls-* flag -> file."""
    key = ec.generate_private_key(ec.SECP256R1())
    names = [x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]
    usage = [ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH]
    cert = (
        _builder(_name(name), ca.cert.subject, key.public_key())
        .add_extension(x509.SubjectAlternativeName(names), critical=False)
        .add_extension(x509.ExtendedKeyUsage(usage), critical=False)
        .sign(ca.key, hashes.SHA256())
    )
    cert_path, key_path = directory / f"{name}.crt", directory / f"{name}.key"
    cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    _write_key(key_path, key)
    return {"--tls-cert": cert_path, "--tls-key": key_path, "--tls-ca": ca.path}


def tls_args(files: dict[str, Path]) -> list[str]:
    return [item for flag, path in files.items() for item in (flag, str(path))]
