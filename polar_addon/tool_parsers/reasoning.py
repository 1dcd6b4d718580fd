"""``<think>`` blocks: the reasoning convention every Qwen-family format shares.

The opening tag may be missing (Qwen3 templates put it in the generation prompt), so everything
before ``</think>`` is reasoning. An unclosed ``<think>`` at the start (generation cut off while
thinking) makes the whole rest reasoning; a ``<think>`` after other text is ordinary text.
"""

from __future__ import annotations

THINK_OPEN = "<think>"
THINK_CLOSE = "</think>"


def split_reasoning(text: str) -> tuple[str | None, str]:
    """Return (reasoning or None, the text after the reasoning block)."""
    close = text.find(THINK_CLOSE)
    if close >= 0:
        head = text[:close]
        open_at = head.find(THINK_OPEN)
        if open_at >= 0:
            head = head[open_at + len(THINK_OPEN) :]
        return head.strip() or None, text[close + len(THINK_CLOSE) :].lstrip()
    open_at = text.find(THINK_OPEN)
    if open_at >= 0 and not text[:open_at].strip():
        return text[open_at + len(THINK_OPEN) :].strip() or None, ""
    return None, text
