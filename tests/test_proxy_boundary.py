"""The sandbox boundary, tried as the agent would through a real mitmdump.

The agent under training has ``HTTPS_PROXY`` with its session credentials, the proxy's CA and any
API key it likes, but not the control token: it must not be able to set a reward or a status for
itself or any other session, through any host, mode or header. With ``polar_block_other`` it must not
reach any non-model host (raw TCP after CONNECT included); without it, TLS to other hosts passes
through untouched and the proxy credentials are not forwarded to third parties.
"""

from __future__ import annotations

import base64
import datetime
import ipaddress
import socket
import ssl
import stat
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, HTTPServer
from pathlib import Path

import httpx
import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

from polar_addon.control import load_or_create_token
from polar_addon.store import read_rewards, read_sessions
from polar_cli.mitm import mitmdump_command
from tests.support.proxy import run_mitmdump
from tests.support.shards import wait_for_shards

SESSION = "victim-1"
HOSTS = ("polar.local", "api.openai.com", "api.anthropic.com", "generativelanguage.googleapis.com")
# What an agent tried on the old endpoint (all three were accepted as rewards).
EVIL_REWARDS = ({"value": 1e308}, {"value": True}, {"value": "1e308"}, {"value": 1.0})


def basic(user: str, password: str = "") -> str:
    return "Basic " + base64.b64encode(f"{user}:{password}".encode()).decode()


@pytest.fixture(scope="module")
def proxy(tiny_model_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("boundary") / "shards"
    with run_mitmdump(f"local:{tiny_model_dir}", out, options={"polar_shard_seconds": "0.2"}) as p:
        yield p


def agent_attempts(proxy) -> Iterator[tuple[str, httpx.Response]]:
    """Every way the agent has to post: each host over plain HTTP and over intercepted TLS, with its
    session in the proxy credentials, in x-polar-* headers and in a polar: API key, for its own session
    and for another, with made-up bearer tokens."""
    ca = ssl.create_default_context(cafile=str(proxy.ca))
    credentials = [
        {},
        {"authorization": f"Bearer polar:{SESSION}"},
        {"x-api-key": f"polar:{SESSION}"},
        {"x-polar-session": SESSION},
        {"authorization": "Bearer x"},
        {"authorization": "Bearer polar"},
        {"authorization": basic(SESSION)},
        {"proxy-authorization": basic(SESSION)},
    ]
    for proxy_url in (proxy.proxy_url(SESSION), proxy.url):
        with httpx.Client(proxy=proxy_url, verify=ca, timeout=30) as client:
            for host in HOSTS:
                for scheme in ("http", "https"):
                    for headers in credentials:
                        for target in (SESSION, "someone-else"):
                            for what, body in (("reward", EVIL_REWARDS[0]), ("status", {"status": "error"})):
                                url = f"{scheme}://{host}/sessions/{target}/{what}"
                                yield f"{url} {headers}", client.post(url, json=body, headers=headers)
            # Spellings of the control host and path, and the token's places taken by the agent's credentials.
            for url in (
                "http://POLAR.LOCAL/sessions/{s}/reward",
                "http://polar.local./sessions/{s}/reward",
                "http://polar.local/sessions/{s}/reward?authorization=Bearer+polar:{s}",
                "http://polar.local/sessions/{s}/reward/",
                "http://polar.local//sessions/{s}/reward",
                "http://polar.local/sessions/{s}/%72eward",
                "http://polar.local:8080/sessions/{s}/reward",
                "http://API.OPENAI.COM/sessions/{s}/reward",
            ):
                url = url.format(s=SESSION)
                yield (
                    url,
                    client.post(url, json={"value": 1.0}, headers={"proxy-authorization": f"Bearer polar:{SESSION}"}),
                )
            # The remaining evil values, on the control host with the agent's own credentials.
            for body in EVIL_REWARDS[1:]:
                url = f"http://polar.local/sessions/{SESSION}/reward"
                yield url, client.post(url, json=body, headers={"x-polar-session": SESSION})


def test_the_agent_cannot_post_a_reward_or_status_through_any_host_or_header(proxy):
    tried = 0
    for what, response in agent_attempts(proxy):
        tried += 1
        assert response.status_code in (401, 404), (what, response.status_code, response.text)
        assert proxy.control_token not in response.text
    assert tried > 200
    wait_for_shards(proxy.out)
    assert read_rewards(str(proxy.out)) == []
    assert all(s.status != "error" for s in read_sessions(str(proxy.out)))


def test_the_control_token_authorizes_and_values_are_checked(proxy):
    verifier = httpx.Client(proxy=proxy.url, headers=proxy.control_headers(), timeout=30)
    base = "http://polar.local/sessions/judged-1"
    for body in (
        {"value": 1e308},
        {"value": True},
        {"value": "1e308"},
        {"value": 1e6 + 1},
        {"value": None},
        {"value": 1, "name": ["x"]},
        {"value": 1, "name": "[/bold]"},
        {"value": 1, "name": "x" * 65},
        {},
    ):
        r = verifier.post(f"{base}/reward", json=body)
        assert r.status_code == 400, (body, r.text)
        assert r.json()["error"]["type"] == "invalid_request"
    for body in (
        {"status": "completed", "metadata": 5},
        {"status": "completed", "metadata": "x"},
        {"status": "completed", "metadata": {"x": "y" * 20000}},
        {"status": "won"},
        {"status": ["error"]},
        {"status": "running"},
    ):
        assert verifier.post(f"{base}/status", json=body).status_code == 400, body
    assert verifier.get(f"{base}/reward").status_code == 405
    assert verifier.post(f"{base}/reward", json={"value": -1e6, "name": "tests_passed"}).status_code == 200
    assert verifier.post(f"{base}/reward", json={"value": 0.5}).status_code == 200
    assert verifier.post(f"{base}/status", json={"status": "timeout", "metadata": {"turns": 3}}).status_code == 200
    # Over intercepted TLS to polar.local too.
    tls = httpx.Client(
        proxy=proxy.url,
        verify=ssl.create_default_context(cafile=str(proxy.ca)),
        headers=proxy.control_headers(),
        timeout=30,
    )
    assert tls.post("https://polar.local/sessions/judged-2/reward", json={"value": 1}).status_code == 200
    # The token is for polar.local only: on a provider host it is refused and never forwarded.
    assert tls.post("https://api.openai.com/sessions/judged-3/reward", json={"value": 1}).status_code == 404
    wait_for_shards(proxy.out)
    sessions = {s.session_id: s for s in read_sessions(str(proxy.out))}
    assert sessions["judged-1"].rewards == {"tests_passed": -1e6, "reward": 0.5}
    assert sessions["judged-1"].status == "timeout" and sessions["judged-1"].metadata == {"turns": 3}
    assert sessions["judged-2"].reward == 1.0 and "judged-3" not in sessions


def test_reverse_mode_needs_the_token_too(tiny_model_dir, tmp_path):
    with run_mitmdump(
        f"local:{tiny_model_dir}",
        tmp_path / "shards",
        mode="reverse:https://api.anthropic.com",
        options={"polar_shard_seconds": "0.2"},
    ) as p:
        url = f"{p.url}/sessions/rev-1/reward"
        for headers in (
            {},
            {"x-api-key": "polar:rev-1"},
            {"authorization": "Bearer polar:rev-1"},
            {"x-polar-session": "rev-1"},
            {"authorization": "Bearer " + p.control_token[:-1]},
        ):
            assert httpx.post(url, json={"value": 1}, headers=headers).status_code == 401, headers
        assert httpx.post(url, json={"value": 1}, headers=p.control_headers()).status_code == 200
        wait_for_shards(tmp_path / "shards")
    assert [r.session_id for r in read_rewards(str(tmp_path / "shards"))] == ["rev-1"]


def test_the_generated_token_file_is_private_and_a_readable_one_is_replaced(proxy, tmp_path):
    path = proxy.out / ".control-token"
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert len(proxy.control_token) >= 32
    leaked = tmp_path / "token"
    leaked.write_text("a-token-someone-else-could-read\n")
    leaked.chmod(0o644)
    fresh = load_or_create_token(leaked)
    assert fresh != "a-token-someone-else-could-read" and stat.S_IMODE(leaked.stat().st_mode) == 0o600
    assert load_or_create_token(leaked) == fresh  # kept across restarts


def test_an_explicit_control_token_is_used(tiny_model_dir, tmp_path):
    token = "operator-chosen-token-0123456789"
    with run_mitmdump(f"local:{tiny_model_dir}", tmp_path / "shards", options={"polar_control_token": token}) as p:
        client = httpx.Client(proxy=p.url)
        url = "http://polar.local/sessions/s/reward"
        assert client.post(url, json={"value": 1}, headers={"authorization": f"Bearer {token}"}).status_code == 200
        assert client.post(url, json={"value": 1}, headers={"authorization": "Bearer x" + token[1:]}).status_code == 401
    assert not (tmp_path / "shards" / ".control-token").exists()


# --- traffic policy -------------------------------------------------------------------------------


class _Recorder(BaseHTTPRequestHandler):
    seen: list[dict[str, str]] = []

    def do_GET(self) -> None:
        _Recorder.seen.append({k.lower(): v for k, v in self.headers.items()})
        self.send_response(200)
        self.send_header("content-length", "2")
        self.end_headers()
        self.wfile.write(b"ok")

    def log_message(self, *args) -> None:
        pass


@contextmanager
def http_server(tls: ssl.SSLContext | None = None) -> Iterator[int]:
    server = HTTPServer(("127.0.0.1", 0), _Recorder)
    if tls is not None:
        server.socket = tls.wrap_socket(server.socket, server_side=True)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield server.server_address[1]
    finally:
        server.shutdown()
        server.server_close()


@contextmanager
def raw_tcp_server() -> Iterator[tuple[int, list[bytes]]]:
    """A plain TCP listener that keeps whatever bytes reach it."""
    received: list[bytes] = []
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen()
    sock.settimeout(0.2)
    stop = threading.Event()

    def serve() -> None:
        while not stop.is_set():
            try:
                conn, _ = sock.accept()
            except OSError:
                continue
            conn.settimeout(2)
            try:
                received.append(conn.recv(4096))
                conn.sendall(b"PONG\n")
            except OSError:
                pass
            finally:
                conn.close()

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    try:
        yield sock.getsockname()[1], received
    finally:
        stop.set()
        thread.join()
        sock.close()


def connect_then_send(proxy_port: int, target: str, payload: bytes) -> bytes:
    """CONNECT through the proxy, then write raw bytes into the tunnel; returns everything read back."""
    with socket.create_connection(("127.0.0.1", proxy_port), timeout=5) as s:
        s.sendall(f"CONNECT {target} HTTP/1.1\r\nHost: {target}\r\n\r\n".encode())
        answer = s.recv(4096)
        if b" 200 " in answer.split(b"\r\n", 1)[0]:
            s.sendall(payload)
            try:
                while chunk := s.recv(4096):
                    answer += chunk
            except OSError:
                pass
        return answer


@pytest.mark.parametrize("block", [False, True])
def test_block_other_refuses_connect_and_raw_tcp(tiny_model_dir, tmp_path, block):
    with raw_tcp_server() as (port, received), raw_tcp_server() as (model_port, model_received):
        # The second listener is declared a model host: raw bytes to it are not model calls either.
        options = {"polar_block_other": str(block).lower(), "polar_hosts": f"127.0.0.1:{model_port}"}
        with run_mitmdump(f"local:{tiny_model_dir}", tmp_path / "shards", options=options) as p:
            answer = connect_then_send(p.port, f"127.0.0.1:{port}", b"\x00\x01raw secret bytes\n")
            to_model_host = connect_then_send(p.port, f"127.0.0.1:{model_port}", b"\x00\x01raw secret bytes\n")
            time.sleep(0.5)
    if block:
        assert answer.startswith(b"HTTP/1.1 403") and received == []
        assert b"PONG" not in to_model_host and model_received == []
    else:
        assert b"PONG" in answer and received == [b"\x00\x01raw secret bytes\n"]


def _self_signed(tmp_path: Path) -> tuple[ssl.SSLContext, Path]:
    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "third-party.test")])
    now = datetime.datetime.now(datetime.UTC)
    cert = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(days=1))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]), False)
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), True)
        .sign(key, hashes.SHA256())
    )
    pem = tmp_path / "third-party.pem"
    pem.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_pem = tmp_path / "third-party.key"
    key_pem.write_bytes(
        key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())
    )
    server = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    server.load_cert_chain(pem, key_pem)
    return server, pem


def test_other_tls_passes_through_untouched(proxy, tmp_path):
    server_ctx, pem = _self_signed(tmp_path)
    with http_server(server_ctx) as port:
        # Trusting only the third party's own certificate: a mitmproxy certificate would fail here.
        with httpx.Client(proxy=proxy.proxy_url(SESSION), verify=ssl.create_default_context(cafile=str(pem))) as client:
            r = client.get(f"https://127.0.0.1:{port}/")
    assert r.status_code == 200 and r.content == b"ok"


def test_proxy_credentials_are_not_forwarded_to_third_parties(proxy):
    _Recorder.seen.clear()
    with http_server() as port:
        with httpx.Client(proxy=proxy.proxy_url("secret-session:task=t;group=g")) as client:
            assert client.get(f"http://127.0.0.1:{port}/x", headers={"x-keep": "1"}).status_code == 200
    (headers,) = _Recorder.seen
    assert headers.get("x-keep") == "1" and "proxy-authorization" not in headers


def test_mitmdump_binds_loopback_by_default(tmp_path):
    cmd = mitmdump_command("local:/m", tmp_path, port=8080, modes=["regular", "reverse:https://api.anthropic.com"])
    assert cmd[cmd.index("--listen-host") + 1] == "127.0.0.1"
    assert [cmd[i + 1] for i, a in enumerate(cmd) if a == "--mode"] == ["regular", "reverse:https://api.anthropic.com"]
    capture = (Path(__file__).resolve().parents[1] / "docs" / "concepts" / "capture.md").read_text()
    assert "--listen-host 127.0.0.1" in capture.split("## Run the proxy", 1)[1].split("|", 1)[0]
