"""What every tool-call format's parser returns, and the call ids polar mints."""

from __future__ import annotations

import secrets
from dataclasses import dataclass, field

from polar_addon.canonical import AssistantMessage


def new_call_id() -> str:
    return "call_" + secrets.token_hex(12)


@dataclass
class ParsedTurn:
    """One decoded turn: the message, and every call block that did not parse.

    ``failed`` holds each malformed block verbatim; the block also stays in ``message.content``, so a
    client sees what the model wrote and the trajectory can be scored as a failed parse (reward 0 but
    trainable) instead of losing the turn.
    """

    message: AssistantMessage
    failed: list[str] = field(default_factory=list)
    # Which parser found ``message.tool_calls`` (a PARSERS or FALLBACKS name; set by ParserChain); None: no calls.
    parser: str | None = None

    @property
    def parse_failed(self) -> bool:
        return bool(self.failed)
