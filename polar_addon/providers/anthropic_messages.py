"""Anthropic Messages: ``POST …/v1/messages`` and ``…/v1/messages/count_tokens`` (Claude Code).

Also answers Claude Code's non-model ``GET /api/…`` calls (policy limits, remote settings) so it
runs offline through a forward proxy.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from polar_addon.canonical import (
    CanonicalRequest,
    Completion,
    ContextLengthExceeded,
    PolarError,
    SamplingParams,
)
from polar_addon.providers import ResponseContext, Route, StreamEvent
from polar_addon.providers.common import (
    arguments_object,
    compact_json,
    drop_tool_choice_without_tools,
    invalid,
    opt_bool,
    opt_int,
    opt_number,
    pieces,
    require_object,
    require_str,
    stop_list,
    system_message,
    thinking_signature,
)

# Blocks are paragraphs in Claude Code's requests (system-reminder blocks, then the prompt).
BLOCK_SEPARATOR = "\n\n"
TOOL_ERROR_PREFIX = "[Tool Error] "
TOOL_ID_PREFIX = "toolu_"
# Claude Code starts compaction when an error message starts with this (as Anthropic's does).
PROMPT_TOO_LONG = "prompt is too long"

# Claude Code 2.1.x validates GET /api/claude_code/policy_limits against
# {restrictions: record<{allowed}>, compliance_taints[], monitoring_notice|null, defaults{}} and uses
# exactly this value as its built-in "no restrictions" answer.
POLICY_LIMITS_BODY: dict[str, Any] = {
    "restrictions": {},
    "compliance_taints": [],
    "monitoring_notice": None,
    "defaults": {},
}
# GET /api/claude_code/settings is parsed as {uuid, checksum, settings: record}; empty settings
# means "no managed settings" and is applied as such.
REMOTE_SETTINGS_BODY: dict[str, Any] = {
    "uuid": "00000000-0000-0000-0000-000000000000",
    "checksum": "polar-empty",
    "settings": {},
}

_ERROR_TYPES = {
    "invalid_request": "invalid_request_error",
    "request_too_large": "request_too_large",  # the type Anthropic's own 413 carries
    "authentication": "authentication_error",
    "not_found": "not_found_error",
    "context_length_exceeded": "invalid_request_error",
    "overloaded": "overloaded_error",
    "timeout": "timeout_error",
    "api_error": "api_error",
    "storage_unavailable": "api_error",
}


def _blocks(content: Any, where: str) -> list[dict[str, Any]]:
    if isinstance(content, str):
        return [{"type": "text", "text": content}]
    if not isinstance(content, list) or not all(isinstance(b, dict) for b in content):
        raise invalid(f"{where}: content must be a string or a list of content blocks")
    return content


def _block_text(block: dict[str, Any], key: str, where: str) -> str:
    value = block.get(key)
    if not isinstance(value, str):
        raise invalid(f"{where}: {block.get('type')} block needs a string '{key}'")
    return value


def _unsupported(kind: Any, where: str) -> PolarError:
    if kind in ("image", "document"):
        return invalid(f"{where}: {kind} blocks are not supported by this engine (text only)")
    return invalid(f"{where}: unsupported content block type {kind!r}")


def _tool_result_text(block: dict[str, Any], where: str) -> str:
    content = block.get("content")
    if content is None:
        text = ""
    elif isinstance(content, str):
        text = content
    else:
        texts = []
        for inner in _blocks(content, where):
            if inner.get("type") != "text":
                raise _unsupported(inner.get("type"), f"{where} tool_result")
            texts.append(_block_text(inner, "text", where))
        text = BLOCK_SEPARATOR.join(texts)
    return TOOL_ERROR_PREFIX + text if block.get("is_error") else text


def _user(content: Any, where: str) -> list[dict[str, Any]]:
    tools: list[dict[str, Any]] = []
    texts: list[str] = []
    for block in _blocks(content, where):
        kind = block.get("type")
        if kind == "text":
            texts.append(_block_text(block, "text", where))
        elif kind == "tool_result":
            call_id = _block_text(block, "tool_use_id", where)
            tools.append({"role": "tool", "tool_call_id": call_id, "content": _tool_result_text(block, where)})
        else:
            raise _unsupported(kind, where)
    # Chat templates expect tool results right after the assistant turn that called them.
    if texts or not tools:
        return tools + [{"role": "user", "content": BLOCK_SEPARATOR.join(texts)}]
    return tools


def _assistant(content: Any, where: str) -> dict[str, Any]:
    texts: list[str] = []
    thinking: list[str] = []
    calls: list[dict[str, Any]] = []
    for block in _blocks(content, where):
        kind = block.get("type")
        if kind == "text":
            texts.append(_block_text(block, "text", where))
        elif kind == "thinking":
            thinking.append(_block_text(block, "thinking", where))
        elif kind == "redacted_thinking":
            # Encrypted Anthropic reasoning: unreadable, and never produced by our engines.
            continue
        elif kind == "tool_use":
            call_id = _block_text(block, "id", where)
            name = _block_text(block, "name", where)
            args = block.get("input", {})
            if not isinstance(args, dict):
                raise invalid(f"{where}: tool_use input must be an object")
            calls.append(
                {"id": call_id, "type": "function", "function": {"name": name, "arguments": compact_json(args)}}
            )
        else:
            raise _unsupported(kind, where)
    msg: dict[str, Any] = {"role": "assistant", "content": BLOCK_SEPARATOR.join(texts) if texts else None}
    if thinking:
        msg["reasoning_content"] = BLOCK_SEPARATOR.join(thinking)
    if calls:
        msg["tool_calls"] = calls
    return msg


def _system(raw: Any) -> list[str]:
    if raw is None:
        return []
    if isinstance(raw, str):
        return [raw]
    if isinstance(raw, list):
        texts = []
        for block in raw:
            if not isinstance(block, dict) or block.get("type") != "text" or not isinstance(block.get("text"), str):
                raise invalid("'system' must be a string or a list of text blocks")
            texts.append(block["text"])
        return texts
    raise invalid("'system' must be a string or a list of text blocks")


def _messages(raw: Any) -> tuple[list[str], list[dict[str, Any]]]:
    """The conversation, plus the texts of ``system`` messages found inside it.

    Claude Code 2.1 sends a ``role: system`` message inside ``messages`` (the list of agent types).
    Chat templates take one leading system message, so its text joins the top-level system prompt,
    the same hygiene as OpenAI's developer messages.
    """
    if not isinstance(raw, list) or not raw:
        raise invalid("'messages' is required and must be a non-empty list")
    system_texts: list[str] = []
    out: list[dict[str, Any]] = []
    for i, msg in enumerate(raw):
        where = f"messages[{i}]"
        if not isinstance(msg, dict):
            raise invalid(f"{where} must be an object")
        role = msg.get("role")
        if role == "user":
            out.extend(_user(msg.get("content"), where))
        elif role == "assistant":
            out.append(_assistant(msg.get("content"), where))
        elif role == "system":
            system_texts.extend(_system(msg.get("content")))
        else:
            raise invalid(f"{where}: role must be 'user', 'assistant' or 'system', got {role!r}")
    if not out:
        raise invalid("'messages' needs at least one user or assistant message")
    return system_texts, out


def _tools(raw: Any) -> list[dict[str, Any]]:
    if raw is None:
        return []
    if not isinstance(raw, list):
        raise invalid("'tools' must be a list")
    out = []
    for i, tool in enumerate(raw):
        if not isinstance(tool, dict):
            raise invalid(f"tools[{i}] must be an object")
        if "input_schema" not in tool:
            # Server tools (web_search_…, code_execution_…) run on Anthropic's side; our engine cannot.
            continue
        if not isinstance(tool.get("name"), str):
            raise invalid(f"tools[{i}]: 'name' is required")
        fn: dict[str, Any] = {"name": tool["name"], "parameters": tool["input_schema"]}
        if tool.get("description") is not None:
            fn["description"] = tool["description"]
        out.append({"type": "function", "function": fn})
    return out


def _tool_choice(raw: Any) -> str | dict[str, Any] | None:
    if raw is None:
        return None
    kind = raw.get("type") if isinstance(raw, dict) else None
    if kind in ("auto", "any", "none"):
        return {"auto": "auto", "any": "required", "none": "none"}[kind]
    if kind == "tool" and isinstance(raw.get("name"), str):
        return {"type": "function", "function": {"name": raw["name"]}}
    raise invalid("'tool_choice' must be {type: auto|any|none} or {type: tool, name}")


def _thinking(raw: Any) -> bool | None:
    if raw is None:
        return None
    kind = raw.get("type") if isinstance(raw, dict) else None
    if kind in ("enabled", "adaptive"):
        return True
    if kind == "disabled":
        return False
    raise invalid("'thinking.type' must be 'enabled', 'adaptive' or 'disabled'")


def _stop_sequences(raw: Any) -> list[str]:
    if isinstance(raw, str):
        raise invalid("'stop_sequences' must be a list of strings")
    return stop_list(raw, "stop_sequences")


def tool_use_id(call_id: str) -> str:
    return call_id if call_id.startswith(TOOL_ID_PREFIX) else TOOL_ID_PREFIX + call_id


def stop_reason(request: CanonicalRequest, completion: Completion) -> tuple[str, str | None]:
    """(stop_reason, stop_sequence). Tool calls always end with tool_use (Claude Code runs tools
    only then); an aborted generation is reported as truncated (max_tokens)."""
    reason = completion.finish_reason
    if completion.message.tool_calls and reason in ("stop", "tool_calls"):
        return "tool_use", None
    if reason == "stop":
        matched = completion.matched_stop
        if matched is not None and matched in request.sampling.stop:
            return "stop_sequence", matched
        return "end_turn", None
    if reason in ("length", "abort"):
        return "max_tokens", None
    if reason == "content_filter":
        return "refusal", None
    return "end_turn", None


def _usage(completion: Completion, output_tokens: int) -> dict[str, Any]:
    # Anthropic's input_tokens excludes cache reads; the three inputs add up to the prompt.
    cached = completion.cached_tokens or 0
    return {
        "input_tokens": completion.prompt_tokens - cached,
        "output_tokens": output_tokens,
        "cache_creation_input_tokens": 0,
        "cache_read_input_tokens": cached,
    }


def _content_blocks(completion: Completion) -> list[dict[str, Any]]:
    msg = completion.message
    blocks: list[dict[str, Any]] = []
    if msg.reasoning:
        blocks.append({"type": "thinking", "thinking": msg.reasoning, "signature": thinking_signature(msg.reasoning)})
    if msg.content:
        blocks.append({"type": "text", "text": msg.content})
    for call in msg.tool_calls:
        blocks.append(
            {
                "type": "tool_use",
                "id": tool_use_id(call.id),
                "name": call.name,
                "input": arguments_object(call.arguments),
            }
        )
    return blocks


class AnthropicMessagesProvider:
    name = "anthropic_messages"

    def route(self, method: str, path: str) -> Route | None:
        bare = path.split("?", 1)[0].rstrip("/")
        method = method.upper()
        if method == "POST" and bare.endswith("/v1/messages"):
            return Route(kind="generate")
        if method == "POST" and bare.endswith("/v1/messages/count_tokens"):
            return Route(kind="count_tokens")
        if method == "GET" and bare.startswith("/api/"):
            return Route(kind="local", params=_local_answer(bare))
        return None

    def parse_request(self, body: dict[str, Any], route: Route) -> CanonicalRequest:
        body = require_object(body)
        max_tokens = opt_int(body, "max_tokens", minimum=1)
        if max_tokens is None and route.kind != "count_tokens":
            raise invalid("'max_tokens' is required")
        inline_system, conversation = _messages(body.get("messages"))
        request = CanonicalRequest(
            api=self.name,
            model=require_str(body, "model"),
            messages=system_message(_system(body.get("system")) + inline_system) + conversation,
            tools=_tools(body.get("tools")),
            tool_choice=_tool_choice(body.get("tool_choice")),
            sampling=SamplingParams(
                temperature=opt_number(body, "temperature"),
                top_p=opt_number(body, "top_p"),
                top_k=opt_int(body, "top_k"),
                max_tokens=max_tokens,
                stop=_stop_sequences(body.get("stop_sequences")),
            ),
            stream=opt_bool(body, "stream"),
            enable_thinking=_thinking(body.get("thinking")),
        )
        return drop_tool_choice_without_tools(request)

    def render_response(
        self, request: CanonicalRequest, completion: Completion, ctx: ResponseContext
    ) -> dict[str, Any]:
        reason, sequence = stop_reason(request, completion)
        return {
            "id": ctx.response_id,
            "type": "message",
            "role": "assistant",
            "model": ctx.model,
            "content": _content_blocks(completion),
            "stop_reason": reason,
            "stop_sequence": sequence,
            "usage": _usage(completion, completion.completion_tokens),
        }

    def render_stream(
        self, request: CanonicalRequest, completion: Completion, ctx: ResponseContext
    ) -> Iterator[StreamEvent]:
        def event(kind: str, **fields: Any) -> StreamEvent:
            return StreamEvent({"type": kind, **fields}, event=kind)

        start = {
            "id": ctx.response_id,
            "type": "message",
            "role": "assistant",
            "model": ctx.model,
            "content": [],
            "stop_reason": None,
            "stop_sequence": None,
            "usage": _usage(completion, 0),
        }
        yield event("message_start", message=start)
        for index, block in enumerate(_content_blocks(completion)):
            kind = block["type"]
            if kind == "thinking":
                yield event(
                    "content_block_start",
                    index=index,
                    content_block={"type": "thinking", "thinking": "", "signature": ""},
                )
                for piece in pieces(block["thinking"]):
                    yield event("content_block_delta", index=index, delta={"type": "thinking_delta", "thinking": piece})
                yield event(
                    "content_block_delta",
                    index=index,
                    delta={"type": "signature_delta", "signature": block["signature"]},
                )
            elif kind == "text":
                yield event("content_block_start", index=index, content_block={"type": "text", "text": ""})
                for piece in pieces(block["text"]):
                    yield event("content_block_delta", index=index, delta={"type": "text_delta", "text": piece})
            else:
                head = {"type": "tool_use", "id": block["id"], "name": block["name"], "input": {}}
                yield event("content_block_start", index=index, content_block=head)
                for piece in pieces(compact_json(block["input"])):
                    yield event(
                        "content_block_delta", index=index, delta={"type": "input_json_delta", "partial_json": piece}
                    )
            yield event("content_block_stop", index=index)
        reason, sequence = stop_reason(request, completion)
        yield event(
            "message_delta",
            delta={"stop_reason": reason, "stop_sequence": sequence},
            usage=_usage(completion, completion.completion_tokens),
        )
        yield event("message_stop")

    def keepalive(self, request: CanonicalRequest, ctx: ResponseContext) -> bytes:
        return b'event: ping\ndata: {"type": "ping"}\n\n'

    def render_error(self, error: PolarError) -> dict[str, Any]:
        message = error.message
        if isinstance(error, ContextLengthExceeded) and error.counted:
            # Claude Code reads the two numbers out of exactly this shape to decide how much to drop.
            message = f"{PROMPT_TOO_LONG}: {error.prompt_tokens} tokens > {error.window} maximum"
        elif error.kind == "context_length_exceeded" and not message.lower().startswith(PROMPT_TOO_LONG):
            message = f"{PROMPT_TOO_LONG}: {message}"
        return {"type": "error", "error": {"type": _ERROR_TYPES.get(error.kind, "api_error"), "message": message}}

    def render_stream_error(self, error: PolarError, ctx: ResponseContext) -> Iterator[StreamEvent]:
        yield StreamEvent(self.render_error(error), event="error")

    def render_count_tokens(self, count: int) -> dict[str, Any]:
        return {"input_tokens": count}


def _local_answer(path: str) -> dict[str, Any]:
    """Answers for Claude Code's account/config calls; with these it runs with no Anthropic account."""
    if path.endswith("/api/claude_code/policy_limits"):
        return {"status": 200, "body": POLICY_LIMITS_BODY}
    if path.endswith("/api/claude_code/settings"):
        return {"status": 200, "body": REMOTE_SETTINGS_BODY}
    # Claude Code reads 404 on its optional account endpoints as "nothing configured".
    body = {"type": "error", "error": {"type": "not_found_error", "message": f"{path} is not served by polar"}}
    return {"status": 404, "body": body}


PROVIDER = AnthropicMessagesProvider()
