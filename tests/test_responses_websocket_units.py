"""The Responses WebSocket server in-process: a real loopback socket, the gateway's ``handle`` replaced by a recorder
(no mitmdump, no engine).

The agent under training writes every message on this socket: each malformed, oversized, binary, over-budget or
out-of-session message must get an error event with the status the HTTP path would answer, never reach the
gateway, leave the client's budget as it found it, and leave the socket serving the next message.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from typing import Any, cast

import aiohttp
import orjson
import pytest

from polar_addon import responses_websocket as rws
from polar_addon.canonical import PolarError
from polar_addon.capture import Identity
from polar_addon.gateway import FullReply, Gateway, GatewayConfig, IncomingCall, StreamReply
from polar_addon.providers.openai_responses import OpenAIResponsesProvider
from polar_addon.relay import BodyBudget
from polar_addon.responses_websocket import (
    PARK_SECONDS,
    RESPONSES_PATH,
    WEBSOCKET_PREFIX,
    ResponsesWebSocket,
    error_event,
    is_responses_upgrade,
    over_budget_event,
    sse_events,
    too_large_event,
)

LIMIT = 4000  # polar_max_body_mb, in bytes, for these tests
IDENT = Identity(session_id="ws-units", source="proxy_auth")
CLIENT = "10.1.2.3"
TURN = {"type": "response.create", "model": "tiny", "input": "hi", "store": False}
COMPLETED = b'{"type":"response.completed","sequence_number":2}'
SSE = b'event: response.created\ndata: {"type":"response.created","sequence_number":0}\n\n: keep-alive\n\n' + (
    b"event: response.completed\ndata: " + COMPLETED + b"\n\n"
)

# --- the pure parts -------------------------------------------------------------------------------------------


def test_an_upgrade_is_a_get_with_upgrade_websocket_on_a_responses_path() -> None:
    ws = {"upgrade": "websocket"}
    assert is_responses_upgrade("get", "/v1/responses/", ws)
    assert is_responses_upgrade("GET", "/v1/responses?stream=1", {"upgrade": "WEBSOCKET"})
    assert not is_responses_upgrade("GET", "/v1/responses/compact", ws)
    assert not is_responses_upgrade("GET", "/v1/chat?next=/responses", ws)  # the query is not the path
    assert not is_responses_upgrade("GET", "/v1/responses", {"upgrade": "h2c"})
    assert not is_responses_upgrade("PUT", "/v1/responses", ws)
    assert is_responses_upgrade("GET", "/v1/responses?a=1?b=/x", ws)  # only the first "?" starts the query
    assert not is_responses_upgrade("GET", "/v1/responsesX", ws)


def test_sse_events_take_data_lines_only_and_keep_the_unfinished_rest() -> None:
    assert sse_events(b"") == ([], b"")
    assert sse_events(b"\n\n\n\n") == ([], b"")
    assert sse_events(b"data:x\n\ndata:  two\n\n") == ([b"x", b" two"], b"")  # one space after the colon is eaten
    assert sse_events(b"data:\n\n") == ([b""], b"")
    assert sse_events(b"id: 1\nevent: e\nretry: 5\n\ndata: a\n") == ([], b"data: a\n")
    assert sse_events(b"event: e\ndata: a\ndata: b\n\nda") == ([b"a\nb"], b"da")
    assert sse_events(b" data: no\n\n") == ([], b"")  # a field starts its line
    assert sse_events(SSE) == ([b'{"type":"response.created","sequence_number":0}', COMPLETED], b"")


def test_an_error_event_carries_the_status_and_the_error_or_the_whole_body() -> None:
    def event(status: int, body: Any) -> Any:
        return orjson.loads(error_event(status, body))

    error = {"type": "invalid_request_error", "message": "m", "param": None, "code": "c"}
    assert event(400, {"error": error, "other": 1}) == {"type": "error", "status": 400, "error": error}
    assert event(502, {"detail": "x"}) == {"type": "error", "status": 502, "error": {"message": "{'detail': 'x'}"}}
    assert event(500, {"error": None}) == {"type": "error", "status": 500, "error": {"message": "{'error': None}"}}
    assert event(503, ["not", "a", "dict"]) == {
        "type": "error",
        "status": 503,
        "error": {"message": "['not', 'a', 'dict']"},
    }


def gateway(max_body: int = LIMIT, providers: list[Any] | None = None) -> Gateway:
    """A gateway whose translators and config are real; its ``handle`` is replaced where a test answers."""
    return Gateway(cast(Any, None), cast(Any, None), GatewayConfig(max_body_bytes=max_body), providers)


def test_the_refusals_read_as_the_http_paths_openai_errors() -> None:
    assert orjson.loads(too_large_event(gateway(), 4001)) == {
        "type": "error",
        "status": 413,
        "error": {
            "message": "message of 4001 bytes exceeds the proxy limit of 4000 bytes (polar_max_body_mb)",
            "type": "invalid_request_error",
            "param": None,
            "code": None,
        },
    }
    assert orjson.loads(over_budget_event(gateway(), 777)) == {
        "type": "error",
        "status": 429,
        "error": {
            "message": "polar: this client already has 777 bytes of request bodies in flight "
            "(polar_client_inflight_mb): retry once its other calls are answered",
            "type": "server_error",
            "param": None,
            "code": "server_is_overloaded",
        },
    }


# --- the socket -----------------------------------------------------------------------------------------------


class Recorder:
    """Stands in for ``Gateway.handle``: records each call and answers with ``reply``."""

    def __init__(self, reply: Callable[[IncomingCall], Awaitable[FullReply | StreamReply]] | None = None) -> None:
        self.calls: list[IncomingCall] = []
        self._reply = reply

    async def __call__(self, call: IncomingCall) -> FullReply | StreamReply:
        self.calls.append(call)
        if self._reply is None:
            return FullReply(200, SSE, "text/event-stream")
        return await self._reply(call)


@asynccontextmanager
async def serving(
    gw: Gateway | None, budget: BodyBudget | None = None, still_live: Callable[[Identity], None] | None = None
) -> AsyncIterator[tuple[ResponsesWebSocket, aiohttp.ClientSession]]:
    server = ResponsesWebSocket(lambda: gw, still_live or (lambda identity: None), budget or BodyBudget(1 << 30))
    await server.start()
    try:
        async with aiohttp.ClientSession() as http:
            yield server, http
    finally:
        await server.stop()


async def connect(server: ResponsesWebSocket, http: aiohttp.ClientSession) -> aiohttp.ClientWebSocketResponse:
    path = server.park(IDENT, {"user-agent": "codex_cli_rs/0.171"}, "api.openai.com", CLIENT, "conn-1")
    return await http.ws_connect(f"http://127.0.0.1:{server.port}{path}")


async def answer(ws: aiohttp.ClientWebSocketResponse, message: Any) -> list[Any]:
    """Send ``message`` (text unless bytes) and read events up to the last of its answer (or a close)."""
    if isinstance(message, bytes):
        await ws.send_bytes(message)
    else:
        await ws.send_str(message if isinstance(message, str) else orjson.dumps(message).decode())
    events: list[Any] = []
    while True:
        msg = await ws.receive(timeout=5)
        if msg.type not in (aiohttp.WSMsgType.TEXT, aiohttp.WSMsgType.BINARY):
            events.append(("closed", ws.close_code))
            return events
        event = orjson.loads(msg.data)
        events.append(("binary", event) if msg.type == aiohttp.WSMsgType.BINARY else event)
        last = event if isinstance(event, dict) else {}
        if last.get("type") in ("response.completed", "response.failed", "error"):
            return events


def run(main: Callable[[], Awaitable[Any]]) -> Any:
    return asyncio.run(main())


def invalid(status: int, message: str, kind: str = "invalid_request_error") -> dict[str, Any]:
    return {"type": "error", "status": status, "error": {"type": kind, "message": message}}


def test_a_turn_goes_through_the_gateway_as_a_streaming_post() -> None:
    gw = gateway()
    gw.handle = recorder = Recorder()  # type: ignore[method-assign]

    async def main() -> list[Any]:
        async with serving(gw) as (server, http):
            ws = await connect(server, http)
            return [await answer(ws, {**TURN, "stream": False}), await answer(ws, TURN)]

    first, second = run(main)
    assert first == second == [{"type": "response.created", "sequence_number": 0}, orjson.loads(COMPLETED)]
    call = recorder.calls[0]
    assert (call.method, call.path, call.headers, call.identity, call.host) == (
        "POST",
        RESPONSES_PATH,
        {"user-agent": "codex_cli_rs/0.171"},
        IDENT,
        "api.openai.com",
    )
    assert orjson.loads(call.body) == {"model": "tiny", "input": "hi", "store": False, "stream": True}
    assert call.started_at > 1.7e9


def test_a_streamed_answer_is_cut_back_into_events_whatever_its_chunking() -> None:
    closed: list[int] = []

    async def chunks() -> AsyncIterator[bytes]:
        try:
            for i in range(0, len(SSE), 7):
                yield SSE[i : i + 7]
        finally:
            closed.append(1)

    class Chunks:  # the generator's own aclose, seen from outside
        def __init__(self) -> None:
            self.inner = chunks()

        def __aiter__(self) -> Chunks:
            return self

        async def __anext__(self) -> bytes:
            return await self.inner.__anext__()

        async def aclose(self) -> None:
            closed.append(2)
            await self.inner.aclose()

    async def stream(call: IncomingCall) -> StreamReply:
        return StreamReply(200, Chunks())

    gw = gateway()
    gw.handle = Recorder(stream)  # type: ignore[method-assign]

    async def main() -> list[Any]:
        async with serving(gw) as (server, http):
            return await answer(await connect(server, http), TURN)

    assert run(main) == [{"type": "response.created", "sequence_number": 0}, orjson.loads(COMPLETED)]
    assert closed == [1, 2]


def test_a_full_reply_that_is_not_a_stream_is_an_error_event_with_its_status() -> None:
    replies = [
        FullReply(400, orjson.dumps({"error": {"type": "invalid_request_error", "message": "bad tools"}})),
        FullReply(200, b'{"output": []}', "application/json"),
        FullReply(503, b'{"detail": "no engine"}', "text/event-stream"),
    ]

    async def reply(call: IncomingCall) -> FullReply:
        return replies.pop(0)

    gw = gateway()
    gw.handle = Recorder(reply)  # type: ignore[method-assign]

    async def main() -> list[Any]:
        async with serving(gw) as (server, http):
            ws = await connect(server, http)
            return [await answer(ws, TURN) for _ in range(3)]

    assert run(main) == [
        [invalid(400, "bad tools")],
        [{"type": "error", "status": 200, "error": {"message": "{'output': []}"}}],
        [{"type": "error", "status": 503, "error": {"message": "{'detail': 'no engine'}"}}],
    ]


def test_malformed_messages_get_400s_and_the_socket_serves_on() -> None:
    gw = gateway()
    gw.handle = recorder = Recorder()  # type: ignore[method-assign]

    async def main() -> list[Any]:
        async with serving(gw) as (server, http):
            ws = await connect(server, http)
            answers = [
                await answer(ws, message)
                for message in (
                    "{not json",
                    {"type": "response.cancel"},
                    {"model": "tiny", "input": "hi"},
                    ["response.create"],
                    "42",
                    b'{"type": "response.create"}',
                )
            ]
            return [*answers, await answer(ws, TURN)]

    *bad, good = run(main)
    assert bad[0][0]["status"] == 400 and bad[0][0]["error"]["message"].startswith("message is not JSON: ")
    assert bad[0][0]["error"]["type"] == "invalid_request_error" and set(bad[0][0]["error"]) == {"type", "message"}
    assert bad[1:] == [
        [invalid(400, "unsupported message type 'response.cancel'; send response.create")],
        [invalid(400, "unsupported message type None; send response.create")],
        [invalid(400, "unsupported message type 'list'; send response.create")],
        [invalid(400, "unsupported message type 'int'; send response.create")],
        [("binary", invalid(400, "binary messages are not supported"))],
    ]
    assert good[-1] == orjson.loads(COMPLETED)
    assert len(recorder.calls) == 1  # only the last one reached the gateway


def test_an_ended_session_writes_nothing_more() -> None:
    seen: list[Identity] = []

    def still_live(identity: Identity) -> None:
        seen.append(identity)
        if len(seen) > 1:
            raise PolarError(403, "session_ended", "session ws-units has ended")

    gw = gateway()
    gw.handle = recorder = Recorder()  # type: ignore[method-assign]

    async def main() -> list[Any]:
        async with serving(gw, still_live=still_live) as (server, http):
            ws = await connect(server, http)
            return [await answer(ws, TURN), await answer(ws, TURN), await answer(ws, {**TURN, "generate": False})]

    first, ended, prewarm = run(main)
    assert first[-1] == orjson.loads(COMPLETED)
    assert ended == prewarm == [invalid(403, "session ws-units has ended", "authentication_error")]
    assert seen == [IDENT, IDENT, IDENT] and len(recorder.calls) == 1


def test_a_message_over_the_body_limit_is_refused_with_a_413_then_the_close() -> None:
    gw = gateway()
    gw.handle = recorder = Recorder()  # type: ignore[method-assign]
    at_limit = orjson.dumps({**TURN, "input": ""})
    at_limit = orjson.dumps({**TURN, "input": "x" * (LIMIT - len(at_limit))})
    assert len(at_limit) == LIMIT

    async def main() -> list[Any]:
        async with serving(gw) as (server, http):
            ws = await connect(server, http)
            answers = [await answer(ws, at_limit.decode()), await answer(ws, at_limit.decode() + " ")]
            closing = await ws.receive(timeout=5)
            return [*answers, (closing.type, ws.close_code)]

    exact, over, closing = run(main)
    # Exactly the limit is read, as the HTTP path reads a body of exactly polar_max_body_mb.
    assert exact[-1] == orjson.loads(COMPLETED) and len(recorder.calls) == 1
    assert over == [invalid(413, "message exceeds the proxy's body limit (polar_max_body_mb)")]
    assert closing == (aiohttp.WSMsgType.CLOSE, aiohttp.WSCloseCode.MESSAGE_TOO_BIG)


def test_characters_past_the_limit_are_refused_before_the_gateway() -> None:
    """aiohttp bounds a message's bytes; the characters are bounded again where they are read."""
    sent: list[str] = []

    class Socket:
        async def send_str(self, data: str) -> None:
            sent.append(data)

    gw = gateway(max_body=10)
    gw.handle = recorder = Recorder()  # type: ignore[method-assign]
    server = ResponsesWebSocket(lambda: gw, lambda identity: None, BodyBudget(100))
    parked = rws._Parked(IDENT, {}, "h", CLIENT, "c", 0.0)
    run(lambda: server._answer(cast(Any, Socket()), gw, parked, "x" * 11))
    assert [orjson.loads(s) for s in sent] == [orjson.loads(too_large_event(gw, 11))] and recorder.calls == []


def test_each_message_is_charged_to_its_client_while_it_is_answered() -> None:
    budget = BodyBudget(LIMIT - 1000)
    held: list[int] = []

    async def reply(call: IncomingCall) -> FullReply:
        held.append(budget.held(CLIENT))
        return FullReply(200, SSE, "text/event-stream")

    gw = gateway()
    gw.handle = recorder = Recorder(reply)  # type: ignore[method-assign]
    fits = orjson.dumps({**TURN, "input": ""})
    fits = orjson.dumps({**TURN, "input": "x" * (budget.limit - len(fits))})
    assert len(fits) == budget.limit

    async def main() -> list[Any]:
        async with serving(gw, budget=budget) as (server, http):
            ws = await connect(server, http)
            answers = [await answer(ws, fits.decode()), await answer(ws, fits.decode() + " ")]
            assert budget.take("other-call", CLIENT, "conn-2", 1)  # another call of the same client in flight
            answers.append(await answer(ws, fits.decode()))
            budget.release("other-call")
            return answers

    exact, over, crowded = run(main)
    assert exact[-1] == orjson.loads(COMPLETED) and held == [budget.limit]
    assert over == crowded == [orjson.loads(over_budget_event(gw, budget.limit))]
    assert len(recorder.calls) == 1 and budget.held(CLIENT) == 0 and budget._charges == {}


@pytest.mark.parametrize("error", [RuntimeError("boom"), KeyError("k")])
def test_a_failure_in_the_answer_is_a_500_event_and_the_budget_is_given_back(error: Exception) -> None:
    budget = BodyBudget(1 << 20)
    calls = 0

    async def reply(call: IncomingCall) -> FullReply:
        nonlocal calls
        calls += 1
        if calls == 1:
            raise error
        return FullReply(200, SSE, "text/event-stream")

    gw = gateway()
    gw.handle = Recorder(reply)  # type: ignore[method-assign]

    async def main() -> list[Any]:
        async with serving(gw, budget=budget) as (server, http):
            ws = await connect(server, http)
            return [await answer(ws, TURN), await answer(ws, TURN)]

    failed, after = run(main)
    assert failed == [
        {
            "type": "error",
            "status": 500,
            "error": {"type": "server_error", "message": f"polar internal error ({type(error).__name__})"},
        }
    ]
    assert after[-1] == orjson.loads(COMPLETED) and budget.held(CLIENT) == 0


def test_a_client_gone_during_an_answer_ends_the_socket_and_gives_the_budget_back() -> None:
    budget = BodyBudget(1 << 20)

    async def reply(call: IncomingCall) -> FullReply:
        raise ConnectionResetError("client gone")

    gw = gateway()
    gw.handle = recorder = Recorder(reply)  # type: ignore[method-assign]

    async def main() -> list[Any]:
        async with serving(gw, budget=budget) as (server, http):
            ws = await connect(server, http)
            return await answer(ws, TURN)

    events = run(main)
    assert events == [("closed", aiohttp.WSCloseCode.OK)]
    assert len(recorder.calls) == 1 and budget.held(CLIENT) == 0


def test_a_stream_cut_by_the_client_is_closed_and_the_socket_answers_on() -> None:
    closed: list[int] = []

    class Cut:
        def __init__(self) -> None:
            self.sent = False

        def __aiter__(self) -> Cut:
            return self

        async def __anext__(self) -> bytes:
            if not self.sent:
                self.sent = True
                return SSE.split(b"\n\n", 1)[0] + b"\n\n"
            raise ConnectionResetError("cut")

        async def aclose(self) -> None:
            closed.append(1)

    replies: list[Any] = [StreamReply(200, Cut()), FullReply(200, SSE, "text/event-stream")]

    async def reply(call: IncomingCall) -> Any:
        return replies.pop(0)

    gw = gateway()
    gw.handle = Recorder(reply)  # type: ignore[method-assign]

    async def main() -> tuple[Any, list[Any]]:
        async with serving(gw) as (server, http):
            ws = await connect(server, http)
            await ws.send_str(orjson.dumps(TURN).decode())
            first = orjson.loads((await ws.receive(timeout=5)).data)
            return first, await answer(ws, TURN)

    first, second = run(main)
    assert first == {"type": "response.created", "sequence_number": 0}
    assert second == [{"type": "response.created", "sequence_number": 0}, orjson.loads(COMPLETED)]
    assert closed == [1]


def test_a_prewarm_generates_nothing_and_is_remembered_for_the_next_turn() -> None:
    gw = gateway()
    gw.handle = recorder = Recorder()  # type: ignore[method-assign]
    prewarm = {**TURN, "generate": False, "input": [], "instructions": "be brief"}

    async def main() -> list[Any]:
        async with serving(gw) as (server, http):
            return await answer(await connect(server, http), prewarm)

    created, completed = run(main)
    response_id = created["response"]["id"]
    assert (created["type"], created["sequence_number"], created["response"]["status"]) == (
        "response.created",
        0,
        "in_progress",
    )
    assert (completed["type"], completed["sequence_number"], completed["response"]["status"]) == (
        "response.completed",
        1,
        "completed",
    )
    assert completed["response"]["id"] == response_id and response_id.startswith("resp_") and len(response_id) == 29
    assert completed["response"]["model"] == "tiny"
    assert completed["response"]["usage"] == {
        "input_tokens": 0,
        "input_tokens_details": {"cached_tokens": 0, "cache_write_tokens": 0},
        "output_tokens": 0,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": 0,
    }
    (provider,) = [p for p in gw.providers if isinstance(p, OpenAIResponsesProvider)]
    entry = provider.history.entry(response_id)
    assert entry is not None and entry.prewarm and entry.session == IDENT.session_id
    # The message's size counts against the session's history bound, as an HTTP body's does.
    assert entry.cost >= len(orjson.dumps(prewarm))
    assert abs(completed["response"]["created_at"] - time.time()) < 60
    assert created["response"]["created_at"] == completed["response"]["created_at"]
    assert recorder.calls == []


def test_a_prewarm_the_translator_refuses_is_its_error() -> None:
    gw = gateway()

    async def main() -> list[Any]:
        async with serving(gw) as (server, http):
            ws = await connect(server, http)
            return [
                await answer(ws, {**TURN, "generate": False, "tools": [{"type": ["x"]}]}),
                await answer(ws, {**TURN, "generate": False, "previous_response_id": "resp_gone"}),
            ]

    bad_tools, gone = run(main)
    assert bad_tools == [
        {
            "type": "error",
            "status": 400,
            "error": {
                "message": "tools[0]: 'type' must be a string",
                "type": "invalid_request_error",
                "param": None,
                "code": None,
            },
        }
    ]
    assert gone[0]["status"] == 400 and gone[0]["error"]["param"] == "previous_response_id"


@pytest.mark.parametrize("error", [TypeError, ValueError, AttributeError, KeyError, IndexError, RecursionError])
def test_a_prewarm_the_translator_trips_on_is_a_400(error: type[Exception]) -> None:
    class Tripping(OpenAIResponsesProvider):
        def parse_request(self, body: dict[str, Any], route: Any) -> Any:
            raise error("deep inside")

    gw = gateway(providers=[Tripping()])

    async def main() -> list[Any]:
        async with serving(gw) as (server, http):
            ws = await connect(server, http)
            return [await answer(ws, {**TURN, "generate": False}), await answer(ws, {**TURN, "generate": False})]

    first, again = run(main)
    assert first == again
    assert first[0]["status"] == 400
    assert first[0]["error"]["message"] == f"request could not be read ({error.__name__})"
    assert first[0]["error"]["type"] == "invalid_request_error"


def test_a_prewarm_without_a_responses_translator_is_a_404() -> None:
    gw = gateway(providers=[])

    async def main() -> list[Any]:
        async with serving(gw) as (server, http):
            return await answer(await connect(server, http), {**TURN, "generate": False})

    assert run(main) == [invalid(404, "no OpenAI Responses provider")]


def test_a_token_is_good_for_one_connection_and_only_while_a_gateway_runs() -> None:
    gw = gateway()

    async def main() -> list[tuple[int, str]]:
        results = []
        async with serving(gw) as (server, http):
            path = server.park(IDENT, {}, "h", CLIENT, "c")
            assert path.startswith(WEBSOCKET_PREFIX) and len(path) == len(WEBSOCKET_PREFIX) + 22
            ws = await http.ws_connect(f"http://127.0.0.1:{server.port}{path}")
            await ws.close()
            for url in (path, WEBSOCKET_PREFIX + "guessed"):
                async with http.get(f"http://127.0.0.1:{server.port}{url}") as response:
                    results.append((response.status, await response.text()))
        async with serving(None) as (server, http):
            path = server.park(IDENT, {}, "h", CLIENT, "c")
            async with http.get(f"http://127.0.0.1:{server.port}{path}") as response:
                results.append((response.status, await response.text()))
        return results

    assert run(main) == [(404, "unknown or already used polar websocket token")] * 3


def test_an_upgrade_never_collected_is_forgotten_after_park_seconds(monkeypatch: pytest.MonkeyPatch) -> None:
    now = [1000.0]
    monkeypatch.setattr(rws.time, "monotonic", lambda: now[0])
    server = ResponsesWebSocket(lambda: None, lambda identity: None, BodyBudget(1))
    first = server.park(IDENT, {}, "h", CLIENT, "c").removeprefix(WEBSOCKET_PREFIX)
    now[0] += PARK_SECONDS
    second = server.park(IDENT, {}, "h", CLIENT, "c").removeprefix(WEBSOCKET_PREFIX)
    assert set(server._parked) == {first, second}  # at exactly PARK_SECONDS it still waits
    now[0] += 0.001
    third = server.park(IDENT, {}, "h", CLIENT, "c").removeprefix(WEBSOCKET_PREFIX)
    assert set(server._parked) == {second, third}
    parked = server._parked[third]
    assert (parked.identity, parked.host, parked.client, parked.connection, parked.expires) == (
        IDENT,
        "h",
        CLIENT,
        "c",
        now[0] + 60.0,
    )


def test_the_server_listens_on_loopback_on_a_free_port() -> None:
    async def main() -> list[tuple[str, int]]:
        servers = [ResponsesWebSocket(lambda: None, lambda identity: None, BodyBudget(1)) for _ in range(2)]
        for server in servers:
            await server.start()
        try:
            return [
                (next(iter(s._runner.sites))._server.sockets[0].getsockname()[0], s.port)  # type: ignore[union-attr]
                for s in servers
            ]
        finally:
            for server in servers:
                await server.stop()

    (host_a, port_a), (host_b, port_b) = run(main)
    assert host_a == host_b == "127.0.0.1" and port_a != port_b and 8080 not in (port_a, port_b)
    asyncio.run(ResponsesWebSocket(lambda: None, lambda identity: None, BodyBudget(1)).stop())


def test_a_stream_whose_first_frame_is_bare_data_and_that_cannot_be_closed_is_answered_whole() -> None:
    class Plain:  # an async iterator without aclose
        def __init__(self) -> None:
            self.left = [b'data: {"type":"a"}\n\n', b"data: " + COMPLETED + b"\n\n"]

        def __aiter__(self) -> Plain:
            return self

        async def __anext__(self) -> bytes:
            if not self.left:
                raise StopAsyncIteration
            return self.left.pop(0)

    async def stream(call: IncomingCall) -> StreamReply:
        return StreamReply(200, Plain())  # type: ignore[arg-type]

    gw = gateway()
    gw.handle = Recorder(stream)  # type: ignore[method-assign]

    async def main() -> list[Any]:
        async with serving(gw) as (server, http):
            ws = await connect(server, http)
            return [await answer(ws, TURN), await answer(ws, TURN)]

    assert run(main) == [[{"type": "a"}, orjson.loads(COMPLETED)]] * 2


def test_concurrent_messages_of_one_client_are_charged_and_given_back_each_on_its_own() -> None:
    """Two sockets of one client answered at once: each message holds its own charge, on its own connection, until
    its own answer ends."""
    budget = BodyBudget(1 << 20)
    release: dict[str, asyncio.Event] = {}
    seen: list[Any] = []

    async def reply(call: IncomingCall) -> FullReply:
        name = orjson.loads(call.body)["input"]
        release[name] = asyncio.Event()
        seen.append((name, sorted(budget._charges.values())))
        await release[name].wait()
        seen.append((name, budget.held(CLIENT)))
        return FullReply(200, SSE, "text/event-stream")

    gw = gateway()
    gw.handle = Recorder(reply)  # type: ignore[method-assign]
    one, two = orjson.dumps({**TURN, "input": "one"}), orjson.dumps({**TURN, "input": "two" + " " * 50})

    async def main() -> list[Any]:
        async with serving(gw, budget=budget) as (server, http):
            first = await http.ws_connect(
                f"http://127.0.0.1:{server.port}{server.park(IDENT, {}, 'h', CLIENT, 'conn-1')}"
            )
            second = await http.ws_connect(
                f"http://127.0.0.1:{server.port}{server.park(IDENT, {}, 'h', CLIENT, 'conn-2')}"
            )
            a = asyncio.ensure_future(answer(first, one.decode()))
            while "one" not in release:
                await asyncio.sleep(0.01)
            b = asyncio.ensure_future(answer(second, two.decode()))
            while "two" + " " * 50 not in release:
                await asyncio.sleep(0.01)
            release["one"].set()
            await a
            release["two" + " " * 50].set()
            await b
            return seen

    assert run(main) == [
        ("one", [(CLIENT, "conn-1", len(one))]),
        ("two" + " " * 50, [(CLIENT, "conn-1", len(one)), (CLIENT, "conn-2", len(two))]),
        ("one", len(one) + len(two)),
        ("two" + " " * 50, len(two)),  # the first answer gave back its own charge only
    ]
    assert budget.held(CLIENT) == 0


def test_pings_are_answered() -> None:
    """Codex keeps an idle socket alive with pings: unanswered, it would take the socket for dead."""

    async def main() -> tuple[Any, Any]:
        async with serving(gateway()) as (server, http):
            path = server.park(IDENT, {}, "h", CLIENT, "c")
            ws = await http.ws_connect(f"http://127.0.0.1:{server.port}{path}", autoping=False)
            await ws.ping(b"are you there")
            msg = await ws.receive(timeout=5)
            return msg.type, msg.data

    assert run(main) == (aiohttp.WSMsgType.PONG, b"are you there")


def test_a_malformed_frame_is_logged_and_ends_the_socket(caplog: pytest.LogCaptureFixture) -> None:
    gw = gateway()
    gw.handle = recorder = Recorder()  # type: ignore[method-assign]

    async def main() -> tuple[Any, Any]:
        async with serving(gw) as (server, http):
            ws = await connect(server, http)
            await ws._writer.send_frame(b'{"type": "response.create", "input": "\xff"}', aiohttp.WSMsgType.TEXT)
            msg = await ws.receive(timeout=5)
            return msg.type, ws.close_code

    with caplog.at_level(logging.INFO, logger="polar"):
        assert run(main) == (aiohttp.WSMsgType.CLOSE, aiohttp.WSCloseCode.INVALID_TEXT)
    assert recorder.calls == []
    (warning,) = [r for r in caplog.records if r.name == "polar"]
    assert (warning.levelno, warning.getMessage().split(":")[:2]) == (
        logging.WARNING,
        ["polar", " responses websocket error"],
    )
    assert "utf-8" in warning.getMessage().lower() or "text" in warning.getMessage().lower()


def test_failures_and_hang_ups_are_logged_for_the_operator(caplog: pytest.LogCaptureFixture) -> None:
    replies: list[Any] = [RuntimeError("boom"), ConnectionResetError("gone")]

    async def reply(call: IncomingCall) -> FullReply:
        raise replies.pop(0)

    gw = gateway()
    gw.handle = Recorder(reply)  # type: ignore[method-assign]

    async def main() -> tuple[list[Any], list[Any], Any]:
        async with serving(gw) as (server, http):
            ws = await connect(server, http)
            failed, gone = await answer(ws, TURN), await answer(ws, TURN)
            return failed, gone, ws.close_code

    with caplog.at_level(logging.INFO, logger="polar"):
        failed, gone, code = run(main)
    assert failed[0]["status"] == 500 and gone == [("closed", aiohttp.WSCloseCode.OK)]
    logged = [(r.levelno, r.getMessage(), r.exc_info is not None) for r in caplog.records if r.name == "polar"]
    assert logged == [
        (logging.ERROR, "polar: responses websocket message failed", True),
        (logging.INFO, "polar: responses websocket closed by the client during an answer", False),
    ]


def test_a_stream_cut_by_the_client_is_logged(caplog: pytest.LogCaptureFixture) -> None:
    class Cut:
        def __aiter__(self) -> Cut:
            return self

        async def __anext__(self) -> bytes:
            raise ConnectionResetError("cut")

    async def stream(call: IncomingCall) -> StreamReply:
        return StreamReply(200, Cut())  # type: ignore[arg-type]

    sent: list[str] = []

    class Socket:
        async def send_str(self, data: str) -> None:
            sent.append(data)

    gw = gateway()
    gw.handle = Recorder(stream)  # type: ignore[method-assign]
    server = ResponsesWebSocket(lambda: gw, lambda identity: None, BodyBudget(1 << 20))
    parked = rws._Parked(IDENT, {}, "h", CLIENT, "c", 0.0)
    with caplog.at_level(logging.INFO, logger="polar"):
        run(lambda: server._answer(cast(Any, Socket()), gw, parked, orjson.dumps(TURN).decode()))
    assert sent == []
    assert [(r.levelno, r.getMessage()) for r in caplog.records if r.name == "polar"] == [
        (logging.INFO, "polar: responses websocket closed by the client during an answer")
    ]


def test_the_websocket_server_logs_no_line_per_connection(caplog: pytest.LogCaptureFixture) -> None:
    async def main() -> list[Any]:
        async with serving(gateway()) as (server, http):
            ws = await connect(server, http)
            await ws.close()
            async with http.get(f"http://127.0.0.1:{server.port}{WEBSOCKET_PREFIX}guessed") as response:
                return [response.status]

    with caplog.at_level(logging.DEBUG, logger="aiohttp.access"):
        assert run(main) == [404]
    assert [r for r in caplog.records if r.name == "aiohttp.access"] == []


def test_the_server_ends_a_socket_with_a_plain_close() -> None:
    async def reply(call: IncomingCall) -> FullReply:
        raise ConnectionResetError("client gone")

    gw = gateway()
    gw.handle = Recorder(reply)  # type: ignore[method-assign]

    async def main() -> tuple[Any, Any, Any]:
        async with serving(gw) as (server, http):
            ws = await connect(server, http)
            await ws.send_str(orjson.dumps(TURN).decode())
            msg = await ws.receive(timeout=5)
            return msg.type, msg.data, msg.extra

    assert run(main) == (aiohttp.WSMsgType.CLOSE, aiohttp.WSCloseCode.OK, "")
