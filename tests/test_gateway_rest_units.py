"""The gateway's request handling and stream paths at their edges (issue 29 audit, section L: `_handle`, `_generate`,
`_stream`): where a body is parsed against the off-loop size, what a local route answers when its provider names no
status or body, and the error a provider is handed when a stream cannot be rendered after its headers."""

from __future__ import annotations

import asyncio
import json
import threading
from pathlib import Path
from typing import Any

import orjson
import pytest

import polar_addon.gateway as gateway_module
from polar_addon.canonical import PolarError
from polar_addon.capture import Identity
from polar_addon.engines import EnginePool
from polar_addon.engines.scripted import ScriptedEngine
from polar_addon.gateway import Gateway, GatewayConfig, IncomingCall, StreamReply
from polar_addon.providers import Route
from polar_addon.providers.anthropic_messages import PROVIDER as ANTHROPIC
from polar_addon.store import TraceStore, read_records

MESSAGES = "/v1/messages"


def _script(tiny_model_dir: Path, tmp_path: Path, latency_s: float = 0.0) -> str:
    path = tmp_path / f"script-{latency_s}.json"
    turns = [{"content": "Hi there."}]
    path.write_text(
        json.dumps({"model_dir": str(tiny_model_dir), "cycle": True, "latency_s": latency_s, "turns": turns})
    )
    return str(path)


def _call(path: str, body: bytes, session: str = "s1") -> IncomingCall:
    return IncomingCall("POST", path, {"user-agent": "claude-cli/2.1.197"}, body, Identity(session_id=session))


def _body_of(size: int) -> bytes:
    """An Anthropic request of exactly ``size`` bytes (the bulk in metadata: few tokens for the tiny model)."""
    head = {"model": "tiny", "max_tokens": 8, "messages": [{"role": "user", "content": "hi"}], "metadata": {}}
    pad = size - len(orjson.dumps({**head, "metadata": {"user_id": ""}}))
    body = orjson.dumps({**head, "metadata": {"user_id": "x" * pad}})
    assert len(body) == size
    return body


class _Wrapped:
    """Anthropic's provider, with local routes that name no status or no body, and a record of the errors its
    streams are asked to tell."""

    def __init__(self) -> None:
        self.stream_errors: list[PolarError] = []

    def __getattr__(self, name: str) -> Any:
        return getattr(ANTHROPIC, name)

    def route(self, method: str, path: str) -> Route | None:
        local = {"/local/bare": {}, "/local/status": {"status": 404}, "/local/body": {"body": {"ok": True}}}
        if path in local:
            return Route(kind="local", params=local[path])
        return ANTHROPIC.route(method, path)

    def render_stream_error(self, error: PolarError, ctx: Any) -> Any:
        self.stream_errors.append(error)
        return ANTHROPIC.render_stream_error(error, ctx)


def test_a_body_of_exactly_the_off_loop_size_is_parsed_on_the_loop_and_one_byte_more_on_a_worker(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    limit = gateway_module.PARSE_OFF_LOOP_BYTES
    out = tmp_path / "shards"
    parsed_on: list[tuple[int, bool]] = []

    async def main() -> list[int]:
        gateway = Gateway(EnginePool([ScriptedEngine(_script(tiny_model_dir, tmp_path))]), TraceStore(str(out)))

        def parse(provider: Any, route: Route, call: IncomingCall) -> Any:
            parsed_on.append((len(call.body), threading.current_thread() is threading.main_thread()))
            return Gateway._parse(gateway, provider, route, call)

        gateway._parse = parse  # type: ignore[method-assign]
        try:
            return [(await gateway.handle(_call(MESSAGES, _body_of(size)))).status for size in (limit, limit + 1)]
        finally:
            await gateway.close()

    assert asyncio.run(main()) == [200, 200]
    assert parsed_on == [(limit, True), (limit + 1, False)]
    assert [r.status for r in read_records(str(out))] == ["ok", "ok"]


def test_a_local_route_answers_200_and_an_empty_object_for_what_its_provider_leaves_out(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    out = tmp_path / "shards"

    async def main() -> list[tuple[int, Any]]:
        pool = EnginePool([ScriptedEngine(_script(tiny_model_dir, tmp_path))])
        gateway = Gateway(pool, TraceStore(str(out)), providers=[_Wrapped()])
        try:
            replies = [
                await gateway.handle(IncomingCall("GET", path, {}, b"", Identity(session_id="s1")))
                for path in ("/local/bare", "/local/status", "/local/body")
            ]
        finally:
            await gateway.close()
        return [(r.status, orjson.loads(r.body)) for r in replies]

    assert asyncio.run(main()) == [(200, {}), (404, {}), (200, {"ok": True})]
    assert read_records(str(out)) == []


@pytest.mark.parametrize("raised", [ValueError("cannot render"), PolarError(429, "rate_limited", "slow down")])
def test_a_stream_that_fails_to_render_hands_its_provider_the_error_to_tell(
    raised: Exception, tiny_model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """After the keep-alives: an unexpected failure is told as a 500 ``api_error`` naming only its class, a
    PolarError as itself."""
    provider = _Wrapped()

    def broken(*args: Any) -> Any:
        raise raised

    async def main() -> bytes:
        pool = EnginePool([ScriptedEngine(_script(tiny_model_dir, tmp_path, latency_s=0.2))])
        gateway = Gateway(pool, TraceStore(str(tmp_path / "shards")), GatewayConfig(keepalive_s=0.05), [provider])
        monkeypatch.setattr(ANTHROPIC, "render_stream", broken)
        try:
            body = orjson.dumps({"model": "tiny", "max_tokens": 8, "messages": [{"role": "user", "content": "hi"}]})
            reply = await gateway.handle(_call(MESSAGES, body[:-1] + b',"stream":true}'))
            assert isinstance(reply, StreamReply)
            return b"".join([chunk async for chunk in reply.chunks])
        finally:
            await gateway.close()

    body = asyncio.run(main())
    [told] = provider.stream_errors
    if isinstance(raised, PolarError):
        assert told is raised
    else:
        assert (told.status, told.kind, told.message) == (500, "api_error", "polar internal error (ValueError)")
    assert body.endswith(b"event: error\ndata: " + orjson.dumps(ANTHROPIC.render_error(told)) + b"\n\n")
