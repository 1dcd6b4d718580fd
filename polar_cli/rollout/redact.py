"""Secrets kept out of what a rollout writes beside the store: the manifest, the summary and the session logs.

Those files outlive the run and are read by people and tools that never needed a credential, and the harness's
output in them is the agent's to choose: it can print its own API key or, on a trusted ``local`` runtime, the
proxy's control token. What is redacted: the secrets the caller knows (the control token, a session's secret),
anything in the shape of a polar credential (``polar:...`` API keys, ``psk-...`` session secrets), ``Bearer``
tokens and passwords in URLs (``scheme://user:PASSWORD@host``, the forward proxy's credentials).
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from polar_addon.identity import SECRET_PREFIX

REDACTED = "<redacted>"
_PATTERNS = (
    (re.compile(r"(?i)(\bbearer\s+)[^\s\"',;]+"), rf"\g<1>{REDACTED}"),
    (re.compile(r"\b(polar:)[^\s\"'@/]+"), rf"\g<1>{REDACTED}"),
    (re.compile(re.escape(SECRET_PREFIX) + r"[A-Za-z0-9_\-]{8,}"), SECRET_PREFIX + REDACTED),
    (re.compile(r"(\b[a-zA-Z][a-zA-Z0-9+.\-]*://[^\s/@:\"']*:)[^\s/@\"']*@"), rf"\g<1>{REDACTED}@"),
)


def redact(text: str, known: Iterable[str | None] = ()) -> str:
    """``text`` with every known secret and every credential-shaped string replaced by ``<redacted>``."""
    # Longest first: a secret that contains another is replaced whole.
    for secret in sorted({s for s in known if s}, key=len, reverse=True):
        text = text.replace(secret, REDACTED)
    for pattern, replacement in _PATTERNS:
        text = pattern.sub(replacement, text)
    return text


def redact_value(value: Any, known: Iterable[str | None] = ()) -> Any:
    """Every string in a JSON-like value redacted (the keys too: a dict keyed by what the agent printed)."""
    known = tuple(known)
    if isinstance(value, str):
        return redact(value, known)
    if isinstance(value, dict):
        return {redact_value(k, known): redact_value(v, known) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [redact_value(v, known) for v in value]
    return value


def write_json(path: Path, value: Any, known: Iterable[str | None] = ()) -> None:
    """``value`` as indented JSON at ``path``, redacted."""
    path.write_text(json.dumps(redact_value(value, known), indent=2) + "\n")


def control_tokens(out: str | None, confdir: Path, given: str | None) -> list[str]:
    """The control tokens a run's files could show: the one given, and the one its started proxy keeps for ``out``
    (next to a local store, else in mitmproxy's confdir)."""
    from polar_addon.control import token_file

    found = [given] if given else []
    if out:
        try:
            found.append(token_file(out, str(confdir)).read_text().strip())
        except OSError:
            pass
    return [t for t in found if t]
