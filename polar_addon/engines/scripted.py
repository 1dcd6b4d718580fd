"""A scripted test engine (``scripted:SCRIPT.json``) for multi-turn, tool-using sessions.

A tiny random model never decides to call a tool, so tests that need an agent loop replay a
script of assistant turns instead, with genuine tokens and logprobs:

    {"model_dir": "models/tiny",            # relative paths are relative to the script
     "turns": [{"content": "...", "reasoning_content": "...",
                "tool_calls": [{"type": "function", "function": {"name": "ls", "arguments": {...}}}]},
               ...],
     "by_model": {"claude": [turns...]},     # optional: a request for this model replays these turns
     "cycle": true,
     "latency_s": 0.0,                       # optional: each answer takes at least this long
     "max_len": 0,                           # optional: the served window in tokens (0: the model's)
     "summary": "...",                       # optional: the answer to a harness's compaction prompt
     "after_compaction": [...]}              # optional: the turns of a history that starts from a summary

The turn answered is chosen by the number of assistant messages already in the request, so
parallel sessions replaying the same script stay deterministic (with ``cycle`` the script wraps
around; without it a request past the last turn is refused). ``by_model`` lets one proxy drive
several harnesses, each with turns in its own tool names: the request's model picks its list,
any other model gets ``turns`` (which may then be omitted when every request names a listed model).

Tokens go through the real tokenizer and chat template: prompt ids are the templated request;
response ids are what the template renders for the scripted turn after the generation prompt, up
to and including the end-of-turn token; logprobs are the model's log_softmax(logits / T) of those
tokens in one teacher-forced pass, i.e. the behaviour logprobs a trainer recomputes.
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import TYPE_CHECKING, Any

import orjson

from polar_addon.canonical import AssistantMessage, CanonicalRequest, Completion, PolarError, ToolCall
from polar_addon.context_compaction import compaction_prompt, summarised_history
from polar_addon.continuity.delta import DeltaPrompt, NoDelta
from polar_addon.engines.local import LocalEngine
from polar_addon.tool_parsers import ParserChain
from polar_addon.tool_parsers.calls import new_call_id

if TYPE_CHECKING:
    from polar_addon.engines import EngineSettings


def _normalise_turn(turn: Any, index: int) -> dict[str, Any]:
    """An assistant message in OpenAI form with arguments as JSON text."""
    if not isinstance(turn, dict):
        raise ValueError(f"turn {index} is not an object")
    message: dict[str, Any] = {"role": "assistant", "content": turn.get("content")}
    reasoning = turn.get("reasoning_content", turn.get("reasoning"))
    if reasoning:
        message["reasoning_content"] = reasoning
    calls = []
    for call in turn.get("tool_calls") or []:
        fn = call.get("function", call) if isinstance(call, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            raise ValueError(f"turn {index}: tool call without a function name: {call!r}")
        arguments = fn.get("arguments", {})
        if not isinstance(arguments, str):
            arguments = orjson.dumps(arguments).decode()
        calls.append(
            {"id": call.get("id"), "type": "function", "function": {"name": fn["name"], "arguments": arguments}}
        )
    if calls:
        message["tool_calls"] = calls
    if not message["content"] and not calls and not reasoning:
        raise ValueError(f"turn {index} is empty")
    return message


class ScriptedEngine:
    kind = "scripted"

    def __init__(self, script: str | Path) -> None:
        path = Path(script)
        data = orjson.loads(path.read_bytes())
        turns = data.get("turns")
        by_model = data.get("by_model") or {}
        if not isinstance(by_model, dict) or not all(isinstance(t, list) and t for t in by_model.values()):
            raise ValueError(f"{path}: 'by_model' must map model names to non-empty lists of turns")
        if turns is None and by_model:
            turns = []
        elif not isinstance(turns, list) or not turns:
            raise ValueError(f"{path}: 'turns' must be a non-empty list")
        model_dir = Path(data["model_dir"])
        if not model_dir.is_absolute():
            model_dir = path.parent / model_dir
        self.name = f"{self.kind}:{script}"
        self.turns = [_normalise_turn(t, i) for i, t in enumerate(turns)]
        self.by_model = {m: [_normalise_turn(t, i) for i, t in enumerate(ts)] for m, ts in by_model.items()}
        self.cycle = bool(data.get("cycle", True))
        # A floor on each answer's latency: keep-alive tests need an engine that is reliably slow.
        self.latency_s = float(data.get("latency_s", 0.0))
        # A compaction call (context_compaction.compaction_prompt) is answered with this text, whatever turn is due.
        self.summary = data.get("summary")
        # A compacted history holds no assistant turns yet: it replays these instead of starting over.
        self.after_compaction = [_normalise_turn(t, i) for i, t in enumerate(data.get("after_compaction") or [])]
        self.local = LocalEngine(model_dir, max_len=int(data.get("max_len", 0)))

    def configure(self, settings: EngineSettings) -> None:
        self.local.configure(settings)  # its answers are decoded by the local engine

    def load(self) -> None:
        self.local.load()

    def turn_for(self, request: CanonicalRequest) -> dict[str, Any]:
        if self.summary and compaction_prompt(request.messages) is not None:
            return {"role": "assistant", "content": self.summary}
        turns, messages = self.by_model.get(request.model, self.turns), request.messages
        if not turns:
            raise PolarError(400, "invalid_request", f"script has no turns for model {request.model!r}")
        if self.after_compaction and summarised_history(messages) is not None:
            # Counted from the summary on: a harness may re-add turns of its own around it.
            turns = self.after_compaction
            messages = messages[max(i for i, m in enumerate(messages) if summarised_history([m]) is not None) :]
        index = sum(1 for m in messages if m.get("role") == "assistant")
        if index >= len(turns):
            if not self.cycle:
                raise PolarError(
                    400, "invalid_request", f"script has {len(turns)} turns; the request already holds {index}"
                )
            index %= len(turns)
        return turns[index]

    def continuation(self, **kwargs: Any) -> DeltaPrompt | NoDelta:
        return self.local.continuation(**kwargs)

    def _complete_sync(self, request: CanonicalRequest, given_prompt: list[int] | None = None) -> Completion:
        """``given_prompt`` (token input): the scripted turn's tokens are scored, and reported, after exactly it."""
        turn = self.turn_for(request)
        local = self.local
        temperature = request.sampling.effective_temperature()
        with local.lock:
            thinking = request.enable_thinking
            prompt_text = local.render_text(
                request.messages, request.tools, add_generation_prompt=True, enable_thinking=thinking
            )
            full_text = local.render_text(
                request.messages + [turn], request.tools, add_generation_prompt=False, enable_thinking=thinking
            )
            if not full_text.startswith(prompt_text):
                raise PolarError(
                    502,
                    "api_error",
                    "scripted turn: the chat template does not render it as a continuation of the prompt",
                )
            prompt, full = local.encode(prompt_text), local.encode(full_text)
            local.check_context(len(prompt))
            # A model samples its turn after the prompt's tokens. Where the whole render re-tokenizes across the
            # prompt's end (Qwen3 with thinking off: "</think>\n\n" + "a.txt" splits the newlines differently),
            # the turn is its own text's tokens.
            tail = full[len(prompt) :] if full[: len(prompt)] == prompt else local.encode(full_text[len(prompt_text) :])
            if given_prompt is not None:
                prompt = list(given_prompt)
                local.check_context(len(prompt))
            end = next((i for i, token in enumerate(tail) if token in local.eos_ids), None)
            if end is None:
                raise PolarError(502, "api_error", "scripted turn: the chat template rendered no end-of-turn token")
            response = tail[: end + 1]
            max_tokens = request.sampling.max_tokens
            truncated = max_tokens is not None and len(response) > max_tokens
            if truncated:
                response = response[:max_tokens]
            logprobs = local.score(prompt, response, temperature)
            text = local.decode(response) if truncated else ""
            weight_version = local.weight_version
        parse_failures: int | None = None  # a scripted turn is given parsed; only a cut one is decoded and parsed
        # The configured fallbacks (polar_tool_parser hermes+fenced_json) read a scripted turn as they read a turn an
        # engine's server parsed; a cut turn is decoded with hermes, as before, then the same fallbacks, given the
        # request's tools (fenced_json only makes calls of those: without them it never found one).
        chain = local.tool_parsers.chain_for(local.served_model)
        if truncated:
            parsed = ParserChain("hermes", chain.fallbacks).parse(text, request.tools)
            message, finish, parse_failures = parsed.message, "length", len(parsed.failed)
            tool_call_parser = parsed.parser
        else:
            message = AssistantMessage(
                content=turn.get("content"),
                reasoning=turn.get("reasoning_content"),
                tool_calls=[
                    ToolCall(
                        id=c["id"] or new_call_id(), name=c["function"]["name"], arguments=c["function"]["arguments"]
                    )
                    for c in turn.get("tool_calls", [])
                ],
            )
            message, tool_call_parser = chain.after_engine(message, request.tools)
            finish = "tool_calls" if message.tool_calls else "stop"
        return Completion(
            message=message,
            finish_reason=finish,  # type: ignore[arg-type]
            prompt_ids=prompt,
            response_ids=response,
            logprobs=logprobs,
            served_model=local.served_model,
            engine=self.name,
            weight_version=weight_version,
            parse_failures=parse_failures,
            tool_call_parser=tool_call_parser,
        )

    async def complete(self, request: CanonicalRequest) -> Completion:
        completion, _ = await asyncio.gather(
            asyncio.to_thread(self._complete_sync, request), asyncio.sleep(self.latency_s)
        )
        return completion

    async def complete_tokens(self, request: CanonicalRequest, prompt_ids: list[int]) -> Completion:
        completion, _ = await asyncio.gather(
            asyncio.to_thread(self._complete_sync, request, prompt_ids), asyncio.sleep(self.latency_s)
        )
        return completion

    async def count_tokens(self, request: CanonicalRequest) -> int:
        return await self.local.count_tokens(request)

    async def close(self) -> None:
        await self.local.close()
