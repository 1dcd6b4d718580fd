"""OpenAI Responses: ``POST …/responses`` (Codex, Pi's ``openai-responses``, the openai SDK).

Input items become canonical chat messages:

- ``instructions`` and every ``system``/``developer`` message form the one leading system message.
- ``reasoning``, assistant ``message``, ``function_call`` and ``custom_tool_call`` items in a row form
  one assistant message (reasoning_content, content, tool_calls); ``function_call_output`` and
  ``custom_tool_call_output`` become ``tool`` messages.

Freeform (``custom``) tools, such as Codex's ``apply_patch``, have no JSON arguments. The engine
sees each as a function tool with a single required string parameter ``input`` (the tool's grammar,
when it has one, is in that parameter's description); a ``custom_tool_call`` in the history is shown
to the engine as arguments ``{"input": …}``, and the engine's call of such a tool goes back to the
client as a ``custom_tool_call`` whose ``input`` is that string. Tools grouped in a ``namespace``
tool are shown flattened as ``NAMESPACE.NAME`` and go back as ``function_call`` items carrying
``namespace`` (Codex dispatches them only that way). Hosted tools (web search, file search, …) run
on OpenAI's side, which no engine here can do: they are left out and named in ``extra``.

Every input item type Codex 0.171 sends is accepted: ``additional_tools`` (its tool list, with the default
model, instead of ``tools``) and ``tool_search_output`` add their tools to the tool list;
``local_shell_call`` and ``tool_search_call`` are tool calls of that name; items with nothing readable
(hosted tool results, encrypted compactions, bookkeeping: :data:`DROPPED_ITEMS`) are left out and named in
``extra.dropped_items``.

``previous_response_id``: the gateway is stateless, but Codex's WebSocket transport sends only the
new items and points at its previous response. The provider keeps the full item history of recent
responses (:class:`ResponseHistory`, an LRU keyed by response id) and prepends it on such requests,
whatever ``store`` says (the WebSocket connection is Codex's store).

A generation cut short by ``max_output_tokens`` ends with ``response.completed`` carrying
``status: "incomplete"`` and ``incomplete_details``: Codex treats the ``response.incomplete`` event
as a failed turn and retries it, which would stop an agent whose turns are capped for training.
"""

from __future__ import annotations

import logging
import threading
import weakref
from collections import OrderedDict
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import orjson

from polar_addon.canonical import CanonicalRequest, Completion, ContextLengthExceeded, PolarError, SamplingParams
from polar_addon.context_compaction import POLAR_COMPACTION_PROMPT, decode_summary, encode_summary, summary_message
from polar_addon.providers import ResponseContext, Route, StreamEvent, encode_sse
from polar_addon.providers.common import (
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
    system_message,
)

# Separate items merged into one assistant turn (two reasoning items, two assistant messages).
ITEM_SEPARATOR = "\n\n"
NAMESPACE_SEPARATOR = "."
CUSTOM_INPUT = "input"
# Responses remembered for previous_response_id; a Codex session needs only its latest one.
HISTORY_SIZE = 4096
# Bytes of remembered history, overall and per session (see ResponseHistory).
HISTORY_BYTES = 1024 * 1024 * 1024
SESSION_HISTORY_BYTES = 128 * 1024 * 1024

log = logging.getLogger("polar")

# Tool types that run on OpenAI's side; an engine can neither run them nor call them.
HOSTED_TOOLS = frozenset(
    {
        "web_search",
        "web_search_preview",
        "web_search_preview_2025_03_11",
        "file_search",
        "code_interpreter",
        "image_generation",
        "computer_use_preview",
        "computer_use",
        "local_shell",
        "shell",
        "apply_patch",
        "mcp",
        "tool_search",
    }
)

# Input items that hold nothing an engine can read: results of OpenAI-hosted tools, OpenAI's encrypted
# compaction summaries and markers, Codex's own bookkeeping. Left out and named in extra.dropped_items.
DROPPED_ITEMS = frozenset(
    {
        "web_search_call",
        "image_generation_call",
        "compaction",
        "compaction_summary",
        "compaction_trigger",
        "context_compaction",
        "configuration_update",
        "ghost_snapshot",
    }
)

# kind -> (OpenAI error type, code). Codex reads the code: context_length_exceeded makes it
# compact or stop, anything else is retried.
_ERROR_TYPES: dict[str, tuple[str, str | None]] = {
    "invalid_request": ("invalid_request_error", None),
    "request_too_large": ("invalid_request_error", None),
    "authentication": ("authentication_error", "invalid_api_key"),
    "not_found": ("invalid_request_error", "not_found"),
    "previous_response_not_found": ("invalid_request_error", "previous_response_not_found"),
    "context_length_exceeded": ("invalid_request_error", "context_length_exceeded"),
    "overloaded": ("server_error", "server_is_overloaded"),
    "timeout": ("server_error", "timeout"),
    "api_error": ("server_error", "server_error"),
    "storage_unavailable": ("server_error", "storage_unavailable"),
}


@dataclass
class _Remembered:
    items: list[dict[str, Any]]
    session: str | None
    cost: int  # bytes this response's whole history took to arrive (its chain of bodies and outputs)
    prewarm: bool


class ResponseHistory:
    """Full input+output items of recent responses, for requests naming a ``previous_response_id``.

    Entries share the item dicts with the requests they came from (lists of references, no copies),
    so a long Codex session costs one list per turn, not one copy of its history per turn.

    Bounded by count, by bytes overall and by bytes per session (issue 11: 40 chained 2.4 MB messages grew
    the proxy by 2 GB). An entry's cost is what its whole history took to arrive, counted once per entry, an
    over-estimate of what sharing actually keeps alive, so the bounds hold whatever the sharing. The least
    recently used entries go first; a session's own oldest entries go first when it is over its share. A
    session keeps at most one prewarm (``generate: false``) entry, so prewarms never grow the history.
    Thread-safe: large requests are parsed on a worker thread.
    """

    def __init__(
        self, size: int = HISTORY_SIZE, max_bytes: int = HISTORY_BYTES, session_bytes: int = SESSION_HISTORY_BYTES
    ) -> None:
        self.size = size
        self.max_bytes = max_bytes
        self.session_bytes = session_bytes
        self._items: OrderedDict[str, _Remembered] = OrderedDict()
        self._by_session: dict[str | None, OrderedDict[str, None]] = {}
        self._session_cost: dict[str | None, int] = {}
        self.total_bytes = 0
        self._lock = threading.Lock()

    def remember(
        self,
        response_id: str,
        items: list[dict[str, Any]],
        *,
        session: str | None = None,
        cost: int = 0,
        prewarm: bool = False,
    ) -> None:
        with self._lock:
            if cost > self.session_bytes or cost > self.max_bytes:
                log.warning(
                    "polar: response %s (%d bytes of history) is over the history bound; "
                    "a request continuing from it will get previous_response_not_found",
                    response_id,
                    cost,
                )
                return
            self._drop(response_id)
            if prewarm:
                for old in [r for r in self._by_session.get(session, ()) if self._items[r].prewarm]:
                    self._drop(old)
            self._items[response_id] = _Remembered(items, session, cost, prewarm)
            self._by_session.setdefault(session, OrderedDict())[response_id] = None
            self._session_cost[session] = self._session_cost.get(session, 0) + cost
            self.total_bytes += cost
            own = self._by_session[session]
            while self._session_cost[session] > self.session_bytes:
                self._drop(next(iter(own)))
            while len(self._items) > self.size or self.total_bytes > self.max_bytes:
                self._drop(next(iter(self._items)))

    def _drop(self, response_id: str) -> None:
        entry = self._items.pop(response_id, None)
        if entry is None:
            return
        own = self._by_session[entry.session]
        del own[response_id]
        self._session_cost[entry.session] -= entry.cost
        self.total_bytes -= entry.cost
        if not own:
            del self._by_session[entry.session]
            del self._session_cost[entry.session]

    def get(self, response_id: str) -> list[dict[str, Any]] | None:
        entry = self.entry(response_id)
        return None if entry is None else entry.items

    def entry(self, response_id: str) -> _Remembered | None:
        with self._lock:
            entry = self._items.get(response_id)
            if entry is not None:
                self._items.move_to_end(response_id)
                self._by_session[entry.session].move_to_end(response_id)
            return entry

    def __len__(self) -> int:
        return len(self._items)


# ---------------------------------------------------------------- request: items -> messages


def _item_type(item: dict[str, Any]) -> Any:
    # EasyInputMessage ({"role", "content"}) carries no type.
    return item.get("type", "message" if "role" in item else None)


def _content_text(content: Any, where: str, allowed: tuple[str, ...]) -> str:
    return content_text(content, where, allowed, unsupported=("input_image", "input_file", "input_audio"))


def _reasoning_text(item: dict[str, Any], where: str) -> str:
    """The readable reasoning of a reasoning item: its raw ``content`` when present (what our
    engines produced), else its summary. ``encrypted_content`` is OpenAI's and unreadable here."""
    for key, kind in (("content", "reasoning_text"), ("summary", "summary_text")):
        parts = item.get(key) or []
        if not isinstance(parts, list):
            raise invalid(f"{where}: reasoning '{key}' must be a list")
        texts = []
        for part in parts:
            if not isinstance(part, dict) or not isinstance(part.get("text"), str):
                raise invalid(f"{where}: reasoning {key} parts need a string 'text'")
            if part.get("type", kind) not in ("reasoning_text", "summary_text", "text"):
                raise invalid(f"{where}: unsupported reasoning part type {part.get('type')!r}")
            texts.append(part["text"])
        if texts:
            return ITEM_SEPARATOR.join(texts)
    return ""


def _output_text(output: Any, where: str) -> str:
    # function_call_output.output is a string or a list of input content parts.
    return _content_text(output, where, ("input_text", "output_text", "text"))


def _call_id(item: dict[str, Any], where: str) -> str:
    value = item.get("call_id")
    if not isinstance(value, str) or not value:
        raise invalid(f"{where}: '{item.get('type')}' needs a string 'call_id'")
    return value


def _name(item: dict[str, Any], where: str) -> str:
    value = item.get("name")
    if not isinstance(value, str) or not value:
        raise invalid(f"{where}: '{item.get('type')}' needs a string 'name'")
    return value


def flat_name(namespace: str | None, name: str) -> str:
    return f"{namespace}{NAMESPACE_SEPARATOR}{name}" if namespace else name


def _conversation(items: list[Any], tools: _Tools) -> tuple[list[str], list[dict[str, Any]]]:
    """(system texts, canonical messages without the system message) for a list of input items.

    Tools that items make available (``additional_tools``, ``tool_search_output``) are added to ``tools``;
    items nothing here can read are named in ``tools.dropped_items``.
    """
    system: list[str] = []
    out: list[dict[str, Any]] = []
    turn: dict[str, Any] | None = None  # the assistant message consecutive items are merged into

    def assistant() -> dict[str, Any]:
        nonlocal turn
        if turn is None:
            turn = {"role": "assistant", "content": None}
            out.append(turn)
        return turn

    def append(msg: dict[str, Any], key: str, text: str) -> None:
        msg[key] = text if msg.get(key) is None else msg[key] + ITEM_SEPARATOR + text

    for i, item in enumerate(items):
        where = f"input[{i}]"
        if not isinstance(item, dict):
            raise invalid(f"{where} must be an object")
        kind = _item_type(item)
        if kind == "message":
            role = item.get("role")
            if role in ("system", "developer"):
                # Each part is its own paragraph of the system message (Codex sends sections as parts).
                content = item.get("content")
                parts = content if isinstance(content, list) else [content]
                system.extend(_content_text([p] if isinstance(p, dict) else p, where, ("input_text",)) for p in parts)
            elif role == "user":
                turn = None
                out.append({"role": "user", "content": _content_text(item.get("content"), where, ("input_text",))})
            elif role == "assistant":
                text = _content_text(item.get("content"), where, ("output_text", "input_text", "refusal"))
                append(assistant(), "content", text)
            else:
                raise invalid(f"{where}: unsupported role {role!r}")
        elif kind == "reasoning":
            text = _reasoning_text(item, where)
            if text:
                append(assistant(), "reasoning_content", text)
        elif kind == "additional_tools":
            # Codex (0.171, default model) sends its whole tool list this way, not in 'tools'.
            raw = item.get("tools")
            if not isinstance(raw, list):
                raise invalid(f"{where}: additional_tools needs a list 'tools'")
            _add_tools(tools, raw, f"{where}.tools")
        elif kind in ("local_shell_call", "tool_search_call"):
            # Calls of OpenAI's built-in tools in the history: shown to the engine as calls of a tool of that
            # name, with the action (or search arguments) as arguments; their outputs follow as tool messages.
            call_id = _call_id(item, where)
            payload = item.get("action") if kind == "local_shell_call" else item.get("arguments")
            arguments = payload if isinstance(payload, str) else compact_json(payload or {})
            name = "local_shell" if kind == "local_shell_call" else "tool_search"
            call = {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}
            assistant().setdefault("tool_calls", []).append(call)
        elif kind == "tool_search_output":
            # The tools a search loaded become callable from here on.
            raw = item.get("tools") or []
            if not isinstance(raw, list):
                raise invalid(f"{where}: tool_search_output 'tools' must be a list")
            _add_tools(tools, raw, f"{where}.tools")
            if item.get("call_id") is not None:
                turn = None
                names = [flat_name(None, t.get("name", "")) for t in raw if isinstance(t, dict)]
                out.append({"role": "tool", "tool_call_id": _call_id(item, where), "content": compact_json(names)})
        elif kind == "agent_message":
            # A message from another agent of a Codex multi-agent run: it reaches this agent as input.
            turn = None
            text = _content_text(item.get("content"), where, ("input_text", "output_text", "text"))
            out.append({"role": "user", "content": text})
        elif kind == "compaction" and decode_summary(item.get("encrypted_content")) is not None:
            # polar's own compaction item (a summary the engine wrote): the engine reads the summary.
            turn = None
            out.append(summary_message(decode_summary(item["encrypted_content"]) or ""))
        elif kind in DROPPED_ITEMS:
            tools.dropped_items.append(kind)
        elif kind in ("function_call", "custom_tool_call"):
            call_id, name = _call_id(item, where), _name(item, where)
            if kind == "function_call":
                args = item.get("arguments", "")
                arguments = args if isinstance(args, str) else compact_json(args)
                name = flat_name(item.get("namespace"), name)
            else:
                text = item.get("input", "")
                if not isinstance(text, str):
                    raise invalid(f"{where}: custom_tool_call 'input' must be a string")
                arguments = compact_json({CUSTOM_INPUT: text})
            call = {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}
            assistant().setdefault("tool_calls", []).append(call)
        elif kind in ("function_call_output", "custom_tool_call_output"):
            turn = None
            out.append(
                {
                    "role": "tool",
                    "tool_call_id": _call_id(item, where),
                    "content": _output_text(item.get("output"), where),
                }
            )
        elif kind == "item_reference":
            raise invalid(
                f"{where}: item_reference needs server-side item storage, which polar does not keep; "
                "send the item itself"
            )
        else:
            raise invalid(f"{where}: unsupported input item type {kind!r}")
    return system, out


def _input_items(raw: Any) -> list[Any]:
    if isinstance(raw, str):
        return [{"type": "message", "role": "user", "content": raw}]
    if not isinstance(raw, list):
        raise invalid("'input' is required and must be a string or a list of items")
    return raw


def _instructions(raw: Any) -> list[str]:
    if raw is None:
        return []
    if isinstance(raw, str):
        return [raw]
    if isinstance(raw, list):  # instructions may also be a list of input messages
        system, rest = _conversation(raw, _Tools())
        if rest:
            raise invalid("'instructions' may hold only system or developer messages")
        return system
    raise invalid("'instructions' must be a string or a list of messages")


# ---------------------------------------------------------------- request: tools


def _custom_description(tool: dict[str, Any]) -> str:
    fmt = tool.get("format") or {}
    if isinstance(fmt, dict) and fmt.get("type") == "grammar" and isinstance(fmt.get("definition"), str):
        return f"The raw input of this tool, written in this {fmt.get('syntax', '')} grammar:\n{fmt['definition']}"
    return "The raw input of this tool (free text)."


def _function_tool(tool: dict[str, Any], name: str, where: str) -> dict[str, Any]:
    params = tool.get("parameters")
    if params is None:
        params = {"type": "object", "properties": {}}
    if not isinstance(params, dict):
        raise invalid(f"{where}: 'parameters' must be an object")
    fn: dict[str, Any] = {"name": name}
    if tool.get("description") is not None:
        fn["description"] = tool["description"]
    fn["parameters"] = params
    return {"type": "function", "function": fn}


def _custom_tool(tool: dict[str, Any], name: str) -> dict[str, Any]:
    fn: dict[str, Any] = {"name": name}
    if tool.get("description") is not None:
        fn["description"] = tool["description"]
    fn["parameters"] = {
        "type": "object",
        "properties": {CUSTOM_INPUT: {"type": "string", "description": _custom_description(tool)}},
        "required": [CUSTOM_INPUT],
        "additionalProperties": False,
    }
    return {"type": "function", "function": fn}


@dataclass
class _Tools:
    tools: list[dict[str, Any]] = field(default_factory=list)
    custom: list[str] = field(default_factory=list)  # engine names of custom (freeform) tools
    namespaces: dict[str, str] = field(default_factory=dict)  # engine name -> namespace
    hosted: list[str] = field(default_factory=list)  # hosted tool types left out
    dropped_items: list[str] = field(default_factory=list)  # input item types nothing here can read


def _tools(raw: Any) -> _Tools:
    found = _Tools()
    if raw is None:
        return found
    if not isinstance(raw, list):
        raise invalid("'tools' must be a list")
    _add_tools(found, raw, "tools")
    return found


def _add_tools(found: _Tools, raw: list[Any], where_prefix: str) -> None:
    """Add ``raw`` tool definitions to ``found``; a name already there keeps its first definition."""
    known = {t["function"]["name"] for t in found.tools}

    def add(tool: Any, where: str, namespace: str | None) -> None:
        if not isinstance(tool, dict):
            raise invalid(f"{where} must be an object")
        kind = tool.get("type")
        if not isinstance(kind, str):
            raise invalid(f"{where}: 'type' must be a string")
        if kind in ("function", "custom"):
            name = flat_name(namespace, _name(tool, where))
            if name in known:
                return
            known.add(name)
            if kind == "function":
                found.tools.append(_function_tool(tool, name, where))
            else:
                found.tools.append(_custom_tool(tool, name))
                found.custom.append(name)
            if namespace:
                found.namespaces[name] = namespace
        elif kind == "namespace" and namespace is None:
            inner = tool.get("tools")
            if not isinstance(inner, list):
                raise invalid(f"{where}: namespace tools need a list 'tools'")
            for j, member in enumerate(inner):
                add(member, f"{where}.tools[{j}]", _name(tool, where))
        elif kind in HOSTED_TOOLS:
            found.hosted.append(kind)
        else:
            raise invalid(f"{where}: unsupported tool type {kind!r}")

    for i, tool in enumerate(raw):
        add(tool, f"{where_prefix}[{i}]", None)


def _tool_choice(raw: Any) -> str | dict[str, Any] | None:
    if raw is None or raw in ("auto", "none", "required"):
        return raw
    if isinstance(raw, dict):
        kind = raw.get("type")
        if kind in ("function", "custom") and isinstance(raw.get("name"), str):
            return {"type": "function", "function": {"name": flat_name(raw.get("namespace"), raw["name"])}}
        if kind == "allowed_tools" and raw.get("mode") in ("auto", "required"):
            # The engine cannot restrict itself to a subset; the mode is what it can honour.
            return raw["mode"]
    raise invalid(
        "'tool_choice' must be 'auto', 'none', 'required', {type: function|custom, name} or {type: allowed_tools, mode}"
    )


def _reasoning(raw: Any) -> tuple[bool | None, bool]:
    """(enable_thinking, whether the client asked for reasoning summaries)."""
    if raw is None:
        return None, False
    if not isinstance(raw, dict):
        raise invalid("'reasoning' must be an object")
    effort = raw.get("effort")
    thinking = None if effort is None else effort != "none"
    summary = raw.get("summary") or raw.get("generate_summary")
    return thinking, summary not in (None, "none")


# ---------------------------------------------------------------- response


def _suffix(ctx: ResponseContext) -> str:
    return ctx.response_id.removeprefix("resp_")


def custom_input(arguments: str) -> str:
    """The freeform input of an engine call to a custom tool (see the module docstring).

    Arguments that are not ``{"input": str}`` (the model named the key differently or wrote no
    JSON at all) are passed on as they are, so the harness shows the model its own mistake."""
    try:
        value = orjson.loads(arguments)
    except orjson.JSONDecodeError:
        return arguments
    if isinstance(value, dict):
        if isinstance(value.get(CUSTOM_INPUT), str):
            return value[CUSTOM_INPUT]
        strings = [v for v in value.values() if isinstance(v, str)]
        if len(value) == 1 and strings:
            return strings[0]
    return arguments


def _status(completion: Completion) -> str:
    return "incomplete" if completion.finish_reason in ("length", "abort") else "completed"


def overflow_message(error: PolarError) -> str:
    """OpenAI's own words for an input over the window, with the engine's counts when known."""
    if not isinstance(error, ContextLengthExceeded):
        return error.message
    counts = (
        f" ({error.prompt_tokens} input tokens > {error.window} maximum)" if error.counted else f" ({error.message})"
    )
    return f"Your input exceeds the context window of this model.{counts} Please adjust your input and try again."


def compaction_item(completion: Completion, ctx: ResponseContext) -> dict[str, Any]:
    """The opaque item Codex keeps in place of the compacted turns (it sends it back in later inputs)."""
    summary = (completion.message.content or "").strip()
    return {"id": f"cmp_{_suffix(ctx)}", "type": "compaction", "encrypted_content": encode_summary(summary)}


def output_items(request: CanonicalRequest, completion: Completion, ctx: ResponseContext) -> list[dict[str, Any]]:
    if request.extra.get("compaction"):
        return [compaction_item(completion, ctx)]
    msg = completion.message
    suffix = _suffix(ctx)
    status = _status(completion)
    items: list[dict[str, Any]] = []
    if msg.reasoning:
        summary = [{"type": "summary_text", "text": msg.reasoning}] if request.extra.get("reasoning_summary") else []
        items.append(
            {
                "id": f"rs_{suffix}",
                "type": "reasoning",
                "summary": summary,
                "content": [{"type": "reasoning_text", "text": msg.reasoning}],
                "encrypted_content": None,
            }
        )
    if msg.content or not msg.tool_calls:
        items.append(
            {
                "id": f"msg_{suffix}",
                "type": "message",
                "role": "assistant",
                "status": status,
                "content": [{"type": "output_text", "text": msg.content or "", "annotations": [], "logprobs": []}],
            }
        )
    custom = set(request.extra.get("custom_tools") or ())
    namespaces: dict[str, str] = request.extra.get("namespaced_tools") or {}
    for index, call in enumerate(msg.tool_calls):
        if call.name in custom:
            item: dict[str, Any] = {
                "id": f"ctc_{suffix}_{index}",
                "type": "custom_tool_call",
                "status": "completed",
                "call_id": call.id,
                "name": call.name,
                "input": custom_input(call.arguments),
            }
        else:
            item = {
                "id": f"fc_{suffix}_{index}",
                "type": "function_call",
                "status": "completed",
                "call_id": call.id,
                "name": call.name,
                "arguments": call.arguments,
            }
        namespace = namespaces.get(call.name)
        if namespace:
            item.update(namespace=namespace, name=call.name[len(namespace) + len(NAMESPACE_SEPARATOR) :])
        items.append(item)
    return items


def usage(completion: Completion) -> dict[str, Any]:
    return {
        "input_tokens": completion.prompt_tokens,
        "input_tokens_details": {"cached_tokens": completion.cached_tokens or 0, "cache_write_tokens": 0},
        "output_tokens": completion.completion_tokens,
        # The engine reports one token stream; how much of it was reasoning is not counted apart.
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": completion.prompt_tokens + completion.completion_tokens,
    }


def response_object(request: CanonicalRequest, ctx: ResponseContext, status: str) -> dict[str, Any]:
    """The Response object with the request's settings echoed, before output and usage are known."""
    s = request.sampling
    echo = request.extra
    return {
        "id": ctx.response_id,
        "object": "response",
        "created_at": ctx.created,
        "status": status,
        "error": None,
        "incomplete_details": None,
        "instructions": None,
        "max_output_tokens": s.max_tokens,
        "model": ctx.model,
        "output": [],
        "parallel_tool_calls": echo.get("parallel_tool_calls", True),
        "previous_response_id": echo.get("previous_response_id"),
        "reasoning": {"effort": echo.get("reasoning_effort"), "summary": echo.get("reasoning_summary")},
        "store": echo.get("store", True),
        "temperature": s.temperature,
        "text": {"format": {"type": "text"}},
        "tool_choice": _echo_tool_choice(request.tool_choice),
        "tools": [],
        "top_p": s.top_p,
        "truncation": "disabled",
        "usage": None,
        "metadata": {},
    }


def _echo_tool_choice(choice: str | dict[str, Any] | None) -> str | dict[str, Any]:
    if isinstance(choice, dict):
        return {"type": "function", "name": choice["function"]["name"]}
    return choice or "auto"


def _final_response(
    request: CanonicalRequest, completion: Completion, ctx: ResponseContext, items: list[dict[str, Any]]
) -> dict[str, Any]:
    status = _status(completion)
    response = response_object(request, ctx, status)
    response["output"] = items
    response["usage"] = usage(completion)
    if status == "incomplete":
        response["incomplete_details"] = {"reason": "max_output_tokens"}
    return response


# ctx.stream_state key: the next sequence number once keep-alives have sent the prelude.
_NEXT_SEQUENCE = "next_sequence_number"


class _Sequencer:
    """Numbers one stream's events; resumes where keep-alives left off."""

    def __init__(self, start: int) -> None:
        self.n = start

    def __call__(self, kind: str, **fields: Any) -> StreamEvent:
        event = StreamEvent({"type": kind, "sequence_number": self.n, **fields}, event=kind)
        self.n += 1
        return event


@dataclass
class _Pending:
    items: list[dict[str, Any]]
    session: str | None
    cost: int


class OpenAIResponsesProvider:
    name = "openai_responses"
    # Codex treats only a streamed response.failed with code context_length_exceeded as "context window
    # exceeded" (an HTTP 400 is a plain invalid request): a streaming call that overflows gets that stream.
    overflow_in_stream = True

    def __init__(self, history_size: int = HISTORY_SIZE) -> None:
        self.history = ResponseHistory(history_size)
        # Full input items of parsed requests, until their response is rendered and remembered
        # (keyed by the request object's id; dropped when the request object is collected).
        self._inputs: dict[int, _Pending] = {}

    def route(self, method: str, path: str) -> Route | None:
        bare = path.split("?", 1)[0].rstrip("/")
        if method.upper() != "POST":
            return None
        if bare.endswith("/responses"):
            return Route(kind="generate")
        if bare.endswith("/responses/input_tokens"):
            return Route(kind="count_tokens")
        if bare.endswith("/responses/compact"):
            return Route(kind="compact")
        return None

    def parse_request(self, body: dict[str, Any], route: Route) -> CanonicalRequest:
        body = require_object(body)
        previous = body.get("previous_response_id")
        history: list[dict[str, Any]] = []
        base_cost = 0
        if previous is not None:
            if not isinstance(previous, str):
                raise invalid("'previous_response_id' must be a string")
            found = self.history.entry(previous)
            if found is None:
                raise PolarError(
                    400, "previous_response_not_found", f"Previous response with id '{previous}' not found."
                )
            history, base_cost = found.items, found.cost
        items = history + _input_items(body.get("input"))
        # Codex's remote compaction: POST /responses/compact (v1), or a call whose input ends with a
        # compaction_trigger item (v2). Either way the engine writes the summary.
        compaction = "remote_v1" if route.kind == "compact" else None
        if items and isinstance(items[-1], dict) and items[-1].get("type") == "compaction_trigger":
            compaction = "remote_v2"
        tools = _tools(body.get("tools"))
        system, conversation = _conversation(items, tools)
        if compaction is not None:
            conversation.append({"role": "user", "content": POLAR_COMPACTION_PROMPT})
        reasoning = body.get("reasoning") or {}
        enable_thinking, summary = _reasoning(body.get("reasoning"))
        extra: dict[str, Any] = {
            "store": body.get("store") is not False,
            "parallel_tool_calls": body.get("parallel_tool_calls") is not False,
            "reasoning_summary": reasoning.get("summary") or reasoning.get("generate_summary") if summary else None,
        }
        if previous is not None:
            extra["previous_response_id"] = previous
        if compaction is not None:
            extra["compaction"] = compaction
        if reasoning.get("effort") is not None:
            extra["reasoning_effort"] = reasoning["effort"]
        if tools.custom:
            extra["custom_tools"] = tools.custom
        if tools.namespaces:
            extra["namespaced_tools"] = tools.namespaces
        if tools.hosted:
            extra["dropped_tools"] = tools.hosted
        if tools.dropped_items:
            extra["dropped_items"] = tools.dropped_items
        request = CanonicalRequest(
            api=self.name,
            model=require_str(body, "model"),
            messages=system_message(_instructions(body.get("instructions")) + system) + conversation,
            tools=tools.tools,
            # A summary is text: the compaction call keeps the tools (the prompt stays a prefix) but calls none.
            tool_choice="none" if compaction is not None else _tool_choice(body.get("tool_choice")),
            sampling=SamplingParams(
                temperature=opt_number(body, "temperature"),
                top_p=opt_number(body, "top_p"),
                max_tokens=opt_int(body, "max_output_tokens", minimum=1),
            ),
            stream=opt_bool(body, "stream") and compaction != "remote_v1",
            enable_thinking=enable_thinking,
            extra=extra,
        )
        key = id(request)
        self._inputs[key] = _Pending(items, route.session, base_cost + route.body_bytes)
        weakref.finalize(request, self._inputs.pop, key, None)
        return drop_tool_choice_without_tools(request)

    def remember(
        self, request: CanonicalRequest, response_id: str, output: list[dict[str, Any]], *, prewarm: bool = False
    ) -> None:
        """Keep ``request``'s items plus ``output`` as the history of ``response_id``."""
        pending = self._inputs.get(id(request)) or _Pending([], None, 0)
        cost = pending.cost + (len(orjson.dumps(output)) if output else 0)
        self.history.remember(response_id, pending.items + output, session=pending.session, cost=cost, prewarm=prewarm)

    def render_response(
        self, request: CanonicalRequest, completion: Completion, ctx: ResponseContext
    ) -> dict[str, Any]:
        items = output_items(request, completion, ctx)
        if request.extra.get("compaction") == "remote_v1":
            return {"output": self._compacted_window(request) + items}
        self.remember(request, ctx.response_id, items)
        return _final_response(request, completion, ctx, items)

    def _compacted_window(self, request: CanonicalRequest) -> list[dict[str, Any]]:
        """What /responses/compact keeps besides the compaction item: the user's own messages, as sent."""
        pending = self._inputs.get(id(request))
        items = pending.items if pending is not None else []
        return [
            i
            for i in items
            if isinstance(i, dict) and i.get("type", "message") == "message" and i.get("role") == "user"
        ]

    def _prelude(self, request: CanonicalRequest, ctx: ResponseContext, seq: _Sequencer) -> Iterator[StreamEvent]:
        start = response_object(request, ctx, "in_progress")
        yield seq("response.created", response=start)
        yield seq("response.in_progress", response=start)

    def _sequencer(self, request: CanonicalRequest, ctx: ResponseContext) -> tuple[_Sequencer, list[StreamEvent]]:
        """The stream's numbering, and the prelude events still to send (none when keep-alives sent it)."""
        resumed = ctx.stream_state.get(_NEXT_SEQUENCE)
        if resumed is not None:
            return _Sequencer(resumed), []
        seq = _Sequencer(0)
        return seq, list(self._prelude(request, ctx, seq))

    def render_stream(
        self, request: CanonicalRequest, completion: Completion, ctx: ResponseContext
    ) -> Iterator[StreamEvent]:
        items = output_items(request, completion, ctx)
        self.remember(request, ctx.response_id, items)
        seq, prelude = self._sequencer(request, ctx)
        return self._events(request, completion, ctx, items, seq, prelude)

    def _events(
        self,
        request: CanonicalRequest,
        completion: Completion,
        ctx: ResponseContext,
        items: list[dict[str, Any]],
        seq: _Sequencer,
        prelude: list[StreamEvent],
    ) -> Iterator[StreamEvent]:
        yield from prelude
        for index, item in enumerate(items):
            kind = item["type"]
            at = {"item_id": item["id"], "output_index": index}
            if kind == "reasoning":
                yield seq("response.output_item.added", output_index=index, item={**item, "summary": [], "content": []})
                for s_index, part in enumerate(item["summary"]):
                    yield seq(
                        "response.reasoning_summary_part.added",
                        **at,
                        summary_index=s_index,
                        part={"type": "summary_text", "text": ""},
                    )
                    for piece in pieces(part["text"]):
                        yield seq("response.reasoning_summary_text.delta", **at, summary_index=s_index, delta=piece)
                    yield seq("response.reasoning_summary_text.done", **at, summary_index=s_index, text=part["text"])
                    yield seq("response.reasoning_summary_part.done", **at, summary_index=s_index, part=part)
                for c_index, part in enumerate(item["content"]):
                    yield seq(
                        "response.content_part.added",
                        **at,
                        content_index=c_index,
                        part={"type": "reasoning_text", "text": ""},
                    )
                    for piece in pieces(part["text"]):
                        yield seq("response.reasoning_text.delta", **at, content_index=c_index, delta=piece)
                    yield seq("response.reasoning_text.done", **at, content_index=c_index, text=part["text"])
                    yield seq("response.content_part.done", **at, content_index=c_index, part=part)
            elif kind == "message":
                yield seq(
                    "response.output_item.added",
                    output_index=index,
                    item={**item, "status": "in_progress", "content": []},
                )
                for c_index, part in enumerate(item["content"]):
                    yield seq("response.content_part.added", **at, content_index=c_index, part={**part, "text": ""})
                    for piece in pieces(part["text"]):
                        yield seq("response.output_text.delta", **at, content_index=c_index, delta=piece, logprobs=[])
                    yield seq("response.output_text.done", **at, content_index=c_index, text=part["text"], logprobs=[])
                    yield seq("response.content_part.done", **at, content_index=c_index, part=part)
            elif kind == "function_call":
                yield seq(
                    "response.output_item.added",
                    output_index=index,
                    item={**item, "status": "in_progress", "arguments": ""},
                )
                for piece in pieces(item["arguments"]):
                    yield seq("response.function_call_arguments.delta", **at, delta=piece)
                yield seq("response.function_call_arguments.done", **at, name=item["name"], arguments=item["arguments"])
            elif kind == "compaction":
                yield seq("response.output_item.added", output_index=index, item=item)
            else:  # custom_tool_call
                yield seq(
                    "response.output_item.added",
                    output_index=index,
                    item={**item, "status": "in_progress", "input": ""},
                )
                for piece in pieces(item["input"]):
                    yield seq("response.custom_tool_call_input.delta", **at, delta=piece)
                yield seq("response.custom_tool_call_input.done", **at, input=item["input"])
            yield seq("response.output_item.done", output_index=index, item=item)
        yield seq("response.completed", response=_final_response(request, completion, ctx, items))

    def keepalive(self, request: CanonicalRequest, ctx: ResponseContext) -> bytes:
        """Keep-alive bytes for one stream while the engine works.

        Codex's SSE reader restarts its idle timer only on a dispatched event (comments are not
        events), and the openai SDK's stream helper requires ``response.created`` first. So the
        first keep-alive is the stream's real prelude (``response.created``, ``response.in_progress``)
        and each later one repeats ``response.in_progress``: a valid event every client accepts
        in that place. Numbering continues in :meth:`render_stream` through ``ctx.stream_state``.
        """
        start = ctx.stream_state.get(_NEXT_SEQUENCE)
        if start is None:
            seq = _Sequencer(0)
            events = list(self._prelude(request, ctx, seq))
        else:
            seq = _Sequencer(start)
            events = [seq("response.in_progress", response=response_object(request, ctx, "in_progress"))]
        ctx.stream_state[_NEXT_SEQUENCE] = seq.n
        return b"".join(encode_sse(e) for e in events)

    def render_error(self, error: PolarError) -> dict[str, Any]:
        kind, code = _ERROR_TYPES.get(error.kind, ("server_error", "server_error"))
        param = "previous_response_id" if error.kind == "previous_response_not_found" else None
        return {"error": {"message": overflow_message(error), "type": kind, "param": param, "code": code}}

    def render_stream_error(self, error: PolarError, ctx: ResponseContext) -> Iterator[StreamEvent]:
        """``response.failed`` (after the prelude, when keep-alives have not sent it yet)."""
        request = CanonicalRequest(api=self.name, model=ctx.model, messages=[])
        seq, prelude = self._sequencer(request, ctx)
        yield from prelude
        failed = response_object(request, ctx, "failed")
        _, code = _ERROR_TYPES.get(error.kind, ("server_error", "server_error"))
        failed["error"] = {"code": code, "message": overflow_message(error)}
        yield seq("response.failed", response=failed)

    def render_count_tokens(self, count: int) -> dict[str, Any]:
        return {"object": "response.input_tokens", "input_tokens": count}


PROVIDER = OpenAIResponsesProvider()
