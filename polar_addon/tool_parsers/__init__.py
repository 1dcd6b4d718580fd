"""Tool-call parsers by format, chosen per served model by name.

Engines that decode text themselves (local, scripted, and any engine given token input) turn the
sampled text into an AssistantMessage with one of these; SGLang and vLLM chat endpoints parse
server-side with their own parser of the same name. Names follow vLLM's ``--tool-call-parser``
(SGLang's ``qwen25`` is hermes, its ``qwen3_coder`` the same as vLLM's).

A name may carry opt-in fallbacks, ``hermes+fenced_json``: tried, in order, on the content of a turn in which no call
was found, whoever parsed it (polar, or the engine's server: :meth:`ParserChain.after_engine`). Each turn records
which one produced its calls (``Completion.tool_call_parser``).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any

from polar_addon.canonical import AssistantMessage, ToolCall
from polar_addon.tool_parsers import fenced_json, hermes, qwen3_coder
from polar_addon.tool_parsers.calls import ParsedTurn, new_call_id

ToolParser = Callable[[str, Sequence[dict[str, Any]]], ParsedTurn]
# (content, tools) -> (the content left, the calls found); (content, []) when it found none.
Fallback = Callable[[str | None, Sequence[dict[str, Any]]], tuple[str | None, list[ToolCall]]]

PARSERS: dict[str, ToolParser] = {
    "hermes": hermes.parse,
    "qwen25": hermes.parse,
    "qwen3_coder": qwen3_coder.parse,
}

# Never a parser alone: a fallback only reads a turn its parser found no call in.
FALLBACKS: dict[str, Fallback] = {fenced_json.NAME: fenced_json.extract}
# Recorded as the tool_call_parser of a turn whose calls the engine's server parsed (or a scripted turn gave).
ENGINE = "engine"


def get_parser(name: str) -> ToolParser:
    """The parser registered as ``name``; ValueError naming the known ones otherwise."""
    try:
        return PARSERS[name]
    except KeyError:
        raise ValueError(f"unknown tool-call parser {name!r}; known: {', '.join(sorted(PARSERS))}") from None


@dataclass(frozen=True)
class ParserChain:
    """One model's parsing: ``primary`` (a PARSERS name), then each of ``fallbacks`` (FALLBACKS names) on a turn
    that still has no call."""

    primary: str = "hermes"
    fallbacks: tuple[str, ...] = ()

    @classmethod
    def from_spec(cls, spec: str) -> ParserChain:
        """``NAME`` or ``NAME+FALLBACK+...``; ValueError naming the known ones for anything else."""
        primary, *rest = (p.strip() for p in spec.split("+"))
        if primary in FALLBACKS:
            raise ValueError(f"{primary!r} is a fallback, not a parser: write hermes+{primary} (or another parser)")
        get_parser(primary)
        for name in rest:
            if name not in FALLBACKS:
                raise ValueError(f"unknown tool-call fallback {name!r}; known: {', '.join(sorted(FALLBACKS))}")
        return cls(primary, tuple(rest))

    def __str__(self) -> str:
        return "+".join((self.primary, *self.fallbacks))

    def parse(self, text: str, tools: Sequence[dict[str, Any]] = ()) -> ParsedTurn:
        """Text polar decoded: the primary parser, then the fallbacks; ``parser`` names the one that found calls."""
        turn = get_parser(self.primary)(text, tools)
        if turn.message.tool_calls:
            return replace(turn, parser=self.primary)
        message, parser = self._fall_back(turn.message, tools)
        return replace(turn, message=message, parser=parser)

    def after_engine(
        self, message: AssistantMessage, tools: Sequence[dict[str, Any]]
    ) -> tuple[AssistantMessage, str | None]:
        """A turn the engine's server parsed: its calls as they are (``engine``), else the fallbacks' on its content;
        and who produced the calls (None: nobody)."""
        if message.tool_calls:
            return message, ENGINE
        return self._fall_back(message, tools)

    def _fall_back(
        self, message: AssistantMessage, tools: Sequence[dict[str, Any]]
    ) -> tuple[AssistantMessage, str | None]:
        for name in self.fallbacks:
            content, calls = FALLBACKS[name](message.content, tools)
            if calls:
                return replace(message, content=content, tool_calls=calls), name
        return message, None


class ParserChoice:
    """``polar_tool_parser``: one parser for every model, or ``MODEL=PARSER,...`` per served model (a bare PARSER
    among them is the default for the others; hermes when none is given). A PARSER is a name with optional
    fallbacks, ``hermes+fenced_json``."""

    def __init__(self, spec: str = "hermes") -> None:
        self.default = ParserChain()
        self.by_model: dict[str, ParserChain] = {}
        for part in (p.strip() for p in spec.split(",")):
            if not part:
                continue
            model, sep, name = part.rpartition("=")
            chain = ParserChain.from_spec(name.strip())  # an unknown name fails at start, not on the first call
            if sep:
                self.by_model[model.strip()] = chain
            else:
                self.default = chain

    def chain_for(self, model: str) -> ParserChain:
        return self.by_model.get(model, self.default)

    def name_for(self, model: str) -> str:
        """The primary parser's name (what the engine's server must run for the same format)."""
        return self.chain_for(model).primary

    def for_model(self, model: str) -> ToolParser:
        return self.chain_for(model).parse


__all__ = [
    "ENGINE",
    "FALLBACKS",
    "PARSERS",
    "ParsedTurn",
    "ParserChain",
    "ParserChoice",
    "ToolParser",
    "get_parser",
    "new_call_id",
]
