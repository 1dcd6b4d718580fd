"""Text from a store made safe for a terminal: session ids, harness names (the agent's User-Agent),
reward names and error messages are data, never rich markup or escape sequences."""

from __future__ import annotations

import re

from rich.markup import escape

# C0 and C1 controls (ESC starts ANSI/OSC sequences), DEL, and bidi overrides that reorder what is shown.
_UNSAFE = re.compile("[\x00-\x1f\x7f-\x9f\u200e\u200f\u202a-\u202e\u2066-\u2069]")


def printable(text: object) -> str:
    """``text`` with every control character written as a visible escape (``\\x1b``, ``\\u202e``)."""
    return _UNSAFE.sub(
        lambda m: repr(m.group())[1:-1] if ord(m.group()) < 0x100 else f"\\u{ord(m.group()):04x}", str(text)
    )


def markup_safe(text: object) -> str:
    """``printable(text)`` with rich markup escaped, for strings that rich renders as markup."""
    return escape(printable(text))
