"""Session identity with no change to the harness.

Precedence (first that gives a session wins; task/group/sample are taken from the same source):

1. Proxy credentials in ``HTTPS_PROXY=http://SESSION[:FIELDS]@127.0.0.1:PORT`` (the harness's proxy
   client sends them as ``Proxy-Authorization: Basic ...`` on CONNECT).
2. Headers ``x-polar-session``, ``x-polar-task``, ``x-polar-group``, ``x-polar-sample``.
3. The API key the harness sends (``Authorization: Bearer``, ``x-api-key``, ``x-goog-api-key``),
   only when it starts with ``polar:`` — e.g. ``OPENAI_API_KEY='polar:s1'`` or
   ``polar:session=s1;task=t1;group=g1;sample=3``. Other keys are never used (nor stored).
4. A generated session per client connection.

FIELDS (the proxy password, or an API key after ``polar:``) is ``key=value`` pairs joined by ``;``
with keys ``session``, ``task``, ``group``, ``sample``; a bare word is the session id.
"""

from __future__ import annotations

import base64
import binascii
import re
from urllib.parse import unquote

from polar_addon.canonical import PolarError
from polar_addon.capture import Identity

API_KEY_PREFIX = "polar:"
# Session ids name journal entries, shard rows and URL paths: short, printable, no separators a shell,
# a terminal or a path would read.
SESSION_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.:-]{0,127}")
# Task and group ids are freer (benchmark names hold '/'), but still printable text of bounded length.
MAX_LABEL_CHARS = 256
_CONTROL = re.compile(r"[\x00-\x1f\x7f-\x9f\ud800-\udfff]")
# sample lands in an int64 column; no rollout has more samples per task than this.
MAX_SAMPLE_INDEX = 2**31 - 1


def _bad(message: str) -> PolarError:
    return PolarError(400, "invalid_request", f"polar identity: {message}")


def _label(value: str | None, what: str) -> str | None:
    if not value:
        return None
    if len(value) > MAX_LABEL_CHARS or _CONTROL.search(value):
        raise _bad(f"{what} must be at most {MAX_LABEL_CHARS} printable characters")
    return value


def _parse_fields(text: str) -> dict[str, str]:
    text = unquote(text)
    if "=" not in text:
        return {"session": text} if text else {}
    fields: dict[str, str] = {}
    for part in text.split(";"):
        key, sep, value = part.partition("=")
        key = key.strip().lower()
        if not sep or key not in {"session", "task", "group", "sample"}:
            # Never quote the credentials back: they may be a password someone mistyped.
            raise _bad("cannot read the session fields (key=value pairs joined by ';', keys: session, task, group, sample)")
        fields[key] = value.strip()
    return fields


def _identity(fields: dict[str, str], source: str) -> Identity | None:
    session = fields.get("session")
    if not session:
        return None
    if not SESSION_ID.fullmatch(session):
        raise _bad("session id must match [A-Za-z0-9][A-Za-z0-9_.:-]{0,127}")
    sample = fields.get("sample")
    sample_index = None
    if sample not in (None, ""):
        if not re.fullmatch(r"[0-9]{1,10}", sample) or int(sample) > MAX_SAMPLE_INDEX:
            raise _bad(f"sample must be an integer from 0 to {MAX_SAMPLE_INDEX}")
        sample_index = int(sample)
    return Identity(
        session_id=session,
        task_id=_label(fields.get("task"), "task"),
        group_id=_label(fields.get("group"), "group"),
        sample_index=sample_index,
        source=source,
    )


def from_proxy_authorization(value: str | None) -> Identity | None:
    """Identity from a ``Proxy-Authorization: Basic`` header value."""
    if not value:
        return None
    scheme, _, token = value.partition(" ")
    if scheme.lower() != "basic":
        return None
    try:
        user, _, password = base64.b64decode(token.strip()).decode().partition(":")
    except (binascii.Error, UnicodeDecodeError):
        raise _bad("malformed Proxy-Authorization header") from None
    fields = _parse_fields(password) if password else {}
    if user:
        fields["session"] = unquote(user)
    return _identity(fields, "proxy_auth")


def from_headers(headers: dict[str, str]) -> Identity | None:
    """Identity from x-polar-* headers, else from a ``polar:``-prefixed API key. Keys are lower-case."""
    session = headers.get("x-polar-session")
    if session:
        fields = {"session": session}
        for key in ("task", "group", "sample"):
            if headers.get(f"x-polar-{key}"):
                fields[key] = headers[f"x-polar-{key}"]
        return _identity(fields, "header")
    for name in ("authorization", "x-api-key", "x-goog-api-key"):
        value = headers.get(name, "")
        if name == "authorization":
            value = value[7:] if value.lower().startswith("bearer ") else ""
        if value.startswith(API_KEY_PREFIX):
            return _identity(_parse_fields(value[len(API_KEY_PREFIX) :]), "api_key")
    return None


def resolve(proxy_authorization: str | None, headers: dict[str, str], connection_id: str) -> Identity:
    return (
        from_proxy_authorization(proxy_authorization)
        or from_headers(headers)
        or Identity(session_id=f"anon-{connection_id[:12]}", source="generated")
    )
