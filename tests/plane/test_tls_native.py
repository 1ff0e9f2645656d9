"""The native listeners' TLS configuration against Python's (gateway.transports, the
reference): the same files load or fail in both, and a client certificate names the
same identity in both (--tls-username-from cn|san)."""

from __future__ import annotations

import os
import ssl
from pathlib import Path

import pytest
import trustme

from gateway.transports import ServerTLS, cert_identity
from serving import plane

if plane.NATIVE is None:
    if os.environ.get("LIGHTGATE_NATIVE") == "1":
        pytest.fail("LIGHTGATE_NATIVE=1 but the native extension is not installed")
    pytest.skip("the native extension is not installed", allow_module_level=True)

native = plane.NATIVE


def _files(tmp_path: Path) -> tuple[trustme.CA, Path, Path, Path]:
    ca = trustme.CA()
    server = ca.issue_cert("127.0.0.1", "localhost")
    cert, key, ca_pem = tmp_path / "server.pem", tmp_path / "server.key", tmp_path / "ca.pem"
    server.cert_chain_pems[0].write_to_path(str(cert))
    server.private_key_pem.write_to_path(str(key))
    ca.cert_pem.write_to_path(str(ca_pem))
    return ca, cert, key, ca_pem


def _python_loads(*args: str | None) -> bool:
    try:
        ServerTLS(*args)  # type: ignore[arg-type]
    except (OSError, ssl.SSLError, ValueError):
        return False
    return True


def _native_loads(*args: str | None) -> bool:
    try:
        native.tls_check(*args)
    except ValueError:
        return False
    return True


def test_the_same_files_load_or_fail_on_both_planes(tmp_path: Path) -> None:
    other = trustme.CA().issue_cert("localhost")
    _, cert, key, ca = _files(tmp_path)
    wrong_key = tmp_path / "wrong.key"
    other.private_key_pem.write_to_path(str(wrong_key))
    broken = tmp_path / "broken.pem"
    broken.write_bytes(b"-----BEGIN CERTIFICATE-----\nbroken\n")
    cases = [
        (str(cert), str(key), None, "none"),
        (str(cert), str(key), str(ca), "optional"),
        (str(cert), str(key), str(ca), "required"),
        (str(cert), str(key), None, "required"),  # client auth needs --tls-ca
        (str(cert), str(wrong_key), None, "none"),  # a key not the certificate's
        (str(key), str(key), None, "none"),  # a key is no certificate
        (str(broken), str(key), None, "none"),
        (str(cert), str(key), str(broken), "required"),
        (str(tmp_path / "missing.pem"), str(key), None, "none"),
        (str(cert), str(key), None, "always"),
    ]
    for case in cases:
        assert _native_loads(*case) == _python_loads(*case), case


@pytest.mark.parametrize("cert_kind", ["cn-and-san", "cn-only", "san-email", "neither"])
def test_identity_is_pythons(tmp_path: Path, cert_kind: str) -> None:
    ca = trustme.CA()
    issued = {
        "cn-and-san": lambda: ca.issue_cert("sensor-9.devices.example",
                                            common_name="device-1"),
        "cn-only": lambda: ca.issue_cert(common_name="only-cn"),
        "san-email": lambda: ca.issue_cert("dev@example.com", "dev.example"),
        "neither": lambda: ca.issue_cert("10.0.0.1"),  # an IP SAN names nobody
    }[cert_kind]()
    pem = tmp_path / "client.pem"
    issued.cert_chain_pems[0].write_to_path(str(pem))
    peercert = ssl._ssl._test_decode_cert(str(pem))  # what getpeercert() gives
    der = ssl.PEM_cert_to_DER_cert(pem.read_text())
    for source in ("none", "cn", "san"):
        assert native.tls_identity(der, source) == cert_identity(peercert, source), source
