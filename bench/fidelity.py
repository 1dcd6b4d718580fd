"""Fidelity of the provider translations: what each client sent against what polar keeps.

For every captured model call in mitmproxy flow files (``--set save_stream_file=PATH``; HTTP bodies
of calls answered whole, and the ``response.create`` messages of Codex's WebSocket), the request is
parsed into the canonical request and rendered back into the provider's own format. Every leaf of
the client's body is then looked up in that round trip:

- a string is **kept** when it occurs in some string of the round trip (texts may be joined);
- a number or boolean is kept when the same field (same path, indices aside) holds the same value;
- anything else must match a documented reason (:data:`REASONS`): **dropped** (not part of what the
  engine sees) or **changed** (kept in another form). A leaf with no reason is **UNEXPLAINED**.

``python bench/fidelity.py FLOWS [FLOWS ...]`` prints one table per file (harness from User-Agent). Record FLOWS
by adding ``--set save_stream_file=FLOWS`` to the proxy's mitmdump command (or ``polar proxy``), then run a
harness through it.
Calls the proxy streamed through its relay (slower than ``polar_keepalive``) leave no request body in
the flow file; run the harness with a large ``polar_keepalive`` to capture all of them.
"""

from __future__ import annotations

import fnmatch
import re
import sys
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import orjson

from polar_addon.canonical import CanonicalRequest, PolarError
from polar_addon.providers import Route
from polar_addon.providers.anthropic_messages import PROVIDER as ANTHROPIC
from polar_addon.providers.gemini import PROVIDER as GEMINI
from polar_addon.providers.openai_chat import PROVIDER as CHAT
from polar_addon.providers.openai_responses import DROPPED_ITEMS, NAMESPACE_SEPARATOR, OpenAIResponsesProvider

KEPT, CHANGED, DROPPED, UNEXPLAINED = "kept", "changed", "dropped", "UNEXPLAINED"


@dataclass(frozen=True)
class Reason:
    api: str  # provider name, or "*"
    path: str  # fnmatch pattern over the leaf path with indices as [*], e.g. "input[*].id"
    status: str  # CHANGED or DROPPED
    why: str
    when: Callable[[Any], bool] | None = None  # only for leaf values where this holds


def _upper(value: Any) -> bool:
    return isinstance(value, str) and value.isupper()


REASONS: list[Reason] = [
    # ---- every API
    Reason("*", "*cache_control*", DROPPED, "prompt-caching hints: the engine caches prefixes by itself"),
    Reason("*", "*strict", DROPPED, "strict schema decoding: engines sample tool calls freely, the harness validates"),
    Reason("*", "metadata*", DROPPED, "client metadata, not part of the prompt"),
    Reason("*", "user", DROPPED, "end-user id, not part of the prompt"),
    Reason("*", "stream_options*", CHANGED, "kept as extra.include_usage (how the answer is streamed)"),
    # ---- OpenAI Chat Completions
    Reason("openai_chat", "max_completion_tokens", CHANGED, "canonical max_tokens"),
    Reason("openai_chat", "store", DROPPED, "OpenAI-side storage; polar records every call anyway"),
    Reason("openai_chat", "parallel_tool_calls", DROPPED, "the engine decides how many calls a turn makes"),
    Reason("openai_chat", "messages[*].name", DROPPED, "participant names are not rendered by chat templates"),
    Reason("openai_chat", "messages[*].content[*].type", CHANGED, "text parts joined into one string"),
    Reason("openai_chat", "messages[*].content[*].cache_control*", DROPPED, "prompt-caching hints"),
    Reason("openai_chat", "response_format*", DROPPED, "structured output is not enforced by the engine"),
    Reason("openai_chat", "frequency_penalty", DROPPED, "penalties are not part of the recorded sampling parameters"),
    Reason("openai_chat", "presence_penalty", DROPPED, "penalties are not part of the recorded sampling parameters"),
    # ---- Anthropic Messages
    Reason("anthropic_messages", "system[*].type", CHANGED, "system blocks joined into the one system message"),
    Reason(
        "anthropic_messages",
        "system[*].text",
        DROPPED,
        "Claude Code's per-request billing line: its hash changes every call and would break prefix merging",
        lambda v: isinstance(v, str) and v.lstrip().startswith("x-anthropic-billing-header:"),
    ),
    Reason(
        "anthropic_messages",
        "messages[*].role",
        CHANGED,
        "system messages inside messages join the one system message",
        lambda v: v == "system",
    ),
    Reason(
        "anthropic_messages",
        "thinking.type",
        CHANGED,
        "adaptive thinking is enable_thinking=True",
        lambda v: v == "adaptive",
    ),
    Reason(
        "anthropic_messages",
        "output_config*",
        DROPPED,
        "effort and output settings: the engine's chat template has no such control",
    ),
    Reason(
        "anthropic_messages",
        "messages[*].content[*].signature",
        DROPPED,
        "thinking signatures are opaque; polar's own are derived",
    ),
    Reason(
        "anthropic_messages",
        "messages[*].content[*].id",
        CHANGED,
        "tool_use ids kept as tool_call ids (toolu_ prefix normalised)",
    ),
    Reason(
        "anthropic_messages",
        "thinking.budget_tokens",
        DROPPED,
        "thinking is on or off (enable_thinking); no token budget",
    ),
    Reason(
        "anthropic_messages",
        "tools[*].eager_input_streaming",
        DROPPED,
        "fine-grained tool-input streaming: each answer is rendered once it is complete",
    ),
    Reason("anthropic_messages", "tools[*].type", DROPPED, "server tool types (web search, …) run on Anthropic's side"),
    Reason("anthropic_messages", "context_management*", DROPPED, "server-side context editing is not performed"),
    # ---- OpenAI Responses
    Reason(
        "openai_responses",
        "input[*].role",
        CHANGED,
        "system and developer messages join instructions in the one system message",
        lambda v: v in ("system", "developer"),
    ),
    Reason(
        "openai_responses",
        "input[*].type",
        CHANGED,
        "system and developer messages join instructions in the one system message",
        lambda v: v == "message",
    ),
    Reason(
        "openai_responses",
        "input[*].internal_chat_message_metadata_passthrough*",
        DROPPED,
        "Codex's own item bookkeeping (turn ids, timestamps), not part of the prompt",
    ),
    Reason("openai_responses", "input[*].id", DROPPED, "item ids are not part of the prompt (call_ids are kept)"),
    Reason("openai_responses", "input[*].status", DROPPED, "item status is not part of the prompt"),
    Reason("openai_responses", "input[*].phase", DROPPED, "assistant message phase (commentary/final) is not rendered"),
    Reason(
        "openai_responses", "input[*].encrypted_content", DROPPED, "OpenAI's encrypted reasoning is unreadable here"
    ),
    Reason(
        "openai_responses",
        "input[*].summary[*].*",
        CHANGED,
        "the raw reasoning content is kept; its summary only when it has none",
    ),
    Reason("openai_responses", "input[*].content[*].type", CHANGED, "content parts joined into one string"),
    Reason(
        "openai_responses", "input[*].content[*].annotations*", DROPPED, "output annotations are not part of the prompt"
    ),
    Reason("openai_responses", "input[*].namespace", CHANGED, "folded into the tool name NAMESPACE.NAME"),
    Reason(
        "openai_responses",
        "input[*].type",
        CHANGED,
        "the tools this item makes available join the tool list",
        lambda v: v in ("additional_tools", "tool_search_output"),
    ),
    Reason("openai_responses", "input[*].tools[*]*", CHANGED, "tools an item makes available join the tool list"),
    Reason(
        "openai_responses",
        "input[*].type",
        DROPPED,
        "nothing an engine can read (extra.dropped_items)",
        lambda v: v in DROPPED_ITEMS,
    ),
    Reason(
        "openai_responses",
        "previous_response_id",
        CHANGED,
        "resolved: the remembered history is expanded into the prompt",
    ),
    Reason("openai_responses", "include*", DROPPED, "encrypted reasoning is OpenAI's; engines return plain reasoning"),
    Reason("openai_responses", "prompt_cache_key", DROPPED, "the engine caches prefixes by itself"),
    Reason("openai_responses", "client_metadata*", DROPPED, "Codex telemetry ids, not part of the prompt"),
    Reason("openai_responses", "text*", DROPPED, "verbosity and output format are not enforced by the engine"),
    Reason(
        "openai_responses", "generate", DROPPED, "WebSocket prewarm flag: answered by the bridge without generating"
    ),
    Reason(
        "openai_responses",
        "tools[*].external_web_access",
        DROPPED,
        "hosted web search runs on OpenAI's side; left out (extra.dropped_tools)",
    ),
    Reason(
        "openai_responses",
        "tools[*].type",
        DROPPED,
        "hosted tools run on OpenAI's side; left out (extra.dropped_tools)",
        lambda v: v not in ("function", "custom", "namespace"),
    ),
    Reason(
        "openai_responses",
        "tools[*].description",
        DROPPED,
        "a namespace's own description has no place in a flat tool list",
    ),
    Reason(
        "openai_responses",
        "tools[*].format.*",
        CHANGED,
        "the custom tool's grammar is in its input parameter's description",
    ),
    Reason("openai_responses", "service_tier", DROPPED, "no service tiers"),
    Reason("openai_responses", "truncation", DROPPED, "the proxy never truncates a prompt"),
    Reason("openai_responses", "safety_identifier", DROPPED, "end-user id, not part of the prompt"),
    # ---- Gemini
    Reason("gemini", "*type", CHANGED, "Gemini schema type names lower-cased to JSON Schema", _upper),
    Reason("gemini", "*thoughtSignature", DROPPED, "thought signatures are opaque; nothing the engine can read"),
    Reason("gemini", "*thought_signature", DROPPED, "thought signatures are opaque; nothing the engine can read"),
    Reason("gemini", "systemInstruction.role", DROPPED, "the system instruction has no role"),
    Reason(
        "gemini",
        "generationConfig.thinkingConfig.*",
        CHANGED,
        "thinking is on or off (enable_thinking); no budget or level",
    ),
    Reason("gemini", "generationConfig.candidateCount", DROPPED, "always one candidate"),
    Reason("gemini", "generationConfig.responseMimeType", DROPPED, "output format is not enforced by the engine"),
    Reason("gemini", "generationConfig.responseSchema*", DROPPED, "output format is not enforced by the engine"),
    Reason("gemini", "generationConfig.responseJsonSchema*", DROPPED, "output format is not enforced by the engine"),
    Reason("gemini", "safetySettings*", DROPPED, "no safety filtering"),
    Reason(
        "gemini", "tools[*].googleSearch*", DROPPED, "hosted tools run on Google's side; left out (extra.dropped_tools)"
    ),
    Reason(
        "gemini",
        "tools[*].codeExecution*",
        DROPPED,
        "hosted tools run on Google's side; left out (extra.dropped_tools)",
    ),
    Reason(
        "gemini", "tools[*].urlContext*", DROPPED, "hosted tools run on Google's side; left out (extra.dropped_tools)"
    ),
    Reason("gemini", "labels*", DROPPED, "billing labels, not part of the prompt"),
]


# ---------------------------------------------------------------- canonical -> provider bodies


def _sampling(req: CanonicalRequest, names: dict[str, str]) -> dict[str, Any]:
    s = req.sampling
    values = {
        "temperature": s.temperature,
        "top_p": s.top_p,
        "top_k": s.top_k,
        "max_tokens": s.max_tokens,
        "stop": s.stop or None,
        "seed": s.seed,
    }
    return {names[k]: v for k, v in values.items() if v is not None and k in names}


def _loads(text: str) -> Any:
    try:
        return orjson.loads(text)
    except orjson.JSONDecodeError:
        return text


def chat_body(req: CanonicalRequest) -> dict[str, Any]:
    body: dict[str, Any] = {"model": req.model, "messages": req.messages, "stream": req.stream}
    if req.tools:
        body["tools"] = req.tools
    if req.tool_choice is not None:
        body["tool_choice"] = req.tool_choice
    body.update(_sampling(req, {k: k for k in ("temperature", "top_p", "top_k", "max_tokens", "stop", "seed")}))
    if req.extra.get("include_usage"):
        body["stream_options"] = {"include_usage": True}
    if "reasoning_effort" in req.extra:
        body["reasoning_effort"] = req.extra["reasoning_effort"]
    return body


def anthropic_body(req: CanonicalRequest) -> dict[str, Any]:
    system = [m["content"] for m in req.messages if m["role"] == "system"]
    messages: list[dict[str, Any]] = []

    def user_turn() -> list[dict[str, Any]]:
        if not messages or messages[-1]["role"] != "user":
            messages.append({"role": "user", "content": []})
        return messages[-1]["content"]

    for m in req.messages:
        if m["role"] == "user":
            user_turn().append({"type": "text", "text": m["content"]})
        elif m["role"] == "tool":
            user_turn().append({"type": "tool_result", "tool_use_id": m["tool_call_id"], "content": m["content"]})
        elif m["role"] == "assistant":
            blocks: list[dict[str, Any]] = []
            if m.get("reasoning_content"):
                blocks.append({"type": "thinking", "thinking": m["reasoning_content"]})
            if m.get("content"):
                blocks.append({"type": "text", "text": m["content"]})
            for call in m.get("tool_calls") or []:
                blocks.append(
                    {
                        "type": "tool_use",
                        "id": call["id"],
                        "name": call["function"]["name"],
                        "input": _loads(call["function"]["arguments"] or "{}"),
                    }
                )
            messages.append({"role": "assistant", "content": blocks})
    body: dict[str, Any] = {"model": req.model, "messages": messages, "stream": req.stream}
    if system:
        body["system"] = system[0]
    if req.tools:
        body["tools"] = [
            {
                "name": t["function"]["name"],
                "description": t["function"].get("description"),
                "input_schema": t["function"].get("parameters"),
            }
            for t in req.tools
        ]
    choice = req.tool_choice
    if choice is not None:
        body["tool_choice"] = (
            {"type": "tool", "name": choice["function"]["name"]}
            if isinstance(choice, dict)
            else {"type": {"required": "any"}.get(choice, choice)}
        )
    if req.enable_thinking is not None:
        body["thinking"] = {"type": "enabled" if req.enable_thinking else "disabled"}
    body.update(
        _sampling(
            req,
            {
                "temperature": "temperature",
                "top_p": "top_p",
                "top_k": "top_k",
                "max_tokens": "max_tokens",
                "stop": "stop_sequences",
            },
        )
    )
    return body


def responses_body(req: CanonicalRequest) -> dict[str, Any]:
    namespaces: dict[str, str] = req.extra.get("namespaced_tools") or {}
    custom = set(req.extra.get("custom_tools") or ())
    custom_calls: set[str] = set()

    def split(name: str) -> dict[str, Any]:
        ns = namespaces.get(name)
        return {"namespace": ns, "name": name[len(ns) + len(NAMESPACE_SEPARATOR) :]} if ns else {"name": name}

    items: list[dict[str, Any]] = []
    for m in req.messages:
        if m["role"] == "user":
            items.append({"type": "message", "role": "user", "content": [{"type": "input_text", "text": m["content"]}]})
        elif m["role"] == "tool":
            kind = "custom_tool_call_output" if m["tool_call_id"] in custom_calls else "function_call_output"
            items.append({"type": kind, "call_id": m["tool_call_id"], "output": m["content"]})
        elif m["role"] == "assistant":
            if m.get("reasoning_content"):
                items.append(
                    {
                        "type": "reasoning",
                        "content": [{"type": "reasoning_text", "text": m["reasoning_content"]}],
                        "summary": [],
                    }
                )
            if m.get("content"):
                items.append(
                    {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": m["content"]}]}
                )
            for call in m.get("tool_calls") or []:
                fn = call["function"]
                if fn["name"] in custom:
                    custom_calls.add(call["id"])
                    args = _loads(fn["arguments"])
                    items.append(
                        {
                            "type": "custom_tool_call",
                            "call_id": call["id"],
                            **split(fn["name"]),
                            "input": args.get("input") if isinstance(args, dict) else fn["arguments"],
                        }
                    )
                else:
                    items.append(
                        {
                            "type": "function_call",
                            "call_id": call["id"],
                            **split(fn["name"]),
                            "arguments": fn["arguments"],
                        }
                    )
    tools: list[dict[str, Any]] = []
    groups: dict[str, dict[str, Any]] = {}
    for t in req.tools:
        fn = t["function"]
        where = split(fn["name"])
        if fn["name"] in custom:
            tool = {
                "type": "custom",
                "name": where["name"],
                "description": fn.get("description"),
                "format": fn["parameters"]["properties"]["input"]["description"],
            }
        else:
            tool = {
                "type": "function",
                "name": where["name"],
                "description": fn.get("description"),
                "parameters": fn.get("parameters"),
            }
        if "namespace" in where:
            group = groups.get(where["namespace"])
            if group is None:
                group = groups[where["namespace"]] = {"type": "namespace", "name": where["namespace"], "tools": []}
                tools.append(group)
            group["tools"].append(tool)
        else:
            tools.append(tool)
    body: dict[str, Any] = {
        "model": req.model,
        "input": items,
        "stream": req.stream,
        "store": req.extra.get("store", True),
        "parallel_tool_calls": req.extra.get("parallel_tool_calls", True),
    }
    system = [m["content"] for m in req.messages if m["role"] == "system"]
    if system:
        body["instructions"] = system[0]
    if tools:
        body["tools"] = tools
    choice = req.tool_choice
    if choice is not None:
        body["tool_choice"] = (
            {"type": "function", **split(choice["function"]["name"])} if isinstance(choice, dict) else choice
        )
    reasoning = {
        k: v
        for k, v in (("effort", req.extra.get("reasoning_effort")), ("summary", req.extra.get("reasoning_summary")))
        if v
    }
    if reasoning:
        body["reasoning"] = reasoning
    body.update(_sampling(req, {"temperature": "temperature", "top_p": "top_p", "max_tokens": "max_output_tokens"}))
    return body


def gemini_body(req: CanonicalRequest) -> dict[str, Any]:
    names = {c["id"]: c["function"]["name"] for m in req.messages for c in m.get("tool_calls") or []}
    contents: list[dict[str, Any]] = []
    for m in req.messages:
        if m["role"] == "user":
            contents.append({"role": "user", "parts": [{"text": m["content"]}]})
        elif m["role"] == "tool":
            part = {
                "functionResponse": {
                    "id": m["tool_call_id"],
                    "name": names.get(m["tool_call_id"]),
                    "response": _loads(m["content"]),
                }
            }
            if contents and contents[-1]["role"] == "user" and "functionResponse" in contents[-1]["parts"][-1]:
                contents[-1]["parts"].append(part)
            else:
                contents.append({"role": "user", "parts": [part]})
        elif m["role"] == "assistant":
            parts: list[dict[str, Any]] = []
            if m.get("reasoning_content"):
                parts.append({"text": m["reasoning_content"], "thought": True})
            if m.get("content"):
                parts.append({"text": m["content"]})
            for call in m.get("tool_calls") or []:
                parts.append(
                    {
                        "functionCall": {
                            "id": call["id"],
                            "name": call["function"]["name"],
                            "args": _loads(call["function"]["arguments"] or "{}"),
                        }
                    }
                )
            contents.append({"role": "model", "parts": parts})
    body: dict[str, Any] = {"contents": contents}
    system = [m["content"] for m in req.messages if m["role"] == "system"]
    if system:
        body["systemInstruction"] = {"parts": [{"text": system[0]}]}
    if req.tools:
        body["tools"] = [
            {
                "functionDeclarations": [
                    {
                        "name": t["function"]["name"],
                        "description": t["function"].get("description"),
                        "parameters": t["function"].get("parameters"),
                    }
                    for t in req.tools
                ]
            }
        ]
    choice = req.tool_choice
    if choice is not None:
        mode = (
            {"auto": "AUTO", "required": "ANY", "none": "NONE"}.get(choice, "ANY") if isinstance(choice, str) else "ANY"
        )
        config: dict[str, Any] = {"mode": mode}
        if isinstance(choice, dict):
            config["allowedFunctionNames"] = [choice["function"]["name"]]
        body["toolConfig"] = {"functionCallingConfig": config}
    generation = _sampling(
        req,
        {
            "temperature": "temperature",
            "top_p": "topP",
            "top_k": "topK",
            "max_tokens": "maxOutputTokens",
            "stop": "stopSequences",
            "seed": "seed",
        },
    )
    if generation:
        body["generationConfig"] = generation
    return body


RENDER: dict[str, Callable[[CanonicalRequest], dict[str, Any]]] = {
    "openai_chat": chat_body,
    "anthropic_messages": anthropic_body,
    "openai_responses": responses_body,
    "gemini": gemini_body,
}
# The same field under another name in the round trip (path segments, for numbers and booleans).
ALIASES = {
    "max_completion_tokens": "max_tokens",
    "parametersJsonSchema": "parameters",
    "parameters_json_schema": "parameters",
    "generation_config": "generationConfig",
    "max_output_tokens": "maxOutputTokens",
}


# ---------------------------------------------------------------- comparison


def leaves(value: Any, path: str = "") -> Iterator[tuple[str, Any]]:
    if isinstance(value, dict):
        for key, inner in value.items():
            yield from leaves(inner, f"{path}.{key}" if path else key)
    elif isinstance(value, list):
        for i, inner in enumerate(value):
            yield from leaves(inner, f"{path}[{i}]")
    elif value is not None:
        yield path, value


def pattern_of(path: str) -> str:
    return re.sub(r"\[\d+\]", "[*]", path)


def _normal(path: str) -> str:
    return ".".join(ALIASES.get(part, part) for part in pattern_of(path).split("."))


def reason_for(api: str, path: str, value: Any) -> Reason | None:
    pattern = pattern_of(path)
    for reason in REASONS:
        # "[" opens a character class in fnmatch; reason paths mean a literal "[*]".
        glob = reason.path.replace("[", "[[]")
        if (
            reason.api in ("*", api)
            and fnmatch.fnmatchcase(pattern, glob)
            and (reason.when is None or reason.when(value))
        ):
            return reason
    return None


@dataclass
class Row:
    api: str
    harness: str
    field: str
    status: str
    why: str = ""
    count: int = 0
    example: str = ""


@dataclass
class Comparison:
    rows: dict[tuple[str, str, str, str], Row] = field(default_factory=dict)
    calls: Counter = field(default_factory=Counter)
    skipped: Counter = field(default_factory=Counter)  # (harness, why) -> count
    leaves: list[tuple[str, str, Any]] = field(default_factory=list)  # (leaf path, status, value), every leaf

    def add(self, api: str, harness: str, leaf: str, status: str, why: str, value: Any) -> None:
        self.leaves.append((leaf, status, value))
        key = (api, harness, _field(leaf), status)
        row = self.rows.setdefault(key, Row(api, harness, key[2], status, why, 0, repr(value)[:60]))
        row.count += 1

    def unexplained(self) -> list[Row]:
        return [r for r in self.rows.values() if r.status == UNEXPLAINED]


def _field(path: str) -> str:
    """The field a leaf belongs to, for the table: its pattern, without the innermost schema detail."""
    pattern = pattern_of(path)
    for marker in (".parameters.", ".input_schema.", ".parametersJsonSchema.", ".args.", ".response.", ".arguments."):
        if marker in pattern:
            return pattern.split(marker)[0] + marker.rstrip(".") + ".*"
    return pattern


def _is_text(value: str) -> bool:
    """Prose, ids and JSON text (found anywhere in the round trip), as opposed to short tokens such
    as roles, types and names (which must come back in the same field)."""
    return len(value) >= 16 or any(c.isspace() for c in value)


def _field_value(path: str, value: Any) -> tuple[str, bytes]:
    # 1 and 1.0 are the same temperature.
    number = isinstance(value, (int, float)) and not isinstance(value, bool)
    return _normal(path), orjson.dumps(float(value) if number else value)


def compare(api: str, harness: str, body: dict[str, Any], back: dict[str, Any], into: Comparison) -> None:
    strings = [v for _, v in leaves(back) if isinstance(v, str)]
    fields = {_field_value(p, v) for p, v in leaves(back)}
    # A JSON-text value (tool arguments) also counts as kept when the same JSON comes back compacted.
    strings += [_compact(v) for v in strings if v[:1] in "{["]
    for path, value in leaves(body):
        if isinstance(value, str) and _is_text(value):
            kept = any(value in s for s in strings) or _compact(value) in strings
            if not kept and value.strip() and any(value.strip() in s for s in strings):
                into.add(
                    api,
                    harness,
                    path,
                    CHANGED,
                    "surrounding whitespace trimmed (system parts join with blank lines)",
                    value,
                )
                continue
        else:
            kept = _field_value(path, value) in fields
        if kept:
            into.add(api, harness, path, KEPT, "", value)
            continue
        reason = reason_for(api, path, value)
        if reason is None:
            into.add(api, harness, path, UNEXPLAINED, "no documented reason", value)
        else:
            into.add(api, harness, path, reason.status, reason.why, value)


def _compact(text: str) -> str:
    value = _loads(text)
    return text if isinstance(value, str) else orjson.dumps(value).decode()


# ---------------------------------------------------------------- captured calls


@dataclass
class Captured:
    api: str
    route: Route
    body: dict[str, Any]
    harness: str
    # Responses over the WebSocket: the final response the proxy sent, so that a later call's
    # previous_response_id resolves in the replay exactly as it did in the proxy.
    response: dict[str, Any] | None = None


def _provider_for(method: str, path: str) -> tuple[Any, Route] | None:
    for provider in (CHAT, ANTHROPIC, GEMINI, OpenAIResponsesProvider()):
        route = provider.route(method, path)
        if route is not None and route.kind in ("generate", "count_tokens"):
            return provider, route
    return None


def _harness(user_agent: str | None) -> str:
    return (user_agent or "unknown").split(" ")[0]


def _websocket_calls(messages: list[Any], label: str) -> list[Captured]:
    calls: list[Captured] = []
    answered = 0
    for message in messages:
        if not message.is_text:
            continue
        data = orjson.loads(message.content)
        kind = data.get("type") if isinstance(data, dict) else None
        if message.from_client and kind == "response.create":
            calls.append(
                Captured(
                    "openai_responses", Route(kind="generate"), {k: v for k, v in data.items() if k != "type"}, label
                )
            )
        elif (
            not message.from_client
            and kind in ("response.completed", "response.failed", "error")
            and answered < len(calls)
        ):
            calls[answered].response = data.get("response")
            answered += 1
    return calls


def captured(path: Path, harness: str | None = None, into: Comparison | None = None) -> Iterator[Captured]:
    """Model calls in a mitmproxy flow file: HTTP request bodies, and Codex's WebSocket messages."""
    from mitmproxy import io

    with open(path, "rb") as fh:
        for flow in io.FlowReader(fh).stream():
            request = getattr(flow, "request", None)
            if request is None:
                continue
            label = harness or _harness(request.headers.get("user-agent"))
            if getattr(flow, "websocket", None) is not None:
                yield from _websocket_calls(flow.websocket.messages, label)
                continue
            if request.path.startswith("/_polar/stream/"):
                if into is not None:
                    into.skipped[(label, "streamed through the relay: body not in the flow file")] += 1
                continue
            found = _provider_for(request.method, request.path)
            if found is None or not request.content:
                continue
            provider, route = found
            yield Captured(provider.name, route, orjson.loads(request.content), label)


def round_trip(call: Captured, responses: OpenAIResponsesProvider) -> dict[str, Any]:
    """The call's body parsed into the canonical request and rendered back into its API's format."""
    provider = {"openai_chat": CHAT, "anthropic_messages": ANTHROPIC, "gemini": GEMINI}.get(call.api, responses)
    request = provider.parse_request(call.body, call.route)
    if call.response is not None and call.response.get("id"):
        responses.remember(request, call.response["id"], call.response.get("output") or [])
    return RENDER[call.api](request)


def compare_flows(paths: list[Path], harness: str | None = None) -> Comparison:
    result = Comparison()
    for path in paths:
        # One Responses provider per file: previous_response_id chains resolve against the calls
        # replayed before them, as they did in the proxy.
        responses = OpenAIResponsesProvider()
        for call in captured(path, harness, result):
            result.calls[(call.api, call.harness)] += 1
            try:
                back = round_trip(call, responses)
            except PolarError as err:
                result.add(call.api, call.harness, "<request>", UNEXPLAINED, f"rejected: {err.message}", "")
                continue
            compare(call.api, call.harness, call.body, back, result)
    return result


# ---------------------------------------------------------------- table


def print_table(result: Comparison, title: str = "provider round-trip fidelity") -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title=title)
    for column in ("api", "harness", "field", "status", "leaves", "why", "example"):
        table.add_column(column, overflow="fold")
    order = {UNEXPLAINED: 0, DROPPED: 1, CHANGED: 2, KEPT: 3}
    for row in sorted(result.rows.values(), key=lambda r: (r.api, r.harness, order[r.status], r.field)):
        style = "bold red" if row.status == UNEXPLAINED else None
        table.add_row(row.api, row.harness, row.field, row.status, str(row.count), row.why, row.example, style=style)
    console = Console(width=200)
    console.print(table)
    for (api, harness), n in sorted(result.calls.items()):
        console.print(f"{api} / {harness}: {n} calls compared")
    for (harness, why), n in sorted(result.skipped.items()):
        console.print(f"{harness}: {n} calls skipped ({why})")


def main(argv: list[str]) -> int:
    if not argv or argv[0] in ("-h", "--help"):
        print(__doc__)
        return 0 if argv else 2
    missing = [p for p in argv if not Path(p).is_file()]
    if missing:
        print(
            f"no such flow file: {', '.join(missing)} (record one with mitmdump --set save_stream_file=PATH)",
            file=sys.stderr,
        )
        return 2
    result = compare_flows([Path(p) for p in argv])
    print_table(result)
    return 1 if result.unexplained() else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
