"""Multi-turn tool-using sessions driven by the official openai and anthropic SDKs through a real proxy, on the
scripted engine with a Qwen3 chat template (it drops earlier think blocks once a new user turn comes), and what
their build gives: shared by tests/test_tito_proxy.py and bench/continuity.py."""

from __future__ import annotations

import importlib.resources
import json
import shutil
import ssl
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import anthropic
import httpx
import openai

from polar_addon.capture import CaptureRecord
from polar_addon.store import read_records, read_sessions
from polar_cli.build import build_traces
from polar_cli.build.inputs import session_info
from polar_cli.trace import Trace

QWEN3_TEMPLATE = (importlib.resources.files("trl") / "chat_templates" / "qwen3.jinja").read_text()

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "ls",
            "description": "List files.",
            "parameters": {"type": "object", "properties": {"path": {"type": "string"}}},
        },
    },
    {
        "type": "function",
        "function": {
            "name": "read",
            "description": "Read a file.",
            "parameters": {"type": "object", "properties": {"path": {"type": "string"}}},
        },
    },
]
ANTHROPIC_TOOLS = [
    {
        "name": t["function"]["name"],
        "description": t["function"]["description"],
        "input_schema": t["function"]["parameters"],
    }
    for t in TOOLS
]
# Arguments written with spaces and in the model's key order, as models write them.
TURNS = [
    {
        "reasoning_content": "I should list the files first.",
        "tool_calls": [{"type": "function", "function": {"name": "ls", "arguments": '{"path": "."}'}}],
    },
    {
        "reasoning_content": "There is a.txt; read it.",
        "tool_calls": [{"type": "function", "function": {"name": "read", "arguments": '{"path": "a.txt"}'}}],
    },
    {"reasoning_content": "It says hi.", "content": "a.txt says hi."},
]


def qwen3_model(tiny_model_dir: Path, root: Path) -> Path:
    """The tiny model with Qwen3's own chat template."""
    out = root / "tiny-qwen3"
    if not out.exists():
        shutil.copytree(tiny_model_dir, out)
        (out / "chat_template.jinja").write_text(QWEN3_TEMPLATE)
    return out


def write_script(model_dir: Path, path: Path, *, thinking: bool = True) -> Path:
    """The scripted ls -> read -> answer loop; ``thinking=False``: the same turns without think blocks, for clients
    that turn thinking off (Qwen3's template then opens an empty think block that its history render drops)."""
    turns = TURNS if thinking else [{k: v for k, v in t.items() if k != "reasoning_content"} for t in TURNS]
    path.write_text(json.dumps({"model_dir": str(model_dir), "cycle": True, "turns": turns}))
    return path


def _http(proxy: Any, session: str) -> httpx.Client:
    return httpx.Client(
        proxy=proxy.proxy_url(session), verify=ssl.create_default_context(cafile=str(proxy.ca)), timeout=120
    )


def openai_session(proxy: Any, session: str, *, user_turns: int = 2) -> None:
    """``user_turns`` user questions, each answered by the script's ls -> read -> answer loop; the client sends
    back what the SDK returned (no reasoning: Chat Completions clients drop it)."""
    client = openai.OpenAI(api_key="sk-not-a-real-key", http_client=_http(proxy, session), max_retries=0)
    messages: list[dict[str, Any]] = [{"role": "system", "content": "You are a file assistant."}]
    for turn in range(user_turns):
        messages.append({"role": "user", "content": f"What does the file say? ({turn})"})
        while True:
            reply = client.chat.completions.create(model="tiny", max_tokens=64, messages=messages, tools=TOOLS)
            message = reply.choices[0].message
            sent: dict[str, Any] = {"role": "assistant", "content": message.content}
            if message.tool_calls:
                sent["tool_calls"] = [c.model_dump() for c in message.tool_calls]
            messages.append(sent)
            if not message.tool_calls:
                break
            for call in message.tool_calls:
                messages.append({"role": "tool", "tool_call_id": call.id, "content": f"output of {call.function.name}"})


def anthropic_session(proxy: Any, session: str, *, user_turns: int = 2, thinking: dict[str, Any] | None = None) -> None:
    """The same loop through the Messages API: tool inputs come back as objects, thinking blocks as sent.
    ``thinking``: the Messages API's thinking parameter (``{"type": "disabled"}`` turns Qwen3's thinking off)."""
    extra: dict[str, Any] = {} if thinking is None else {"thinking": thinking}
    client = anthropic.Anthropic(api_key="sk-ant-not-real", http_client=_http(proxy, session), max_retries=0)
    messages: list[dict[str, Any]] = []
    for turn in range(user_turns):
        messages.append({"role": "user", "content": f"What does the file say? ({turn})"})
        while True:
            reply = client.messages.create(
                model="tiny",
                max_tokens=64,
                system="You are a file assistant.",
                messages=messages,
                tools=ANTHROPIC_TOOLS,
                **extra,
            )
            messages.append({"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in reply.content]})
            uses = [b for b in reply.content if b.type == "tool_use"]
            if not uses:
                break
            messages.append(
                {
                    "role": "user",
                    "content": [
                        {"type": "tool_result", "tool_use_id": b.id, "content": f"output of {b.name}"} for b in uses
                    ],
                }
            )


@dataclass
class SessionFigures:
    calls: int
    traces: int
    trainable_tokens: int  # loss-mask-1 tokens
    off_policy_tokens: int  # sampled tokens of calls whose trace context is not the prompt they were sampled after


def off_policy_tokens(trace: Trace, records: dict[str, CaptureRecord]) -> int:
    sequence = trace.prompt_ids + trace.completion_ids
    return sum(
        len(records[r].response_ids)
        for r in trace.record_ids
        if list(sequence[: len(records[r].prompt_ids)]) != list(records[r].prompt_ids)
    )


def build(out: Path, *, merge_retokenized: bool = True) -> tuple[list[CaptureRecord], list[Trace]]:
    records = read_records(str(out))
    sessions = {row.session_id: session_info(row) for row in read_sessions(str(out))}
    return records, build_traces(records, sessions, merge_retokenized=merge_retokenized).traces


def figures(records: list[CaptureRecord], traces: list[Trace]) -> dict[str, SessionFigures]:
    by_id = {r.record_id: r for r in records}
    out: dict[str, SessionFigures] = {}
    for session in sorted({r.session_id for r in records}):
        mine = [t for t in traces if t.session_id == session]
        out[session] = SessionFigures(
            calls=sum(r.session_id == session for r in records),
            traces=len(mine),
            trainable_tokens=sum(sum(t.loss_mask) for t in mine),
            off_policy_tokens=sum(off_policy_tokens(t, by_id) for t in mine),
        )
    return out


def sampled_tokens_are_trained(trace: Trace, records: dict[str, CaptureRecord]) -> bool:
    """Every call of the trace sits at its recorded prompt, and the loss-mask-1 tokens are exactly its sampled ids."""
    sequence = trace.prompt_ids + trace.completion_ids
    mask = [0] * len(trace.prompt_ids) + list(trace.loss_mask)
    expected = [0] * len(sequence)
    for record_id in trace.record_ids:
        record = records[record_id]
        start, end = len(record.prompt_ids), len(record.prompt_ids) + len(record.response_ids)
        if list(sequence[:start]) != list(record.prompt_ids) or list(sequence[start:end]) != list(record.response_ids):
            return False
        expected[start:end] = [1] * (end - start)
    return mask == expected
