"""Sessions are registered, not claimed (issue 23, attack 1): an agent in a rollout tries to write calls into a
sibling's session and to relabel task and group, by every credential the proxy reads, in a real `polar rollout`
(bwrap, proxy-only) on the scripted engine; the proxy refuses each in the caller's own protocol, and `polar build`
shows every session's traces in its own group with its own reward. Then the pieces: an ended session's secret,
wrong and missing secrets, x-polar-* headers, the Codex WebSocket, the registry and the control route, and claimed
mode for plain capture."""

from __future__ import annotations

import asyncio
import base64
import json
import os
import shutil
import ssl
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import aiohttp
import anthropic
import httpx
import openai
import orjson
import pytest

from polar_addon import identity
from polar_addon.canonical import PolarError
from polar_addon.control import ControlPlane
from polar_addon.identity import SECRET_PREFIX, SessionEnded, SessionRegistry, registration
from polar_addon.store import read_records
from polar_cli.mitm import Proxy
from tests.support.prereq import missing
from tests.support.proxy import register_session, run_mitmdump, shared_proxy
from tests.support.shards import session_records

# The agent of both tasks. On "victim": one honest call. On "attack", the attacker: it knows how session ids are made
# (RUN-TASKHASH-SAMPLE) and tries every way a call names its session, printing `TRY name status error-shape` for
# each; then one honest call of its own.
AGENT = r"""
import hashlib, json, os, secrets, sys
import httpx, openai

if sys.argv[1] == "victim":
    client = openai.OpenAI(max_retries=0)
    print(client.chat.completions.create(model=os.environ["POLAR_MODEL"],
                                         messages=[{"role": "user", "content": "hi"}]).choices[0].message.content)
    sys.exit(0)
me, model = os.environ["POLAR_SESSION"], os.environ["POLAR_MODEL"]
base, key = os.environ["OPENAI_BASE_URL"], os.environ["OPENAI_API_KEY"]
rev = base.removesuffix("/v1")
run = me.rsplit("-", 2)[0]
victim = f"{run}-{hashlib.sha256(b'victim').hexdigest()[:10]}-0"
sibling = me.rsplit("-", 1)[0] + ("-1" if me.endswith("-0") else "-0")
chat = {"model": model, "messages": [{"role": "user", "content": "hi"}]}

def shape(response):
    try:
        body = response.json()
    except ValueError:
        return "not-json"
    if body.get("type") == "error" and isinstance(body.get("error"), dict):
        return "anthropic:" + str(body["error"].get("type"))
    error = body.get("error")
    if isinstance(error, dict) and "param" in error:
        return "openai:" + str(error.get("type"))
    return "other"

def sdk(name, api_key, headers=None):
    client = openai.OpenAI(api_key=api_key, base_url=base, max_retries=0, default_headers=headers or {})
    try:
        client.chat.completions.create(**chat)
        print("TRY", name, 200, "-")
    except openai.APIStatusError as exc:
        print("TRY", name, exc.status_code, shape(exc.response))

def raw(name, url, headers, body=chat, **kw):
    with httpx.Client(timeout=60, **kw) as client:
        response = client.post(url, json=body, headers=headers)
    print("TRY", name, response.status_code, shape(response))

sdk("sibling-claimed", f"polar:session={victim};task=victim;group=attack;sample=0")
sdk("sibling-bare-id", f"polar:{victim}")
sdk("own-relabel", f"polar:session={me};task=victim;group=victim;sample=0")
sdk("same-task-sibling", f"polar:session={sibling}")
sdk("own-secret-plus-headers", key, {"x-polar-session": victim, "x-polar-group": "victim"})
sdk("headers-alone", "sk-none", {"x-polar-session": victim, "x-polar-task": "victim", "x-polar-group": "victim"})
sdk("guessed-secret", "polar:psk-" + secrets.token_urlsafe(32))
sdk("no-credential", "sk-none")
sdk("own-secret-and-a-claim", key, {"x-api-key": f"polar:session={victim}"})
raw("anthropic-claimed", f"{rev}/v1/messages", {"x-api-key": f"polar:session={victim};group=attack"},
    {"model": model, "max_tokens": 8, "messages": [{"role": "user", "content": "hi"}]})
proxy_host = os.environ["HTTPS_PROXY"].rsplit("@", 1)[1]
raw("forward-claimed", "https://api.openai.com/v1/chat/completions", {"authorization": "Bearer sk-none"},
    proxy=f"http://{victim}:task%3Dvictim%3Bgroup%3Dattack@{proxy_host}", verify=os.environ["SSL_CERT_FILE"])
sdk("honest", key)
"""

REFUSED = {  # attempt -> (status, the error's shape: the caller's own protocol)
    "sibling-claimed": (403, "openai:authentication_error"), "sibling-bare-id": (403, "openai:authentication_error"),
    "own-relabel": (403, "openai:authentication_error"), "same-task-sibling": (403, "openai:authentication_error"),
    "own-secret-plus-headers": (403, "openai:authentication_error"),
    "headers-alone": (403, "openai:authentication_error"), "guessed-secret": (401, "openai:authentication_error"),
    "no-credential": (401, "openai:authentication_error"),
    "own-secret-and-a-claim": (403, "openai:authentication_error"),
    "anthropic-claimed": (403, "anthropic:authentication_error"),
    "forward-claimed": (403, "openai:authentication_error"),
}  # fmt: skip


def _polar(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "polar_cli.app", *args],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=600,
        env={**os.environ, "TRL_EXPERIMENTAL_SILENCE": "1"},
    )


def _script(path: Path, model_dir: Path) -> Path:
    path.write_bytes(orjson.dumps({"model_dir": str(model_dir), "cycle": True, "turns": [{"content": "done"}]}))
    return path


def test_an_agent_cannot_write_into_a_sibling_session_nor_relabel_its_own(tiny_model_dir: Path, tmp_path: Path) -> None:
    if not (shutil.which("bwrap") and shutil.which("socat")):
        missing("bubblewrap/socat missing (make sandbox)")
    (tmp_path / "agent.py").write_text(AGENT)
    agent = f"cmd:{sys.executable} {tmp_path / 'agent.py'} {{task}}"
    (tmp_path / "tasks.jsonl").write_text(
        json.dumps({"id": "victim", "instruction": "x", "verify": "true"})
        + "\n"
        + json.dumps({"id": "attack", "instruction": "x", "verify": "false"})
        + "\n"
    )
    done = _polar(
        "rollout",
        "tasks.jsonl",
        "--harness",
        agent,
        "--samples",
        "2",
        "--concurrency",
        "4",
        "--runtime",
        "bwrap",
        "--network",
        "proxy-only",
        "--engine",
        f"scripted:{_script(tmp_path / 'script.json', tiny_model_dir)}",
        "--out",
        "store",
        "--seed",
        "9",
        "--confdir",
        str(tmp_path / "conf"),
        "--set",
        "polar_shard_seconds=0.2",
        "--no-progress",
        cwd=tmp_path,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    summary = json.loads((tmp_path / "store" / "rollouts" / "r9" / "rollout-summary.json").read_text())
    results = {s["session_id"]: s for s in summary["session_results"]}
    assert {s["status"] for s in results.values()} == {"completed"}, results
    attackers = [sid for sid, s in results.items() if s["task_id"] == "attack"]
    for sid in attackers:
        log = (tmp_path / "store" / "rollouts" / "r9" / "logs" / "sessions" / sid / "harness.log").read_text()
        tried = {
            line.split()[1]: (int(line.split()[2]), line.split()[3])
            for line in log.splitlines()
            if line.startswith("TRY ")
        }
        assert tried == {**REFUSED, "honest": (200, "-")}, log

    built = tmp_path / "built"
    assert _polar("build", "store", "--out", str(built), cwd=tmp_path).returncode == 0
    from polar_cli.build.output import read_traces

    traces = read_traces(built)
    got = sorted((t.session_id, t.group_id, t.sample_index, t.reward) for t in traces)
    # One trace per session (its own honest call), in its own group, with its own verifier's reward.
    assert got == sorted(
        (sid, s["task_id"], s["sample"], 1.0 if s["task_id"] == "victim" else 0.0) for sid, s in results.items()
    ), got
    for sid in results:
        records = read_records(str(tmp_path / "store"), [sid])
        assert [(r.task_id, r.group_id, r.status) for r in records] == [(results[sid]["task_id"],) * 2 + ("ok",)]
    # The secret is a credential: in no record, log (mitmdump's included), summary or manifest of the run.
    leaked = [p for p in (tmp_path / "store").rglob("*") if p.is_file() and SECRET_PREFIX.encode() in p.read_bytes()]
    assert leaked == []
    assert SECRET_PREFIX not in repr(read_records(str(tmp_path / "store")))


def test_a_claimed_mode_proxy_is_refused_unless_trusted(tiny_model_dir: Path, tmp_path: Path) -> None:
    """`polar rollout --proxy` on a `polar proxy` left in claimed mode (its default): refused before anything runs,
    and by the runner itself for a library caller; with --trust-claimed-sessions it runs, loudly, and the runner's
    sessions still get their registered labels."""
    if not (shutil.which("bwrap") and shutil.which("socat")):
        missing("bubblewrap/socat missing (make sandbox)")
    from polar_cli.rollout.proxy import ExternalProxy
    from polar_cli.rollout.runner import RolloutConfig, run_rollout
    from polar_cli.rollout.tasks import load_tasks

    (tmp_path / "agent.py").write_text(AGENT)
    (tmp_path / "tasks.jsonl").write_text(json.dumps({"id": "victim", "instruction": "x", "verify": "true"}) + "\n")
    # Closed to non-model traffic (rollout --proxy checks that too): only its session mode is left as it defaults.
    with shared_proxy(
        _script(tmp_path / "script.json", tiny_model_dir), tmp_path / "shards", {"polar_block_other": "true"}
    ) as proxy:
        args = [
            "rollout",
            "tasks.jsonl",
            "--harness",
            f"cmd:{sys.executable} {tmp_path / 'agent.py'} {{task}}",
            "--runtime",
            "bwrap",
            "--network",
            "proxy-only",
            "--proxy",
            f"http://127.0.0.1:{proxy.forward}",
            "--reverse-url",
            f"http://127.0.0.1:{proxy.reverse}",
            "--control-token",
            proxy.control_token,
            "--confdir",
            str(proxy.ca.parent),
            "--seed",
            "4",
            "--no-progress",
        ]
        refused = _polar(*args, "--report-dir", "refused", cwd=tmp_path)
        assert refused.returncode == 2 and "polar_sessions=claimed" in refused.stderr, refused.stdout + refused.stderr
        assert not (tmp_path / "refused" / "rollout-summary.json").exists()

        external = ExternalProxy(
            f"http://127.0.0.1:{proxy.forward}", proxy.control_token, f"http://127.0.0.1:{proxy.reverse}", proxy.ca
        )
        config = RolloutConfig(
            tasks=load_tasks(tmp_path / "tasks.jsonl"),
            harness="cmd:true",
            proxy=external,
            runtime="bwrap",
            init_attempts=1,
            run_id="lib",
        )
        (session,) = asyncio.run(run_rollout(config)).sessions
        assert session.status == "error" and not session.ran and "polar_sessions=claimed" in (session.reason or "")

        trusted = _polar(*args, "--report-dir", "trusted", "--trust-claimed-sessions", cwd=tmp_path)
        assert trusted.returncode == 0, trusted.stdout + trusted.stderr
        assert "WARNING" in trusted.stderr and "trust on claim" in trusted.stderr
        (result,) = json.loads((tmp_path / "trusted" / "rollout-summary.json").read_text())["session_results"]
        (record,) = session_records(proxy.out, result["session_id"])
        assert (record.task_id, record.group_id, record.sample_index) == ("victim", "victim", 0)


# --- one registered-mode proxy for the pieces ---------------------------------------------------------------


@pytest.fixture(scope="module")
def registered(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Proxy]:
    root = tmp_path_factory.mktemp("registered")
    with run_mitmdump(
        f"scripted:{_script(root / 'script.json', tiny_model_dir)}",
        root / "shards",
        options={"polar_shard_seconds": "0.2", "polar_sessions": "registered"},
    ) as proxy:
        yield proxy


def _control(
    proxy: Proxy, method: str, path: str, body: dict | None = None, token: str | None = None
) -> httpx.Response:
    return httpx.request(
        method,
        f"http://polar.local{path}",
        proxy=proxy.url,
        json=body,
        timeout=30,
        headers={"authorization": f"Bearer {token or proxy.control_token}"},
    )


def _openai(proxy: Proxy, key: str) -> openai.OpenAI:
    http = httpx.Client(proxy=proxy.url, verify=ssl.create_default_context(cafile=str(proxy.ca)), timeout=60)
    return openai.OpenAI(api_key=key, http_client=http, max_retries=0)


def _hi(client: openai.OpenAI) -> str | None:
    return (
        client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}])
        .choices[0]
        .message.content
    )


def test_an_ended_sessions_secret_is_refused_and_its_calls_are_kept(registered: Proxy) -> None:
    secret = register_session(registered.port, registered.control_token, "ended-1", "t-end", "g-end", 2)
    assert secret.startswith(SECRET_PREFIX) and len(secret) >= 32 + len(SECRET_PREFIX)
    assert _hi(_openai(registered, f"polar:{secret}")) == "done"
    assert _control(registered, "POST", "/sessions/ended-1/status", {"status": "completed"}).status_code == 200
    with pytest.raises(openai.PermissionDeniedError) as refused:
        _hi(_openai(registered, f"polar:{secret}"))
    assert "has ended" in refused.value.message and refused.value.body["type"] == "authentication_error"
    again = _control(registered, "POST", "/sessions/ended-1/register", {"task": "t", "group": "g", "sample": 0})
    assert again.status_code == 409, again.text
    (record,) = session_records(registered.out, "ended-1")
    assert (record.task_id, record.group_id, record.sample_index, record.status) == ("t-end", "g-end", 2, "ok")


def test_wrong_missing_and_claimed_credentials_are_refused_in_the_callers_protocol(registered: Proxy) -> None:
    secret = register_session(registered.port, registered.control_token, "right-1", "t", "g", 0)
    for key, status in (
        (f"polar:{secret[:-1]}x", 401),
        ("sk-real-looking", 401),
        ("polar:session=right-1", 403),
        ("polar:session=right-1;task=t;group=g", 403),
    ):
        with pytest.raises(openai.APIStatusError) as refused:
            _hi(_openai(registered, key))
        assert refused.value.status_code == status, key
        assert secret not in str(refused.value.body)
    client = anthropic.Anthropic(
        base_url="https://api.anthropic.com",
        api_key=f"polar:{secret}",
        max_retries=0,
        http_client=httpx.Client(
            proxy=registered.url, timeout=60, verify=ssl.create_default_context(cafile=str(registered.ca))
        ),
    )
    with pytest.raises(anthropic.PermissionDeniedError) as refused_headers:
        client.messages.create(
            model="tiny",
            max_tokens=8,
            messages=[{"role": "user", "content": "hi"}],
            extra_headers={"x-polar-group": "other"},
        )
    assert refused_headers.value.body["error"]["type"] == "authentication_error"
    ok = client.messages.create(model="tiny", max_tokens=8, messages=[{"role": "user", "content": "hi"}])
    assert ok.content[0].text == "done"
    assert [(r.session_id, r.group_id) for r in session_records(registered.out, "right-1")] == [("right-1", "g")]


def _basic(user: str, password: str) -> str:
    return "Basic " + base64.b64encode(f"{user}:{password}".encode()).decode()


def test_the_codex_websocket_takes_the_same_check(registered: Proxy) -> None:
    """Codex's WebSocket: a claimed identity is refused at the upgrade; a registered one works until its session
    ends, and then the open socket writes nothing more."""
    secret = register_session(registered.port, registered.control_token, "ws-reg", "t-ws", "g-ws", 1)
    turn = {
        "type": "response.create",
        "model": "tiny",
        "stream": True,
        "store": False,
        "instructions": "",
        "input": [{"type": "message", "role": "user", "content": [{"type": "input_text", "text": "hi"}]}],
    }

    async def session() -> tuple[int, list[dict], list[dict]]:
        ctx = ssl.create_default_context(cafile=str(registered.ca))
        async with aiohttp.ClientSession() as http:
            try:
                async with http.ws_connect(
                    "wss://api.openai.com/v1/responses",
                    ssl=ctx,
                    proxy=f"http://ws-reg:task%3Dx@127.0.0.1:{registered.port}",
                ):
                    claimed = 101
            except aiohttp.WSServerHandshakeError as exc:
                claimed = exc.status
            async with http.ws_connect(
                "wss://api.openai.com/v1/responses", ssl=ctx, proxy=f"http://polar:{secret}@127.0.0.1:{registered.port}"
            ) as ws:
                first = await _exchange(ws, turn)
                await asyncio.to_thread(
                    _control, registered, "POST", "/sessions/ws-reg/status", {"status": "completed"}
                )
                after = await _exchange(ws, turn)
        return claimed, first, after

    claimed, first, after = asyncio.run(session())
    assert claimed == 403
    assert first[-1]["type"] == "response.completed"
    assert (
        after == [{"type": "error", "status": 403, "error": after[0]["error"]}]
        and "ended" in after[0]["error"]["message"]
    )
    (record,) = session_records(registered.out, "ws-reg")
    assert (record.task_id, record.group_id, record.sample_index) == ("t-ws", "g-ws", 1)


async def _exchange(ws: aiohttp.ClientWebSocketResponse, message: dict) -> list[dict]:
    await ws.send_str(orjson.dumps(message).decode())
    events = []
    while True:
        event = orjson.loads((await asyncio.wait_for(ws.receive(), timeout=120)).data)
        events.append(event)
        if event["type"] in ("response.completed", "response.failed", "error"):
            return events


def test_the_control_route_registers_only_with_the_token(registered: Proxy) -> None:
    assert _control(registered, "POST", "/sessions/tok-1/register", {"task": "t"}, token="x" * 32).status_code == 401
    # The proxy's modes, so a runner can refuse a claimed-mode or client-sampling proxy up front.
    assert _control(registered, "GET", "/sessions").json() == {
        "ok": True,
        "sessions": "registered",
        "sampling": "client",
    }
    assert _control(registered, "GET", "/sessions", token="x" * 32).status_code == 401
    bad = _control(registered, "POST", "/sessions/-bad/register", {"task": "t"})
    assert bad.status_code == 400 and "session id" in bad.json()["error"]["message"]
    assert _control(registered, "POST", "/sessions/tok-1/register", {"sample": "1"}).status_code == 400
    reply = _control(registered, "POST", "/sessions/tok-1/register", {"task": "t", "group": "g", "sample": 1}).json()
    assert reply["ok"] and reply["sessions"] == "registered" and reply["secret"].startswith(SECRET_PREFIX)
    # The secret is returned to the token holder only; nothing of it is logged.
    assert reply["secret"] not in registered.logs()


# --- the registry and identity resolution (no network) ---------------------------------------------------------


def test_registry_lookup_revoke_end_and_forget() -> None:
    registry = SessionRegistry(max_ended=1)
    first = registry.register(registration("s-0", "t", "g", 0))
    assert registry.lookup(first) == registration("s-0", "t", "g", 0)
    second = registry.register(registration("s-0", "t", "g", 0))  # an INIT retried: the old secret is revoked
    assert second != first and registry.lookup(second).session_id == "s-0"
    with pytest.raises(PolarError) as unknown:
        registry.lookup(first)
    assert unknown.value.status == 401
    other = registry.register(registration("s-1", "t", "g", 1))
    registry.end("s-0")
    with pytest.raises(PolarError) as ended:
        registry.lookup(second)
    assert ended.value.status == 403 and "ended" in ended.value.message
    with pytest.raises(SessionEnded):
        registry.register(registration("s-0", "t", "g", 0))
    registry.end("s-1")  # over max_ended: s-0 is forgotten, its secret now merely unknown (still refused)
    with pytest.raises(PolarError) as forgotten:
        registry.lookup(second)
    assert forgotten.value.status == 401 and registry.ended("s-1") and not registry.ended("s-0")
    with pytest.raises(PolarError):
        registry.lookup(other)
    with pytest.raises(PolarError) as bad:
        registration("s 1", "t", "g", 0)
    assert bad.value.status == 400


def test_registered_resolution_takes_labels_from_the_registration_alone() -> None:
    registry = SessionRegistry()
    secret = registry.register(registration("s-0", "task-a", "task-a", 0))
    sibling = registry.register(registration("s-1", "task-a", "task-a", 1))
    for auth, headers in (
        (None, {"authorization": f"Bearer polar:{secret}"}),
        (None, {"x-api-key": f"polar:{secret}"}),
        (_basic("polar", secret), {}),
        (_basic(secret, ""), {"authorization": "Bearer sk-other"}),
    ):
        ident = identity.resolve(auth, headers, "c", registry, "registered")
        assert (ident.session_id, ident.task_id, ident.group_id, ident.sample_index, ident.source) == (
            "s-0",
            "task-a",
            "task-a",
            0,
            "registered",
        )
    refusals = [
        (_basic("polar", secret), {"x-api-key": f"polar:{sibling}"}, 403),  # two sessions' credentials
        (_basic("s-1", "task=b"), {}, 403),
        (None, {"x-polar-session": "s-1"}, 403),
        (None, {}, 401),
        (None, {"x-goog-api-key": "polar:s-1"}, 403),
        (None, {"x-api-key": "polar:psk-guess"}, 401),
    ]
    for auth, headers, status in refusals:
        with pytest.raises(PolarError) as refused:
            identity.resolve(auth, headers, "c", registry, "registered")
        assert (refused.value.status, refused.value.kind) == (status, "authentication"), headers
        assert secret not in refused.value.message and sibling not in refused.value.message


def test_claimed_mode_trusts_claims_but_never_takes_a_secret_for_a_session_id() -> None:
    registry = SessionRegistry()
    secret = registry.register(registration("s-0", "t", "g", 0))
    claimed = identity.resolve(None, {"x-api-key": "polar:session=mine;task=x"}, "c", registry, "claimed")
    assert (claimed.session_id, claimed.task_id, claimed.source) == ("mine", "x", "api_key")
    assert identity.resolve(_basic("polar", secret), {}, "c", registry, "claimed").session_id == "s-0"
    with pytest.raises(PolarError) as unknown:
        identity.resolve(None, {"x-api-key": "polar:psk-not-registered"}, "c", registry, "claimed")
    assert unknown.value.status == 401


def test_a_status_post_ends_the_registered_session() -> None:
    class Store:
        async def session_update(self, *args, **kwargs) -> None:
            pass

        def final_status(self, session_id: str, status: str) -> tuple[str, None]:
            return status, None

    plane = ControlPlane(Store(), "t" * 16, sessions_mode=lambda: "registered")  # type: ignore[arg-type]
    bearer = "Bearer " + "t" * 16

    async def go() -> tuple[str, int]:
        status, reply = await plane.handle("POST", "/sessions/s-9/register", bearer, b'{"task": "t", "sample": 3}')
        assert status == 200 and reply["sessions"] == "registered"
        assert plane.sessions.lookup(reply["secret"]).sample_index == 3
        ended, _ = await plane.handle("POST", "/sessions/s-9/status", bearer, b'{"status": "completed"}')
        assert ended == 200
        again, _ = await plane.handle("POST", "/sessions/s-9/register", bearer, b"{}")
        return reply["secret"], again

    secret, again = asyncio.run(go())
    assert again == 409 and plane.sessions.ended("s-9")
    with pytest.raises(PolarError):
        plane.sessions.lookup(secret)
