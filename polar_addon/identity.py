"""Session identity with no change to the harness.

Two modes (the addon's ``polar_sessions`` option):

- ``claimed`` (plain capture, ``polar proxy`` without a runner): TRUST ON CLAIM. Whoever sends a call names its
  session, task, group and sample; fine for capturing your own harness, never for training an untrusted policy,
  which could write into another session or relabel its own.
- ``registered`` (the proxy ``polar rollout`` starts): a session exists only once the runner registered it on the
  control plane (``POST /sessions/ID/register`` with the control token; :class:`SessionRegistry`). The proxy
  answers the registration with the session's secret, and the harness's credential carries only that secret
  (``polar:SECRET`` as its API key, or ``http://polar:SECRET@...`` as its proxy URL); session, task, group and
  sample come from the registration alone. Claimed fields, ``x-polar-*`` headers, an unknown secret and the secret
  of an ended session (a final status was posted) are refused.

In claimed mode a credential that looks like a secret (``SECRET_PREFIX``) is still looked up as one (a runner's
sessions keep their registered labels), and never read as a claim.

Claimed precedence (first that gives a session wins; task/group/sample are taken from the same source):

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
import hashlib
import hmac
import re
import secrets
from collections import OrderedDict
from dataclasses import dataclass
from urllib.parse import unquote

from polar_addon.canonical import PolarError
from polar_addon.capture import Identity

API_KEY_PREFIX = "polar:"
SESSION_MODES = ("claimed", "registered")
# Secrets name themselves, so a claimed-mode proxy never takes one for a session id (it would land in the store).
SECRET_PREFIX = "psk-"
SECRET_BYTES = 32  # token_urlsafe(32): 43 characters, 256 bits
# Ended sessions stay known (their secrets refused as ended) up to this many; older ones are forgotten, and their
# secrets are then refused as unknown, which refuses them just the same.
MAX_ENDED_SESSIONS = 100_000
KEY_HEADERS = ("authorization", "x-api-key", "x-goog-api-key")
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


def _refused(status: int, message: str) -> PolarError:
    # Never quotes the credential back: a near-miss of a real secret is still half a secret.
    return PolarError(status, "authentication", f"polar identity: {message}")


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
            raise _bad(
                "cannot read the session fields (key=value pairs joined by ';', keys: session, task, group, sample)"
            )
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


def _proxy_credentials(value: str | None) -> tuple[str, str] | None:
    """(user, password) of a ``Proxy-Authorization: Basic`` header value, None for no or another scheme."""
    if not value:
        return None
    scheme, _, token = value.partition(" ")
    if scheme.lower() != "basic":
        return None
    try:
        user, _, password = base64.b64decode(token.strip()).decode().partition(":")
    except (binascii.Error, UnicodeDecodeError):
        raise _bad("malformed Proxy-Authorization header") from None
    return user, password


def from_proxy_authorization(value: str | None) -> Identity | None:
    """Identity from a ``Proxy-Authorization: Basic`` header value."""
    credentials = _proxy_credentials(value)
    if credentials is None:
        return None
    user, password = credentials
    fields = _parse_fields(password) if password else {}
    if user:
        fields["session"] = unquote(user)
    return _identity(fields, "proxy_auth")


def _api_keys(headers: dict[str, str]) -> list[str]:
    """What follows ``polar:`` in each provider key header the call carries."""
    keys = []
    for name in KEY_HEADERS:
        value = headers.get(name, "")
        if name == "authorization":
            value = value[7:] if value.lower().startswith("bearer ") else ""
        if value.startswith(API_KEY_PREFIX):
            keys.append(value[len(API_KEY_PREFIX) :])
    return keys


def from_headers(headers: dict[str, str]) -> Identity | None:
    """Identity from x-polar-* headers, else from a ``polar:``-prefixed API key. Keys are lower-case."""
    session = headers.get("x-polar-session")
    if session:
        fields = {"session": session}
        for key in ("task", "group", "sample"):
            if headers.get(f"x-polar-{key}"):
                fields[key] = headers[f"x-polar-{key}"]
        return _identity(fields, "header")
    keys = _api_keys(headers)
    return _identity(_parse_fields(keys[0]), "api_key") if keys else None


@dataclass(frozen=True)
class Registration:
    session_id: str
    task_id: str | None
    group_id: str | None
    sample_index: int | None

    def identity(self) -> Identity:
        return Identity(
            session_id=self.session_id,
            task_id=self.task_id,
            group_id=self.group_id,
            sample_index=self.sample_index,
            source="registered",
        )


def registration(session_id: str, task: str | None, group: str | None, sample: int | None) -> Registration:
    """A checked registration: the same bounds a claimed identity has (the labels land in the same columns)."""
    fields = {
        "session": session_id,
        "task": task or "",
        "group": group or "",
        "sample": "" if sample is None else str(sample),
    }
    ident = _identity(fields, "registered")
    if ident is None:
        raise _bad("a registration needs a session id")
    return Registration(ident.session_id, ident.task_id, ident.group_id, ident.sample_index)


class SessionEnded(ValueError):
    """A registration of a session that already ended (its id is never reused)."""


def _digest(secret: str) -> bytes:
    return hashlib.sha256(secret.encode("utf-8", "surrogatepass")).digest()


class SessionRegistry:
    """Registered sessions by secret; in memory (a restarted proxy knows none, and refuses their calls).

    Secrets are looked up by their SHA-256: what the timing of a lookup can reveal is about a digest, which gives
    away nothing of the secret; a digest found is then confirmed with a constant-time comparison."""

    def __init__(self, max_ended: int = MAX_ENDED_SESSIONS) -> None:
        self._live: dict[str, tuple[bytes, Registration]] = {}  # session id -> (its secret's digest, registration)
        self._by_digest: dict[bytes, str] = {}  # digest -> session id, live or ended
        self._ended: OrderedDict[str, bytes | None] = OrderedDict()  # ended session id -> its secret's digest
        self._max_ended = max_ended

    def register(self, entry: Registration) -> str:
        """A new secret for ``entry``. Registering a live session again (the runner retried its INIT) revokes its
        previous secret; an ended session cannot come back."""
        if entry.session_id in self._ended:
            raise SessionEnded(f"session {entry.session_id} already ended")
        previous = self._live.get(entry.session_id)
        if previous is not None:
            del self._by_digest[previous[0]]
        secret = SECRET_PREFIX + secrets.token_urlsafe(SECRET_BYTES)
        digest = _digest(secret)
        self._live[entry.session_id] = (digest, entry)
        self._by_digest[digest] = entry.session_id
        return secret

    def end(self, session_id: str) -> None:
        """A final status was posted: the session's secret is refused from now on."""
        if session_id in self._ended:
            return
        previous = self._live.pop(session_id, None)
        self._ended[session_id] = previous[0] if previous else None
        while len(self._ended) > self._max_ended:
            _, digest = self._ended.popitem(last=False)
            if digest is not None:
                self._by_digest.pop(digest, None)

    def ended(self, session_id: str) -> bool:
        return session_id in self._ended

    def lookup(self, secret: str) -> Registration:
        """The registration ``secret`` belongs to; refused (401 unknown, 403 ended) otherwise."""
        digest = _digest(secret)
        session_id = self._by_digest.get(digest)
        live = self._live.get(session_id) if session_id is not None else None
        if live is not None and hmac.compare_digest(live[0], digest):
            return live[1]
        if session_id is not None and session_id in self._ended:
            raise _refused(403, "this session has ended (its final status was posted): its credential is refused")
        raise _refused(
            401,
            "unknown session credential: this proxy takes calls only from sessions registered "
            "with it (polar rollout gives each session its own)",
        )


def _offered(proxy_authorization: str | None, headers: dict[str, str]) -> list[str]:
    """Every polar credential the call offers: the proxy password (else the proxy user), each ``polar:`` key."""
    offered = []
    credentials = _proxy_credentials(proxy_authorization)
    if credentials is not None and any(credentials):
        user, password = credentials
        offered.append(unquote(password or user))
    return offered + _api_keys(headers)


def _offers_secret(proxy_authorization: str | None, headers: dict[str, str]) -> bool:
    return any(c.startswith(SECRET_PREFIX) for c in _offered(proxy_authorization, headers))


def resolve_registered(proxy_authorization: str | None, headers: dict[str, str], registry: SessionRegistry) -> Identity:
    """The identity of a registered session's call, from its secret alone; anything claimed is refused."""
    if any(name.startswith("x-polar-") for name in headers):
        raise _refused(
            403,
            "x-polar-* headers are refused: this proxy takes the session, task, group and sample "
            "from the session's registration",
        )
    offered = _offered(proxy_authorization, headers)
    if not offered:
        raise _refused(
            401,
            "no session credential (the API key polar:SECRET, or the proxy URL "
            "http://polar:SECRET@HOST:PORT, of a session registered with this proxy)",
        )
    if any(not c.startswith(SECRET_PREFIX) for c in offered):
        raise _refused(
            403,
            "claimed identities are refused: this proxy takes the session, task, group and sample "
            "from the session's registration; the credential is its secret alone",
        )
    found = {registry.lookup(c) for c in offered}
    if len(found) > 1:
        raise _refused(403, "the call carries the credentials of more than one session")
    return found.pop().identity()


def resolve(
    proxy_authorization: str | None,
    headers: dict[str, str],
    connection_id: str,
    registry: SessionRegistry | None = None,
    mode: str = "claimed",
) -> Identity:
    """The call's identity under ``mode`` (see the module docstring); refusals are PolarErrors (400, 401, 403)."""
    if mode == "registered" or _offers_secret(proxy_authorization, headers):
        # A secret is never taken for a claimed session id (it would land in the store as one).
        return resolve_registered(proxy_authorization, headers, registry or SessionRegistry())
    return (
        from_proxy_authorization(proxy_authorization)
        or from_headers(headers)
        or Identity(session_id=f"anon-{connection_id[:12]}", source="generated")
    )
