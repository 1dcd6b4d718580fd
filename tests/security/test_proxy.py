"""The proxy as a boundary (issue 23, attacks 3 and 7), against a real `polar proxy` as users start it.

- Attack 3: a proxy-only agent asks the proxy for a loopback service on the host by every route it has (absolute
  URL, origin-form Host header, CONNECT then HTTP or raw TCP, a tunnel to a model host with another Host inside,
  WebSocket upgrades, HTTP/2, the reverse listener's Host header and absolute URL). `polar proxy` refuses each with
  its 403 and the service is never reached; `polar rollout --proxy` refuses a proxy started with --pass-through
  before any session, and accepts the default one, whose session completes while its attacker is refused.
- Attack 7: 20 connections each sending a 30 MiB body (minus its last byte) and holding it, then 20 that stay
  under polar_max_body_mb: mitmdump's RSS stays within the in-flight budget, a call over the budget is refused
  in its caller's protocol (429, Anthropic-shaped on /v1/messages), a stalled body is cut by polar_body_timeout,
  and once the connections end the memory is released and honest calls are answered again.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import httpx
import orjson
import pytest

from polar_addon.control import token_file
from polar_cli.mitm import REPO, free_port, wait_for_port
from polar_cli.rollout.proxy_check import BLOCKED_MARKER, check_blocks_other
from tests.support.proxy import register_session

BODY_TIMEOUT_S = 6
MIB = 1 << 20
needs_bwrap = pytest.mark.skipif(
    not (shutil.which("bwrap") and shutil.which("socat")), reason="bubblewrap/socat missing (make sandbox)"
)


@dataclass
class RunningProxy:
    forward: int
    reverse: int
    out: Path
    confdir: Path
    process: subprocess.Popen

    @property
    def token(self) -> str:
        return token_file(str(self.out), str(self.confdir)).read_text().strip()

    @property
    def mitmdump_pid(self) -> int:
        """`polar proxy`'s mitmdump (its other child is the lifeline's guardian)."""
        children = Path(f"/proc/{self.process.pid}/task/{self.process.pid}/children").read_text().split()
        (pid,) = [int(c) for c in children if b"mitmdump" in Path(f"/proc/{c}/cmdline").read_bytes()]
        return pid


@contextmanager
def polar_proxy(tmp: Path, script: Path, *args: str) -> Iterator[RunningProxy]:
    """`polar proxy` (the CLI, as a user runs it) on the scripted engine, with registered sessions and fixed
    sampling (what `polar rollout --proxy` requires) and ``args``."""
    forward, reverse = free_port(), free_port()
    out, confdir = tmp / "store", tmp / "conf"
    process = subprocess.Popen(
        [sys.executable, "-m", "polar_cli.app", "proxy", "--engine", f"scripted:{script}", "--out", str(out),
         "--port", str(forward), "--reverse-port", str(reverse), "--confdir", str(confdir),
         "--set", "polar_sessions=registered", "--set", "polar_sampling=fixed", "--set", "polar_shard_seconds=0.5",
         "--set", f"polar_body_timeout={BODY_TIMEOUT_S}", *args],
        cwd=REPO, stdout=open(tmp / "polar-proxy.log", "wb"), stderr=subprocess.STDOUT,
        start_new_session=True)  # fmt: skip
    try:
        for port in (forward, reverse):
            wait_for_port(port, 120, process, tmp / "polar-proxy.log")
        deadline = time.monotonic() + 30
        while not token_file(str(out), str(confdir)).exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        yield RunningProxy(forward, reverse, out, confdir, process)
    finally:
        os.killpg(process.pid, signal.SIGINT)
        try:
            process.wait(timeout=90)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()


def _script(root: Path, tiny_model_dir: Path) -> Path:
    script = root / "script.json"
    script.write_bytes(orjson.dumps({"model_dir": str(tiny_model_dir), "cycle": True, "turns": [{"content": "hi"}]}))
    return script


@pytest.fixture(scope="module")
def guarded(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningProxy]:
    """`polar proxy` with its defaults: non-model traffic refused."""
    root = tmp_path_factory.mktemp("guarded")
    with polar_proxy(root, _script(root, tiny_model_dir)) as proxy:
        yield proxy


@pytest.fixture(scope="module")
def open_proxy(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningProxy]:
    """`polar proxy --pass-through`: the opt-out."""
    root = tmp_path_factory.mktemp("open")
    with polar_proxy(root, _script(root, tiny_model_dir), "--pass-through") as proxy:
        yield proxy


@contextmanager
def loopback_service() -> Iterator[tuple[int, list[bytes]]]:
    """Another service on the host's loopback (what the agent is after): answers anything with a secret."""
    hits: list[bytes] = []
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(64)

    def serve() -> None:
        while True:
            try:
                conn, _ = server.accept()
            except OSError:
                return
            conn.settimeout(2)
            try:
                hits.append(conn.recv(4096))
                conn.sendall(b"HTTP/1.1 200 OK\r\ncontent-length: 11\r\nconnection: close\r\n\r\nHOST-SECRET")
            except OSError:
                pass
            conn.close()

    threading.Thread(target=serve, daemon=True).start()
    try:
        yield server.getsockname()[1], hits
    finally:
        server.shutdown(socket.SHUT_RDWR)
        server.close()


# The agent's routes to 127.0.0.1:{t}, in the sandbox: {fwd} and {rev} are its proxy listeners (HTTPS_PROXY and
# OPENAI_BASE_URL), each route (listener, first bytes, bytes sent once the proxy said 200, or TLS host for a tunnel).
ATTACK = r'''
import json, os, socket, ssl, sys, urllib.parse, urllib.request
target = sys.argv[1].split("TARGET=", 1)[1].split()[0]
t = f"127.0.0.1:{target}"
fwd = urllib.parse.urlsplit(os.environ["HTTPS_PROXY"]).port
rev = urllib.parse.urlsplit(os.environ["OPENAI_BASE_URL"]).port
ws = ("Upgrade: websocket\r\nConnection: Upgrade\r\nSec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\n"
      "Sec-WebSocket-Version: 13\r\n")
ROUTES = {
    "absolute URL": (fwd, f"GET http://{t}/ HTTP/1.1\r\nHost: {t}\r\n\r\n", None),
    "absolute URL, model path": (
        fwd, f"POST http://{t}/v1/chat/completions HTTP/1.1\r\nHost: {t}\r\ncontent-length: 2\r\n\r\n{{}}", None),
    "origin form, Host header": (fwd, f"GET / HTTP/1.1\r\nHost: {t}\r\n\r\n", None),
    "absolute URL to a model host, Host header": (
        fwd, f"GET http://api.openai.com/ HTTP/1.1\r\nHost: {t}\r\n\r\n", None),
    "absolute URL, model Host header": (fwd, f"GET http://{t}/ HTTP/1.1\r\nHost: api.openai.com\r\n\r\n", None),
    "CONNECT then HTTP": (fwd, f"CONNECT {t} HTTP/1.1\r\nHost: {t}\r\n\r\n", "GET / HTTP/1.1\r\nHost: x\r\n\r\n"),
    "CONNECT then raw TCP": (fwd, f"CONNECT {t} HTTP/1.1\r\nHost: {t}\r\n\r\n", "\x00\x01raw bytes\n"),
    "tunnel to a model host, inner Host": (
        fwd, "CONNECT api.openai.com:80 HTTP/1.1\r\nHost: api.openai.com:80\r\n\r\n",
        f"GET / HTTP/1.1\r\nHost: {t}\r\n\r\n"),
    "TLS tunnel to a model host, inner Host": (
        fwd, "CONNECT api.openai.com:443 HTTP/1.1\r\nHost: api.openai.com:443\r\n\r\n",
        ("api.openai.com", f"GET / HTTP/1.1\r\nHost: {t}\r\n\r\n")),
    "WebSocket upgrade": (fwd, f"GET http://{t}/ws HTTP/1.1\r\nHost: {t}\r\n{ws}\r\n", None),
    "WebSocket upgrade, Responses path": (fwd, f"GET http://{t}/v1/responses HTTP/1.1\r\nHost: {t}\r\n{ws}\r\n", None),
    "HTTP/2 prior knowledge": (fwd, "PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n", None),
    "reverse, Host header": (rev, f"GET / HTTP/1.1\r\nHost: {t}\r\n\r\n", None),
    "reverse, absolute URL": (rev, f"GET http://{t}/ HTTP/1.1\r\nHost: {t}\r\n\r\n", None),
    "reverse, CONNECT": (rev, f"CONNECT {t} HTTP/1.1\r\nHost: {t}\r\n\r\n", "GET / HTTP/1.1\r\nHost: x\r\n\r\n"),
    "reverse, WebSocket upgrade": (rev, f"GET /ws HTTP/1.1\r\nHost: {t}\r\n{ws}\r\n", None),
}
def read(s):
    """Whatever arrives within a second of quiet (or until the proxy closes)."""
    got = s.recv(4096)
    s.settimeout(1)
    try:
        while chunk := s.recv(4096):
            got += chunk
    except (TimeoutError, ssl.SSLError):
        pass
    s.settimeout(5)
    return got
for name, (port, first, then) in ROUTES.items():
    s = socket.create_connection(("127.0.0.1", port), timeout=5)
    s.sendall(first.encode("latin-1"))
    answer = b""
    try:
        answer = read(s)
        if then is not None and b" 200 " in answer.split(b"\r\n", 1)[0]:
            if isinstance(then, tuple):
                s = ssl.create_default_context(cafile=os.environ["SSL_CERT_FILE"]).wrap_socket(
                    s, server_hostname=then[0])
                then = then[1]
            s.sendall(then.encode("latin-1"))
            answer += b" THEN " + read(s)
    except OSError as exc:
        answer += repr(exc).encode()
    s.close()
    print("ROUTE", json.dumps([name, answer.decode("latin-1")]), flush=True)
# HTTP/2 offered inside an intercepted TLS tunnel to a model host, :authority naming the service (mitmproxy
# answers in HTTP/1.1 when it has no upstream to mirror: either way, refused).
import httpx
with httpx.Client(
    proxy=os.environ["HTTPS_PROXY"], http2=True, verify=os.environ["SSL_CERT_FILE"], timeout=10
) as client:
    r = client.get("https://api.openai.com/", headers={"host": t})
    print("ROUTE", json.dumps(["HTTP/2 offered, :authority " + t, f"{r.http_version} {r.status_code} {r.text}"]),
          flush=True)
# And the honest part of the session: a model call, and the work the verifier checks.
body = json.dumps({"model": os.environ["POLAR_MODEL"], "messages": [{"role": "user", "content": "hi"}]}).encode()
call = urllib.request.Request(os.environ["OPENAI_BASE_URL"] + "/chat/completions", data=body, headers={
    "authorization": "Bearer " + os.environ["OPENAI_API_KEY"], "content-type": "application/json"})
print("MODEL", urllib.request.urlopen(call, timeout=60).status, flush=True)
open("done.txt", "w").write("done\n")
'''


def _rollout(proxy: RunningProxy, tmp: Path, target: int) -> tuple[subprocess.CompletedProcess, Path]:
    attack = tmp / "attack.py"
    attack.write_text(ATTACK)
    tasks = tmp / "tasks.jsonl"
    tasks.write_text(
        json.dumps({"id": "boundary", "instruction": f"TARGET={target}", "verify": "test -f done.txt"}) + "\n"
    )
    report = tmp / "report"
    done = subprocess.run(
        [sys.executable, "-m", "polar_cli.app", "rollout", str(tasks),
         "--harness", f"cmd:{sys.executable} {attack} {{instruction}}",
         "--proxy", f"http://127.0.0.1:{proxy.forward}", "--reverse-url", f"http://127.0.0.1:{proxy.reverse}",
         "--control-token", proxy.token, "--confdir", str(proxy.confdir), "--out", str(proxy.out),
         "--runtime", "bwrap", "--network", "proxy-only", "--seed", "23", "--no-progress", "--report-dir", str(report)],
        cwd=REPO, capture_output=True, text=True, timeout=300)  # fmt: skip
    return done, report


@needs_bwrap
def test_rollout_on_polar_proxy_runs_and_the_agent_reaches_no_loopback_service(
    guarded: RunningProxy, tmp_path: Path
) -> None:
    with loopback_service() as (target, hits):
        done, report = _rollout(guarded, tmp_path, target)
        time.sleep(0.5)
    logs = "\n".join(p.read_text(errors="replace") for p in (report / "logs").rglob("*") if p.is_file())
    assert done.returncode == 0, done.stdout + done.stderr + logs
    (session,) = json.loads((report / "rollout-summary.json").read_text())["session_results"]
    assert (session["status"], session["reward"]) == ("completed", 1.0), (session, logs)
    routes = dict(json.loads(line.split(" ", 1)[1]) for line in logs.splitlines() if line.startswith("ROUTE "))
    assert len(routes) == 17, logs
    for name, answer in routes.items():
        status = answer.split("THEN")[-1].strip().split("\r\n", 1)[0]
        # polar's 403, or mitmproxy refusing a form it does not take (HTTP/2 prior knowledge, CONNECT in reverse
        # mode) with a 400 before any upstream connection: never the service's 200 or an upstream error.
        refused = (" 403" in status and BLOCKED_MARKER.decode() in answer) or status.startswith("HTTP/1.1 400")
        assert refused, (name, answer)
        assert "HOST-SECRET" not in answer, (name, answer)
    assert "MODEL 200" in logs
    assert hits == []


def test_the_opt_out_is_an_open_proxy_and_the_probe_sees_it(open_proxy: RunningProxy, guarded: RunningProxy) -> None:
    """The control of the blocked routes above: through --pass-through the same service is reached (so a route
    that could never succeed proves nothing); the probe `polar rollout --proxy` runs tells the two apart."""
    with loopback_service() as (target, hits):
        reached = httpx.get(f"http://127.0.0.1:{target}/", proxy=f"http://127.0.0.1:{open_proxy.forward}", timeout=10)
        blocked = httpx.get(f"http://127.0.0.1:{target}/", proxy=f"http://127.0.0.1:{guarded.forward}", timeout=10)
    assert reached.text == "HOST-SECRET" and len(hits) == 1
    assert blocked.status_code == 403 and BLOCKED_MARKER in blocked.content
    check_blocks_other("guarded", guarded.forward, guarded.reverse)
    with pytest.raises(ValueError, match="passes non-model traffic"):
        check_blocks_other("open", open_proxy.forward, open_proxy.reverse)


@needs_bwrap
def test_rollout_refuses_an_open_proxy_before_any_session(open_proxy: RunningProxy, tmp_path: Path) -> None:
    with loopback_service() as (target, hits):
        done, report = _rollout(open_proxy, tmp_path, target)
    assert done.returncode == 2, done.stdout + done.stderr
    assert f"the proxy at http://127.0.0.1:{open_proxy.forward} passes non-model traffic" in done.stderr
    assert "start it with `polar proxy`" in done.stderr.lower()
    assert not (report / "logs").exists() and not (report / "rollout-summary.json").exists()
    # The probe's own listener was reached, never the agent's target: no session ran.
    assert hits == []


# --- bounded request bodies ---------------------------------------------------------------------------------


def rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise AssertionError(f"no VmRSS for {pid}")


def hold_bodies(port: int, count: int, declared: int) -> list[socket.socket]:
    """``count`` connections, each declaring a ``declared``-byte /v1/messages body and sending all of it but the
    last byte: bodies the proxy would hold forever (no read timeout, issue 23 attack 7)."""
    chunk = b"x" * MIB
    held = []
    for i in range(count):
        sock = socket.create_connection(("127.0.0.1", port), timeout=30)
        sock.sendall(
            f"POST /v1/messages HTTP/1.1\r\nHost: 127.0.0.1\r\ncontent-type: application/json\r\n"
            f"x-api-key: polar:flood-{i}\r\ncontent-length: {declared}\r\n\r\n".encode()
        )
        left = declared - 1
        while left:
            n = min(left, len(chunk))
            sock.sendall(chunk[:n])
            left -= n
        held.append(sock)
    return held


def cut_by_proxy(sock: socket.socket, within_s: float) -> bool:
    sock.settimeout(within_s)
    try:
        return sock.recv(4096) == b""
    except ConnectionResetError:
        return True
    except TimeoutError:
        return False


def anthropic_call(proxy: RunningProxy, secret: str, pad: int = 0) -> httpx.Response:
    body = {"model": "m", "max_tokens": 8, "messages": [{"role": "user", "content": "x" * pad or "hi"}]}
    return httpx.post(
        f"http://127.0.0.1:{proxy.reverse}/v1/messages",
        json=body,
        timeout=60,
        headers={"x-api-key": f"polar:{secret}", "anthropic-version": "2023-06-01"},
    )


def settled_rss(pid: int, above: float, within_s: float = 15.0) -> float:
    """RSS once it fell to ``above`` or below, or what it is after ``within_s``."""
    deadline = time.monotonic() + within_s
    while (now := rss_mib(pid)) > above and time.monotonic() < deadline:
        time.sleep(0.25)
    return now


def test_a_flood_of_large_bodies_stays_bounded_is_cut_and_released(guarded: RunningProxy) -> None:
    pid = guarded.mitmdump_pid
    secret = register_session(guarded.forward, guarded.token, "honest-1")
    assert anthropic_call(guarded, secret).status_code == 200
    base = rss_mib(pid)

    # 20 x (30 MiB - 1 byte), over polar_max_body_mb (16): refused as declared, not one byte kept; before the fix,
    # mitmdump held +0.6 GB.
    over = hold_bodies(guarded.reverse, 20, 30 * MIB)
    over_held = rss_mib(pid) - base
    # 20 x (15 MiB - 1 byte): each within the limit, 17 fit the client's 256 MiB in-flight budget, 3 do not.
    under = hold_bodies(guarded.reverse, 20, 15 * MIB)
    under_held = rss_mib(pid) - base
    refused = anthropic_call(guarded, secret, pad=MIB)  # the budget is spent: an honest call is told to retry
    # None of them sends its last byte: each connection is cut once polar_body_timeout has passed.
    cut = [cut_by_proxy(sock, BODY_TIMEOUT_S + 10) for sock in over + under]
    for sock in over + under:
        sock.close()
    released = settled_rss(pid, base + 32) - base
    # The budget is back: the same call is no longer refused (the engine says it is too long for the window).
    after = anthropic_call(guarded, secret, pad=MIB)
    print(
        f"mitmdump RSS {base:.0f} MiB; +{over_held:.0f} MiB holding 20 x 30 MiB, +{under_held:.0f} MiB holding "
        f"20 x 15 MiB more; +{released:.0f} MiB after they were cut"
    )

    assert over_held < 50, over_held
    assert under_held < 256 * 1.25 + 50, under_held  # the budget, with the buffers' own overhead
    assert refused.status_code == 429, refused.text
    assert refused.json()["type"] == "error" and refused.json()["error"]["type"] == "overloaded_error"
    assert "polar_client_inflight_mb" in refused.json()["error"]["message"]
    assert all(cut), cut
    assert released < 32, released
    assert after.status_code == 400 and "prompt is too long" in after.text, after.text
    assert anthropic_call(guarded, secret).status_code == 200


def test_a_body_over_the_limit_is_refused_in_the_callers_protocol(guarded: RunningProxy) -> None:
    big = {"model": "m", "max_tokens": 8, "messages": [{"role": "user", "content": "x" * (17 * MIB)}]}
    anthropic = httpx.post(
        f"http://127.0.0.1:{guarded.reverse}/v1/messages", json=big, timeout=60, headers={"x-api-key": "polar:whoever"}
    )
    assert anthropic.status_code == 413
    assert anthropic.json()["error"]["type"] == "request_too_large"
    # Chunked (no declared length): counted on its way in, dropped once over the limit.
    chunks = (b"x" * MIB for _ in range(17))
    openai = httpx.post(
        f"http://127.0.0.1:{guarded.reverse}/v1/chat/completions",
        content=chunks,
        timeout=60,
        headers={"authorization": "Bearer polar:whoever", "content-type": "application/json"},
    )
    assert openai.status_code == 413 and openai.json()["error"]["type"] == "invalid_request_error"


def test_a_slow_loris_body_is_cut_after_the_body_timeout(guarded: RunningProxy) -> None:
    with socket.create_connection(("127.0.0.1", guarded.reverse), timeout=5) as sock:
        sock.sendall(
            b"POST /v1/messages HTTP/1.1\r\nHost: x\r\ncontent-type: application/json\r\n"
            b"x-api-key: polar:slow\r\ntransfer-encoding: chunked\r\n\r\n"
        )
        started = time.monotonic()
        cut_at = None
        while time.monotonic() - started < BODY_TIMEOUT_S + 10:
            try:
                sock.sendall(b"1\r\n{\r\n")  # one byte a second: never idle long enough for mitmproxy's own timeout
            except OSError:
                cut_at = time.monotonic() - started
                break
            sock.settimeout(1)
            try:
                if sock.recv(4096) == b"":
                    cut_at = time.monotonic() - started
                    break
            except TimeoutError:
                continue
            except OSError:
                cut_at = time.monotonic() - started
                break
    assert cut_at is not None and BODY_TIMEOUT_S - 1 <= cut_at <= BODY_TIMEOUT_S + 3, cut_at


# --- the pure parts ----------------------------------------------------------------------------------------


def test_the_budget_is_per_client_across_connections_and_released_with_each_flow_or_connection() -> None:
    from polar_addon.relay import BodyBudget

    budget = BodyBudget(100)
    assert budget.take("f1", "10.0.0.1", "c1", 60) and budget.take("f2", "10.0.0.1", "c2", 40)
    assert not budget.take("f3", "10.0.0.1", "c3", 1)  # another connection of the same client: over
    assert budget.take("f4", "10.0.0.2", "c4", 100)  # another client has its own
    assert budget.release("f1") == 60 and budget.held("10.0.0.1") == 40
    assert budget.release_connection("c2") == 40 and budget.held("10.0.0.1") == 0
    assert budget.release("f1") == 0  # released once


def test_a_counted_body_is_dropped_once_over_its_cap_or_its_budget() -> None:
    from polar_addon.relay import OVER_BUDGET, TOO_LARGE, BodyBudget, CountedBody

    def counted(cap: int, budget: BodyBudget) -> CountedBody:
        return CountedBody(
            cap=cap,
            token="t",
            scheme="http",
            host="h",
            port=1,
            path="/",
            host_header=None,
            take=lambda n: budget.take("f", "c", "conn", n),
            drop=lambda: budget.release("f"),
        )

    budget = BodyBudget(1000)
    body = counted(10, budget)
    assert body.count(b"x" * 8) == [] and bytes(body.kept) == b"x" * 8 and budget.held("c") == 8
    body.count(b"x" * 3)
    assert (body.refused, body.kept, body.seen, budget.held("c")) == (TOO_LARGE, bytearray(), 11, 0)
    body.count(b"x")
    assert body.kept == bytearray() and body.seen == 12
    small = counted(100, BodyBudget(5))
    small.count(b"x" * 6)
    assert small.refused == OVER_BUDGET and small.kept == bytearray()


def test_the_probe_verdict() -> None:
    from polar_cli.rollout.proxy_check import Probe, verdict

    polar_403 = (
        b"HTTP/1.1 403 Forbidden\r\ncontent-length: 55\r\n\r\npolar: non-model traffic is blocked (polar_block_other)"
    )
    blocked = [Probe("a", polar_403), Probe("b", polar_403)]
    assert verdict("u", blocked, reached=False) is None
    assert "passes non-model traffic" in (verdict("u", blocked, reached=True) or "")
    other_403 = Probe("b", b"HTTP/1.1 403 Forbidden\r\ncontent-length: 9\r\n\r\nforbidden")  # not polar's
    assert "b: 'HTTP/1.1 403 Forbidden'" in (verdict("u", [blocked[0], other_403], reached=False) or "")
    assert "no answer (timed out)" in (verdict("u", [blocked[0], Probe("b", error="timed out")], reached=False) or "")
    assert "no proxy answers at u" in (verdict("u", [Probe("a", error="refused")] * 2, reached=False) or "")
