"""HTTP plumbing shared by the SGLang and vLLM engines: both speak OpenAI Chat Completions with
token-id extras, so the request body, the error mapping and the response parsing live here.

``parse_chat_response`` is a pure function over the engine's JSON: it accepts every shape SGLang
(0.5.x releases and main-branch naming) and vLLM (>= 0.10.2) use for token ids and logprobs, and
refuses (502 api_error) any answer whose ids and logprobs do not line up, because a Completion
with misaligned arrays would silently poison training data.
"""

from __future__ import annotations

import array
import logging
import re
import threading
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

import aiohttp
import numpy as np
import orjson

from polar_addon.canonical import (
    AssistantMessage,
    CanonicalRequest,
    Completion,
    ContextLengthExceeded,
    EngineFault,
    PolarError,
    ToolCall,
    VersionSpan,
)
from polar_addon.continuity.delta import DeltaPrompt, NoDelta, continuation_prompt
from polar_addon.token_ids import IdText, pack_token_ids
from polar_addon.tool_parsers import ENGINE, ParsedTurn, ParserChoice
from polar_addon.tool_parsers.calls import new_call_id
from polar_addon.tool_parsers.reasoning import split_reasoning

if TYPE_CHECKING:
    from polar_addon.engines import EngineSettings

log = logging.getLogger("polar")

_CONTEXT_LENGTH_RE = re.compile(
    r"context length|context window|maximum model length|max_model_len|prompt is too long|too many tokens",
    re.IGNORECASE,
)
# vLLM: "This model's maximum context length is M tokens. However, your prompt contains N input tokens"; its
# scale-out generate endpoint: "The decoder prompt (length N) is longer than the maximum model length of M.";
# SGLang: "The input (N tokens) is longer than the model's context length (M tokens)."
_WINDOW_RES = [
    re.compile(r"maximum context length is (\d+)", re.I),
    re.compile(r"context length \((\d+) tokens\)", re.I),
    re.compile(r"maximum model length of (\d+)", re.I),
]
_AT_LEAST_RE = re.compile(r"at least \d+ input tokens", re.I)
_PROMPT_RES = [
    re.compile(r"(?:contains|has) (?:at least )?(\d+) input tokens", re.I),
    re.compile(r"input \((\d+) tokens\)", re.I),
    re.compile(r"prompt \(length (\d+)\)", re.I),
]
_FINISH_REASONS = {
    "stop": "stop",
    "length": "length",
    "tool_calls": "tool_calls",
    "function_call": "tool_calls",
    "content_filter": "content_filter",
    "abort": "abort",
}


def sampling_body(request: CanonicalRequest) -> dict[str, Any]:
    """The sampling fields every engine request carries (chat, completions)."""
    sampling = request.sampling
    body: dict[str, Any] = {}
    for key in ("max_tokens", "seed"):
        value = getattr(sampling, key)
        if value is not None:
            body[key] = value
    # Every parameter that shapes the distribution is explicit: an omitted one falls back to the model's
    # generation_config.json in SGLang and vLLM (Qwen3: T=0.6, top_p 0.95, top_k 20; Qwen2.5: repetition
    # penalty 1.05), which nothing would record. The gateway fills them (SamplingDefaults); a caller
    # that did not gets the untruncated distribution at T=1.
    body["temperature"] = sampling.effective_temperature()
    body["top_p"] = 1.0 if sampling.top_p is None else sampling.top_p
    body["top_k"] = sampling.top_k if sampling.top_k is not None and sampling.top_k > 0 else -1  # -1: off for both
    body["min_p"] = 0.0 if sampling.min_p is None else sampling.min_p
    body["repetition_penalty"] = 1.0
    if sampling.stop:
        body["stop"] = list(sampling.stop)
    return body


def chat_body(request: CanonicalRequest, model: str) -> dict[str, Any]:
    """The engine-neutral part of the /v1/chat/completions body (non-streaming, logprobs on)."""
    body: dict[str, Any] = {"model": model, "messages": request.messages}
    if request.tools:
        body["tools"] = request.tools
        if request.tool_choice is not None:
            body["tool_choice"] = request.tool_choice
    body.update(sampling_body(request))
    if request.enable_thinking is not None:
        body["chat_template_kwargs"] = {"enable_thinking": request.enable_thinking}
    body["logprobs"] = True
    body["stream"] = False
    return body


def engine_error(status: int, content: bytes) -> PolarError:
    """Map an engine's HTTP error answer to a PolarError, keeping the engine's message."""
    message = error_message(content) or f"engine answered HTTP {status}"
    if status in (429, 503):  # queue full / starting / paused for a weight update: retryable
        return PolarError(503, "overloaded", f"engine busy: {message}")
    if status >= 500:
        return EngineFault(502, "api_error", f"engine error {status}: {message}")
    if _CONTEXT_LENGTH_RE.search(message):
        return ContextLengthExceeded(
            message, prompt_tokens=_first_int(_PROMPT_RES, message), window=_first_int(_WINDOW_RES, message)
        )
    return PolarError(400, "invalid_request", message)


def at_least(err: ContextLengthExceeded) -> bool:
    """The refusal does not say the prompt's real length (vLLM stops tokenizing one token past its window)."""
    return err.prompt_tokens is None or bool(_AT_LEAST_RE.search(err.message))


def _first_int(patterns: list[re.Pattern[str]], text: str) -> int | None:
    for pattern in patterns:
        found = pattern.search(text)
        if found:
            return int(found.group(1))
    return None


def error_message(content: bytes) -> str:
    """The message of an error body: vLLM ``{"error": {...}}``, SGLang ``ErrorResponse``, FastAPI ``detail``."""
    try:
        data = orjson.loads(content)
    except orjson.JSONDecodeError:
        return content.decode("utf-8", "replace").strip()[:2000]
    if isinstance(data, dict):
        inner = data.get("error")
        if isinstance(inner, dict) and inner.get("message"):
            return str(inner["message"])
        if isinstance(inner, str):
            return inner
        if data.get("message"):
            return str(data["message"])
        if "detail" in data:
            detail = data["detail"]
            return detail if isinstance(detail, str) else orjson.dumps(detail).decode()
    return orjson.dumps(data).decode()[:2000]


KEEPALIVE_S = 4.0


class HTTPEngine:
    """An OpenAI-compatible engine server reached over HTTP with one pooled client."""

    kind = "http"

    def __init__(self, url: str, timeout_s: float = 900.0) -> None:
        self.url = url.rstrip("/")
        self.name = f"{self.kind}:{self.url}"
        self.timeout_s = timeout_s
        # aiohttp rather than httpx: ~1 ms less per call on loopback, which is most of the proxy's
        # own budget (bench/proxy_overhead.py). Created on first use, inside the running loop.
        self._session: aiohttp.ClientSession | None = None
        self._model: str | None = None
        self._window: int | None = None
        # Token input (continuity.chains) renders deltas with the served model's own tokenizer and template, read from
        # tokenizer_dir (polar_tokenizer); without it every call is rendered by the engine in full.
        self.tokenizer_dir: str | None = None
        self._tokenizer: Any = None
        self._tokenizer_lock = threading.Lock()
        self.tool_parsers = ParserChoice()
        # The policy version this server holds when it reports none itself (its spec's ?weight_version=V, engines.spec).
        self.weight_version: str | None = None

    def configure(self, settings: EngineSettings) -> None:
        self.tool_parsers = settings.tool_parsers
        self.tokenizer_dir = settings.tokenizer_dir

    def load(self) -> None:
        """Nothing in process: the model is served elsewhere (and may start after the proxy)."""

    def _client(self) -> aiohttp.ClientSession:
        if self._session is None or self._session.closed:
            self._session = aiohttp.ClientSession(
                timeout=aiohttp.ClientTimeout(total=self.timeout_s, connect=min(10.0, self.timeout_s)),
                # Below uvicorn's 5 s keep-alive (vLLM, SGLang): an idle connection is dropped here before the
                # server closes it, which is when a request sent on it meets a reset.
                connector=aiohttp.TCPConnector(limit=256, limit_per_host=256, keepalive_timeout=KEEPALIVE_S),
            )
        return self._session

    async def request_json(self, method: str, path: str, body: dict[str, Any] | None = None) -> Any:
        return self._json(await self.request_bytes(method, path, body))

    def _json(self, content: bytes) -> Any:
        try:
            return orjson.loads(content)
        except orjson.JSONDecodeError as exc:
            log.warning("polar: engine %s answered non-JSON: %r", self.url, content[:200])
            raise PolarError(502, "api_error", "the engine answered non-JSON") from exc

    async def request_bytes(self, method: str, path: str, body: dict[str, Any] | None = None) -> bytes:
        """The body of a successful answer; a PolarError for an HTTP error or an unreachable engine."""
        data = None if body is None else orjson.dumps(body)
        headers = None if body is None else {"content-type": "application/json"}
        try:
            try:
                status, content = await self._send(method, path, data, headers)
            except (aiohttp.ServerDisconnectedError, aiohttp.ClientOSError) as exc:
                # A pooled connection the server closed while the request was on its way (a keep-alive race,
                # seen as 4 in 1280 calls under load): it never reached the engine's handler, so one retry on
                # a fresh connection is safe; at worst the engine samples twice and one answer is kept.
                log.info("polar: engine %s dropped a pooled connection (%r); retrying once", self.url, exc)
                status, content = await self._send(method, path, data, headers)
        # Clients see what went wrong, never where the engine lives: the URL goes to the proxy log only.
        except aiohttp.ServerTimeoutError as exc:  # includes the connect timeout
            if "connect" in str(exc).lower():
                log.warning("polar: engine %s unreachable: connect timeout", self.url)
                raise EngineFault(503, "overloaded", "the engine is unreachable: connect timeout") from exc
            raise PolarError(504, "timeout", f"the engine did not answer within {self.timeout_s:g} s") from exc
        except TimeoutError as exc:
            raise PolarError(504, "timeout", f"the engine did not answer within {self.timeout_s:g} s") from exc
        except aiohttp.ClientError as exc:
            log.warning("polar: engine %s unreachable: %r", self.url, exc)
            # Refused: nothing listens there (the server is gone), unlike a dropped or reset connection.
            refused = isinstance(exc, aiohttp.ClientConnectorError) and isinstance(exc.os_error, ConnectionRefusedError)
            raise EngineFault(
                503, "overloaded", f"the engine is unreachable ({type(exc).__name__})", refused=refused
            ) from exc
        if status >= 400:
            raise engine_error(status, content)
        return content

    async def _send(
        self, method: str, path: str, data: bytes | None, headers: dict[str, str] | None
    ) -> tuple[int, bytes]:
        async with self._client().request(method, self.url + path, data=data, headers=headers) as response:
            return response.status, await response.read()

    async def served_model(self) -> str:
        """The engine's served model name (vLLM rejects any other), read once from /v1/models."""
        if self._model is None:
            data = await self.request_json("GET", "/v1/models")
            try:
                self._model = str(data["data"][0]["id"])
            except (KeyError, IndexError, TypeError) as exc:
                raise PolarError(502, "api_error", "the engine's /v1/models lists no model") from exc
        return self._model

    def extra_body(self) -> dict[str, Any]:
        """Engine-specific request fields asking for token ids."""
        return {}

    def tokenizer(self) -> Any | None:
        """The served model's tokenizer, or None without polar_tokenizer. Call off the event loop."""
        with self._tokenizer_lock:
            if self._tokenizer is None:
                if not self.tokenizer_dir:
                    return None
                from transformers import AutoTokenizer

                self._tokenizer = AutoTokenizer.from_pretrained(self.tokenizer_dir)
            return self._tokenizer

    def continuation(self, **kwargs: Any) -> DeltaPrompt | NoDelta:
        tokenizer = self.tokenizer()
        if tokenizer is None:
            return NoDelta("no tokenizer for the served model (set polar_tokenizer)")
        with self._tokenizer_lock:  # Hugging Face tokenizers are not safe to share across threads
            return continuation_prompt(tokenizer, **kwargs)

    def parse_text(self, request: CanonicalRequest, text: str) -> ParsedTurn:
        """Sampled text (token input: the engine parsed nothing) as content, reasoning and tool calls, with the
        blocks that did not parse."""
        return self.tool_parsers.for_model(self._model or request.model)(text, request.tools)

    async def window(self) -> int:
        """The served window (``max_model_len`` in /v1/models, vLLM and SGLang alike), read once."""
        if self._window is None:
            data = await self.request_json("GET", "/v1/models")
            try:
                self._window = int(data["data"][0]["max_model_len"])
            except (KeyError, IndexError, TypeError, ValueError) as exc:
                raise PolarError(502, "api_error", "the engine's /v1/models gives no max_model_len") from exc
        return self._window

    async def complete_prompt_ids(self, request: CanonicalRequest, prompt_ids: list[int], logprobs: int) -> Completion:
        """``POST /v1/completions`` with the prompt as token ids (vLLM and SGLang 0.5.23 read it the same way):
        ``return_token_ids`` answers with the prompt ids the engine used and the sampled ids, ``logprobs`` one
        ``token_logprobs`` entry per sampled token. The engine parses no tool calls or reasoning there; polar does
        (polar_tool_parser), and counts the blocks it could not read."""
        body: dict[str, Any] = {"model": await self.served_model(), "prompt": list(prompt_ids)}
        body.update(sampling_body(request))
        if request.sampling.max_tokens is None:
            # The completions endpoint reads a missing max_tokens as 16 (both engines), the chat endpoint as the
            # rest of the window: send the rest of the window, as a chat call of the same request gets.
            body["max_tokens"] = max(1, await self.window() - len(prompt_ids))
        body.update(logprobs=logprobs, return_token_ids=True, stream=False)
        data = await self.request_json("POST", "/v1/completions", body)
        text, parsed = parse_completion_response(data)
        return self.text_completion(request, text, parsed)

    def text_completion(self, request: CanonicalRequest, text: str, parsed: ParsedChat) -> Completion:
        """The Completion of sampled text the engine parsed nothing of: polar's tool parser reads it, and counts the
        blocks it could not read."""
        turn = self.parse_text(request, text)
        parsed.message = turn.message
        if parsed.message.tool_calls and parsed.finish_reason == "stop":
            parsed.finish_reason = "tool_calls"
        completion = self._completion(request, parsed)
        completion.parse_failures = len(turn.failed)
        completion.tool_call_parser = turn.parser
        return completion

    def _completion(self, request: CanonicalRequest, parsed: ParsedChat) -> Completion:
        return parsed.to_completion(
            engine=self.name, default_model=self._model or request.model, default_weight_version=self.weight_version
        )

    async def count_tokens(self, request: CanonicalRequest) -> int:
        raise PolarError(501, "invalid_request", f"{self.kind} engines cannot count tokens")

    async def complete(self, request: CanonicalRequest) -> Completion:
        body = chat_body(request, await self.served_model())
        body.update(self.extra_body())
        try:
            content = await self.request_bytes("POST", "/v1/chat/completions", body)
        except ContextLengthExceeded as err:
            if at_least(err):
                # vLLM stops tokenizing one token past its window and says "at least N"; its /tokenize (SGLang's
                # too) counts the whole prompt, so the refused call is recorded, and answered, with its real length.
                try:
                    err.prompt_tokens = await self.count_tokens(request)
                except PolarError as count_err:
                    log.info("polar: could not count a refused prompt on %s: %s", self.url, count_err)
            raise
        cut = cut_prompt_ids(content)
        if cut is None:
            parsed = parse_chat_response(self._json(content))
        else:
            rest, prompt_ids = cut
            parsed = parse_chat_response(self._json(rest), prompt_ids=prompt_ids)
        return self.chat_completion(request, parsed)

    def chat_completion(self, request: CanonicalRequest, parsed: ParsedChat) -> Completion:
        """The Completion of a chat answer the server parsed (its message, ids and logprobs)."""
        # The server parsed the text with its own --tool-call-parser; an opt-in fallback (polar_tool_parser
        # hermes+fenced_json) may still find calls in the content of a turn it found none in. Only the message
        # changes: the sampled ids and logprobs stay the engine's.
        chain = self.tool_parsers.chain_for(self._model or request.model)
        parsed.message, parser = chain.after_engine(split_think(parsed.message), request.tools)
        if parser != ENGINE and parsed.message.tool_calls and parsed.finish_reason == "stop":
            parsed.finish_reason = "tool_calls"
        completion = self._completion(request, parsed)
        completion.tool_call_parser = parser
        return completion

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()


def split_think(message: AssistantMessage) -> AssistantMessage:
    """A server started without a reasoning parser leaves a model's ``<think>`` block in the content. polar's own
    parsers (the token input path, the local engine) split it off as reasoning, so the chat path does the same: a
    session's calls have one message shape whichever path answered them. What the server split stays as it is."""
    if message.reasoning is not None or not message.content:
        return message
    reasoning, content = split_reasoning(message.content)
    if reasoning is None and content == message.content:
        return message
    return replace(message, reasoning=reasoning, content=content)


@dataclass
class ParsedChat:
    message: AssistantMessage
    finish_reason: str
    prompt_ids: Sequence[int]  # an int32 array.array, or the engine's own text of it (IdText)
    response_ids: list[int]
    logprobs: list[float]
    served_model: str | None
    matched_stop: str | None
    weight_version: str | None
    cached_tokens: int | None

    def to_completion(
        self, *, engine: str, default_model: str, default_weight_version: str | None = None
    ) -> Completion:
        return Completion(
            message=self.message,
            finish_reason=self.finish_reason,  # type: ignore[arg-type]
            prompt_ids=self.prompt_ids,
            response_ids=self.response_ids,
            logprobs=self.logprobs,
            served_model=self.served_model or default_model,
            engine=engine,
            matched_stop=self.matched_stop,
            weight_version=_weight_version(self.weight_version, default_weight_version),
            cached_tokens=self.cached_tokens,
        )


# What SGLang reports before any update_weights_from_disk named a version (ServerArgs.weight_version's default).
SGLANG_UNSET_VERSION = "default"


def _weight_version(reported: str | None, configured: str | None) -> str | None:
    """The engine's own tag (SGLang's) wins over the one the proxy was started with (``URL?weight_version=V``),
    except SGLang's placeholder for "never told": an operator's tag says more than that, and a loop cannot bound the
    staleness of a call tagged "default"."""
    if reported is None or (reported == SGLANG_UNSET_VERSION and configured is not None):
        return configured
    return reported


def _bad(message: str) -> PolarError:
    return PolarError(502, "api_error", f"malformed engine answer: {message}")


def _packed(value: Any, what: str) -> bytes | None:
    if value is None:
        return None
    if not isinstance(value, list):
        raise _bad(f"{what} is not a list of token ids")
    try:
        packed = pack_token_ids(value, what)  # also the cheapest full check (one C pass)
    except (TypeError, ValueError) as exc:
        raise _bad(f"{what} is not a list of token ids ({exc})") from None
    # int32 admits negatives, which no vocabulary has: recorded, they would crash the trainer's embedding lookup
    # long after the call, and continued, the engine's next prompt.
    if packed and int(np.frombuffer(packed, np.int32).min()) < 0:
        raise _bad(f"{what} holds a negative token id")
    return packed


def _int_list(value: Any, what: str) -> list[int] | None:
    return None if _packed(value, what) is None else value


def _id_array(value: Any, what: str) -> array.array | None:
    packed = _packed(value, what)
    if packed is None:
        return None
    ids = array.array("i")
    ids.frombytes(packed)
    return ids


_PROMPT_KEY = b'"prompt_token_ids"'
_COLON_BRACKET = re.compile(rb"\s*:\s*\[")


def cut_prompt_ids(content: bytes) -> tuple[bytes, IdText] | None:
    """The answer with its prompt id array emptied, and that array's text; None: use the general path.

    The prompt ids stay text (see polar_addon.token_ids). Applies only to an answer with exactly one
    ``"prompt_token_ids"`` key holding a compact flat array of non-negative integers, which is what vLLM's
    and SGLang's encoders write; anything else is read by the general path, which checks everything. The
    key cannot match inside a JSON string, where quotes are escaped.
    """
    key = content.find(_PROMPT_KEY)
    if key < 0 or content.find(_PROMPT_KEY, key + 1) >= 0:
        return None
    opening = _COLON_BRACKET.match(content, key + len(_PROMPT_KEY))
    if opening is None:
        return None
    start = opening.end()
    end = content.find(b"]", start)
    if end < 0:
        return None
    ids = IdText.parse(content[start:end])
    if ids is None:
        return None
    return content[:start] + content[end:], ids


def _float_list(values: list[Any], what: str) -> list[float]:
    out: list[float] = []
    for v in values:
        if not isinstance(v, (int, float)) or isinstance(v, bool):
            raise _bad(f"{what} holds a non-number logprob {v!r}")
        out.append(float(v))
    return out


def _first_of_nested(value: Any) -> Any:
    """sglext ids: a flat list (one prompt) or a list per choice; take choice 0."""
    if isinstance(value, list) and value and isinstance(value[0], list):
        return value[0]
    return value


def _tool_calls(raw: Any) -> list[ToolCall]:
    if not raw:
        return []
    if not isinstance(raw, list):
        raise _bad("message.tool_calls is not a list")
    calls: list[ToolCall] = []
    for item in raw:
        fn = item.get("function") if isinstance(item, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            raise _bad(f"tool call without a function name: {item!r}")
        arguments = fn.get("arguments")
        if arguments is None:
            arguments = "{}"
        elif not isinstance(arguments, str):
            # SGLang's FunctionResponse allows an object; the canonical form is JSON text.
            arguments = orjson.dumps(arguments).decode()
        calls.append(ToolCall(id=item.get("id") or new_call_id(), name=fn["name"], arguments=arguments))
    return calls


def _first_choice(data: Any) -> dict[str, Any]:
    if not isinstance(data, dict):
        raise _bad("not a JSON object")
    choices = data.get("choices")
    if not isinstance(choices, list) or not choices or not isinstance(choices[0], dict):
        raise _bad("no choices")
    return choices[0]


def parse_completion_response(data: Any) -> tuple[str, ParsedChat]:
    """A vLLM or SGLang ``/v1/completions`` answer to a token prompt (``return_token_ids``, ``logprobs``): the sampled
    text, and everything else as for a chat answer (its message left empty for the caller's tool parser)."""
    choice = _first_choice(data)
    text = choice.get("text")
    if not isinstance(text, str):
        raise _bad("choices[0].text missing")
    prompt_ids = _id_array(choice.get("prompt_token_ids"), "choices[0].prompt_token_ids")
    if not prompt_ids:
        raise _bad("no prompt token ids (is the engine new enough to return them?)")
    response_ids = _int_list(choice.get("token_ids"), "choices[0].token_ids")
    if response_ids is None:
        raise _bad("no response token ids")
    block = choice.get("logprobs")
    values = block.get("token_logprobs") if isinstance(block, dict) else None
    if not isinstance(values, list):
        raise _bad("no logprobs (was logprobs honoured?)")
    logprobs = _float_list(values, "choices[0].logprobs.token_logprobs")
    usage = data.get("usage")
    details = usage.get("prompt_tokens_details") if isinstance(usage, dict) else None
    cached = details.get("cached_tokens") if isinstance(details, dict) else None
    metadata = data.get("metadata")  # SGLang: {"weight_version": ...}
    weight_version = metadata.get("weight_version") if isinstance(metadata, dict) else None
    # vLLM: stop_reason; SGLang: matched_stop.
    matched = choice.get("matched_stop", choice.get("stop_reason"))
    return text, _sampled(data, choice, prompt_ids, response_ids, logprobs, matched, weight_version, cached)


def _sampled(
    data: dict[str, Any],
    choice: dict[str, Any],
    prompt_ids: Sequence[int],
    response_ids: list[int],
    logprobs: list[float],
    matched: Any,
    weight_version: Any = None,
    cached: Any = None,
) -> ParsedChat:
    """A token-level answer (completions, generate) as a ParsedChat with an empty message, its arrays checked."""
    if len(logprobs) != len(response_ids):
        raise _bad(f"{len(logprobs)} logprobs for {len(response_ids)} response tokens")
    finish = _FINISH_REASONS.get(str(choice.get("finish_reason")))
    if finish is None:
        raise _bad(f"unknown finish_reason {choice.get('finish_reason')!r}")
    return ParsedChat(
        message=AssistantMessage(),
        finish_reason=finish,
        prompt_ids=prompt_ids,
        response_ids=response_ids,
        logprobs=logprobs,
        served_model=data.get("model") if isinstance(data.get("model"), str) else None,
        matched_stop=matched if isinstance(matched, str) else None,  # an int is a stop token id, not a string
        weight_version=str(weight_version) if weight_version is not None else None,
        cached_tokens=int(cached) if isinstance(cached, int) else None,
    )


def parse_version_spans(raw: Any, tokens: int, configured: str | None) -> list[VersionSpan]:
    """vLLM's ``weight_versions`` (scale-out generate) over ``tokens`` response tokens, checked: contiguous spans from
    0 to ``tokens``, each a non-empty range with a string version. ``default`` (vLLM's version before anyone set one)
    reads as ``configured`` when there is one. A response of no tokens has no spans."""
    if raw is None:
        if tokens == 0:
            return []
        raise _bad("no weight_versions (is the server started with --enable-scale-out?)")
    if not isinstance(raw, list):
        raise _bad("weight_versions is not a list")
    spans: list[VersionSpan] = []
    reach = 0
    for item in raw:
        if not isinstance(item, dict):
            raise _bad(f"weight_versions entry {item!r} is not an object")
        version, start, end = item.get("version"), item.get("start"), item.get("end")
        if not isinstance(version, str) or not version:
            raise _bad(f"weight_versions entry {item!r} has no version")
        if not all(isinstance(v, int) and not isinstance(v, bool) for v in (start, end)):
            raise _bad(f"weight_versions entry {item!r} has non-integer bounds")
        if start != reach or end <= start:
            raise _bad(f"weight_versions do not cover the response tokens in order ({raw!r})")
        if version == SGLANG_UNSET_VERSION and configured is not None:
            version = configured
        if spans and spans[-1].version == version:
            spans[-1] = VersionSpan(version, spans[-1].start, end)
        else:
            spans.append(VersionSpan(version, start, end))
        reach = end
    if reach != tokens:
        raise _bad(f"weight_versions cover {reach} of {tokens} response tokens")
    return spans


def parse_generate_response(data: Any) -> tuple[str | None, ParsedChat, Any]:
    """A vLLM ``/inference/v1/generate`` answer (``return_token_ids``, logprobs 0): its text (``output_mode: text``;
    None for ``tokens``), everything a chat answer gives (an empty message, for the caller's parser), and the
    choice's raw ``weight_versions``."""
    choice = _first_choice(data)
    text = choice.get("text")
    if text is not None and not isinstance(text, str):
        raise _bad("choices[0].text is not text")
    prompt_ids = _id_array(data.get("prompt_token_ids"), "prompt_token_ids")
    if not prompt_ids:
        raise _bad("no prompt token ids (was return_token_ids honoured?)")
    response_ids = _int_list(choice.get("token_ids"), "choices[0].token_ids")
    if response_ids is None:
        raise _bad("no response token ids")
    block = choice.get("logprobs")
    entries = block.get("content") if isinstance(block, dict) else None
    if not isinstance(entries, list) or not all(isinstance(e, dict) and "logprob" in e for e in entries):
        raise _bad("no logprobs (was logprobs honoured?)")
    logprobs = _float_list([e["logprob"] for e in entries], "choices[0].logprobs.content")
    parsed = _sampled(data, choice, prompt_ids, response_ids, logprobs, choice.get("stop_reason"))
    return text, parsed, choice.get("weight_versions")


def parse_chat_response(data: Any, prompt_ids: Sequence[int] | None = None) -> ParsedChat:
    """Read a non-streaming chat completion with token ids from SGLang or vLLM.

    ``prompt_ids``: the prompt already cut out of the answer (``cut_prompt_ids``), else it is read here.

    Prompt ids: ``choices[0].prompt_token_ids`` (SGLang), ``choices[0].input_token_ids``,
    top-level ``prompt_token_ids`` (vLLM), ``sglext.input_ids``.
    Response ids: ``choices[0].response_token_ids`` (SGLang 0.5.23), ``choices[0].token_ids``
    (vLLM, SGLang main), ``sglext.output_ids[0]``, else the ids inside
    ``choices[0].meta_info.output_token_logprobs`` ``[logprob, id, text]`` triples.
    Logprobs: the triples when present (they carry their own ids, which must equal the response
    ids), else ``choices[0].logprobs.content[].logprob`` (must have one entry per id).
    """
    choice = _first_choice(data)
    message = choice.get("message")
    if not isinstance(message, dict):
        raise _bad("choices[0].message missing")
    meta = choice.get("meta_info") if isinstance(choice.get("meta_info"), dict) else {}
    sglext = data.get("sglext") if isinstance(data.get("sglext"), dict) else {}

    for value, what in (
        (choice.get("prompt_token_ids"), "choices[0].prompt_token_ids"),
        (choice.get("input_token_ids"), "choices[0].input_token_ids"),
        (data.get("prompt_token_ids"), "prompt_token_ids"),
        (_first_of_nested(sglext.get("input_ids")), "sglext.input_ids"),
    ):
        if prompt_ids:
            break
        prompt_ids = _id_array(value, what)
    if not prompt_ids:
        raise _bad("no prompt token ids (is the engine new enough to return them?)")

    explicit_ids = None
    for key in ("response_token_ids", "token_ids"):
        if choice.get(key) is not None:
            explicit_ids = _int_list(choice[key], f"choices[0].{key}")
            break
    if explicit_ids is None:
        explicit_ids = _int_list(_first_of_nested(sglext.get("output_ids")), "sglext.output_ids")

    triples = meta.get("output_token_logprobs")
    meta_ids: list[int] | None = None
    meta_logprobs: list[float] | None = None
    if triples is not None:
        if not isinstance(triples, list) or not all(isinstance(t, list) and len(t) >= 2 for t in triples):
            raise _bad("meta_info.output_token_logprobs is not a list of [logprob, id, text]")
        meta_ids = _int_list([t[1] for t in triples], "meta_info.output_token_logprobs ids")
        meta_logprobs = _float_list([t[0] for t in triples], "meta_info.output_token_logprobs")

    content_logprobs: list[float] | None = None
    lp_block = choice.get("logprobs")
    if isinstance(lp_block, dict) and isinstance(lp_block.get("content"), list):
        entries = lp_block["content"]
        if not all(isinstance(e, dict) and "logprob" in e for e in entries):
            raise _bad("choices[0].logprobs.content entries without logprob")
        content_logprobs = _float_list([e["logprob"] for e in entries], "choices[0].logprobs.content")

    if explicit_ids is not None:
        response_ids = explicit_ids
        if meta_ids is not None:
            if meta_ids != explicit_ids:
                raise _bad("meta_info.output_token_logprobs ids differ from the response token ids")
            logprobs = meta_logprobs
        elif content_logprobs is not None:
            logprobs = content_logprobs
        else:
            raise _bad("no logprobs (was logprobs=true honoured?)")
    elif meta_ids is not None:
        response_ids, logprobs = meta_ids, meta_logprobs
    else:
        raise _bad("no response token ids")
    assert logprobs is not None
    if len(logprobs) != len(response_ids):
        raise _bad(f"{len(logprobs)} logprobs for {len(response_ids)} response tokens")

    raw_finish = choice.get("finish_reason")
    if raw_finish is None and isinstance(meta.get("finish_reason"), dict):
        raw_finish = meta["finish_reason"].get("type")
    finish = _FINISH_REASONS.get(str(raw_finish))
    if finish is None:
        raise _bad(f"unknown finish_reason {raw_finish!r}")
    calls = _tool_calls(message.get("tool_calls"))
    if calls and finish == "stop":
        # vLLM reports "stop" for a named tool_choice; the call is what the client must act on.
        finish = "tool_calls"

    matched = choice.get("matched_stop", choice.get("stop_reason"))
    if matched is None and isinstance(meta.get("finish_reason"), dict):
        matched = meta["finish_reason"].get("matched")
    # An int is a stop token id (EOS or stop_token_ids), not a stop string.
    matched_stop = matched if isinstance(matched, str) else None

    weight_version = meta.get("weight_version")
    metadata = data.get("metadata")
    if weight_version is None and isinstance(metadata, dict):
        weight_version = metadata.get("weight_version")
    cached = meta.get("cached_tokens")
    usage = data.get("usage")
    if cached is None and isinstance(usage, dict) and isinstance(usage.get("prompt_tokens_details"), dict):
        cached = usage["prompt_tokens_details"].get("cached_tokens")

    reasoning = message.get("reasoning_content")
    if reasoning is None:
        reasoning = message.get("reasoning")
    content = message.get("content")
    return ParsedChat(
        message=AssistantMessage(
            content=content if isinstance(content, str) else None,
            reasoning=reasoning if isinstance(reasoning, str) and reasoning else None,
            tool_calls=calls,
        ),
        finish_reason=finish,
        prompt_ids=prompt_ids,
        response_ids=response_ids,
        logprobs=logprobs,
        served_model=data.get("model") if isinstance(data.get("model"), str) else None,
        matched_stop=matched_stop,
        weight_version=str(weight_version) if weight_version is not None else None,
        cached_tokens=int(cached) if isinstance(cached, int) else None,
    )
