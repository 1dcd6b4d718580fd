"""OpenAI Chat Completions: ``POST …/chat/completions`` (Qwen Code, Pi, generic OpenAI clients)."""

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
    INT64_MAX,
    compact_json,
    content_text,
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
)

# kind -> (OpenAI error type, code)
_ERROR_TYPES: dict[str, tuple[str, str | None]] = {
    "invalid_request": ("invalid_request_error", None),
    "request_too_large": ("invalid_request_error", None),
    "authentication": ("authentication_error", "invalid_api_key"),
    "not_found": ("invalid_request_error", "not_found"),
    "context_length_exceeded": ("invalid_request_error", "context_length_exceeded"),
    "overloaded": ("server_error", "overloaded"),
    "timeout": ("server_error", "timeout"),
    "api_error": ("server_error", None),
    "storage_unavailable": ("server_error", "storage_unavailable"),
}


def _text(content: Any, where: str, allowed: tuple[str, ...] = ("text",)) -> str:
    return content_text(content, where, allowed, unsupported=("image_url", "input_audio", "file"))


def _tool_calls(calls: Any, where: str) -> list[dict[str, Any]]:
    if not isinstance(calls, list):
        raise invalid(f"{where}: tool_calls must be a list")
    out = []
    for call in calls:
        fn = call.get("function") if isinstance(call, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            raise invalid(f"{where}: each tool call needs function.name")
        if not isinstance(call.get("id"), str):
            raise invalid(f"{where}: each tool call needs an 'id'")
        args = fn.get("arguments", "")
        # Some clients send the arguments back as an object rather than JSON text.
        arguments = args if isinstance(args, str) else compact_json(args)
        out.append({"id": call["id"], "type": "function", "function": {"name": fn["name"], "arguments": arguments}})
    return out


def _messages(raw: Any) -> list[dict[str, Any]]:
    if not isinstance(raw, list) or not raw:
        raise invalid("'messages' is required and must be a non-empty list")
    system: list[str] = []
    out: list[dict[str, Any]] = []
    for i, msg in enumerate(raw):
        where = f"messages[{i}]"
        if not isinstance(msg, dict):
            raise invalid(f"{where} must be an object")
        role = msg.get("role")
        if role in ("system", "developer") and not out:
            system.append(_text(msg.get("content"), where))
        elif role in ("system", "developer"):
            # Once the conversation has started, a system message stays where the client put it (gptme sends each
            # tool's output as one): moved into the leading prompt it would change every call's system prompt, the
            # model would read the output out of its turn, and no two calls would share a prefix.
            out.append({"role": "system", "content": _text(msg.get("content"), where)})
        elif role == "user":
            out.append({"role": "user", "content": _text(msg.get("content"), where)})
        elif role == "assistant":
            content = msg.get("content")
            entry: dict[str, Any] = {
                "role": "assistant",
                "content": None if content is None else _text(content, where, ("text", "refusal")),
            }
            reasoning = msg.get("reasoning_content") or msg.get("reasoning")
            if reasoning:
                if not isinstance(reasoning, str):
                    raise invalid(f"{where}: reasoning_content must be a string")
                entry["reasoning_content"] = reasoning
            if msg.get("tool_calls"):
                entry["tool_calls"] = _tool_calls(msg["tool_calls"], where)
            out.append(entry)
        elif role == "tool":
            call_id = msg.get("tool_call_id")
            if not isinstance(call_id, str):
                raise invalid(f"{where}: tool messages need a string 'tool_call_id'")
            out.append({"role": "tool", "tool_call_id": call_id, "content": _text(msg.get("content"), where)})
        else:
            raise invalid(f"{where}: unsupported role {role!r}")
    return system_message(system) + out


def _tools(raw: Any) -> list[dict[str, Any]]:
    if raw is None:
        return []
    if not isinstance(raw, list):
        raise invalid("'tools' must be a list")
    out = []
    for i, tool in enumerate(raw):
        fn = tool.get("function") if isinstance(tool, dict) else None
        if not isinstance(tool, dict) or tool.get("type", "function") != "function":
            raise invalid(f"tools[{i}]: only function tools are supported")
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            raise invalid(f"tools[{i}]: function.name is required")
        out.append({"type": "function", "function": fn})
    return out


def _tool_choice(raw: Any) -> str | dict[str, Any] | None:
    if raw is None or raw in ("auto", "none", "required"):
        return raw
    function = raw.get("function") if isinstance(raw, dict) else None
    if isinstance(function, dict) and isinstance(function.get("name"), str):
        return {"type": "function", "function": {"name": raw["function"]["name"]}}
    raise invalid("'tool_choice' must be 'auto', 'none', 'required' or {type: function, function: {name}}")


class OpenAIChatProvider:
    name = "openai_chat"

    def route(self, method: str, path: str) -> Route | None:
        if method.upper() == "POST" and path.split("?", 1)[0].rstrip("/").endswith("/chat/completions"):
            return Route(kind="generate")
        return None

    def parse_request(self, body: dict[str, Any], route: Route) -> CanonicalRequest:
        body = require_object(body)
        n = opt_int(body, "n", minimum=1)
        if n not in (None, 1):
            raise invalid("'n' > 1 is not supported: one choice per request")
        max_tokens = opt_int(body, "max_completion_tokens", minimum=1)
        if max_tokens is None:
            max_tokens = opt_int(body, "max_tokens", minimum=1)
        stream_options = body.get("stream_options") or {}
        if not isinstance(stream_options, dict):
            raise invalid("'stream_options' must be an object")
        extra: dict[str, Any] = {"include_usage": bool(stream_options.get("include_usage"))}
        # The engine's chat template decides how much to think; recorded so a trace shows what was asked.
        if body.get("reasoning_effort") is not None:
            extra["reasoning_effort"] = body["reasoning_effort"]
        request = CanonicalRequest(
            api=self.name,
            model=require_str(body, "model"),
            messages=_messages(body.get("messages")),
            tools=_tools(body.get("tools")),
            tool_choice=_tool_choice(body.get("tool_choice")),
            sampling=SamplingParams(
                temperature=opt_number(body, "temperature"),
                top_p=opt_number(body, "top_p"),
                top_k=opt_int(body, "top_k"),
                max_tokens=max_tokens,
                stop=stop_list(body.get("stop"), "stop"),
                seed=opt_int(body, "seed", minimum=-INT64_MAX, maximum=INT64_MAX),
            ),
            stream=opt_bool(body, "stream"),
            extra=extra,
        )
        return drop_tool_choice_without_tools(request)

    def render_response(
        self, request: CanonicalRequest, completion: Completion, ctx: ResponseContext
    ) -> dict[str, Any]:
        msg = completion.message
        message: dict[str, Any] = {"role": "assistant", "content": _content(completion)}
        if msg.reasoning:
            message["reasoning_content"] = msg.reasoning
        if msg.tool_calls:
            message["tool_calls"] = [
                {"id": c.id, "type": "function", "function": {"name": c.name, "arguments": c.arguments}}
                for c in msg.tool_calls
            ]
        return {
            "id": ctx.response_id,
            "object": "chat.completion",
            "created": ctx.created,
            "model": ctx.model,
            "choices": [{"index": 0, "message": message, "logprobs": None, "finish_reason": finish_reason(completion)}],
            "usage": _usage(completion),
        }

    def render_stream(
        self, request: CanonicalRequest, completion: Completion, ctx: ResponseContext
    ) -> Iterator[StreamEvent]:
        include_usage = bool(request.extra.get("include_usage"))

        def chunk(delta: dict[str, Any], finish: str | None = None) -> StreamEvent:
            data: dict[str, Any] = {
                "id": ctx.response_id,
                "object": "chat.completion.chunk",
                "created": ctx.created,
                "model": ctx.model,
                "choices": [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}],
            }
            if include_usage:
                data["usage"] = None
            return StreamEvent(data)

        msg = completion.message
        first_content = None if _content(completion) is None else ""
        yield chunk({"role": "assistant", "content": first_content})
        for piece in pieces(msg.reasoning or ""):
            yield chunk({"reasoning_content": piece})
        for piece in pieces(msg.content or ""):
            yield chunk({"content": piece})
        for index, call in enumerate(msg.tool_calls):
            head = {"index": index, "id": call.id, "type": "function", "function": {"name": call.name, "arguments": ""}}
            yield chunk({"tool_calls": [head]})
            for piece in pieces(call.arguments):
                yield chunk({"tool_calls": [{"index": index, "function": {"arguments": piece}}]})
        yield chunk({}, finish_reason(completion))
        if include_usage:
            yield StreamEvent(
                {
                    "id": ctx.response_id,
                    "object": "chat.completion.chunk",
                    "created": ctx.created,
                    "model": ctx.model,
                    "choices": [],
                    "usage": _usage(completion),
                }
            )
        yield StreamEvent("[DONE]")

    def keepalive(self, request: CanonicalRequest, ctx: ResponseContext) -> bytes:
        return b": keep-alive\n\n"

    def render_error(self, error: PolarError) -> dict[str, Any]:
        kind, code = _ERROR_TYPES.get(error.kind, ("server_error", None))
        message = error.message
        if isinstance(error, ContextLengthExceeded) and error.counted:
            # OpenAI's wording: harnesses and SDK users match on "maximum context length".
            message = (
                f"This model's maximum context length is {error.window} tokens. However, your messages "
                f"resulted in {error.prompt_tokens} tokens. Please reduce the length of the messages."
            )
        return {"error": {"message": message, "type": kind, "param": None, "code": code}}

    def render_stream_error(self, error: PolarError, ctx: ResponseContext) -> Iterator[StreamEvent]:
        # The openai SDK raises APIError on a data event carrying "error"; nothing may follow it.
        yield StreamEvent(self.render_error(error))

    def render_count_tokens(self, count: int) -> dict[str, Any]:
        raise NotImplementedError("OpenAI Chat Completions has no token-count route")


def finish_reason(completion: Completion) -> str:
    """OpenAI's finish_reason: a turn that carries tool calls always ends with ``tool_calls``
    (clients run tools only then); an aborted generation is reported as truncated."""
    if completion.message.tool_calls and completion.finish_reason in ("stop", "tool_calls"):
        return "tool_calls"
    if completion.finish_reason == "abort":
        return "length"
    if completion.finish_reason == "tool_calls":
        return "stop"
    return completion.finish_reason


def _content(completion: Completion) -> str | None:
    # Like OpenAI: a tool-call-only turn has content null; a turn without tool calls always has a string.
    content = completion.message.content
    if completion.message.tool_calls:
        return content or None
    return content or ""


def _usage(completion: Completion) -> dict[str, Any]:
    usage: dict[str, Any] = {
        "prompt_tokens": completion.prompt_tokens,
        "completion_tokens": completion.completion_tokens,
        "total_tokens": completion.prompt_tokens + completion.completion_tokens,
    }
    if completion.cached_tokens is not None:
        usage["prompt_tokens_details"] = {"cached_tokens": completion.cached_tokens}
    return usage


PROVIDER = OpenAIChatProvider()
