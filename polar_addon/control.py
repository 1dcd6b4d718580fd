"""The control plane: rewards and session statuses, written only by whoever holds the control token.

The agent under training shares the sandbox, ``HTTPS_PROXY`` and its session credentials with its
verifier, so a session credential cannot authorize a reward: the agent would reward itself. Posts to
``/sessions/ID/reward`` and ``/sessions/ID/status`` therefore need ``Authorization: Bearer TOKEN``
with the proxy's control token, which lives in a 0600 file (or the ``polar_control_token`` option)
that the sandboxed agent cannot read. The addon answers these paths only on the ``polar.local``
pseudo-host (or on a reverse-mode listener), never on an intercepted provider host.

Sessions are registered here too (``POST /sessions/ID/register``, ``{"task", "group", "sample"}``, with the
token): the proxy generates the session's secret (``polar_addon.identity.SessionRegistry``) and returns it with
the proxy's session mode, ``{"ok", "session_id", "secret", "sessions": "claimed" | "registered"}``. A posted
status ends the session: its secret is refused from then on, and its id cannot be registered again.
``GET /sessions`` (with the token) says the proxy's modes alone, ``{"ok", "sessions", "sampling": "client" |
"fixed"}``, so a runner can refuse up front a claimed-mode proxy, or one that lets the policy choose how it is
sampled (``polar_sampling=client``).

Values are checked here before anything reaches the store: a reward is a finite number within
``REWARD_LIMIT``, a name matches ``REWARD_NAME``, metadata is a JSON object of bounded size.
"""

from __future__ import annotations

import hmac
import logging
import os
import re
import secrets
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import orjson

from polar_addon.canonical import PolarError
from polar_addon.identity import SessionEnded, SessionRegistry, registration
from polar_addon.store import SESSION_STATUSES, StorageUnavailable, TraceStore
from polar_addon.store.rewards import check_reward
from polar_addon.store.shards import Output

log = logging.getLogger("polar")

CONTROL_HOST = "polar.local"
CONTROL_PATH = re.compile(r"^/sessions(?:/([^/]+)/(reward|status|register))?$")
TOKEN_FILE = ".control-token"  # in a local store's directory
REMOTE_TOKEN_FILE = "polar-control-token"  # in mitmproxy's confdir when the store is remote
MIN_TOKEN_CHARS = 16
MAX_METADATA_BYTES = 16 * 1024
MAX_CONTROL_BODY_BYTES = 64 * 1024
POSTABLE_STATUSES = tuple(s for s in SESSION_STATUSES if s != "running")


class ControlError(ValueError):
    def __init__(self, status: int, kind: str, message: str) -> None:
        super().__init__(message)
        self.status, self.kind, self.message = status, kind, message


def is_control_path(path: str) -> bool:
    return CONTROL_PATH.match(path.split("?", 1)[0]) is not None


def token_file(out_uri: str, confdir: str) -> Path:
    """Where a generated control token is kept: next to a local store, else in mitmproxy's confdir."""
    root = Output.local_root(out_uri)
    if root is not None:
        return Path(root) / TOKEN_FILE
    return Path(os.path.expanduser(confdir)) / REMOTE_TOKEN_FILE


def load_or_create_token(path: Path) -> str:
    """The token in ``path``, or a new one written there with mode 0600.

    An existing file is reused (verifiers keep working across proxy restarts) only if no one but its
    owner can read it; otherwise it is replaced, since the agent may have read it.
    """
    try:
        st = path.stat()
        token = path.read_text().strip()
        if st.st_mode & 0o077 == 0 and st.st_uid == os.getuid() and len(token) >= MIN_TOKEN_CHARS:
            return token
    except FileNotFoundError:
        pass
    path.parent.mkdir(parents=True, exist_ok=True)
    token = secrets.token_urlsafe(32)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as fh:
        fh.write(token + "\n")
    os.replace(tmp, path)
    return token


def check_token(token: str) -> str:
    if len(token) < MIN_TOKEN_CHARS or not token.isascii() or not token.isprintable() or " " in token:
        raise ValueError(
            f"polar_control_token must be at least {MIN_TOKEN_CHARS} printable ASCII characters without spaces"
        )
    return token


def authorized(authorization: str | None, token: str) -> bool:
    """Whether an ``Authorization`` header carries the control token (constant-time comparison)."""
    if not authorization or not token:
        return False
    scheme, _, given = authorization.partition(" ")
    if scheme.lower() != "bearer":
        return False
    return hmac.compare_digest(given.strip().encode("utf-8", "replace"), token.encode())


def _body(raw: bytes) -> dict[str, Any]:
    if len(raw) > MAX_CONTROL_BODY_BYTES:
        raise ControlError(413, "invalid_request", f"body over {MAX_CONTROL_BODY_BYTES} bytes")
    try:
        body = orjson.loads(raw or b"{}")
    except orjson.JSONDecodeError:
        raise ControlError(400, "invalid_request", "body is not valid JSON") from None
    if not isinstance(body, dict):
        raise ControlError(400, "invalid_request", "body must be a JSON object")
    return body


def parse_reward(raw: bytes) -> tuple[float, str]:
    """``{"value": number, "name"?: str}`` -> (value, name)."""
    body = _body(raw)
    if "value" not in body:
        raise ControlError(400, "invalid_request", 'missing "value"')
    try:
        value, name = check_reward(body["value"], body.get("name", "reward"))
    except ValueError as exc:
        raise ControlError(400, "invalid_request", str(exc)) from None
    return value, name


def parse_status(raw: bytes) -> tuple[str, dict[str, Any] | None]:
    """``{"status": one of POSTABLE_STATUSES, "metadata"?: object}`` -> (status, metadata)."""
    body = _body(raw)
    status = body.get("status")
    if not isinstance(status, str) or status not in POSTABLE_STATUSES:
        raise ControlError(400, "invalid_request", f"status must be one of {list(POSTABLE_STATUSES)}")
    metadata = body.get("metadata")
    if metadata is not None:
        if not isinstance(metadata, dict):
            raise ControlError(400, "invalid_request", "metadata must be a JSON object")
        if len(orjson.dumps(metadata)) > MAX_METADATA_BYTES:
            raise ControlError(400, "invalid_request", f"metadata over {MAX_METADATA_BYTES} bytes of JSON")
    return status, metadata


def parse_registration(raw: bytes) -> tuple[str | None, str | None, int | None]:
    """``{"task"?: str, "group"?: str, "sample"?: int}`` -> (task, group, sample)."""
    body = _body(raw)
    task, group, sample = body.get("task"), body.get("group"), body.get("sample")
    if not all(v is None or isinstance(v, str) for v in (task, group)):
        raise ControlError(400, "invalid_request", "task and group must be strings")
    if sample is not None and (not isinstance(sample, int) or isinstance(sample, bool)):
        raise ControlError(400, "invalid_request", "sample must be an integer")
    return task, group, sample


class ControlPlane:
    """Answers the session control paths for a store, and keeps the session registry; every request needs the
    control token."""

    def __init__(
        self,
        store: TraceStore,
        token: str,
        on_session_end: Callable[[str], None] | None = None,
        sessions_mode: Callable[[], str] = lambda: "claimed",
        sampling_mode: Callable[[], str] = lambda: "client",
    ) -> None:
        self.store = store
        self.token = token
        self.on_session_end = on_session_end  # a posted status ends the session (the engine pool frees its slot)
        self.sessions = SessionRegistry()
        self.sessions_mode = sessions_mode  # the addon's polar_sessions, read per request
        self.sampling_mode = sampling_mode  # and its polar_sampling

    async def handle(
        self, method: str, path: str, authorization: str | None, body: bytes
    ) -> tuple[int, dict[str, Any]]:
        """(HTTP status, JSON payload) for one request on a control path."""
        try:
            return 200, await self._handle(method, path, authorization, body)
        except ControlError as err:
            return err.status, {"error": {"type": err.kind, "message": f"polar control: {err.message}"}}
        except StorageUnavailable as exc:
            log.warning("polar: control post not stored: %s", exc)
            return 503, {
                "error": {
                    "type": "storage_unavailable",
                    "message": "polar control: the store cannot persist right now; retry later",
                }
            }

    async def _handle(self, method: str, path: str, authorization: str | None, body: bytes) -> dict[str, Any]:
        match = CONTROL_PATH.match(path.split("?", 1)[0])
        if match is None:
            raise ControlError(404, "not_found", "no such control path")
        if not authorized(authorization, self.token):
            # Checked before anything about the request is looked at: nothing to learn without the token.
            raise ControlError(
                401,
                "authentication_error",
                "Authorization: Bearer <control token> required (the session's own credentials do not suffice)",
            )
        session_id, what = match.group(1), match.group(2)
        if what is None:
            if method != "GET":
                raise ControlError(405, "invalid_request", "use GET")
            return {"ok": True, "sessions": self.sessions_mode(), "sampling": self.sampling_mode()}
        if method != "POST":
            raise ControlError(405, "invalid_request", "use POST")
        if what == "register":
            task, group, sample = parse_registration(body)
            try:
                secret = self.sessions.register(registration(session_id, task, group, sample))
            except PolarError as err:
                raise ControlError(400, "invalid_request", err.message) from None
            except SessionEnded as exc:
                raise ControlError(409, "conflict", f"{exc}: a session id is never registered again") from None
            return {"ok": True, "session_id": session_id, "secret": secret, "sessions": self.sessions_mode()}
        if what == "reward":
            value, name = parse_reward(body)
            await self.store.add_reward(session_id, value, name=name, source="proxy")
        else:
            status, metadata = parse_status(body)
            # Ended before the store write: a call arriving while the status is stored is already refused.
            self.sessions.end(session_id)
            await self.store.session_update(session_id, status=status, ended_at=time.time(), metadata=metadata)
            if self.on_session_end is not None:
                self.on_session_end(session_id)
            # What the store now says of the session (error is final), so the poster reports the same.
            final, why = self.store.final_status(session_id, status)
            return {"ok": True, "session_id": session_id, "status": final, **({"final_because": why} if why else {})}
        return {"ok": True, "session_id": session_id}
