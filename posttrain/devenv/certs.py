"""Throw-away PKI for the dev control plane: a CA, the apiserver's serving cert, an
admin client cert in group system:masters, and the service-account signing key; the real node
asks for more certificates from the same CA (:func:`issue`: the kubelet's client and serving
certificates)."""

from __future__ import annotations

import datetime as dt
import ipaddress
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec, rsa
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID


@dataclass(frozen=True)
class Pki:
    ca_cert: Path
    ca_key: Path
    serving_cert: Path
    serving_key: Path
    admin_cert: Path
    admin_key: Path
    sa_public: Path
    sa_private: Path


def _pem_key(key: ec.EllipticCurvePrivateKey | rsa.RSAPrivateKey) -> bytes:
    return key.private_bytes(
        serialization.Encoding.PEM,
        serialization.PrivateFormat.PKCS8,
        serialization.NoEncryption(),
    )


def _cert(
    subject: x509.Name,
    public_key: ec.EllipticCurvePublicKey,
    issuer: x509.Name,
    issuer_key: ec.EllipticCurvePrivateKey,
    *,
    ca: bool = False,
    usages: list[x509.ObjectIdentifier] | None = None,
    sans: list[x509.GeneralName] | None = None,
) -> x509.Certificate:
    now = dt.datetime.now(dt.UTC)
    builder = (
        x509.CertificateBuilder()
        .subject_name(subject)
        .issuer_name(issuer)
        .public_key(public_key)
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - dt.timedelta(minutes=5))
        .not_valid_after(now + dt.timedelta(days=7))
        .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True)
    )
    if usages:
        builder = builder.add_extension(x509.ExtendedKeyUsage(usages), critical=False)
    if sans:
        builder = builder.add_extension(x509.SubjectAlternativeName(sans), critical=False)
    return builder.sign(issuer_key, hashes.SHA256())


def _pki_paths(directory: Path) -> Pki:
    return Pki(
        ca_cert=directory / "ca.crt",
        ca_key=directory / "ca.key",
        serving_cert=directory / "apiserver.crt",
        serving_key=directory / "apiserver.key",
        admin_cert=directory / "admin.crt",
        admin_key=directory / "admin.key",
        sa_public=directory / "sa.pub",
        sa_private=directory / "sa.key",
    )


def load_pki(
    directory: Path, extra_ips: tuple[str, ...] = (), min_valid: dt.timedelta = dt.timedelta(days=1)
) -> Pki | None:
    """The PKI an earlier start wrote into ``directory``, if complete, serving ``extra_ips`` and
    valid for at least ``min_valid`` more; None otherwise.

    A control plane restarted on its old data keeps its CA and service-account key, so the
    kubeconfigs, tokens and processes that trusted it before keep working."""
    pki = _pki_paths(directory)
    if not all(Path(path).is_file() for path in vars(pki).values()):
        return None
    serving = x509.load_pem_x509_certificate(pki.serving_cert.read_bytes())
    if serving.not_valid_after_utc - dt.datetime.now(dt.UTC) < min_valid:
        return None
    served = serving.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    if not {ipaddress.ip_address(ip) for ip in extra_ips} <= set(
        served.get_values_for_type(x509.IPAddress)
    ):
        return None
    return pki


def make_pki(directory: Path, extra_ips: tuple[str, ...] = ()) -> Pki:
    """Write a fresh PKI into ``directory`` (valid 7 days; never reused across runs).

    ``extra_ips``: more addresses the apiserver serves on (the real node's address, which pods
    reach it through the ``kubernetes`` Service)."""
    directory.mkdir(parents=True, exist_ok=True)
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "posttrain-dev-ca")])
    ca = _cert(ca_name, ca_key.public_key(), ca_name, ca_key, ca=True)

    serving_key = ec.generate_private_key(ec.SECP256R1())
    serving = _cert(
        x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "kube-apiserver")]),
        serving_key.public_key(),
        ca_name,
        ca_key,
        usages=[ExtendedKeyUsageOID.SERVER_AUTH],
        sans=[
            x509.DNSName("localhost"),
            x509.DNSName("kubernetes"),
            x509.DNSName("kubernetes.default"),
            x509.DNSName("kubernetes.default.svc"),
            x509.DNSName("kubernetes.default.svc.cluster.local"),
            x509.IPAddress(ipaddress.ip_address("127.0.0.1")),
            *(x509.IPAddress(ipaddress.ip_address(ip)) for ip in extra_ips),
        ],
    )
    admin_key = ec.generate_private_key(ec.SECP256R1())
    admin = _cert(
        x509.Name(
            [
                x509.NameAttribute(NameOID.COMMON_NAME, "posttrain-admin"),
                x509.NameAttribute(NameOID.ORGANIZATION_NAME, "system:masters"),
            ]
        ),
        admin_key.public_key(),
        ca_name,
        ca_key,
        usages=[ExtendedKeyUsageOID.CLIENT_AUTH],
    )
    sa_key = rsa.generate_private_key(public_exponent=65537, key_size=2048)

    pki = _pki_paths(directory)
    pem = serialization.Encoding.PEM
    pki.ca_cert.write_bytes(ca.public_bytes(pem))
    pki.ca_key.write_bytes(_pem_key(ca_key))
    pki.serving_cert.write_bytes(serving.public_bytes(pem))
    pki.serving_key.write_bytes(_pem_key(serving_key))
    pki.admin_cert.write_bytes(admin.public_bytes(pem))
    pki.admin_key.write_bytes(_pem_key(admin_key))
    pki.sa_private.write_bytes(_pem_key(sa_key))
    pki.sa_public.write_bytes(
        sa_key.public_key().public_bytes(pem, serialization.PublicFormat.SubjectPublicKeyInfo)
    )
    for key in (pki.ca_key, pki.serving_key, pki.admin_key, pki.sa_private):
        key.chmod(0o600)
    return pki


def issue(
    pki: Pki,
    name: str,
    common_name: str,
    *,
    organizations: tuple[str, ...] = (),
    server_ips: tuple[str, ...] = (),
    server_names: tuple[str, ...] = (),
) -> tuple[Path, Path]:
    """A certificate signed by ``pki``'s CA, written beside it as ``<name>.crt``/``.key``.

    With ``server_ips``/``server_names`` it is a serving certificate for them; otherwise a
    client certificate for ``common_name`` in ``organizations`` (Kubernetes reads them as
    user and groups: ``system:node:<node>`` in ``system:nodes`` for a kubelet)."""
    directory = pki.ca_cert.parent
    ca = x509.load_pem_x509_certificate(pki.ca_cert.read_bytes())
    ca_key = serialization.load_pem_private_key(pki.ca_key.read_bytes(), password=None)
    assert isinstance(ca_key, ec.EllipticCurvePrivateKey)
    key = ec.generate_private_key(ec.SECP256R1())
    attributes = [x509.NameAttribute(NameOID.COMMON_NAME, common_name)]
    attributes += [x509.NameAttribute(NameOID.ORGANIZATION_NAME, org) for org in organizations]
    serving = bool(server_ips or server_names)
    sans: list[x509.GeneralName] = [x509.DNSName(n) for n in server_names]
    sans += [x509.IPAddress(ipaddress.ip_address(ip)) for ip in server_ips]
    cert = _cert(
        x509.Name(attributes),
        key.public_key(),
        ca.subject,
        ca_key,
        usages=[ExtendedKeyUsageOID.SERVER_AUTH if serving else ExtendedKeyUsageOID.CLIENT_AUTH],
        sans=sans or None,
    )
    cert_path, key_path = directory / f"{name}.crt", directory / f"{name}.key"
    cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_path.write_bytes(_pem_key(key))
    key_path.chmod(0o600)
    return cert_path, key_path
