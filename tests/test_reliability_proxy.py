"""Load and faults through a real mitmdump (issue 11): 64 sessions x 20 turns against an instant engine (the
scripted engine: real tokenizer, template and logprobs, no sampling wait), a client that disconnects
mid-stream, and engine faults seen end to end (provider-shaped error, recorded as failed, never as exact)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import httpx
import orjson
import pytest

from polar_addon.store import read_records
from polar_addon.store.validate import validate_store
from tests.support.hostile import hang_up_mid_stream, is_provider_error, valid_body, write_script
from tests.support.load import check_store, run_load
from tests.support.proxy import free_port, run_mitmdump, wait_for_port

SESSIONS = int(os.environ.get("POLAR_LOAD_SESSIONS", "64"))
TURNS = int(os.environ.get("POLAR_LOAD_TURNS", "20"))


@pytest.mark.timeout(900)
def test_load_through_mitmdump_loses_duplicates_and_mixes_up_nothing(tiny_model_dir: Path, tmp_path: Path) -> None:
    out = tmp_path / "shards"
    engine = write_script(tmp_path / "script.json", tiny_model_dir)
    with run_mitmdump(
        engine,
        out,
        mode="reverse:https://api.openai.com",
        options={"polar_shard_records": "128", "polar_shard_seconds": "1"},
    ) as proxy:
        result = run_load(proxy.url, proxy.process.pid, out, SESSIONS, TURNS)
        logs = proxy.logs()
    result = check_store(result, out)
    print(f"load: {result}")
    assert result.answered == SESSIONS * TURNS
    assert (result.lost, result.duplicated, result.mixed_up, result.failed_calls) == (0, 0, 0, 0)
    assert validate_store(str(out)) == []
    assert "sk-load-secret" not in logs
    assert not any("sk-load-secret" in r.messages_json for r in read_records(str(out)))


ENGINE_SERVER = r"""
import sys
from aiohttp import web
mode, port = sys.argv[1], int(sys.argv[2])
async def chat(request):
    await request.read()
    if mode == "hang":  # never answers within the deadline
        import asyncio; await asyncio.sleep(3600)
    if mode == "not_json":
        return web.Response(text="<html>oops", content_type="text/html")
    if mode == "no_ids":
        return web.json_response({"id": "x", "object": "chat.completion", "model": "tiny", "choices": [
            {"index": 0, "message": {"role": "assistant", "content": "hi"}, "finish_reason": "stop"}]})
    if mode == "die":
        import os; os._exit(1)  # the engine process dies mid-request
async def models(request):
    return web.json_response({"object": "list", "data": [{"id": "tiny", "object": "model"}]})
app = web.Application()
app.router.add_get("/v1/models", models)
app.router.add_post("/v1/chat/completions", chat)
app.router.add_post("/generate", chat)
web.run_app(app, host="127.0.0.1", port=port, print=None)
"""


@pytest.mark.timeout(300)
@pytest.mark.parametrize("mode,status", [("hang", 504), ("not_json", 502), ("no_ids", 502), ("die", 503)])
def test_engine_faults_become_provider_errors_recorded_as_failed(mode: str, status: int, tmp_path: Path) -> None:
    """A misbehaving engine process (hanging past the deadline, answering non-JSON or without token ids,
    dying mid-request) gives the client its provider's error and the store a failed record, never an exact
    one; the proxy keeps answering."""
    port = free_port()
    server = subprocess.Popen([sys.executable, "-c", ENGINE_SERVER, mode, str(port)], start_new_session=True)
    out = tmp_path / "shards"
    try:
        wait_for_port(port, 30, server)
        with run_mitmdump(
            f"vllm:http://127.0.0.1:{port}",
            out,
            mode="reverse:https://api.anthropic.com",
            options={"polar_engine_timeout": "2", "polar_shard_seconds": "0.2"},
        ) as proxy:
            body = orjson.dumps(valid_body("anthropic_messages"))
            answers = [
                httpx.post(
                    proxy.url + "/v1/messages",
                    content=body,
                    timeout=60,
                    headers={"content-type": "application/json", "x-polar-session": f"fault-{i}"},
                )
                for i in range(2)
            ]
    finally:
        if server.poll() is None:
            os.killpg(server.pid, signal.SIGKILL)
        server.wait()
    first = answers[0]
    assert first.status_code in ({status, 503} if mode == "die" else {status}), first.text[:300]
    assert is_provider_error("anthropic_messages", first.status_code, first.content), first.text[:300]
    assert answers[1].status_code >= 500 and is_provider_error(
        "anthropic_messages", answers[1].status_code, answers[1].content
    )
    records = read_records(str(out))
    assert sorted(r.session_id for r in records) == ["fault-0", "fault-1"]
    assert all(r.status == "failed" and not r.response_ids and not r.prompt_ids for r in records)


@pytest.mark.timeout(300)
def test_client_disconnecting_mid_stream_leaves_the_proxy_serving(tiny_model_dir: Path, tmp_path: Path) -> None:
    out = tmp_path / "shards"
    engine = write_script(tmp_path / "script.json", tiny_model_dir, latency_s=1.5)
    with run_mitmdump(
        engine,
        out,
        mode="reverse:https://api.openai.com",
        options={"polar_keepalive": "0.2", "polar_shard_seconds": "0.2"},
    ) as proxy:
        hang_up_mid_stream(proxy.url, out)
        after = httpx.post(
            proxy.url + "/v1/chat/completions",
            json=valid_body("openai_chat"),
            headers={"x-polar-session": "after"},
            timeout=60,
        )
    assert after.status_code == 200
    records = read_records(str(out))
    # An abandoned call was still generated and persisted (the engine did the work): recorded exactly once.
    assert [r.seq for r in records if r.session_id == "cut"] == [0, 1, 2]
    assert [r.status for r in records if r.session_id == "after"] == ["ok"]
    assert validate_store(str(out)) == []
