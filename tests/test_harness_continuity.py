"""Token continuity on real harness tool loops (scripted engine, tiny tokenizer).

- Claude Code: every call after the first continues the one before it as the harness really replayed it, and the
  delta rendered from the previous prompt, the sampled ids and the new messages is exactly the tail of the prompt
  the engine then got.
- All five CLIs (Claude Code, Codex over its WebSocket, Qwen Code, Pi, Gemini CLI) through one proxy with
  ``polar_tito`` on, Qwen3's template, a think block on every scripted turn (tests/support/harness_tito.py):
  every main-chain call after the first is a continuity prompt, and the main chain builds into one trace whose
  trainable tokens are exactly the sampled ids. Codex and Pi also resume their conversation with a second user
  turn (``codex exec resume --last``, ``pi --continue``), where a full render would drop the think blocks.
"""

from __future__ import annotations

import json

import orjson
import pytest
from transformers import AutoTokenizer

from polar_addon.canonical import AssistantMessage, CanonicalRequest, SamplingParams
from polar_addon.continuity.check import Continues, check_continuity
from polar_addon.continuity.delta import DeltaPrompt, continuation_prompt
from polar_addon.store import read_records
from tests.support.harness_tito import HARNESSES, harness_figures, run_harness, session_id, shared_proxy, write_script
from tests.support.harnesses import harness, run
from tests.support.proxy import run_mitmdump
from tests.support.tito_sessions import qwen3_model

pytestmark = pytest.mark.harness


def canonical(record) -> CanonicalRequest:
    return CanonicalRequest(
        api=record.api,
        model=record.requested_model,
        messages=record.messages,
        tools=record.tools,
        tool_choice=orjson.loads(record.tool_choice_json),
        sampling=SamplingParams(
            temperature=record.temperature, top_p=record.top_p, top_k=record.top_k, min_p=record.min_p
        ),
    )


def test_claude_code_tool_loop_continues_call_by_call(tiny_model_dir, tmp_path):
    claude = harness("claude")
    script = tmp_path / "script.json"
    glob = {
        "type": "function",
        "function": {"name": "Glob", "arguments": '{"pattern":  "*.txt"}'},
    }  # not compact: replayed re-serialized
    script.write_text(
        json.dumps(
            {
                "model_dir": str(tiny_model_dir),
                "cycle": True,
                "turns": [
                    {
                        "reasoning_content": "Find the text files first.",
                        "content": "I will look for text files.",
                        "tool_calls": [glob],
                    },
                    {"content": "Once more, to be sure.", "tool_calls": [glob]},
                    {"content": "There is one text file: notes.txt."},
                ],
            }
        )
    )
    home = tmp_path / "home"
    home.mkdir()
    (home / "notes.txt").write_text("hello\n")
    out = tmp_path / "shards"
    env = {
        "ANTHROPIC_API_KEY": "polar:session=cc-tito",
        "ANTHROPIC_MODEL": "tiny",
        "ANTHROPIC_DEFAULT_HAIKU_MODEL": "tiny",
        "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1",
        "CLAUDE_CODE_MAX_RETRIES": "1",
    }
    with run_mitmdump(
        f"scripted:{script}", out, mode="reverse:https://api.anthropic.com", options={"polar_shard_seconds": "0.5"}
    ) as proxy:
        result = run(
            [
                str(claude),
                "-p",
                "Which text files are here?",
                "--output-format",
                "json",
                "--tools",
                "Glob",
                "--system-prompt",
                "You are a file finder.",
            ],
            {**env, "ANTHROPIC_BASE_URL": proxy.url},
            home,
        )
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
        delta = continuation_prompt(
            tokenizer,
            prompt_ids=prev.prompt_ids,
            sampled_ids=prev.response_ids,
            history=nxt.messages[:at],
            new_messages=check.new_messages,
            tools=nxt.tools,
        )
        assert isinstance(delta, DeltaPrompt), delta
        engine_prompt = list(nxt.prompt_ids)
        assert delta.delta_ids == engine_prompt[len(engine_prompt) - len(delta.delta_ids) :]
        assert delta.prompt_ids[: len(prev.prompt_ids) + len(prev.response_ids)] == list(prev.prompt_ids) + list(
            prev.response_ids
        )
    # Claude Code sent the arguments back re-serialized, so a full re-render is not the sampled stream; continuity is.
    assert '"pattern":  "*.txt"' not in records[1].messages_json


BINARIES = {"claude": "claude", "codex": "codex", "qwen": "qwen", "pi": "pi", "gemini": "gemini"}
RESUMED = ("codex", "pi")  # the cheap ones: a second user turn on the resumed conversation


def test_every_harness_main_chain_is_one_on_policy_trace(tiny_model_dir, tmp_path):
    for short in HARNESSES:
        harness(BINARIES[short])
    script = write_script(qwen3_model(tiny_model_dir, tmp_path), tmp_path, list(HARNESSES))
    out = tmp_path / "shards"
    with shared_proxy(script, out, "on") as proxy:
        for short in HARNESSES:
            for follow_up in (False, True) if short in RESUMED else (False,):
                result = run_harness(short, proxy, tmp_path, "on", follow_up=follow_up)
                assert result.returncode == 0, (
                    short,
                    result.stdout[-2000:],
                    result.stderr[-2000:],
                    proxy.logs()[-3000:],
                )
    sampled = {r.record_id: len(r.response_ids) for r in read_records(str(out))}
    for short in HARNESSES:
        figures, traces = harness_figures(out, session_id(short, "on"), merge_retokenized=False)
        assert figures.main_calls >= (5 if short in RESUMED else 3), (short, figures)
        assert figures.main_continuity == figures.main_calls - 1, (short, figures.reasons)
        assert figures.main_traces == 1 and figures.exact, (short, figures)
        # The main chain is the agent's; the only side calls are Qwen Code's memory extractor, tagged as its side job.
        assert figures.main_roles == {"agent": figures.main_calls}, (short, figures)
        assert set(figures.side_roles) <= ({"auxiliary: qwen-code memory"} if short == "qwen" else set()), figures
        # Every sampled token of the chain is trained, and (figures.exact) nothing else is.
        assert traces[0].calls_merged == figures.main_calls
        assert sum(traces[0].loss_mask) == sum(sampled[r] for r in traces[0].record_ids) > 0
