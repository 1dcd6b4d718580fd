"""Continuity through turns cut by length (issue 24's scenario): linear six-turn chats through a real mitmdump on the
local engine (the tiny model samples for real), the official openai SDK, ``max_tokens`` small enough that nearly
every turn is cut. The template's end of a turn (``<|im_end|>\\n``, the tiny model's Qwen template and Qwen3's
own) closes each cut turn as context: every chat is one exact chain, no re-tokenized merge, the closing tokens
masked, and every trained token a sampled one with its captured logprob."""

from __future__ import annotations

import ssl
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from transformers import AutoTokenizer

from polar_addon.capture import CaptureRecord
from polar_addon.store import read_records, read_sessions
from polar_cli.build import BuildReport, SessionInfo, iter_session_builds
from polar_cli.build.inputs import session_info, tokenizer_eot
from polar_cli.trace import Trace
from tests.support.proxy import run_mitmdump
from tests.support.tito_sessions import qwen3_model, sampled_tokens_are_trained

CHATS, TURNS, MAX_TOKENS = 4, 6, 12


def chat(proxy: Any, session: str) -> None:
    """A linear chat: each reply is sent back as the SDK gave it (its tool calls answered), then a new user turn."""
    http = httpx.Client(
        proxy=proxy.proxy_url(session), verify=ssl.create_default_context(cafile=str(proxy.ca)), timeout=120
    )
    client = openai.OpenAI(api_key="sk-not-a-real-key", http_client=http, max_retries=0)
    messages: list[dict[str, Any]] = [{"role": "system", "content": "You are terse."}]
    for turn in range(TURNS):
        messages.append({"role": "user", "content": f"Tell me more ({turn})."})
        reply = client.chat.completions.create(model="tiny", max_tokens=MAX_TOKENS, messages=messages)
        message = reply.choices[0].message
        sent: dict[str, Any] = {"role": "assistant", "content": message.content}
        if message.tool_calls:
            sent["tool_calls"] = [c.model_dump() for c in message.tool_calls]
        messages.append(sent)
        for call in message.tool_calls or []:
            messages.append({"role": "tool", "tool_call_id": call.id, "content": "ok"})


def build(
    records: list[CaptureRecord], sessions: dict[str, SessionInfo], tok: Any, *, merge_retokenized: bool
) -> tuple[list[Trace], BuildReport]:
    """What `polar build` does: the end-of-turn token from the tokenizer where no call stopped by itself."""
    traces: list[Trace] = []
    report = BuildReport()
    ordered = sorted(records, key=lambda r: (r.session_id, r.seq))
    for built in iter_session_builds(
        ordered,
        sessions,
        decode=tok.decode,
        fallback_eot_token_id=tokenizer_eot(tok),
        merge_retokenized=merge_retokenized,
    ):
        traces.extend(built.traces)
        report.add(built.harness, built.stats)
    return traces, report


@pytest.mark.parametrize("template", ["tiny", "qwen3"])
def test_chats_cut_by_length_are_one_exact_chain_each(tiny_model_dir: Path, tmp_path: Path, template: str) -> None:
    model = tiny_model_dir if template == "tiny" else qwen3_model(tiny_model_dir, tmp_path)
    out = tmp_path / "shards"
    with run_mitmdump(f"local:{model}", out, options={"polar_tito": "on", "polar_shard_seconds": "0.2"}) as proxy:
        for i in range(CHATS):
            chat(proxy, f"chat-{i}")
    records = read_records(str(out))
    assert len(records) == CHATS * TURNS and all(r.status == "ok" for r in records)
    cut = [r for r in records if r.finish_reason == "length"]
    assert len(cut) >= len(records) // 2  # a random model rarely samples its end-of-turn token in 12 tokens
    for record in records:
        expected = ("fresh", "first_call") if record.seq == 0 else ("continuity", "continues")
        assert (record.prompt_source, record.prompt_reason) == expected, record.prompt_reason

    tok = AutoTokenizer.from_pretrained(model)
    glue = tok("<|im_end|>\n", add_special_tokens=False)["input_ids"]
    assert len(glue) == 2
    sessions = {row.session_id: session_info(row) for row in read_sessions(str(out))}
    # Merging re-tokenized turns allowed, as the old default: there is none to merge.
    traces, report = build(records, sessions, tok, merge_retokenized=True)
    assert report.total.retokenized_merges == 0 and report.total.breaks == {}
    assert len(traces) == CHATS
    by_id = {r.record_id: r for r in records}
    closings = 0
    for trace in traces:
        assert trace.calls_merged == TURNS and trace.break_cause is None
        assert sampled_tokens_are_trained(trace, by_id)
        sequence = trace.prompt_ids + trace.completion_ids
        mask = [0] * len(trace.prompt_ids) + trace.loss_mask
        logprobs = [0.0] * len(trace.prompt_ids) + trace.behavior_logprobs
        calls = [by_id[r] for r in trace.record_ids]
        for call, nxt in zip(calls, calls[1:] + [None]):
            start, end = len(call.prompt_ids), len(call.prompt_ids) + len(call.response_ids)
            assert logprobs[start:end] == pytest.approx(call.logprobs, abs=0)
            if nxt is None or call.response_ids[-1] == glue[0]:
                continue
            # A cut turn (or one ended by <|endoftext|>, which the random model samples now and then) is closed by
            # the template's own end of a turn, as in a full render, and never trained.
            assert sequence[end : end + 2] == glue
            assert mask[end : end + 2] == [0, 0] and logprobs[end : end + 2] == [0.0, 0.0]
            closings += 1
    assert closings >= len(cut) - CHATS  # every cut turn but a chat's last is closed inside its trace

    # The same traces with the new default (break at a re-tokenized merge): nothing to break.
    strict, _ = build(records, sessions, tok, merge_retokenized=False)
    assert [t.completion_ids for t in strict] == [t.completion_ids for t in traces]
