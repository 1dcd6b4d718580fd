"""Issue 29's acceptance check: one-line bugs planted by hand in the modules that decide rewards, advantages and
continuity, which their own tests let through. Each test here fails with the planted bug and passes without it."""

from __future__ import annotations

import asyncio
import copy
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from polar_addon.canonical import AssistantMessage, CanonicalRequest, SamplingParams, ToolCall
from polar_addon.context_compaction import PROMPT_MARKERS
from polar_addon.continuity.check import Continues, Diverged, DivergeReason, check_continuity, same_message
from polar_addon.store.status import SessionStatus
from polar_addon.tool_parsers.hermes import parse
from polar_cli.rollout.runtimes.base import ExecResult
from polar_cli.trace import Trace
from polar_cli.train.dataset import prepare_rows
from tests.test_rollout_session_units import Control, Watched, _ready, _runner

R = DivergeReason
TOOLS = [{"type": "function", "function": {"name": "bash", "parameters": {"type": "object", "properties": {}}}}]
SAMPLING = SamplingParams(temperature=1.0, top_p=1.0, top_k=0, min_p=0.0, max_tokens=100)


def _request(messages: list[dict[str, Any]], sampling: SamplingParams = SAMPLING) -> CanonicalRequest:
    return CanonicalRequest(
        api="openai_chat", model="tiny", tools=copy.deepcopy(TOOLS), sampling=sampling, messages=messages
    )


def _call(call_id: str, cmd: str) -> ToolCall:
    return ToolCall(id=call_id, name="bash", arguments=f'{{"cmd": "{cmd}"}}')


HISTORY = [{"role": "system", "content": "You are a coding agent."}, {"role": "user", "content": "What is here?"}]
ONE_CALL = AssistantMessage(content=None, tool_calls=[_call("c1", "ls")])
TWO_CALLS = AssistantMessage(content=None, tool_calls=[_call("c1", "ls"), _call("c2", "pwd")])
TOOL_RESULT = {"role": "tool", "tool_call_id": "c1", "content": "a.py"}


def _after(returned: AssistantMessage, sent_back: AssistantMessage) -> Any:
    """The continuity verdict on a call that replays ``sent_back`` where polar had returned ``returned``."""
    new = [*copy.deepcopy(HISTORY), sent_back.to_openai(), TOOL_RESULT]
    return check_continuity(_request(copy.deepcopy(HISTORY)), returned, _request(new))


def test_a_replayed_turn_with_a_call_more_or_less_is_not_the_turn_polar_returned() -> None:
    # Planted: `len(calls_a) != len(calls_b)` -> `>`: a client that adds a call to the turn would continue the
    # chain, training the model on a call it never sampled.
    assert _after(ONE_CALL, ONE_CALL) == Continues([TOOL_RESULT])
    edited = Diverged(R.EDITED_HISTORY, "message 2 is not the assistant turn polar returned")
    assert _after(ONE_CALL, TWO_CALLS) == edited
    assert _after(TWO_CALLS, ONE_CALL) == edited
    assert not same_message(ONE_CALL.to_openai(), TWO_CALLS.to_openai())
    assert not same_message(TWO_CALLS.to_openai(), ONE_CALL.to_openai())


@pytest.mark.parametrize(("name", "value"), [("temperature", 0.7), ("top_p", 0.9), ("top_k", 20), ("min_p", 0.05)])
def test_each_sampling_parameter_of_the_distribution_is_a_divergence(name: str, value: float) -> None:
    # Planted: min_p dropped from the parameters compared: a chain would mix tokens of two distributions.
    new = [*copy.deepcopy(HISTORY), ONE_CALL.to_openai(), TOOL_RESULT]
    changed = replace(SAMPLING, **{name: value})
    verdict = check_continuity(_request(copy.deepcopy(HISTORY)), ONE_CALL, _request(new, changed))
    before = getattr(SAMPLING, name)
    assert verdict == Diverged(R.CHANGED_SAMPLING, f"{name} changed from {before!r} to {value!r}")


def test_max_tokens_is_not_part_of_the_distribution() -> None:
    new = [*copy.deepcopy(HISTORY), ONE_CALL.to_openai(), TOOL_RESULT]
    longer = replace(SAMPLING, max_tokens=5000)
    assert check_continuity(_request(copy.deepcopy(HISTORY)), ONE_CALL, _request(new, longer)) == Continues(
        [TOOL_RESULT]
    )


def test_only_a_call_that_starts_a_compaction_breaks_the_chain_for_it() -> None:
    # Planted: `harness is not None and previous.compaction_prompt is None` -> `harness is not None`: a compaction
    # call's own continuation (Gemini CLI's prompt is its system prompt, there on every turn) would break again.
    marker = PROMPT_MARKERS["gemini-cli"][0]
    system = {"role": "system", "content": f"You are the component that {marker}."}
    old = [system, {"role": "user", "content": "Summarise."}]
    new = [*copy.deepcopy(old), ONE_CALL.to_openai(), TOOL_RESULT]
    assert check_continuity(_request(copy.deepcopy(old)), ONE_CALL, _request(new)) == Continues([TOOL_RESULT])
    # The call that asks for the summary first is a compaction (the previous one was not).
    asks = [*copy.deepcopy(HISTORY), ONE_CALL.to_openai(), TOOL_RESULT]
    asks.append({"role": "user", "content": PROMPT_MARKERS["claude-code"][0] + "."})
    assert check_continuity(_request(copy.deepcopy(HISTORY)), ONE_CALL, _request(asks)) == Diverged(
        R.COMPACTION, "claude-code asks for a summary of the conversation"
    )


def _trace(session: str, reward: float, chain: int = 0) -> Trace:
    return Trace(
        trace_id=f"{session}-c{chain}",
        session_id=session,
        group_id="g",
        chain_index=chain,
        prompt_ids=[1, 2, 3],
        completion_ids=[10, 11],
        loss_mask=[1, 1],
        behavior_logprobs=[-0.1, -0.2],
        reward=reward,
        temperature=1.0,
        trainable=True,
    )


def test_a_session_with_no_advantage_keeps_its_chains_that_differ_from_the_baseline() -> None:
    # Both sessions average 0.5 (session advantage 0), but a's chains are 1 and 0 against b's baseline 0.5:
    # they train at +-0.5, and only b's chain (exactly at the baseline) is dropped. Planted: the drop read the
    # session's advantage, not the trace's, and dropped a's chains too.
    data = prepare_rows([_trace("a", 1.0, 0), _trace("a", 0.0, 1), _trace("b", 0.5)], max_length=16)
    assert [(r.trace_id, r.advantage) for r in data.rows] == [("a-c0", 0.5), ("a-c1", -0.5)]
    assert [r.session_weight for r in data.rows] == [0.5, 0.5]
    assert data.stats["zero_advantage"] == 1


def test_a_call_with_an_empty_name_stays_content_as_a_failed_parse() -> None:
    # Planted: the `not data["name"]` check dropped: a call named "" would reach the harness as a call.
    empty = '<tool_call>{"name": "", "arguments": {}}</tool_call>'
    good = '<tool_call>{"name": "g", "arguments": {}}</tool_call>'
    turn = parse(f"{empty}{good}")
    assert [c.name for c in turn.message.tool_calls] == ["g"]
    assert turn.message.content == empty and turn.failed == [empty]


@pytest.mark.parametrize(
    ("done", "go_on", "status"),
    [(ExecResult(0, "done", ""), True, None), (ExecResult(1, "", "broke"), False, SessionStatus.FAILED)],
)
def test_a_harness_that_ended_on_its_own_in_a_stopped_group_is_not_cancelled(
    tmp_path: Path, done: ExecResult, go_on: bool, status: SessionStatus | None
) -> None:
    # The group's early stop came while the harness ran, but the harness ended before any cancel reached it: it is
    # verified (exit 0) or scored 0 (exit 1) like any other, never masked. Planted: `done.cancelled and` dropped.
    control = Control()
    runner = _runner(tmp_path, control)
    box = Watched(runner, done)
    session = _ready(runner, box)
    original = box.exec

    async def exec_and_stop(*args: Any, **kwargs: Any) -> ExecResult:
        runner.stopped_groups.add("t1")
        return await original(*args, **kwargs)

    box.exec = exec_and_stop  # type: ignore[method-assign]
    assert asyncio.run(runner.run(session)) is go_on
    if status is None:
        assert session.stage == "run" and control.statuses == []
    else:
        assert session.result.status == status and session.result.reward == 0.0
        assert [s for _, s, _ in control.statuses] == ["agent_error"]
