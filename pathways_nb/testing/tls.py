"""TLS certificates for tests: a CA of their own and a server certificate it signed, as PEM files."""

from __future__ import annotations

import datetime
import ipaddress
import os
from collections.abc import Sequence


def certificates(
    directory: str | os.PathLike[str], addresses: Sequence[str] = ("127.0.0.1",), names: Sequence[str] = ("localhost",)
) -> dict[str, str]:
    """Writes ``ca.pem``, ``cert.pem`` (for ``addresses`` and ``names``) and ``key.pem`` into ``directory``;
    returns their paths by ``ca``, ``cert`` and ``key``. (``cryptography`` comes with the test extra.)"""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    now = datetime.datetime.now(datetime.timezone.utc)
    ca_key, server_key = ec.generate_private_key(ec.SECP256R1()), ec.generate_private_key(ec.SECP256R1())
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "pathways-nb test CA")])

    def signed(subject: x509.Name, key, *extensions) -> x509.Certificate:
        builder = (
            x509.CertificateBuilder()
            .subject_name(subject)
            .issuer_name(ca_name)
            .public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + datetime.timedelta(days=1))
        )
        for extension, critical in extensions:
            builder = builder.add_extension(extension, critical=critical)
        return builder.sign(ca_key, hashes.SHA256())

    ca = signed(ca_name, ca_key, (x509.BasicConstraints(ca=True, path_length=None), True))
    alternative_names = [x509.DNSName(name) for name in names]
    alternative_names += [x509.IPAddress(ipaddress.ip_address(address)) for address in addresses]
    server = signed(
        x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, (list(names) or list(addresses))[0])]),
        server_key,
        (x509.SubjectAlternativeName(alternative_names), False),
    )
    files = {
        "ca": ca.public_bytes(serialization.Encoding.PEM),
        "cert": server.public_bytes(serialization.Encoding.PEM),
        "key": server_key.private_bytes(
            serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
        ),
    }
    paths = {}
    for name, data in files.items():
        paths[name] = os.path.join(directory, f"{name}.pem")
        with open(paths[name], "wb") as f:
            f.write(data)
    return paths
