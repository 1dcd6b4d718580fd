"""Token continuity on SGLang: a real mitmdump in front of the SGLang 0.5.23 contract server (SGLang's own protocol
classes; tests/support/sglang_contract_server.py), multi-turn tool-using sessions from the official openai and
anthropic SDKs, Qwen3's chat template (which drops earlier think blocks at a new user turn).

The tiny random model cannot make tool calls, so the server replays the scripted turns (the scripted engine, as in
tests/test_tito_proxy.py); the first call of a session goes through SGLang's chat endpoint, every later one through
``/v1/completions`` with the continuation prompt as token ids, and polar parses the sampled text itself. The real
tiny model samples after a token prompt in tests/test_engine_sglang.py."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import orjson
from typer.testing import CliRunner

from polar_addon.capture import Identity
from polar_addon.engines import EnginePool
from polar_addon.engines.scripted import ScriptedEngine
from polar_addon.engines.sglang import SGLangEngine
from polar_addon.gateway import Gateway, IncomingCall
from polar_addon.store import TraceStore
from polar_cli.app import app
from tests.support.proxy import run_mitmdump
from tests.support.tito_sessions import (
    anthropic_session,
    build,
    figures,
    openai_session,
    qwen3_model,
    sampled_tokens_are_trained,
    write_script,
)


def test_sglang_sessions_continue_in_tokens_the_engine_saw(
    sglang_protocol, tiny_model_dir: Path, tmp_path: Path
) -> None:
    from tests.support.sglang_contract_server import SGLangContractServer

    model = qwen3_model(tiny_model_dir, tmp_path)
    script = write_script(model, tmp_path / "script.json")
    out = tmp_path / "out"
    with SGLangContractServer(ScriptedEngine(script), protocol=sglang_protocol) as server:
        options = {"polar_tokenizer": str(model), "polar_shard_seconds": "0.2"}  # polar_tito: auto
        with run_mitmdump(f"sglang:{server.url}", out, options=options) as proxy:
            openai_session(proxy, "oai", user_turns=2)
            anthropic_session(proxy, "ant", user_turns=1)
        completion_bodies = [b for b in server.requests if "prompt" in b]
        engine_prompts = server.completion_prompts

    records, traces = build(out)
    assert len(records) == 9 and all(r.status == "ok" and r.engine == f"sglang:{server.url}" for r in records)
    continued = [r for r in records if r.seq > 0]
    for record in records:
        first = record.seq == 0
        assert (record.prompt_source, record.prompt_reason) == (
            ("fresh", "first_call") if first else ("continuity", "continues")
        )
        # SGLang's chat endpoint parsed the first call; polar parsed every token-input call, and each parsed cleanly.
        assert record.parse_failures == (None if first else 0)
    # The engine sampled after exactly the prompt each record holds: one /v1/completions call per continued record.
    assert sorted(engine_prompts) == sorted(list(r.prompt_ids) for r in continued)
    assert all(b["return_token_ids"] is True and b["logprobs"] == 0 and b["stream"] is False for b in completion_bodies)
    for session, stats in figures(records, traces).items():
        assert stats.traces == 1 and stats.off_policy_tokens == 0, (session, stats)
    by_id = {r.record_id: r for r in records}
    assert all(sampled_tokens_are_trained(t, by_id) for t in traces)


# Turn 1's call never closes its JSON: hermes cannot read it. Turn 3 only mentions Qwen3-Coder's tag in prose, which
# a markup test would fail but polar's hermes parser rightly reads as text.
FAILED_PARSE_TURNS = [
    {"tool_calls": [{"type": "function", "function": {"name": "ls", "arguments": '{"path": "."}'}}]},
    {"content": 'Reading it. <tool_call>{"name": "read", "arguments": {"path": "a.txt"</tool_call>'},
    {"tool_calls": [{"type": "function", "function": {"name": "read", "arguments": '{"path": "a.txt"}'}}]},
    {"content": "Done. (Qwen3-Coder would have written <function=read> here.)"},
]
START = [
    {"role": "system", "content": "You are a file assistant."},
    {"role": "user", "content": "What does a.txt say?"},
]


async def _turn(gateway, session: str, messages: list[dict]) -> list[dict]:
    """One Chat Completions call through the gateway; the history with the answer (and a result per call) appended."""
    from tests.support.tito_sessions import TOOLS

    body = orjson.dumps({"model": "tiny", "max_tokens": 64, "messages": messages, "tools": TOOLS})
    reply = await gateway.handle(
        IncomingCall(
            method="POST",
            path="/v1/chat/completions",
            headers={"user-agent": "OpenAI/Python 2.0"},
            body=body,
            identity=Identity(session_id=session, source="header"),
        )
    )
    assert reply.status == 200, reply.body
    message = orjson.loads(reply.body)["choices"][0]["message"]
    calls = message.get("tool_calls") or []
    sent = {"role": "assistant", "content": message.get("content"), **({"tool_calls": calls} if calls else {})}
    return [*messages, sent, *({"role": "tool", "tool_call_id": c["id"], "content": "ok"} for c in calls)]


def test_a_call_polar_cannot_parse_scores_0_but_stays_trainable(
    sglang_protocol, tiny_model_dir: Path, tmp_path: Path
) -> None:
    """Parser -> record -> shard -> build -> stats: the malformed call of a token-input turn is counted on its
    record, its trace gets reward 0 and stays trainable, and `polar stats` shows it."""
    from tests.support.sglang_contract_server import SGLangContractServer

    model = qwen3_model(tiny_model_dir, tmp_path)
    script = tmp_path / "script.json"
    script.write_text(json.dumps({"model_dir": str(model), "cycle": False, "turns": FAILED_PARSE_TURNS}))
    out = tmp_path / "shards"
    with SGLangContractServer(ScriptedEngine(script), protocol=sglang_protocol) as server:
        engine = SGLangEngine(server.url, timeout_s=60)
        engine.tokenizer_dir = str(model)

        async def main() -> None:
            gateway = Gateway(EnginePool([engine]), TraceStore(str(out)))
            await _turn(gateway, "bad", await _turn(gateway, "bad", START))  # turns 0 (chat) and 1 (tokens)
            # "good" starts from a history of two assistant turns (fresh: state_lost), then continues in tokens.
            history = [
                *START,
                {"role": "assistant", "content": "Looking."},
                {"role": "user", "content": "Go on."},
                {"role": "assistant", "content": "Still looking."},
                {"role": "user", "content": "Read it."},
            ]
            await _turn(gateway, "good", await _turn(gateway, "good", history))  # turns 2 (chat) and 3 (tokens)
            for session in ("bad", "good"):
                await gateway.store.session_update(session, status="completed")
                await gateway.store.add_reward(session, 1.0)
            await gateway.close()

        asyncio.run(main())

    records, traces = build(out)
    by_key = {(r.session_id, r.seq): r for r in records}
    assert [by_key[("bad", 1)].prompt_source, by_key[("good", 1)].prompt_source] == ["continuity", "continuity"]
    bad, good = by_key[("bad", 1)], by_key[("good", 1)]
    assert bad.parse_failures == 1 and '<tool_call>{"name": "read"' in bad.response_message["content"]
    assert good.parse_failures == 0 and "<function=read>" in good.response_message["content"]
    assert by_key[("bad", 0)].parse_failures is None  # SGLang's chat endpoint parsed it: polar counted nothing
    rewards = {t.session_id: (t.reward, t.trainable) for t in traces}
    assert rewards == {"bad": (0.0, True), "good": (1.0, True)}

    stats = CliRunner().invoke(app, ["stats", str(out), "--tokenizer", str(model), "--json"])
    assert stats.exit_code == 0, stats.output
    total = orjson.loads(stats.stdout)["total"]
    assert total["parse_failed_calls"] == 1
    assert total["reward_reasons"] == {"outcome reward": 1, "parser-invalid tool call": 1}
    table = CliRunner().invoke(app, ["stats", str(out), "--tokenizer", str(model)])
    assert "failed tool-call parses" in table.output
