"""polar_cli.export's pieces one by one (no store, no CLI): each message once, in order, with its role, its tool
calls and results paired, sampled turns with their exact tokens; ATIF's exact fields (Harbor's models,
tests/support/harbor_atif) and the OpenAI chat examples, as docs/how-to/export.md describes them."""

from __future__ import annotations

import hashlib
from typing import Any

import orjson
import pytest

from polar_addon.capture import CaptureRecord
from polar_cli.build.breaks import Break, BreakCause
from polar_cli.build.prefix_merging import RecordChain
from polar_cli.build.rewards import SessionInfo
from polar_cli.export import FORMATS, chain_example, session_examples
from polar_cli.export.atif import (
    _agent,
    _agent_step,
    _chain_trajectory,
    _metrics,
    _text,
    _timestamp,
    _tool_call,
    _version,
    chain_steps,
    session_trajectory,
    trajectory_file_name,
)
from polar_cli.export.conversation import (
    SessionChains,
    _with_sent_ids,
    chain_turns,
    sampled_message,
    session_chains,
)
from polar_cli.export.conversation import Turn as ExportTurn
from tests.support.harbor_atif import Trajectory

SYSTEM = {"role": "system", "content": "You are a coding agent."}
TASK = {"role": "user", "content": "fix the bug"}


def _record(messages: list[dict[str, Any]], response: dict[str, Any] | None, **fields: Any) -> CaptureRecord:
    base: dict[str, Any] = dict(
        record_id="r0",
        session_id="s",
        seq=0,
        api="openai_chat",
        status="ok",
        prompt_ids=[1, 2],
        response_ids=[3],
        logprobs=[-0.5],
        messages_json=orjson.dumps(messages).decode(),
        response_json=orjson.dumps(response).decode(),
    )
    return CaptureRecord(**(base | fields))


def _answer(content: str | None = None, calls: list[tuple[str, str, str]] = (), reasoning: str | None = None) -> dict:  # type: ignore[assignment]
    return {
        "content": content,
        "reasoning": reasoning,
        "tool_calls": [{"id": i, "name": n, "arguments": a} for i, n, a in calls],
    }


# --- atif: the small pieces ---------------------------------------------------------------------------------


def test_timestamps_are_utc_iso_with_z_and_none_for_unknown() -> None:
    assert _timestamp(1.5) == "1970-01-01T00:00:01.500000Z"
    assert _timestamp(1_700_000_000.0) == "2023-11-14T22:13:20Z"
    assert _timestamp(0.0) is None  # a record that predates the timestamps
    assert _timestamp(-1.0) is None


def test_text_of_each_content_shape() -> None:
    assert _text(None) == ""
    assert _text("") == ""
    assert _text("hi") == "hi"
    assert _text([{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]) == "ab"
    assert _text([]) == ""
    # Anything that is not only text parts keeps every field, as compact JSON.
    assert _text([{"type": "text", "text": "a"}, {"type": "image"}]) == '[{"type":"text","text":"a"},{"type":"image"}]'
    assert _text([{"type": "text", "text": 1}]) == '[{"type":"text","text":1}]'
    assert _text(["a"]) == '["a"]'
    assert _text({"output": "x"}) == '{"output":"x"}'
    assert _text({}) == "{}"
    assert _text(5) == "5"


def test_tool_call_arguments_are_an_object_or_keep_their_text() -> None:
    call = {"id": "c1", "type": "function", "function": {"name": "bash", "arguments": '{"cmd": "ls"}'}}
    assert _tool_call(call) == {"tool_call_id": "c1", "function_name": "bash", "arguments": {"cmd": "ls"}}
    empty = {"id": "c2", "function": {"name": "noop", "arguments": ""}}
    assert _tool_call(empty) == {"tool_call_id": "c2", "function_name": "noop", "arguments": {}}
    assert _tool_call({"id": "c3", "function": {"name": "x", "arguments": None}})["arguments"] == {}
    # No function at all: a nameless call, still one call.
    assert _tool_call({"id": "c4"}) == {"tool_call_id": "c4", "function_name": "", "arguments": {}}
    assert _tool_call({"id": "c5", "function": None}) == {"tool_call_id": "c5", "function_name": "", "arguments": {}}
    for raw in ('{"cmd": ', "[1, 2]", '"text"', "3", "null"):
        out = _tool_call({"id": "c6", "function": {"name": "bash", "arguments": raw}})
        assert out == {"tool_call_id": "c6", "function_name": "bash", "arguments": {}, "extra": {"arguments_text": raw}}


def test_metrics_are_the_calls_exact_tokens_and_logprobs() -> None:
    record = _record([], None, prompt_ids=[5, 6, 7], response_ids=[8, 9], logprobs=[-0.25, 0.0])
    assert _metrics(record) == {
        "prompt_tokens": 3,
        "completion_tokens": 2,
        "prompt_token_ids": [5, 6, 7],
        "completion_token_ids": [8, 9],
        "logprobs": [-0.25, 0.0],
    }
    record.logprobs = [-0.25, float("inf")]
    metrics = _metrics(record)
    assert "logprobs" not in metrics
    assert metrics["extra"] == {"logprobs_missing": "token 1 has logprob inf (not finite)"}
    record.logprobs = [-9999.0, -0.1]  # vLLM's sentinel for -inf
    assert _metrics(record)["extra"]["logprobs_missing"].startswith("token 0 has logprob -9999.0 (below ")


def test_a_sampled_agent_step_carries_everything_the_call_knew() -> None:
    record = _record(
        [TASK],
        _answer("Done.", [("c1", "bash", '{"cmd": "ls"}')], reasoning="think"),
        record_id="rid",
        seq=4,
        served_model="tiny",
        finish_reason="tool_calls",
        temperature=0.7,
        top_p=0.9,
        top_k=20,
        min_p=0.05,
        weight_version="w3",
        api="anthropic_messages",
    )
    step = _agent_step(ExportTurn(sampled_message(record), record, 2.0))
    assert step == {
        "source": "agent",
        "message": "Done.",
        "timestamp": "1970-01-01T00:00:02Z",
        "reasoning_content": "think",
        "tool_calls": [{"tool_call_id": "c1", "function_name": "bash", "arguments": {"cmd": "ls"}}],
        "model_name": "tiny",
        "metrics": _metrics(record),
        "llm_call_count": 1,
        "extra": {
            "record_id": "rid",
            "seq": 4,
            "api": "anthropic_messages",
            "finish_reason": "tool_calls",
            "temperature": 0.7,
            "top_p": 0.9,
            "top_k": 20,
            "min_p": 0.05,
            "weight_version": "w3",
        },
    }


def test_an_agent_step_leaves_out_what_it_does_not_have() -> None:
    record = _record([TASK], _answer("hi"))
    step = _agent_step(ExportTurn(sampled_message(record), record, 0.0))
    assert set(step) == {"source", "message", "metrics", "llm_call_count", "extra"}  # no time, model, reasoning, calls
    copied = _agent_step(ExportTurn({"role": "assistant", "content": "Hello.", "tool_calls": []}, None, 0.5))
    assert copied == {
        "source": "agent",
        "message": "Hello.",
        "timestamp": "1970-01-01T00:00:00.500000Z",
        "is_copied_context": True,
    }


def test_version_is_the_product_tokens_own() -> None:
    assert _version("claude-cli/2.1.197 (external, cli)") == "2.1.197"
    assert _version("codex_exec/0.171.0") == "0.171.0"
    assert _version("a/b/c") == "b/c"
    assert _version("claude-code") is None  # a preset's name
    assert _version("x/ y") is None  # an empty version
    assert _version("") is None
    assert _version("   ") is None
    assert _version(None) is None


def test_file_names_keep_safe_ids_and_hash_the_others() -> None:
    assert trajectory_file_name("tools") == "tools.json"
    assert trajectory_file_name("a-b_c.1") == "a-b_c.1.json"
    assert trajectory_file_name("Xa.B-9") == "Xa.B-9.json"  # capitals, and a leading X, are safe

    def digest(s: str) -> str:
        return hashlib.sha256(s.encode()).hexdigest()[:12]

    assert trajectory_file_name("side/1") == f"side_1-{digest('side/1')}.json"
    assert trajectory_file_name(".hidden") == f"hidden-{digest('.hidden')}.json"
    assert trajectory_file_name("..") == f"session-{digest('..')}.json"
    assert trajectory_file_name("a" * 120) == "a" * 120 + ".json"  # at the limit: kept whole
    assert trajectory_file_name("a" * 121) == f"{'a' * 120}-{digest('a' * 121)}.json"  # one past: cut and hashed
    # Two ids that are made the same safe spelling still get two files.
    assert trajectory_file_name("a/b") != trajectory_file_name("a_b") != trajectory_file_name("a:b")


# --- atif: steps of a chain ---------------------------------------------------------------------------------


def test_steps_pair_each_result_with_its_call_and_keep_every_role() -> None:
    first = _record(
        [{"role": "developer", "content": "rules"}, TASK],
        _answer(None, [("c1", "bash", '{"cmd":"ls"}'), ("c2", "read", '{"p":"a"}')]),
        started_at=10.0,
        finished_at=11.0,
    )
    sent_back = sampled_message(first)
    second_messages = [
        {"role": "developer", "content": "rules"},
        TASK,
        sent_back,
        {"role": "tool", "tool_call_id": "c1", "content": "a.txt"},
        {"role": "tool", "tool_call_id": "c2", "content": [{"type": "text", "text": "x"}]},
        {"role": "tool", "tool_call_id": "gone", "content": "late"},
        {"role": "user", "content": "thanks"},
    ]
    second = _record(second_messages, _answer("ok"), record_id="r1", seq=1, started_at=12.0, finished_at=13.0)
    steps = chain_steps([first, second])
    assert [s["step_id"] for s in steps] == [1, 2, 3, 4, 5, 6]
    assert steps[0] == {
        "step_id": 1,
        "source": "system",
        "message": "rules",
        "extra": {"role": "developer"},
        "timestamp": "1970-01-01T00:00:10Z",
    }
    assert steps[1] == {"step_id": 2, "source": "user", "message": "fix the bug", "timestamp": "1970-01-01T00:00:10Z"}
    assert steps[2]["source"] == "agent" and steps[2]["timestamp"] == "1970-01-01T00:00:11Z"
    assert steps[2]["observation"] == {
        "results": [{"content": "a.txt", "source_call_id": "c1"}, {"content": "x", "source_call_id": "c2"}]
    }
    # A result for no call of the step before it: a system step naming the call in extra.
    assert steps[3] == {
        "step_id": 4,
        "source": "system",
        "message": "",
        "observation": {"results": [{"content": "late", "extra": {"tool_call_id": "gone"}}]},
        "timestamp": "1970-01-01T00:00:12Z",
    }
    assert steps[4] == {"step_id": 5, "source": "user", "message": "thanks", "timestamp": "1970-01-01T00:00:12Z"}
    assert steps[5]["source"] == "agent" and steps[5]["extra"]["record_id"] == "r1"
    data = orjson.loads(orjson.dumps(session_trajectory("s", [first, second])))
    assert Trajectory.model_validate(data).to_json_dict() == data


def test_a_result_after_a_user_message_or_first_answers_no_call() -> None:
    lone = _record([{"role": "tool", "tool_call_id": "c0", "content": "out"}, TASK], _answer("ok"))
    steps = chain_steps([lone])
    assert steps[0] == {
        "step_id": 1,
        "source": "system",
        "message": "",
        "observation": {"results": [{"content": "out", "extra": {"tool_call_id": "c0"}}]},
    }
    assert "timestamp" not in steps[1]  # started_at 0: unknown
    history = [
        TASK,
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [{"id": "h1", "type": "function", "function": {"name": "ls", "arguments": "{}"}}],
        },
        {"role": "user", "content": "wait"},
        {"role": "tool", "tool_call_id": "h1", "content": "out"},
    ]
    steps = chain_steps([_record(history, _answer("ok"), started_at=0.5)])
    assert [s["source"] for s in steps] == ["user", "agent", "user", "system", "agent"]
    assert {s["timestamp"] for s in steps[:4]} == {"1970-01-01T00:00:00.500000Z"}  # half a second is a time
    assert steps[1]["is_copied_context"] is True and "observation" not in steps[1]
    assert steps[3]["observation"]["results"][0]["extra"] == {"tool_call_id": "h1"}


def test_an_unknown_role_is_a_system_step_that_names_it() -> None:
    steps = chain_steps([_record([{"role": "function", "content": "f"}, {"content": "no role"}], _answer("ok"))])
    assert steps[0] == {"step_id": 1, "source": "system", "message": "f", "extra": {"role": "function"}}
    assert steps[1] == {"step_id": 2, "source": "system", "message": "no role", "extra": {"role": None}}
    assert [s["source"] for s in chain_steps([_record([SYSTEM, TASK], _answer("x"))])][:2] == ["system", "user"]
    assert "extra" not in chain_steps([_record([SYSTEM], _answer("x"))])[0]


# --- atif: the agent, one chain, the session ----------------------------------------------------------------


def test_the_agent_is_named_by_the_preset_or_the_client() -> None:
    tools = [{"type": "function", "function": {"name": "ls"}}]
    records = [
        _record([], None, harness=None, requested_model="policy", tools_json="[]"),
        _record([], None, harness="claude-cli/2.1.197 (external, cli)", served_model="tiny"),
        _record([], None, harness="other/9", served_model="other", tools_json=orjson.dumps(tools).decode()),
    ]
    assert _agent(records, None) == {
        "name": "claude-cli",
        "version": "2.1.197",
        "model_name": "tiny",
        "tool_definitions": tools,  # the last call's
        "extra": {
            "user_agent": "claude-cli/2.1.197 (external, cli)",
            "api": "openai_chat",
            "requested_model": "policy",
        },
    }
    preset = _agent(records, SessionInfo("s", harness="claude-code"))
    assert (preset["name"], preset["version"]) == ("claude-code", "2.1.197")
    assert _agent(records, SessionInfo("s", harness="mine/3.0"))["version"] == "3.0"  # the preset's own version wins
    bare = _agent([_record([], None)], SessionInfo("s"))
    assert bare == {"name": "unknown", "version": "unknown", "extra": {"api": "openai_chat"}}


def test_a_chain_trajectory_names_its_chain_and_totals() -> None:
    a = _record([TASK], _answer("x"), prompt_ids=[1, 2, 3], response_ids=[4, 5], logprobs=[-1.0, -1.0])
    b = _record(
        [TASK], _answer("y"), record_id="r1", seq=1, prompt_ids=[1, 2, 3, 4, 5, 6], response_ids=[7], logprobs=[-1.0]
    )
    chain = RecordChain(
        3, [a, b], start=Break(BreakCause.COMPACTION, "d"), end=Break(BreakCause.SUB_AGENT, "e"), related=1
    )
    trajectory = _chain_trajectory("sess", chain, None, "auxiliary")
    assert trajectory["schema_version"] == "ATIF-v1.7" and trajectory["session_id"] == "sess"
    assert trajectory["trajectory_id"] == "sess:c3"
    assert trajectory["final_metrics"] == {
        "total_prompt_tokens": 9,
        "total_completion_tokens": 3,
        "total_steps": len(trajectory["steps"]),
    }
    assert trajectory["extra"] == {
        "polar": {
            "chain_index": 3,
            "calls": 2,
            "role": "auxiliary",
            "start": "compaction",
            "end": "sub_agent",
            "related_chain": 1,
        }
    }
    plain = _chain_trajectory("sess", RecordChain(0, [a]), None, "agent")
    assert plain["extra"] == {"polar": {"chain_index": 0, "calls": 1, "role": "agent"}}
    assert _chain_trajectory("s", RecordChain(2, [a], related=0), None, "agent")["extra"]["polar"]["related_chain"] == 0


EOT = 99  # the end-of-turn token of the hand-made token ids below (each call's last sampled token)


def _call(
    seq: int,
    messages: list[dict[str, Any]],
    answer: dict[str, Any],
    prompt: list[int],
    response: list[int],
    **fields: Any,
) -> CaptureRecord:
    """A session's call as the proxy records it: answered at seq + 0.5, its prompt the token ids given."""
    base: dict[str, Any] = dict(
        record_id=f"s1-{seq}", session_id="s1", seq=seq, prompt_ids=prompt, response_ids=response,
        logprobs=[-0.5] * len(response), finish_reason="stop", started_at=float(seq), finished_at=seq + 0.5,
        harness="codex_exec/0.171.0", served_model="tiny",
    )  # fmt: skip
    return _record(messages, answer, **(base | fields))


def _tool_turns(*calls: tuple[str, str, str], content: str | None = None) -> list[CaptureRecord]:
    """One chain: a call answering with ``calls``, each answered by the harness, then a call answering "Done."."""
    first = _call(0, [SYSTEM, TASK], _answer(content, list(calls)), [1, 2, 3], [10, 11, EOT])
    results = [{"role": "tool", "tool_call_id": i, "content": f"output of {n}"} for i, n, _ in calls]
    messages = [SYSTEM, TASK, sampled_message(first), *results]
    return [first, _call(1, messages, _answer("Done."), [1, 2, 3, 10, 11, EOT, 20], [12, EOT])]


def _two_chain_session() -> list[CaptureRecord]:
    """A two-call tool loop, then a title call whose prompt extends no earlier one: two chains."""
    title = _call(2, [{"role": "user", "content": "Title for: fix"}], _answer("Fix it"), [50, 51], [52, EOT])
    title.tools_json = "[]"
    return [*_tool_turns(("c1", "bash", '{"cmd": "ls"}')), title]


def test_a_session_is_its_main_chain_with_the_others_embedded_and_its_outcome() -> None:
    records = _two_chain_session()
    for record in records:
        record.task_id, record.group_id, record.sample_index = "rt", "rg", 5
    info = SessionInfo("s1", task_id="t", group_id="g", sample_index=2, harness="codex", status="failed", reward=0.0)
    trajectory = session_trajectory("s1", records, info)
    assert trajectory is not None
    assert trajectory["trajectory_id"] == "s1:c0"
    assert trajectory["final_metrics"]["extra"] == {"reward": 0.0, "status": "failed"}
    assert trajectory["extra"] == {
        "reward": 0.0,
        "status": "failed",
        "task_id": "t",
        "group_id": "g",
        "sample_index": 2,
        "polar": {"chain_index": 0, "calls": 2, "role": "agent", "chains": 2, "calls_unusable": {}},
    }
    (title,) = trajectory["subagent_trajectories"]
    assert title["trajectory_id"] == "s1:c1" and title["extra"]["polar"]["calls"] == 1
    assert [s["message"] for s in title["steps"]] == ["Title for: fix", "Fix it"]
    # Every chain is the same session's: the same agent, named by the preset.
    assert trajectory["agent"]["name"] == title["agent"]["name"] == "codex"
    assert title["agent"]["version"] == "0.171.0"
    # Without the session's row: the records' own labels, no outcome.
    bare = session_trajectory("s1", records)
    assert bare is not None and bare["final_metrics"]["extra"] == {"reward": None, "status": None}
    assert (bare["extra"]["task_id"], bare["extra"]["group_id"], bare["extra"]["sample_index"]) == ("rt", "rg", 5)
    unlabelled = session_trajectory("s1", records, SessionInfo("s1"))
    assert unlabelled is not None
    assert (unlabelled["extra"]["task_id"], unlabelled["extra"]["group_id"], unlabelled["extra"]["sample_index"]) == (
        "rt",
        "rg",
        5,
    )
    zero = session_trajectory("s1", records, SessionInfo("s1", sample_index=0))
    assert zero is not None and zero["extra"]["sample_index"] == 0  # 0 is a sample index, not "none"
    data = orjson.loads(orjson.dumps(trajectory))
    assert Trajectory.model_validate(data).to_json_dict() == data


def test_one_chain_has_no_subagents_and_no_usable_call_no_trajectory() -> None:
    trajectory = session_trajectory("s1", _two_chain_session()[:2])
    assert trajectory is not None and "subagent_trajectories" not in trajectory
    assert trajectory["extra"]["polar"]["chains"] == 1
    failed = _call(0, [TASK], _answer("x"), [1], [2], status="failed")
    assert session_trajectory("s1", [failed]) is None


# --- conversation -------------------------------------------------------------------------------------------


def test_session_chains_leave_out_and_count_unusable_calls() -> None:
    records = [
        _call(0, [TASK], _answer("x"), [1, 2], [3, EOT], status="failed"),
        _call(1, [TASK], _answer("y"), [1, 2], [3, EOT], status="failed"),
        _call(2, [SYSTEM, TASK], _answer("a"), [1, 2, 3], [4, EOT]),
        _call(3, [SYSTEM, TASK], _answer("b"), [1, 2, 3], [5, EOT]),  # sent again: the answer before thrown away
        _call(4, [SYSTEM, TASK], _answer("c"), [], [6, EOT]),
    ]
    split = session_chains("s1", records)
    assert split.session_id == "s1"
    assert split.unusable == {"failed call": 2, "discarded: retried": 1, "no prompt token ids": 1}
    assert [[r.seq for r in c.records] for c in split.chains] == [[3]]
    assert split.roles == ["agent"]


def test_the_main_chain_is_the_agent_chain_with_the_most_calls_the_first_of_equals() -> None:
    a, b, c = (RecordChain(i, [_record([], None)] * n) for i, n in enumerate((1, 2, 2)))
    assert SessionChains("s", [a, b, c], {}, ["agent", "agent", "agent"]).main is b
    assert SessionChains("s", [a, b, c], {}, ["agent", "auxiliary", "agent"]).main is c
    assert SessionChains("s", [a, b, c], {}, ["agent", "auxiliary", "auxiliary"]).main is a  # fewer calls, but agent
    assert SessionChains("s", [a, b, c], {}, ["auxiliary", "auxiliary", "auxiliary"]).main is b
    assert SessionChains("s", [a, b, c], {}).main is b  # no roles: every chain an agent's
    assert SessionChains("s", [], {}).main is None


def test_sent_ids_replace_the_engines_only_when_they_match_call_for_call() -> None:
    sampled = sampled_message(_record([], _answer(None, [("e1", "ls", "{}"), ("e2", "cat", "{}")])))
    sent = {"role": "assistant", "tool_calls": [{"id": "toolu_e1"}, {"id": "toolu_e2"}]}
    assert [c["id"] for c in _with_sent_ids(sampled, sent)["tool_calls"]] == ["toolu_e1", "toolu_e2"]
    assert _with_sent_ids(sampled, sent)["tool_calls"][0]["function"] == {"name": "ls", "arguments": "{}"}
    for other in (
        {"role": "user", "tool_calls": sent["tool_calls"]},  # not the assistant's copy
        {"role": "assistant", "tool_calls": [{"id": "toolu_e1"}]},  # another number of calls
        {"role": "assistant", "tool_calls": [{"id": "toolu_e1"}, {"id": ""}]},
        {"role": "assistant", "tool_calls": [{"id": "toolu_e1"}, {"id": 7}]},
        {"role": "assistant", "tool_calls": [{"id": "toolu_e1"}, "x"]},
        {"role": "assistant", "tool_calls": None},
        {"role": "assistant"},
        "assistant",
    ):
        assert _with_sent_ids(sampled, other) is sampled, other
    plain = sampled_message(_record([], _answer("hi")))
    assert _with_sent_ids(plain, {"role": "assistant", "tool_calls": []}) is plain


def test_sampled_message_is_the_engines_answer_in_openai_form() -> None:
    record = _record([], _answer("x", [("c1", "ls", '{"a": 1}')], reasoning="r"))
    assert sampled_message(record) == {
        "role": "assistant",
        "content": "x",
        "reasoning_content": "r",
        "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "ls", "arguments": '{"a": 1}'}}],
    }
    assert sampled_message(_record([], None)) == {"role": "assistant", "content": None}


def test_chain_turns_are_each_message_once_with_the_sampled_answers_and_sent_ids() -> None:
    first = _record(
        [SYSTEM, TASK], _answer(None, [("e1", "ls", '{"a":1}')], reasoning="look"), started_at=1.0, finished_at=2.0
    )
    # The harness sent the answer back without its reasoning, with arguments re-serialized and its own call id.
    sent = {
        "role": "assistant",
        "content": None,
        "tool_calls": [{"id": "toolu_1", "type": "function", "function": {"name": "ls", "arguments": '{"a": 1}'}}],
    }
    result = {"role": "tool", "tool_call_id": "toolu_1", "content": "out"}
    second = _record(
        [SYSTEM, TASK, sent, result], _answer("done"), record_id="r1", seq=1, started_at=3.0, finished_at=4.0
    )
    turns = chain_turns([first, second])
    assert [(t.message, t.record, t.at) for t in turns] == [
        (SYSTEM, None, 1.0),
        (TASK, None, 1.0),
        (
            {
                "role": "assistant",
                "content": None,
                "reasoning_content": "look",
                "tool_calls": [
                    {"id": "toolu_1", "type": "function", "function": {"name": "ls", "arguments": '{"a":1}'}}
                ],
            },
            first,
            2.0,
        ),
        (result, None, 3.0),
        ({"role": "assistant", "content": "done"}, second, 4.0),
    ]
    # A next request shorter than the conversation so far (no copy of the answer to read ids from): engine ids.
    short = _record([SYSTEM, TASK], _answer("again"), record_id="r2", seq=1)
    assert chain_turns([first, short])[2].message["tool_calls"][0]["id"] == "e1"
    # The next request holds the answer and nothing more: its ids are still read.
    exact = _record([SYSTEM, TASK, sent], _answer("again"), record_id="r3", seq=1)
    assert chain_turns([first, exact])[2].message["tool_calls"][0]["id"] == "toolu_1"
    # Each answer's ids come from the request right after it, not from another one.
    calling = _record([SYSTEM, TASK, sent, result], _answer(None, [("e2", "ls", "{}")]), record_id="r4", seq=1)
    sent_2 = {**sent, "tool_calls": [{**sent["tool_calls"][0], "id": "toolu_2"}]}
    third = _record([SYSTEM, TASK, sent, result, sent_2], _answer("end"), record_id="r5", seq=2)
    turns = chain_turns([first, calling, third])
    assert [c["id"] for t in turns if t.record for c in t.message.get("tool_calls", [])] == ["toolu_1", "toolu_2"]


# --- openai jsonl -------------------------------------------------------------------------------------------


def test_a_chain_example_is_its_conversation_and_its_last_calls_tools() -> None:
    tools = [{"type": "function", "function": {"name": "ls"}}]
    first = _record([TASK], _answer("a"), tools_json="[]")
    second = _record(
        [TASK, {"role": "assistant", "content": "a"}, {"role": "user", "content": "more"}],
        _answer("b"),
        record_id="r1",
        seq=1,
        tools_json=orjson.dumps(tools).decode(),
    )
    assert chain_example([first, second]) == {
        "messages": [
            TASK,
            {"role": "assistant", "content": "a"},
            {"role": "user", "content": "more"},
            {"role": "assistant", "content": "b"},
        ],
        "tools": tools,
    }


def test_session_examples_are_the_chains_of_the_roles_asked_for_in_order() -> None:
    assert FORMATS == ("atif", "openai-jsonl")
    records = _two_chain_session()
    records[-1].role, records[-1].role_reason = "auxiliary", "codex title"
    every = session_examples("s1", records)
    assert [e["messages"][-1]["content"] for e in every] == ["Done.", "Fix it"]
    assert [e["messages"][-1]["content"] for e in session_examples("s1", records, ["agent"])] == ["Done."]
    assert [e["messages"][-1]["content"] for e in session_examples("s1", records, {"auxiliary"})] == ["Fix it"]
    assert session_examples("s1", records, ()) == []


@pytest.mark.parametrize("roles", [("agent", "auxiliary")])
def test_every_tool_call_and_result_survives_an_example(roles: tuple[str, ...]) -> None:
    records = _tool_turns(("c1", "bash", '{"cmd": "ls"}'), ("c2", "read_file", '{"path": "a"}'), content="Both.")
    (example,) = session_examples("s1", records, roles)
    assert example["messages"] == [*records[1].messages, {"role": "assistant", "content": "Done."}]
    assert [m["role"] for m in example["messages"]] == ["system", "user", "assistant", "tool", "tool", "assistant"]
    said = example["messages"][2]
    assert (said["content"], [c["id"] for c in said["tool_calls"]]) == ("Both.", ["c1", "c2"])
    assert [(m["tool_call_id"], m["content"]) for m in example["messages"][3:5]] == [
        ("c1", "output of bash"),
        ("c2", "output of read_file"),
    ]
