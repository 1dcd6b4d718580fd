"""Token continuity on SGLang: a real mitmdump in front of the SGLang 0.5.23 contract server (SGLang's own protocol
classes; tests/support/sglang_contract_server.py), multi-turn tool-using sessions from the official openai and
anthropic SDKs, Qwen3's chat template (which drops earlier think blocks at a new user turn).

The tiny random model cannot make tool calls, so the server replays the scripted turns (the scripted engine, as in
tests/test_tito_proxy.py); the first call of a session goes through SGLang's chat endpoint, every later one through
``/v1/completions`` with the continuation prompt as token ids, and polar parses the sampled text itself. The real
tiny model samples after a token prompt in tests/test_engine_sglang.py."""

from __future__ import annotations

from pathlib import Path

import pytest

from polar_addon.engines.scripted import ScriptedEngine
from tests.support.proxy import run_mitmdump
from tests.support.tito_sessions import (
    anthropic_session, build, figures, openai_session, qwen3_model, sampled_tokens_are_trained, write_script,
)


@pytest.fixture(scope="module")
def protocol():
    from tests.support.sglang_contract_server import ContractUnavailable, load_protocol

    try:
        return load_protocol()
    except ContractUnavailable as exc:
        pytest.fail(f"SGLang 0.5.23 protocol unavailable ({exc}); run `make sglang-contract`")


def test_sglang_sessions_continue_in_tokens_the_engine_saw(protocol, tiny_model_dir: Path, tmp_path: Path) -> None:
    from tests.support.sglang_contract_server import SGLangContractServer

    model = qwen3_model(tiny_model_dir, tmp_path)
    script = write_script(model, tmp_path / "script.json")
    out = tmp_path / "out"
    with SGLangContractServer(ScriptedEngine(script), protocol=protocol) as server:
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
        assert (record.prompt_source, record.prompt_reason) == (("fresh", "first_call") if first else ("continuity", "continues"))
        # SGLang's chat endpoint parsed the first call; polar parsed every token-input call, and each parsed cleanly.
        assert record.parse_failures == (None if first else 0)
    # The engine sampled after exactly the prompt each record holds: one /v1/completions call per continued record.
    assert sorted(engine_prompts) == sorted(list(r.prompt_ids) for r in continued)
    assert all(b["return_token_ids"] is True and b["logprobs"] == 0 and b["stream"] is False for b in completion_bodies)
    for session, stats in figures(records, traces).items():
        assert stats.traces == 1 and stats.off_policy_tokens == 0, (session, stats)
    by_id = {r.record_id: r for r in records}
    assert all(sampled_tokens_are_trained(t, by_id) for t in traces)
