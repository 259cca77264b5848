"""lazyckpt's client over TLS, as the Hub, its CDN and most servers answer: ranges read
straight into place through an encrypted socket, a redirect from one https origin to
another with the token kept to its own, deadlines kept on an encrypted connection,
and a certificate that cannot be verified refused at once, by name."""

from __future__ import annotations

import datetime
import ipaddress
import json
import ssl
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from safetensors.numpy import save

import lazyckpt
from tests.hub_server import HubServer
from tests.test_http_reads import MiB, ranges, tensors

pytest.importorskip("cryptography")


@pytest.fixture(scope="module")
def certificate(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """A self-signed certificate for 127.0.0.1, and its key."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "127.0.0.1")])
    now = datetime.datetime.now(datetime.UTC)
    cert = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(days=1))
        .not_valid_after(now + datetime.timedelta(days=7))
        .add_extension(
            x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]),
            critical=False,
        )
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .sign(key, hashes.SHA256())
    )
    folder = tmp_path_factory.mktemp("tls")
    (folder / "cert.pem").write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    (folder / "key.pem").write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
    )
    return folder / "cert.pem", folder / "key.pem"


def _server(tmp_path: Path, certificate: tuple[Path, Path], **options: Any) -> HubServer:
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.load_cert_chain(*certificate)
    return HubServer(tmp_path / "hub", tls=context, **options)


@pytest.fixture
def secure(
    tmp_path: Path, certificate: tuple[Path, Path], monkeypatch: pytest.MonkeyPatch
) -> Iterator[HubServer]:
    """The loopback Hub over https, its certificate trusted (SSL_CERT_FILE)."""
    monkeypatch.setenv("SSL_CERT_FILE", str(certificate[0]))
    with _server(tmp_path, certificate, valid_tokens={"member"}) as hub:
        yield hub


def test_ranges_over_tls_land_in_place(secure: HubServer) -> None:
    values = tensors()
    url = secure.add_plain_file("m/model.safetensors", save(values))
    assert url.startswith("https://")
    tree = lazyckpt.open(url, flat=True)
    secure.clear_log()
    with lazyckpt.network_options(request_bytes=2 * MiB):
        loaded = lazyckpt.load(tree, memory_budget=256 * MiB)
    for name, value in values.items():
        np.testing.assert_array_equal(loaded[name], value)
    start = tree["big"].stored.start
    big = [r for r in ranges(secure, "model.safetensors") if start <= r[0] < start + 8 * MiB]
    assert big == [(start + i * 2 * MiB, start + (i + 1) * 2 * MiB) for i in range(4)]


def test_a_hub_over_tls_keeps_its_token_from_the_cdn(
    secure: HubServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    constants = pytest.importorskip("huggingface_hub.constants")
    monkeypatch.setattr(constants, "ENDPOINT", secure.endpoint)
    monkeypatch.setattr(constants, "HF_TOKEN_PATH", "/nonexistent/token")
    monkeypatch.setenv("HF_TOKEN", "member")
    values = tensors()
    index = {"metadata": {}, "weight_map": dict.fromkeys(values, "model.safetensors")}
    secure.commit(
        "org/model",
        {
            "model.safetensors": save(values),
            "model.safetensors.index.json": json.dumps(index).encode(),
        },
    )
    secure.repos["org/model"].private = True
    secure.repos["org/model"].allowed_tokens = {"member"}
    loaded = lazyckpt.load("hf://org/model")
    np.testing.assert_array_equal(loaded["big"], values["big"])
    assert secure.cdn != secure.endpoint and secure.cdn.startswith("https://")
    sent = {(e.server, e.authorization) for e in secure.log}
    assert ("hub", "Bearer member") in sent
    assert {a for s, a in sent if s == "cdn"} == {None}


def test_a_deadline_holds_on_an_encrypted_connection(secure: HubServer) -> None:
    values = {"w": np.ones(1 << 18, np.float32)}  # 1 MiB
    tree = lazyckpt.open(secure.add_plain_file("slow/model.safetensors", save(values)))
    secure.rate = 1000.0  # bytes a second after each 64 KiB sent: 17 min for the tensor
    slow = lazyckpt.network_options(timeout=1, min_rate=1 << 20, retries=1)  # 2 s for it
    with slow, pytest.raises(lazyckpt.StorageAccessError, match="no complete answer within 2 s"):
        tree["w"].get()


def test_a_certificate_that_cannot_be_verified_is_refused_at_once(
    tmp_path: Path, certificate: tuple[Path, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("SSL_CERT_FILE", raising=False)
    with _server(tmp_path, certificate) as hub:
        url = hub.add_plain_file("m/model.safetensors", save({"w": np.ones(4, np.float32)}))
        with (
            lazyckpt.measure() as cost,
            pytest.raises(
                lazyckpt.StorageAccessError,
                match=r"TLS certificate of 127\.0\.0\.1:\d+ could not be verified .*SSL_CERT_FILE",
            ),
        ):
            lazyckpt.open(url)
    assert cost.requests == 0  # no answer, and not tried again
