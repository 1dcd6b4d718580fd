"""Google Gemini: ``POST …/models/{model}:generateContent``, ``:streamGenerateContent`` and
``:countTokens`` (the Gemini CLI, google-genai SDKs, Pi's ``google-generative-ai``).

The model is named in the path (``Route.model``). ``streamGenerateContent?alt=sse`` streams SSE
frames, each a whole ``GenerateContentResponse``; without ``alt=sse`` the same chunks come back as
one JSON array, rendered here as a non-streamed answer whose body is that array.

Gemini function calls carry no id unless the client gives one. Calls without one get a stable id
from their position (``call_{content}_{part}``); a ``functionResponse`` without an id answers the
earliest open call of its name. Rendered calls carry the engine's id, which clients echo back.
Function responses are objects; the engine sees them as compact JSON text.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from typing import Any

from polar_addon.canonical import CanonicalRequest, Completion, ContextLengthExceeded, PolarError, SamplingParams
from polar_addon.providers import ResponseContext, Route, StreamEvent
from polar_addon.providers.common import (
    INT32_MAX,
    INT64_MAX,
    arguments_object,
    bounded_int,
    compact_json,
    drop_tool_choice_without_tools,
    invalid,
    pieces,
    stop_list,
    system_message,
)

_PATH = re.compile(r"/models/([^/:]+):(generateContent|streamGenerateContent|countTokens)$")
# User turns are separate paragraphs of one message; a model turn's text parts are fragments
# of one text (a streamed answer is stored as many parts), so they join with nothing.
USER_PART_SEPARATOR = "\n"
MODEL_PART_SEPARATOR = ""
# Gemini schemas spell types as enum names ("OBJECT"); JSON Schema, which chat templates show, in lower case.
_SCHEMA_TYPES = {"STRING", "NUMBER", "INTEGER", "BOOLEAN", "ARRAY", "OBJECT", "NULL"}
# Tools Google runs on its side: no engine here can run them.
HOSTED_TOOLS = (
    "googleSearch",
    "googleSearchRetrieval",
    "codeExecution",
    "urlContext",
    "computerUse",
    "fileSearch",
    "googleMaps",
    "enterpriseWebSearch",
    "retrieval",
)
_FINISH = {
    "stop": "STOP",
    "tool_calls": "STOP",
    "length": "MAX_TOKENS",
    "abort": "MAX_TOKENS",
    "content_filter": "SAFETY",
}
_STATUS = {
    "invalid_request": "INVALID_ARGUMENT",
    "request_too_large": "INVALID_ARGUMENT",
    "authentication": "UNAUTHENTICATED",
    "not_found": "NOT_FOUND",
    "context_length_exceeded": "INVALID_ARGUMENT",
    "overloaded": "UNAVAILABLE",
    "timeout": "DEADLINE_EXCEEDED",
    "api_error": "INTERNAL",
    "storage_unavailable": "UNAVAILABLE",
}


def _get(obj: dict[str, Any], camel: str) -> Any:
    """A field by its JSON (camelCase) name or its proto (snake_case) name; the API takes both."""
    if camel in obj:
        return obj[camel]
    return obj.get(re.sub(r"([A-Z])", lambda m: "_" + m.group(1).lower(), camel))


def _parts(content: Any, where: str) -> list[dict[str, Any]]:
    parts = content.get("parts") if isinstance(content, dict) else None
    if parts is None:
        return []
    if not isinstance(parts, list) or not all(isinstance(p, dict) for p in parts):
        raise invalid(f"{where}: 'parts' must be a list of objects")
    return parts


_SIGNATURE_KEYS = {"thought", "thoughtSignature", "thought_signature"}


def _unsupported(part: dict[str, Any], where: str) -> PolarError:
    kinds = [k for k in part if k not in _SIGNATURE_KEYS]
    if any(k in ("inlineData", "inline_data", "fileData", "file_data") for k in kinds):
        return invalid(f"{where}: inline or file data parts are not supported by this engine (text only)")
    return invalid(f"{where}: unsupported part {kinds!r}")


def _text(part: dict[str, Any], where: str) -> str:
    if not isinstance(part["text"], str):
        raise invalid(f"{where}: 'text' must be a string")
    return part["text"]


def _model_turn(parts: list[dict[str, Any]], index: int, where: str) -> tuple[dict[str, Any], list[tuple[str, str]]]:
    texts: list[str] = []
    thoughts: list[str] = []
    calls: list[dict[str, Any]] = []
    for j, part in enumerate(parts):
        call = _get(part, "functionCall")
        if call is not None:
            if not isinstance(call, dict) or not isinstance(call.get("name"), str):
                raise invalid(f"{where}.parts[{j}]: functionCall needs a string 'name'")
            args = call.get("args") or {}
            if not isinstance(args, dict):
                raise invalid(f"{where}.parts[{j}]: functionCall 'args' must be an object")
            call_id = call.get("id") or f"call_{index}_{j}"
            calls.append(
                {"id": call_id, "type": "function", "function": {"name": call["name"], "arguments": compact_json(args)}}
            )
        elif "text" in part:
            (thoughts if part.get("thought") else texts).append(_text(part, f"{where}.parts[{j}]"))
        elif set(part) <= _SIGNATURE_KEYS:
            continue  # an opaque thought signature on its own: nothing the engine can read
        else:
            raise _unsupported(part, f"{where}.parts[{j}]")
    msg: dict[str, Any] = {"role": "assistant", "content": MODEL_PART_SEPARATOR.join(texts) if texts else None}
    if thoughts:
        msg["reasoning_content"] = MODEL_PART_SEPARATOR.join(thoughts)
    if calls:
        msg["tool_calls"] = calls
    return msg, [(c["id"], c["function"]["name"]) for c in calls]


def _user_turn(
    parts: list[dict[str, Any]], index: int, where: str, open_calls: list[tuple[str, str]]
) -> list[dict[str, Any]]:
    texts: list[str] = []
    results: list[dict[str, Any]] = []
    for j, part in enumerate(parts):
        response = _get(part, "functionResponse")
        if response is not None:
            if not isinstance(response, dict) or not isinstance(response.get("name"), str):
                raise invalid(f"{where}.parts[{j}]: functionResponse needs a string 'name'")
            call_id = response.get("id") or _answer(open_calls, response["name"]) or f"call_{index}_{j}"
            open_calls[:] = [c for c in open_calls if c[0] != call_id]
            results.append(
                {"role": "tool", "tool_call_id": call_id, "content": compact_json(response.get("response") or {})}
            )
        elif "text" in part and not part.get("thought"):
            texts.append(_text(part, f"{where}.parts[{j}]"))
        else:
            raise _unsupported(part, f"{where}.parts[{j}]")
    # Chat templates expect tool results right after the assistant turn that called them.
    if texts or not results:
        return results + [{"role": "user", "content": USER_PART_SEPARATOR.join(texts)}]
    return results


def _answer(open_calls: list[tuple[str, str]], name: str) -> str | None:
    for call_id, call_name in open_calls:
        if call_name == name:
            return call_id
    return None


def _contents(raw: Any) -> list[dict[str, Any]]:
    if not isinstance(raw, list) or not raw:
        raise invalid("'contents' is required and must be a non-empty list")
    out: list[dict[str, Any]] = []
    open_calls: list[tuple[str, str]] = []
    for i, content in enumerate(raw):
        where = f"contents[{i}]"
        if not isinstance(content, dict):
            raise invalid(f"{where} must be an object")
        role = content.get("role") or "user"
        parts = _parts(content, where)
        if role == "model":
            msg, open_calls = _model_turn(parts, i, where)
            out.append(msg)
        elif role in ("user", "function"):
            out.extend(_user_turn(parts, i, where, open_calls))
        else:
            raise invalid(f"{where}: role must be 'user' or 'model', got {role!r}")
    return out


def _system(raw: Any) -> list[str]:
    if raw is None:
        return []
    if isinstance(raw, str):
        return [raw]
    if not isinstance(raw, dict):
        raise invalid("'systemInstruction' must be a Content object")
    texts = []
    for j, part in enumerate(_parts(raw, "systemInstruction")):
        if "text" not in part:
            raise _unsupported(part, f"systemInstruction.parts[{j}]")
        texts.append(_text(part, f"systemInstruction.parts[{j}]"))
    return texts


def json_schema(schema: Any) -> Any:
    """A Gemini ``Schema`` as JSON Schema: enum type names lower-cased, everything else as it is."""
    if isinstance(schema, list):
        return [json_schema(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {}
    for key, value in schema.items():
        if key == "type" and isinstance(value, str) and value in _SCHEMA_TYPES:
            out[key] = value.lower()
        else:
            out[key] = json_schema(value)
    return out


def _tools(raw: Any) -> tuple[list[dict[str, Any]], list[str]]:
    """(canonical function tools, hosted tools left out)."""
    if raw is None:
        return [], []
    if not isinstance(raw, list):
        raise invalid("'tools' must be a list")
    out: list[dict[str, Any]] = []
    hosted: list[str] = []
    for i, tool in enumerate(raw):
        if not isinstance(tool, dict):
            raise invalid(f"tools[{i}] must be an object")
        for key in tool:
            camel = re.sub(r"_([a-z])", lambda m: m.group(1).upper(), key)
            if camel in HOSTED_TOOLS:
                hosted.append(camel)
            elif camel != "functionDeclarations":
                raise invalid(f"tools[{i}]: unsupported tool {key!r}")
        declarations = _get(tool, "functionDeclarations") or []
        if not isinstance(declarations, list):
            raise invalid(f"tools[{i}]: functionDeclarations must be a list")
        for j, decl in enumerate(declarations):
            where = f"tools[{i}].functionDeclarations[{j}]"
            if not isinstance(decl, dict) or not isinstance(decl.get("name"), str):
                raise invalid(f"{where}: 'name' is required")
            params = _get(decl, "parametersJsonSchema")
            if params is None:
                params = json_schema(decl.get("parameters"))
            if params is None:
                params = {"type": "object", "properties": {}}
            if not isinstance(params, dict):
                raise invalid(f"{where}: parameters must be an object")
            fn: dict[str, Any] = {"name": decl["name"]}
            if decl.get("description") is not None:
                fn["description"] = decl["description"]
            fn["parameters"] = params
            out.append({"type": "function", "function": fn})
    return out, hosted


def _tool_choice(raw: Any) -> str | dict[str, Any] | None:
    if raw is None:
        return None
    if not isinstance(raw, dict):
        raise invalid("'toolConfig' must be an object")
    config = _get(raw, "functionCallingConfig")
    if config is None:
        return None
    if not isinstance(config, dict):
        raise invalid("'toolConfig.functionCallingConfig' must be an object")
    mode = str(config.get("mode") or "MODE_UNSPECIFIED").upper()
    allowed = _get(config, "allowedFunctionNames") or []
    if mode == "ANY":
        if isinstance(allowed, list) and len(allowed) == 1 and isinstance(allowed[0], str):
            return {"type": "function", "function": {"name": allowed[0]}}
        return "required"
    if mode == "NONE":
        return "none"
    if mode in ("AUTO", "VALIDATED"):
        return "auto"
    if mode == "MODE_UNSPECIFIED":
        return None
    raise invalid(f"unsupported functionCallingConfig.mode {config.get('mode')!r}")


def _number(config: dict[str, Any], key: str, integer: bool = False, maximum: int = INT32_MAX) -> Any:
    value = _get(config, key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int if integer else (int, float)):
        raise invalid(f"generationConfig.{key} must be {'an integer' if integer else 'a number'}")
    if integer:
        return bounded_int(value, f"generationConfig.{key}", -maximum, maximum)
    return value


def _thinking(config: dict[str, Any]) -> bool | None:
    thinking = _get(config, "thinkingConfig")
    if thinking is None:
        return None
    if not isinstance(thinking, dict):
        raise invalid("generationConfig.thinkingConfig must be an object")
    budget = _get(thinking, "thinkingBudget")
    if budget == 0:
        return False
    if budget is not None or _get(thinking, "thinkingLevel") is not None:
        return True
    return None


def _sampling(config: Any) -> tuple[SamplingParams, bool | None]:
    if config is None:
        config = {}
    if not isinstance(config, dict):
        raise invalid("'generationConfig' must be an object")
    count = _number(config, "candidateCount", integer=True)
    if count not in (None, 1):
        raise invalid("generationConfig.candidateCount > 1 is not supported: one candidate per request")
    max_tokens = _number(config, "maxOutputTokens", integer=True)
    if max_tokens is not None and max_tokens < 1:
        raise invalid("generationConfig.maxOutputTokens must be >= 1")
    temperature = _number(config, "temperature")
    top_p = _number(config, "topP")
    sampling = SamplingParams(
        temperature=None if temperature is None else float(temperature),
        top_p=None if top_p is None else float(top_p),
        top_k=_number(config, "topK", integer=True),
        max_tokens=max_tokens,
        stop=stop_list(_get(config, "stopSequences"), "generationConfig.stopSequences"),
        seed=_number(config, "seed", integer=True, maximum=INT64_MAX),
    )
    return sampling, _thinking(config)


def _parts_out(completion: Completion) -> list[dict[str, Any]]:
    msg = completion.message
    parts: list[dict[str, Any]] = []
    if msg.reasoning:
        parts.append({"text": msg.reasoning, "thought": True})
    if msg.content or not msg.tool_calls:
        parts.append({"text": msg.content or ""})
    for call in msg.tool_calls:
        parts.append({"functionCall": {"id": call.id, "name": call.name, "args": arguments_object(call.arguments)}})
    return parts


def _usage(completion: Completion) -> dict[str, Any]:
    usage: dict[str, Any] = {
        "promptTokenCount": completion.prompt_tokens,
        "candidatesTokenCount": completion.completion_tokens,
        "totalTokenCount": completion.prompt_tokens + completion.completion_tokens,
    }
    if completion.cached_tokens:
        usage["cachedContentTokenCount"] = completion.cached_tokens
    return usage


def _chunk(parts: list[dict[str, Any]], ctx: ResponseContext) -> dict[str, Any]:
    return {
        "candidates": [{"content": {"role": "model", "parts": parts}, "index": 0}],
        "modelVersion": ctx.model,
        "responseId": ctx.response_id,
    }


def _finish(chunk: dict[str, Any], completion: Completion) -> dict[str, Any]:
    chunk["candidates"][0]["finishReason"] = _FINISH.get(completion.finish_reason, "STOP")
    chunk["usageMetadata"] = _usage(completion)
    return chunk


def stream_chunks(completion: Completion, ctx: ResponseContext) -> list[dict[str, Any]]:
    """The streamed answer: text in pieces, function calls whole (as Gemini sends them), and
    finishReason plus usage on the last chunk."""
    groups: list[list[dict[str, Any]]] = []
    calls: list[dict[str, Any]] = []
    for part in _parts_out(completion):
        if "functionCall" in part:
            calls.append(part)
        else:
            thought = {"thought": True} if part.get("thought") else {}
            groups.extend([{"text": piece, **thought}] for piece in pieces(part["text"]))
    if calls:
        groups.append(calls)
    if not groups:
        groups.append([{"text": ""}])
    chunks = [_chunk(parts, ctx) for parts in groups]
    _finish(chunks[-1], completion)
    return chunks


class GeminiProvider:
    name = "gemini"

    def route(self, method: str, path: str) -> Route | None:
        bare, _, query = path.partition("?")
        match = _PATH.search(bare)
        if method.upper() != "POST" or match is None:
            return None
        model, method_name = match.group(1), match.group(2)
        if method_name == "countTokens":
            return Route(kind="count_tokens", model=model)
        streaming = method_name == "streamGenerateContent"
        sse = "alt=sse" in query.split("&")
        return Route(kind="generate", stream_hint=streaming, model=model, params={"sse": sse})

    def parse_request(self, body: dict[str, Any], route: Route) -> CanonicalRequest:
        if not isinstance(body, dict):
            raise invalid("request body must be a JSON object")
        # countTokens takes either the bare contents or a whole generateContentRequest.
        inner = _get(body, "generateContentRequest")
        if route.kind == "count_tokens" and isinstance(inner, dict):
            body = inner
        if not route.model:
            raise invalid("the model must be named in the path: /models/{model}:generateContent")
        tools, hosted = _tools(body.get("tools"))
        sampling, thinking = _sampling(_get(body, "generationConfig"))
        streaming = bool(route.stream_hint)
        extra: dict[str, Any] = {}
        if streaming and not route.params.get("sse"):
            # No alt=sse: the stream's chunks are answered at once as one JSON array.
            extra["json_array"] = True
        if hosted:
            extra["dropped_tools"] = hosted
        request = CanonicalRequest(
            api=self.name,
            model=route.model,
            messages=system_message(_system(_get(body, "systemInstruction"))) + _contents(body.get("contents")),
            tools=tools,
            tool_choice=_tool_choice(_get(body, "toolConfig")),
            sampling=sampling,
            stream=streaming and bool(route.params.get("sse")),
            enable_thinking=thinking,
            extra=extra,
        )
        return drop_tool_choice_without_tools(request)

    def render_response(
        self, request: CanonicalRequest, completion: Completion, ctx: ResponseContext
    ) -> dict[str, Any] | list[dict[str, Any]]:
        if request.extra.get("json_array"):
            return stream_chunks(completion, ctx)
        return _finish(_chunk(_parts_out(completion), ctx), completion)

    def render_stream(
        self, request: CanonicalRequest, completion: Completion, ctx: ResponseContext
    ) -> Iterator[StreamEvent]:
        for chunk in stream_chunks(completion, ctx):
            yield StreamEvent(chunk)

    def keepalive(self, request: CanonicalRequest, ctx: ResponseContext) -> bytes:
        # A blank line: no SSE event, skipped by the Python SDK's line reader, and eaten by the JS
        # SDK's /^\s*data: / frame pattern. A ": comment" line would stall the JS SDK for good
        # (its pattern never matches a buffer that starts with one).
        return b"\n"

    def render_error(self, error: PolarError) -> dict[str, Any]:
        message = error.message
        if isinstance(error, ContextLengthExceeded) and error.counted:
            message = (
                f"The input token count ({error.prompt_tokens}) exceeds the maximum number of tokens "
                f"allowed ({error.window})."
            )
        return {"error": {"code": error.status, "message": message, "status": _STATUS.get(error.kind, "INTERNAL")}}

    def render_stream_error(self, error: PolarError, ctx: ResponseContext) -> Iterator[StreamEvent]:
        yield StreamEvent(self.render_error(error))

    def render_count_tokens(self, count: int) -> dict[str, Any]:
        return {"totalTokens": count}


PROVIDER = GeminiProvider()
