"""The TLS builder: a fresh CA and the SuperLink's certificate (``ca.crt`` in every kit,
``server.crt`` and ``server.key`` in the server's). The CA's private key lives only inside
``make_tls``: nobody can issue further certificates after provisioning."""

from __future__ import annotations

import datetime as dt
import ipaddress
from collections.abc import Sequence

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

from crypto.at_rest import write_public_file
from federation.deploy.provisioning.spec import Project, ProvisionContext, write_private_raw

__all__ = ["TLSBuilder", "make_tls"]

_CERT_DAYS = 365


def _name(cn: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, cn)])


def _san(hosts: Sequence[str]) -> x509.SubjectAlternativeName:
    names: list[x509.GeneralName] = []
    for h in hosts:
        try:
            names.append(x509.IPAddress(ipaddress.ip_address(h)))
        except ValueError:
            names.append(x509.DNSName(h))
    return x509.SubjectAlternativeName(names)


def make_tls(hosts: Sequence[str], ca_name: str = "fedkv provisioner CA") -> tuple[bytes, bytes, bytes]:
    """A fresh CA and a server certificate for ``hosts``: (ca.crt, server.crt, server.key) PEM.

    The CA's private key is dropped on return: nobody can issue further certificates."""
    now = dt.datetime.now(dt.timezone.utc)
    ca_key = ec.generate_private_key(ec.SECP384R1())
    ca = (
        x509.CertificateBuilder().subject_name(_name(ca_name)).issuer_name(_name(ca_name))
        .public_key(ca_key.public_key()).serial_number(x509.random_serial_number())
        .not_valid_before(now - dt.timedelta(minutes=5)).not_valid_after(now + dt.timedelta(days=_CERT_DAYS))
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(x509.KeyUsage(False, False, False, False, False, True, True, False, False), critical=True)
        .sign(ca_key, hashes.SHA384())
    )
    key = ec.generate_private_key(ec.SECP384R1())
    cert = (
        x509.CertificateBuilder().subject_name(_name(hosts[0] if hosts else "fedkv-superlink"))
        .issuer_name(ca.subject).public_key(key.public_key()).serial_number(x509.random_serial_number())
        .not_valid_before(now - dt.timedelta(minutes=5)).not_valid_after(now + dt.timedelta(days=_CERT_DAYS))
        .add_extension(_san(hosts), critical=False)
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(x509.ExtendedKeyUsage([x509.oid.ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
        .sign(ca_key, hashes.SHA384())
    )
    pem = serialization.Encoding.PEM
    key_pem = key.private_bytes(pem, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())
    return ca.public_bytes(pem), cert.public_bytes(pem), key_pem


class TLSBuilder:
    """``ca.crt`` for every party; ``server.crt`` (for ``project.hosts``) and ``server.key``
    (plain PKCS#8 PEM, mode 0600: the SuperLink reads it) for the server."""

    def build(self, project: Project, ctx: ProvisionContext) -> None:
        ca, cert, key = make_tls(project.hosts)
        for folder in ctx.folders.values():
            write_public_file(folder / "ca.crt", ca)
        write_public_file(ctx.server() / "server.crt", cert)
        write_private_raw(ctx.server() / "server.key", key)
