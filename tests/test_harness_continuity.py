"""Token continuity on a real Claude Code tool loop (scripted engine, tiny tokenizer): every call after the first
continues the one before it as the harness really replayed it, and the delta rendered from the previous prompt,
the sampled ids and the new messages is exactly the tail of the prompt the engine then got."""

from __future__ import annotations

import json

import orjson
import pytest
from transformers import AutoTokenizer

from polar_addon.canonical import AssistantMessage, CanonicalRequest, SamplingParams
from polar_addon.continuity import Continues, check_continuity
from polar_addon.continuity_tokens import DeltaPrompt, continuation_prompt
from polar_addon.store import read_records
from tests.support.harnesses import harness, run
from tests.support.proxy import run_mitmdump

pytestmark = pytest.mark.harness


def canonical(record) -> CanonicalRequest:
    return CanonicalRequest(
        api=record.api, model=record.requested_model, messages=record.messages, tools=record.tools,
        tool_choice=orjson.loads(record.tool_choice_json),
        sampling=SamplingParams(temperature=record.temperature, top_p=record.top_p, top_k=record.top_k, min_p=record.min_p),
    )


def test_claude_code_tool_loop_continues_call_by_call(tiny_model_dir, tmp_path):
    claude = harness("claude")
    script = tmp_path / "script.json"
    glob = {"type": "function", "function": {"name": "Glob", "arguments": '{"pattern":  "*.txt"}'}}  # not compact: replayed re-serialized
    script.write_text(json.dumps({"model_dir": str(tiny_model_dir), "cycle": True, "turns": [
        {"reasoning_content": "Find the text files first.", "content": "I will look for text files.", "tool_calls": [glob]},
        {"content": "Once more, to be sure.", "tool_calls": [glob]},
        {"content": "There is one text file: notes.txt."},
    ]}))
    home = tmp_path / "home"
    home.mkdir()
    (home / "notes.txt").write_text("hello\n")
    out = tmp_path / "shards"
    env = {"ANTHROPIC_API_KEY": "polar:session=cc-tito", "ANTHROPIC_MODEL": "tiny", "ANTHROPIC_DEFAULT_HAIKU_MODEL": "tiny",
           "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1", "CLAUDE_CODE_MAX_RETRIES": "1"}
    with run_mitmdump(f"scripted:{script}", out, mode="reverse:https://api.anthropic.com", options={"polar_shard_seconds": "0.5"}) as proxy:
        result = run([str(claude), "-p", "Which text files are here?", "--output-format", "json", "--tools", "Glob",
                      "--system-prompt", "You are a file finder."], {**env, "ANTHROPIC_BASE_URL": proxy.url}, home)
        assert result.returncode == 0, result.stdout + result.stderr + proxy.logs()[-3000:]
    records = sorted((r for r in read_records(str(out)) if r.session_id == "cc-tito"), key=lambda r: r.seq)
    assert [r.finish_reason for r in records] == ["tool_calls", "tool_calls", "stop"]

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    for prev, nxt in zip(records, records[1:]):
        returned = AssistantMessage.from_dict(prev.response_message)
        check = check_continuity(canonical(prev), returned, canonical(nxt))
        assert isinstance(check, Continues), check
        assert [m["role"] for m in check.new_messages] == ["tool"]
        at = len(nxt.messages) - len(check.new_messages)
        delta = continuation_prompt(tokenizer, prompt_ids=prev.prompt_ids, sampled_ids=prev.response_ids,
                                    history=nxt.messages[:at], new_messages=check.new_messages, tools=nxt.tools)
        assert isinstance(delta, DeltaPrompt), delta
        engine_prompt = list(nxt.prompt_ids)
        assert delta.delta_ids == engine_prompt[len(engine_prompt) - len(delta.delta_ids):]
        assert delta.prompt_ids[: len(prev.prompt_ids) + len(prev.response_ids)] == list(prev.prompt_ids) + list(prev.response_ids)
    # Claude Code sent the arguments back re-serialized, so a full re-render is not the sampled stream; continuity is.
    assert '"pattern":  "*.txt"' not in records[1].messages_json
