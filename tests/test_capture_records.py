"""Capture records: what record_ok and record_failed put in every call's record, and the logprob check.

Every training token downstream comes from these records, so each field is checked for its exact value: a field
left at its default (a dropped keyword) or taken from the wrong source would pass any test that only reads roles.
"""

from __future__ import annotations

import re
import time

import orjson
import pytest

from polar_addon.canonical import (
    AssistantMessage,
    CanonicalRequest,
    Completion,
    SamplingParams,
    ToolCall,
    VersionSpan,
)
from polar_addon.capture import (
    LOGPROB_SLACK,
    MIN_SAMPLED_LOGPROB,
    CaptureRecord,
    Identity,
    logprob_problem,
    new_record_id,
    record_failed,
    record_ok,
)

MESSAGES = [{"role": "system", "content": "You are a coding agent."}, {"role": "user", "content": "Fix the bug."}]
TOOLS = [{"type": "function", "function": {"name": "bash", "parameters": {"type": "object"}}}]
IDENTITY = Identity("sess-1", task_id="task-7", group_id="grp-3", sample_index=2, source="header")
# Claude Code's compaction request opens the last user message with this.
COMPACT = "Your task is to create a detailed summary of the conversation so far"
HEX32 = re.compile(r"[0-9a-f]{32}")


def request(**sampling: float | int | None) -> CanonicalRequest:
    return CanonicalRequest(
        api="anthropic_messages",
        model="claude-ish",
        messages=MESSAGES,
        tools=TOOLS,
        tool_choice={"type": "auto"},
        sampling=SamplingParams(**sampling),
    )


def completion() -> Completion:
    return Completion(
        message=AssistantMessage(
            content="Running it.", reasoning="Look first.", tool_calls=[ToolCall("call_1", "bash", '{"cmd": "ls"}')]
        ),
        finish_reason="tool_calls",
        prompt_ids=[11, 12, 13],
        response_ids=[21, 22],
        logprobs=[-0.25, -1.5],
        served_model="qwen-tiny",
        engine="sglang:http://127.0.0.1:30000",
        matched_stop="</tool_call>",
        weight_version="step-4",
        weight_versions=[VersionSpan("step-4", 0, 1), VersionSpan("step-5", 1, 2)],
        parse_failures=1,
        tool_call_parser="hermes",
    )


def test_record_ok_holds_every_field_of_the_call() -> None:
    done = completion()
    before = time.time()
    record = record_ok(
        identity=IDENTITY,
        seq=5,
        request=request(temperature=0.7, top_p=0.9, top_k=20, min_p=0.05, max_tokens=64),
        completion=done,
        harness="claude-cli/2.1.197 (external, cli)",
        started_at=123.5,
        engine_latency_s=0.75,
        prompt_source="continuity",
        prompt_reason="first_call",
    )
    after = time.time()
    assert HEX32.fullmatch(record.record_id)
    assert before <= record.finished_at <= after
    expected = {
        "record_id": record.record_id,
        "session_id": "sess-1",
        "seq": 5,
        "api": "anthropic_messages",
        "status": "ok",
        "task_id": "task-7",
        "group_id": "grp-3",
        "sample_index": 2,
        "harness": "claude-cli/2.1.197 (external, cli)",
        "requested_model": "claude-ish",
        "served_model": "qwen-tiny",
        "engine": "sglang:http://127.0.0.1:30000",
        "started_at": 123.5,
        "engine_latency_s": 0.75,
        "finished_at": record.finished_at,
        "temperature": 0.7,
        "top_p": 0.9,
        "top_k": 20,
        "min_p": 0.05,
        "max_tokens": 64,
        "prompt_ids": [11, 12, 13],
        "response_ids": [21, 22],
        "logprobs": [-0.25, -1.5],
        "finish_reason": "tool_calls",
        "matched_stop": "</tool_call>",
        "weight_version": "step-4",
        "messages_json": orjson.dumps(MESSAGES).decode(),
        "tools_json": orjson.dumps(TOOLS).decode(),
        "tool_choice_json": '{"type":"auto"}',
        "response_json": record.response_json,
        "error": None,
        "prompt_source": "continuity",
        "prompt_reason": "first_call",
        "parse_failures": 1,
        "tool_call_parser": "hermes",
        "role": "agent",
        "role_reason": None,
        "weight_versions_json": '[{"version":"step-4","start":0,"end":1},{"version":"step-5","start":1,"end":2}]',
    }
    assert record.to_dict() == expected
    # The response is the message as the engine's parser gave it, reasoning and call ids included.
    assert record.response_message == {
        "content": "Running it.",
        "reasoning": "Look first.",
        "tool_calls": [{"id": "call_1", "name": "bash", "arguments": '{"cmd": "ls"}'}],
    }
    assert AssistantMessage.from_dict(record.response_message) == done.message
    assert record.messages == MESSAGES and record.tools == TOOLS


def test_record_ok_temperature_is_the_one_sampled_with() -> None:
    # Nothing said: engines called directly sample at 1.0, and the trainer recomputes logprobs at that temperature.
    kw = dict(identity=Identity("s"), seq=0, completion=completion(), harness=None, started_at=0.0, engine_latency_s=0)
    unset = record_ok(request=request(), **kw)
    assert unset.temperature == 1.0 and isinstance(unset.temperature, float)
    assert (unset.top_p, unset.top_k, unset.min_p, unset.max_tokens) == (None, None, None, None)
    greedy = record_ok(request=request(temperature=0), **kw)
    assert greedy.temperature == 0.0 and isinstance(greedy.temperature, float)
    # Identity fields the client never gave stay None; the optional prompt provenance defaults to None.
    assert (unset.task_id, unset.group_id, unset.sample_index, unset.harness) == (None, None, None, None)
    assert (unset.prompt_source, unset.prompt_reason) == (None, None)


def test_each_record_gets_its_own_id() -> None:
    ids = {new_record_id() for _ in range(50)}
    assert len(ids) == 50 and all(HEX32.fullmatch(i) for i in ids)
    kw = dict(identity=IDENTITY, seq=0, request=request(), completion=completion(), harness="h", started_at=0.0)
    assert record_ok(engine_latency_s=0.1, **kw).record_id != record_ok(engine_latency_s=0.1, **kw).record_id


def test_a_side_job_is_recorded_with_its_role_and_reason() -> None:
    side = CanonicalRequest(
        api="openai_chat",
        model="m",
        messages=[*MESSAGES, {"role": "user", "content": COMPACT}],
    )
    record = record_ok(
        identity=IDENTITY, seq=1, request=side, completion=completion(), harness="h", started_at=0, engine_latency_s=0
    )
    assert (record.role, record.role_reason) == ("auxiliary", "claude-code compaction")


def test_record_failed_with_a_request_keeps_what_was_asked() -> None:
    before = time.time()
    record = record_failed(
        identity=IDENTITY,
        seq=9,
        api="openai_responses",
        request=request(temperature=0.3, top_p=0.8, top_k=5, min_p=0.1, max_tokens=16),
        error="engine timeout after 600 s",
        harness="codex",
        started_at=42.0,
        engine="vllm:http://10.0.0.2:8000",
    )
    after = time.time()
    assert HEX32.fullmatch(record.record_id)
    assert before <= record.finished_at <= after
    assert record.to_dict() == {
        "record_id": record.record_id,
        "session_id": "sess-1",
        "seq": 9,
        # The api the client spoke, not the request's (a request may not have been parsed at all).
        "api": "openai_responses",
        "status": "failed",
        "task_id": "task-7",
        "group_id": "grp-3",
        "sample_index": 2,
        "harness": "codex",
        "requested_model": "claude-ish",
        "served_model": None,
        "engine": "vllm:http://10.0.0.2:8000",
        "started_at": 42.0,
        "engine_latency_s": None,
        "finished_at": record.finished_at,
        "temperature": 0.3,
        "top_p": 0.8,
        "top_k": 5,
        "min_p": 0.1,
        "max_tokens": 16,
        "prompt_ids": [],
        "response_ids": [],
        "logprobs": [],
        "finish_reason": None,
        "matched_stop": None,
        "weight_version": None,
        "messages_json": orjson.dumps(MESSAGES).decode(),
        "tools_json": orjson.dumps(TOOLS).decode(),
        "tool_choice_json": '{"type":"auto"}',
        "response_json": "null",
        "error": "engine timeout after 600 s",
        "prompt_source": None,
        "prompt_reason": None,
        "parse_failures": None,
        "tool_call_parser": None,
        "role": "discarded",
        "role_reason": "failed",
        "weight_versions_json": None,
    }


def test_record_failed_before_the_request_was_read() -> None:
    record = record_failed(
        identity=Identity("s2"), seq=0, api="gemini", request=None, error="bad JSON", harness=None, started_at=1.0
    )
    assert (record.session_id, record.seq, record.api) == ("s2", 0, "gemini")
    assert (record.status, record.error) == ("failed", "bad JSON")
    assert (record.engine, record.requested_model, record.temperature) == (None, None, None)
    assert (record.messages_json, record.tools_json, record.tool_choice_json) == ("[]", "[]", "null")
    assert record.messages == [] and record.tools == [] and record.response_message is None
    assert record.started_at == 1.0 and record.finished_at >= 1.0


def test_to_dict_is_shallow_and_in_field_order() -> None:
    record = CaptureRecord("r", "s", 0, "openai_chat", "ok", prompt_ids=[1, 2], response_ids=[3], logprobs=[-0.5])
    data = record.to_dict()
    assert list(data)[:5] == ["record_id", "session_id", "seq", "api", "status"]
    assert list(data)[-3:] == ["role", "role_reason", "weight_versions_json"] and len(data) == 38
    # The token lists are the record's own (no copy of an 8k-token record per write).
    assert data["prompt_ids"] is record.prompt_ids and data["logprobs"] is record.logprobs


@pytest.mark.parametrize(
    ("logprobs", "problem"),
    [
        ([-0.5, -9999.0], "token 1 has logprob -9999.0 (below -100: a sentinel, not a sampled token)"),
        ([-0.5, -2.0, float("nan")], "token 2 has logprob nan (not finite)"),
        ([float("-inf")], "token 0 has logprob -inf (not finite)"),
        ([float("inf"), -0.5], "token 0 has logprob inf (not finite)"),
        ([-0.1, 0.5], "token 1 has logprob 0.5 (> 0: not a log-probability)"),
        # The first bad token is named, whatever comes after it.
        ([-0.1, 0.5, float("nan"), -9999.0], "token 1 has logprob 0.5 (> 0: not a log-probability)"),
        ([-0.1, -1000.0, 0.5], "token 1 has logprob -1000.0 (below -100: a sentinel, not a sampled token)"),
    ],
)
def test_each_logprob_problem_names_its_token_and_value(logprobs: list[float], problem: str) -> None:
    assert logprob_problem(logprobs) == problem


def test_logprob_bounds_are_inclusive() -> None:
    assert (MIN_SAMPLED_LOGPROB, LOGPROB_SLACK) == (-100.0, 1e-4)
    assert logprob_problem([MIN_SAMPLED_LOGPROB, LOGPROB_SLACK]) is None
    assert logprob_problem([-100.001]) == "token 0 has logprob -100.001 (below -100: a sentinel, not a sampled token)"
    assert logprob_problem([-0.5, 0.00011]) == "token 1 has logprob 0.00011 (> 0: not a log-probability)"
    assert logprob_problem([]) is None
    assert logprob_problem([-3.0] * 10_000) is None


def test_the_role_reads_the_requests_tools() -> None:
    # A title request is a side job only without tools: the same text in a call that declares tools is the agent's.
    title = {"role": "user", "content": "Generate a concise, single-line task title of at most 8 words."}
    kw = dict(identity=IDENTITY, seq=0, completion=completion(), harness="codex", started_at=0, engine_latency_s=0)
    bare = record_ok(request=CanonicalRequest(api="openai_responses", model="m", messages=[title]), **kw)
    assert (bare.role, bare.role_reason) == ("auxiliary", "codex title")
    armed = record_ok(request=CanonicalRequest(api="openai_responses", model="m", messages=[title], tools=TOOLS), **kw)
    assert (armed.role, armed.role_reason) == ("agent", None)


def test_the_logprob_bounds_hold_where_another_token_is_bad() -> None:
    # The fast path accepts a list whose extremes are in bounds; a list it rejects is walked token by token, and the
    # bounds there are inclusive too.
    assert logprob_problem([-100.0, 1e-4, 5.0]) == "token 2 has logprob 5.0 (> 0: not a log-probability)"
    assert logprob_problem([1e-4, -100.0, float("nan")]) == "token 2 has logprob nan (not finite)"
