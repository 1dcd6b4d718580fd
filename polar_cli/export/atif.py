"""Harbor's Agent Trajectory Interchange Format (ATIF, RFC 0001): one trajectory per session.

Written as plain JSON-ready dicts against Harbor's pydantic models (harbor 0.26.0, harbor/models/trajectories;
tests/support/harbor_atif holds a copy the tests validate against): a step per system or user message, an agent
step per assistant turn with its tool calls, the tool results as that step's observation. A turn polar sampled
carries its call's exact prompt and completion token ids and logprobs in ``metrics`` (what ATIF keeps for "RL
training without retokenization drift"); an assistant turn the harness sent that no call of this chain sampled is
``is_copied_context`` (ATIF: not training data). The session's main chain is the trajectory; its other chains
(sub-agents, titles, compaction restarts) are embedded as ``subagent_trajectories``.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Sequence
from datetime import UTC, datetime
from typing import Any

import orjson

from polar_addon.capture import CaptureRecord, logprob_problem
from polar_cli.build.prefix_merging import RecordChain
from polar_cli.build.rewards import SessionInfo
from polar_cli.build.stats import harness_name
from polar_cli.export.conversation import Turn, chain_turns, session_chains

# The oldest version holding every field written here (llm_call_count, trajectory_id, subagent_trajectories and
# ToolCall.extra came in v1.7), so readers of older Harbor releases accept it too.
ATIF_VERSION = "ATIF-v1.7"


def _timestamp(at: float) -> str | None:
    return datetime.fromtimestamp(at, UTC).isoformat().replace("+00:00", "Z") if at > 0 else None


def _text(content: Any) -> str:
    """A canonical message's content as ATIF's text message (canonical content is a string, or None)."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list) and all(isinstance(p, dict) and isinstance(p.get("text"), str) for p in content):
        return "".join(p["text"] for p in content)
    return orjson.dumps(content).decode()


def _tool_call(call: dict[str, Any]) -> dict[str, Any]:
    function = call.get("function") or {}
    raw = function.get("arguments") or ""
    try:
        arguments = orjson.loads(raw) if raw else {}
    except orjson.JSONDecodeError:
        arguments = None
    out: dict[str, Any] = {"tool_call_id": call["id"], "function_name": function.get("name") or ""}
    if isinstance(arguments, dict):
        out["arguments"] = arguments
    else:
        # ATIF arguments are an object; the model wrote something else (cut off, or not JSON): keep its text.
        out["arguments"] = {}
        out["extra"] = {"arguments_text": raw}
    return out


def _metrics(record: CaptureRecord) -> dict[str, Any]:
    metrics: dict[str, Any] = {
        "prompt_tokens": len(record.prompt_ids),
        "completion_tokens": len(record.response_ids),
        "prompt_token_ids": list(record.prompt_ids),
        "completion_token_ids": list(record.response_ids),
    }
    problem = logprob_problem(record.logprobs)
    if problem is None:
        metrics["logprobs"] = list(record.logprobs)
    else:
        # A NaN or an infinity has no JSON spelling, and a sentinel is no logprob: say why they are missing.
        metrics["extra"] = {"logprobs_missing": problem}
    return metrics


def _agent_step(turn: Turn) -> dict[str, Any]:
    message = turn.message
    step: dict[str, Any] = {"source": "agent", "message": _text(message.get("content"))}
    if turn.at > 0:
        step["timestamp"] = _timestamp(turn.at)
    if message.get("reasoning_content"):
        step["reasoning_content"] = message["reasoning_content"]
    if message.get("tool_calls"):
        step["tool_calls"] = [_tool_call(c) for c in message["tool_calls"]]
    record = turn.record
    if record is None:
        step["is_copied_context"] = True
        return step
    if record.served_model:
        step["model_name"] = record.served_model
    step["metrics"] = _metrics(record)
    step["llm_call_count"] = 1
    step["extra"] = {
        "record_id": record.record_id,
        "seq": record.seq,
        "api": record.api,
        "finish_reason": record.finish_reason,
        "temperature": record.temperature,
        "top_p": record.top_p,
        "top_k": record.top_k,
        "min_p": record.min_p,
        "weight_version": record.weight_version,
    }
    return step


def chain_steps(records: Sequence[CaptureRecord]) -> list[dict[str, Any]]:
    """One chain's conversation as ATIF steps, numbered from 1."""
    steps: list[dict[str, Any]] = []
    for turn in chain_turns(records):
        role = turn.message.get("role")
        if role == "assistant":
            steps.append(_agent_step(turn))
            continue
        if role == "tool":
            call_id = turn.message.get("tool_call_id")
            result: dict[str, Any] = {"content": _text(turn.message.get("content"))}
            last = steps[-1] if steps else None
            calls = {c["tool_call_id"] for c in (last or {}).get("tool_calls") or []}
            if last is not None and call_id in calls:
                result["source_call_id"] = call_id
                last.setdefault("observation", {"results": []})["results"].append(result)
                continue
            # A result for no call of the step before it (the harness cut its history): a system event that
            # names the call in extra, since ATIF only lets an observation name its own step's calls.
            result["extra"] = {"tool_call_id": call_id}
            step: dict[str, Any] = {"source": "system", "message": "", "observation": {"results": [result]}}
        else:
            step = {"source": "user" if role == "user" else "system", "message": _text(turn.message.get("content"))}
            if role not in ("user", "system"):
                step["extra"] = {"role": role}
        if turn.at > 0:
            step["timestamp"] = _timestamp(turn.at)
        steps.append(step)
    return [{"step_id": i, **step} for i, step in enumerate(steps, 1)]


def _version(label: str | None) -> str | None:
    """The version in a User-Agent's product token ("claude-cli/2.1.197 (external, cli)" -> "2.1.197")."""
    product = label.split()[0] if label and label.strip() else ""
    return (product.split("/", 1)[1] or None) if "/" in product else None


def _agent(records: Sequence[CaptureRecord], session: SessionInfo | None) -> dict[str, Any]:
    user_agent = next((r.harness for r in records if r.harness), None)
    preset = session.harness if session else None
    agent: dict[str, Any] = {
        "name": harness_name(preset, user_agent),
        # A preset's name carries no version; the client's own User-Agent usually does.
        "version": _version(preset) or _version(user_agent) or "unknown",
    }
    model = next((r.served_model for r in records if r.served_model), None)
    if model:
        agent["model_name"] = model
    tools = orjson.loads(records[-1].tools_json)
    if tools:
        agent["tool_definitions"] = tools
    extra = {"user_agent": user_agent, "api": records[0].api, "requested_model": records[0].requested_model}
    agent["extra"] = {k: v for k, v in extra.items() if v is not None}
    return agent


def _chain_trajectory(session_id: str, chain: RecordChain, session: SessionInfo | None, role: str) -> dict[str, Any]:
    steps = chain_steps(chain.records)
    trajectory: dict[str, Any] = {
        "schema_version": ATIF_VERSION,
        "session_id": session_id,
        "trajectory_id": f"{session_id}:c{chain.index}",
        "agent": _agent(chain.records, session),
        "steps": steps,
        "final_metrics": {
            "total_prompt_tokens": sum(len(r.prompt_ids) for r in chain.records),
            "total_completion_tokens": sum(len(r.response_ids) for r in chain.records),
            "total_steps": len(steps),
        },
    }
    chain_extra: dict[str, Any] = {"chain_index": chain.index, "calls": len(chain.records), "role": role}
    if chain.start is not None:
        chain_extra["start"] = chain.start.cause.value
    if chain.end is not None:
        chain_extra["end"] = chain.end.cause.value
    if chain.related is not None:
        chain_extra["related_chain"] = chain.related
    trajectory["extra"] = {"polar": chain_extra}
    return trajectory


def session_trajectory(
    session_id: str, records: Sequence[CaptureRecord], session: SessionInfo | None = None
) -> dict[str, Any] | None:
    """One session's records (seq order) as an ATIF trajectory, or None when no call of it is usable.

    The main chain (the agent chain with the most calls) is the trajectory; every other chain is one of its
    ``subagent_trajectories``; each says its role in ``extra.polar.role``. The session's outcome (reward, status,
    task and group) is in ``final_metrics.extra`` and ``extra``."""
    split = session_chains(session_id, records)
    main = split.main
    if main is None:
        return None
    trajectory = _chain_trajectory(session_id, main, session, split.roles[main.index])
    others = [_chain_trajectory(session_id, c, session, split.roles[c.index]) for c in split.chains if c is not main]
    if others:
        trajectory["subagent_trajectories"] = others
    outcome = {
        "reward": session.reward if session else None,
        "status": session.status if session else None,
    }
    trajectory["final_metrics"]["extra"] = outcome
    first = records[0]
    trajectory["extra"] = {
        **outcome,
        "task_id": session.task_id if session and session.task_id is not None else first.task_id,
        "group_id": session.group_id if session and session.group_id is not None else first.group_id,
        "sample_index": session.sample_index if session and session.sample_index is not None else first.sample_index,
        "polar": {
            **trajectory["extra"]["polar"],
            "chains": len(split.chains),
            "calls_unusable": split.unusable,
        },
    }
    return trajectory


def trajectory_file_name(session_id: str) -> str:
    """The file a session's trajectory is written to: its id, or (an id no file name can hold as it is: a slash, a
    leading dot, odd characters) the id made safe plus a hash of the real one, so two ids never share a file."""
    safe = re.sub(r"[^A-Za-z0-9._-]", "_", session_id).lstrip(".")[:120]
    if safe == session_id:
        return f"{session_id}.json"
    return f"{safe or 'session'}-{hashlib.sha256(session_id.encode()).hexdigest()[:12]}.json"
