"""The run's certificates: one CA made for the run (ECDSA P-256, with `trustme`), a server
certificate for 127.0.0.1 and localhost that every broker's TLS listener presents, and
one client certificate that every device presents where a row asks for mutual TLS. The
load generator's side is wire.set_tls (it verifies the server against this CA)."""

from __future__ import annotations

import ssl
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Certs:
    """PEM files in one directory: the CA, the server's chain and key, a client's."""

    ca: Path
    cert: Path
    key: Path
    client_cert: Path
    client_key: Path


def make_certs(directory: Path) -> Certs:
    import trustme  # the test extra has it, which `make bench` installs

    directory.mkdir(parents=True, exist_ok=True)
    ca = trustme.CA(organization_name="bench")
    server = ca.issue_cert("127.0.0.1", "localhost", common_name="localhost")
    # rumqttd's client verification takes the subject's organization as a tenant id and
    # refuses one that is not alphanumeric (trustme's default has a space and dots).
    client = ca.issue_cert("bench-device", common_name="bench-device",
                           organization_name="bench")
    certs = Certs(*(directory / n for n in ("ca.pem", "server.pem", "server.key",
                                            "client.pem", "client.key")))
    ca.cert_pem.write_to_path(str(certs.ca))
    certs.cert.write_bytes(b"".join(p.bytes() for p in server.cert_chain_pems))
    server.private_key_pem.write_to_path(str(certs.key))
    certs.client_cert.write_bytes(b"".join(p.bytes() for p in client.cert_chain_pems))
    client.private_key_pem.write_to_path(str(certs.client_key))
    # Readable by a broker that drops root for a user of its own (Debian's Mosquitto runs
    # as mosquitto): throwaway keys, trusted by nothing but this run's load generator.
    directory.chmod(0o755)
    for path in directory.iterdir():
        path.chmod(0o644)
    return certs


def client_context(certs: Certs, mutual: bool) -> ssl.SSLContext:
    """What the load generator's clients use: the run's CA as the only trust anchor, the
    host name checked (127.0.0.1 is in the certificate), the client certificate when the
    broker asks for one."""
    ctx = ssl.create_default_context(cafile=str(certs.ca))
    if mutual:
        ctx.load_cert_chain(str(certs.client_cert), str(certs.client_key))
    return ctx
