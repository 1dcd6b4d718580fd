"""Tool-call parsers by format, chosen per served model by name.

Engines that decode text themselves (local, scripted, and any engine given token input) turn the
sampled text into an AssistantMessage with one of these; SGLang and vLLM chat endpoints parse
server-side with their own parser of the same name. Names follow vLLM's ``--tool-call-parser``
(SGLang's ``qwen25`` is hermes, its ``qwen3_coder`` the same as vLLM's).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from polar_addon.tool_parsers import hermes, qwen3_coder
from polar_addon.tool_parsers.calls import ParsedTurn, new_call_id

ToolParser = Callable[[str, Sequence[dict[str, Any]]], ParsedTurn]

PARSERS: dict[str, ToolParser] = {
    "hermes": hermes.parse,
    "qwen25": hermes.parse,
    "qwen3_coder": qwen3_coder.parse,
}


def get_parser(name: str) -> ToolParser:
    """The parser registered as ``name``; ValueError naming the known ones otherwise."""
    try:
        return PARSERS[name]
    except KeyError:
        raise ValueError(f"unknown tool-call parser {name!r}; known: {', '.join(sorted(PARSERS))}") from None


class ParserChoice:
    """``polar_tool_parser``: one parser name for every model, or ``MODEL=NAME,...`` per served model (a bare
    NAME among them is the default for the others; hermes when none is given)."""

    def __init__(self, spec: str = "hermes") -> None:
        self.default = "hermes"
        self.by_model: dict[str, str] = {}
        for part in (p.strip() for p in spec.split(",")):
            if not part:
                continue
            model, sep, name = part.rpartition("=")
            get_parser(name.strip())  # an unknown name fails at start, not on the first call
            if sep:
                self.by_model[model.strip()] = name.strip()
            else:
                self.default = name.strip()

    def name_for(self, model: str) -> str:
        return self.by_model.get(model, self.default)

    def for_model(self, model: str) -> ToolParser:
        return get_parser(self.name_for(model))


__all__ = ["PARSERS", "ParsedTurn", "ParserChoice", "ToolParser", "get_parser", "new_call_id"]
