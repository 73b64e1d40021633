"""run_server with TLS (a self-signed certificate), --root-path and CORS, on the fake engine."""

from __future__ import annotations

import datetime
import os
import signal
import socket
import ssl
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import httpx
import pytest

_CHILD = textwrap.dedent("""
    import sys
    sys.path.insert(0, {tests_dir!r})
    from pathlib import Path
    from server_fakes import CHATML, FakeEngine, build_tokenizer, make_config
    from servelm.engine import async_engine
    from servelm.server.app import run_server

    async def start(cls, config, launch=None):
        return FakeEngine(build_tokenizer(Path({tok_dir!r}), CHATML))

    async_engine.AsyncEngine.start = classmethod(start)
    async_engine.AsyncEngine.check_model = staticmethod(lambda config: None)
    run_server(make_config(port={port}, log_level="warning", ssl_keyfile={key!r},
                           ssl_certfile={cert!r}, root_path="/llm"))
""")


def _self_signed(directory: Path) -> tuple[Path, Path]:
    crypto = pytest.importorskip("cryptography")  # noqa: F841
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "127.0.0.1")])
    now = datetime.datetime.now(datetime.timezone.utc)
    import ipaddress
    cert = (x509.CertificateBuilder().subject_name(name).issuer_name(name)
            .public_key(key.public_key()).serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=1))
            .not_valid_after(now + datetime.timedelta(days=1))
            .add_extension(x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]),
                           critical=False)
            .sign(key, hashes.SHA256()))
    key_path, cert_path = directory / "key.pem", directory / "cert.pem"
    key_path.write_bytes(key.private_bytes(serialization.Encoding.PEM,
                                           serialization.PrivateFormat.PKCS8,
                                           serialization.NoEncryption()))
    cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    return key_path, cert_path


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def test_tls_and_root_path(tmp_path: Path) -> None:
    key, cert = _self_signed(tmp_path)
    port = _free_port()
    code = _CHILD.format(tests_dir=str(Path(__file__).parent), tok_dir=str(tmp_path / "tok"),
                         port=port, key=str(key), cert=str(cert))
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).parents[3])}
    process = subprocess.Popen([sys.executable, "-c", code], env=env)
    base = f"https://127.0.0.1:{port}"
    context = ssl.create_default_context(cafile=str(cert))
    try:
        deadline = time.monotonic() + 90
        while True:
            assert process.poll() is None, "server exited during start-up"
            try:
                if httpx.get(f"{base}/health", verify=context, timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                assert time.monotonic() < deadline, "server did not become healthy"
                time.sleep(0.2)
        models = httpx.get(f"{base}/v1/models", verify=context)
        assert models.json()["data"][0]["id"] == "tiny-model"
        # The proxy strips --root-path; the generated docs point clients through it.
        assert httpx.get(f"{base}/openapi.json", verify=context).json()["servers"] == [{"url": "/llm"}]
        with pytest.raises(httpx.ConnectError):  # the certificate is not trusted by default
            httpx.get(f"{base}/health")
        with pytest.raises(httpx.HTTPError):  # plain HTTP is not served
            httpx.get(f"http://127.0.0.1:{port}/health", timeout=2)
    finally:
        process.send_signal(signal.SIGINT)
        process.wait(timeout=30)
