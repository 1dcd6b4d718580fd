"""The control channel's own rules, in-process (polar_addon.control): which paths it answers, who may post (the
control token, never a session's credential), what a post may say, where the token is kept and when a found one is
distrusted. The agent under training is the adversary here: every refusal is checked at its exact boundary."""

from __future__ import annotations

import asyncio
import base64
import logging
import os
import stat
import time
from pathlib import Path
from typing import Any

import orjson
import pytest

from polar_addon import control
from polar_addon.control import (
    MAX_CONTROL_BODY_BYTES,
    MAX_METADATA_BYTES,
    ControlError,
    ControlPlane,
    authorized,
    check_token,
    is_control_path,
    load_or_create_token,
    parse_registration,
    parse_reward,
    parse_status,
    token_file,
)
from polar_addon.store import StorageUnavailable

TOKEN = "k" * 24
BEARER = f"Bearer {TOKEN}"


def _refusal(fn, *args: Any) -> tuple[int, str, str]:
    with pytest.raises(ControlError) as err:
        fn(*args)
    return err.value.status, err.value.kind, err.value.message


# --- paths --------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "path",
    ["/sessions", "/sessions/s-1/reward", "/sessions/s-1/status", "/sessions/s-1/register", "/sessions/a/reward?x=1?y"],
)
def test_the_control_paths(path: str) -> None:
    assert is_control_path(path)


@pytest.mark.parametrize(
    "path",
    [
        "/sessions/",
        "/sessions/s-1",
        "/sessions//reward",
        "/sessions/a/b/reward",
        "/sessions/a/rewards",
        "/sessions/a/reward/",
        "/v1/sessions/a/reward",
        "/sessionsx",
        "/Sessions/a/reward",
        "/x?/sessions",
    ],
)
def test_anything_else_is_not_a_control_path(path: str) -> None:
    assert not is_control_path(path)


# --- the token ----------------------------------------------------------------------------------------------------


def test_the_token_lives_next_to_a_local_store_else_in_the_confdir(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert token_file(str(tmp_path / "out"), "~/conf") == tmp_path / "out" / ".control-token"
    assert token_file(f"file://{tmp_path}/out", "~/conf") == tmp_path / "out" / ".control-token"
    assert token_file("s3://bucket/out", "~/conf") == tmp_path / "home" / "conf" / "polar-control-token"


def test_a_new_token_is_32_random_bytes_in_a_private_file_in_a_new_directory(tmp_path: Path) -> None:
    path = tmp_path / "a" / "b" / ".control-token"
    token = load_or_create_token(path)
    assert len(base64.urlsafe_b64decode(token + "=")) == 32
    assert path.read_text() == token + "\n"
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert sorted(p.name for p in path.parent.iterdir()) == [".control-token"]  # no temporary file left behind
    assert load_or_create_token(path) == token  # kept across restarts: verifiers keep working
    assert load_or_create_token(tmp_path / "c") != token


@pytest.mark.parametrize("mode", [0o640, 0o604, 0o620, 0o602, 0o610, 0o601])
def test_a_token_anyone_else_could_read_or_write_is_replaced(tmp_path: Path, mode: int) -> None:
    path = tmp_path / ".control-token"
    path.write_text("leaked-token-0123456789\n")
    path.chmod(mode)
    token = load_or_create_token(path)
    assert token != "leaked-token-0123456789"
    assert path.read_text() == token + "\n" and stat.S_IMODE(path.stat().st_mode) == 0o600


def test_a_private_token_is_kept_from_16_characters(tmp_path: Path) -> None:
    path = tmp_path / ".control-token"
    path.write_text(" " + "x" * 16 + "\n")
    path.chmod(0o600)
    assert load_or_create_token(path) == "x" * 16
    path.write_text("x" * 15 + "\n")
    assert load_or_create_token(path) not in ("x" * 15, "")


def test_a_token_file_someone_else_owns_is_replaced(tmp_path: Path, monkeypatch) -> None:
    path = tmp_path / ".control-token"
    path.write_text("planted-by-another-user-0123\n")
    path.chmod(0o600)
    real = os.getuid()
    monkeypatch.setattr(os, "getuid", lambda: real + 1)
    assert load_or_create_token(path) != "planted-by-another-user-0123"


def test_the_new_token_is_never_written_through_a_planted_file(tmp_path: Path) -> None:
    """Its temporary file is created exclusively: a symlink waiting under that name is not followed."""
    path = tmp_path / ".control-token"
    bait = tmp_path / "world-readable"
    bait.write_text("")
    (tmp_path / f"..control-token.{os.getpid()}.tmp").symlink_to(bait)
    with pytest.raises(FileExistsError):
        load_or_create_token(path)
    assert bait.read_text() == "" and not path.exists()


def test_a_configured_token_needs_16_printable_ascii_characters_without_spaces() -> None:
    message = "polar_control_token must be at least 16 printable ASCII characters without spaces"
    assert check_token("x" * 16) == "x" * 16
    for bad in ("x" * 15, "x" * 15 + "é", "x" * 8 + " " + "x" * 8, "x" * 16 + "\t", "x" * 16 + "\n", ""):
        with pytest.raises(ValueError) as err:
            check_token(bad)
        assert str(err.value) == message, bad


@pytest.mark.parametrize(
    ("header", "ok"),
    [
        (BEARER, True),
        (f"bearer {TOKEN}", True),
        (f"BEARER   {TOKEN} ", True),
        (f"Bearer {TOKEN}x", False),
        (f"Bearer {TOKEN[:-1]}", False),
        (f"Basic {TOKEN}", False),
        (f"Token {TOKEN}", False),
        (f"Bearer{TOKEN}", False),
        (TOKEN, False),
        ("Bearer ", False),
        ("Bearer é\udc80", False),  # not UTF-8 encodable: refused, not an exception
        ("", False),
        (None, False),
    ],
)
def test_only_the_bearer_control_token_authorizes(header: str | None, ok: bool) -> None:
    assert authorized(header, TOKEN) is ok


def test_no_header_matches_an_empty_token() -> None:
    assert not authorized("Bearer ", "")
    assert not authorized("Bearer x", "")


# --- bodies ---------------------------------------------------------------------------------------------------------


def _json_of_size(size: int) -> bytes:
    body = b'{"value": 1, "pad": "' + b"p" * (size - 23) + b'"}'
    assert len(body) == size
    return body


def test_a_refusal_reads_as_its_message_wherever_it_is_printed() -> None:
    with pytest.raises(ControlError) as err:
        parse_reward(b"{}")
    assert str(err.value) == 'missing "value"'


def test_a_body_is_a_json_object_of_at_most_64_kib() -> None:
    assert parse_reward(_json_of_size(MAX_CONTROL_BODY_BYTES)) == (1.0, "reward")
    over = _refusal(parse_reward, _json_of_size(MAX_CONTROL_BODY_BYTES + 1))
    assert over == (413, "invalid_request", "body over 65536 bytes")
    assert _refusal(parse_reward, b"{") == (400, "invalid_request", "body is not valid JSON")
    assert _refusal(parse_reward, b"[1]") == (400, "invalid_request", "body must be a JSON object")
    assert _refusal(parse_reward, b"1") == (400, "invalid_request", "body must be a JSON object")
    assert parse_registration(b"") == (None, None, None)  # no body: an empty object


def test_a_reward_is_a_bounded_number_with_a_checked_name() -> None:
    assert parse_reward(b'{"value": 0.5}') == (0.5, "reward")
    assert parse_reward(b'{"value": -1000000, "name": "tests@v2"}') == (-1e6, "tests@v2")
    assert _refusal(parse_reward, b"{}") == (400, "invalid_request", 'missing "value"')
    assert _refusal(parse_reward, b'{"value": null}') == (400, "invalid_request", "reward value must be a JSON number")
    assert _refusal(parse_reward, b'{"value": true}') == (400, "invalid_request", "reward value must be a JSON number")
    assert _refusal(parse_reward, b'{"value": 1000000.5}') == (
        400,
        "invalid_request",
        "reward value must be a finite number within +-1e+06",
    )
    status, kind, message = _refusal(parse_reward, b'{"value": 1, "name": "../x"}')
    assert (status, kind) == (400, "invalid_request") and message.startswith("reward name must match ")


def test_a_status_is_a_final_one_with_bounded_object_metadata() -> None:
    for status in ("completed", "timeout", "error", "agent_error"):
        assert parse_status(orjson.dumps({"status": status})) == (status, None)
    allowed = "status must be one of ['completed', 'timeout', 'error', 'agent_error']"
    for body in (b'{"status": "running"}', b"{}", b'{"status": ["completed"]}', b'{"status": "Completed"}'):
        assert _refusal(parse_status, body) == (400, "invalid_request", allowed)
    not_object = (400, "invalid_request", "metadata must be a JSON object")
    assert _refusal(parse_status, b'{"status": "error", "metadata": [1]}') == not_object
    assert _refusal(parse_status, b'{"status": "error", "metadata": "x"}') == not_object
    at_limit = {"e": "x" * (MAX_METADATA_BYTES - 8)}
    assert len(orjson.dumps(at_limit)) == MAX_METADATA_BYTES
    assert parse_status(orjson.dumps({"status": "error", "metadata": at_limit})) == ("error", at_limit)
    over = {"e": "x" * (MAX_METADATA_BYTES - 7)}
    assert _refusal(parse_status, orjson.dumps({"status": "error", "metadata": over})) == (
        400,
        "invalid_request",
        "metadata over 16384 bytes of JSON",
    )
    assert parse_status(b'{"status": "timeout", "metadata": {}}') == ("timeout", {})


def test_a_registration_has_string_labels_and_an_integer_sample() -> None:
    assert parse_registration(b'{"task": "t", "group": "g", "sample": 0}') == ("t", "g", 0)
    assert parse_registration(b'{"group": "g"}') == (None, "g", None)
    labels = (400, "invalid_request", "task and group must be strings")
    assert _refusal(parse_registration, b'{"task": 1}') == labels
    assert _refusal(parse_registration, b'{"group": ["g"]}') == labels
    sample = (400, "invalid_request", "sample must be an integer")
    for bad in (b"true", b"1.0", b'"1"'):
        assert _refusal(parse_registration, b'{"sample": ' + bad + b"}") == sample


# --- the plane ------------------------------------------------------------------------------------------------------


class Store:
    """Records what the plane writes; ``unavailable`` makes the next write fail as a full disk does."""

    def __init__(self, plane_of: list[ControlPlane], final: tuple[str, str | None] | None = None) -> None:
        self.calls: list[tuple] = []
        self.plane_of = plane_of
        self.final = final
        self.unavailable = False

    async def add_reward(self, session_id: str, value: float, **kwargs: Any) -> None:
        self.calls.append(("reward", session_id, value, kwargs))

    async def session_update(self, session_id: str, **kwargs: Any) -> None:
        # The session is already ended while the status is being stored.
        self.calls.append(("update", session_id, kwargs, self.plane_of[0].sessions.ended(session_id)))
        if self.unavailable:
            self.unavailable = False
            raise StorageUnavailable("disk full")

    def final_status(self, session_id: str, status: str) -> tuple[str, str | None]:
        self.calls.append(("final", session_id, status))
        return self.final or (status, None)


def _plane(**kwargs: Any) -> tuple[ControlPlane, Store, list[str]]:
    holder: list[ControlPlane] = []
    store = Store(holder, kwargs.pop("final", None))
    ended: list[str] = []
    plane = ControlPlane(store, TOKEN, on_session_end=ended.append, **kwargs)  # type: ignore[arg-type]
    holder.append(plane)
    return plane, store, ended


def _call(plane: ControlPlane, method: str, path: str, body: bytes = b"", auth: str | None = BEARER):
    return asyncio.run(plane.handle(method, path, auth, body))


def _error(kind: str, message: str) -> dict:
    return {"error": {"type": kind, "message": f"polar control: {message}"}}


UNAUTHORIZED = _error(
    "authentication_error",
    "Authorization: Bearer <control token> required (the session's own credentials do not suffice)",
)


def test_every_path_needs_the_token_before_anything_else_is_looked_at() -> None:
    plane, store, ended = _plane()
    secret = plane.sessions.register(control.registration("s-1", "t", None, None))
    for method, path, body in [
        ("POST", "/sessions/s-1/reward", b'{"value": 1}'),
        ("POST", "/sessions/s-1/status", b'{"status": "completed"}'),
        ("POST", "/sessions/s-1/register", b"{}"),
        ("GET", "/sessions", b""),
        ("DELETE", "/sessions", b"not json"),
        ("GET", "/sessions/s-1/reward", b""),
    ]:
        for auth in (None, f"Bearer {secret}", f"Basic {TOKEN}", f"Bearer {TOKEN[1:]}"):
            assert _call(plane, method, path, body, auth) == (401, UNAUTHORIZED), (method, path, auth)
    assert store.calls == [] and ended == [] and not plane.sessions.ended("s-1")
    assert plane.sessions.lookup(secret).session_id == "s-1"  # a refused re-registration revoked nothing


def test_an_unknown_path_is_404_even_with_the_token() -> None:
    plane, _, _ = _plane()
    assert _call(plane, "POST", "/sessions/a/rewards") == (404, _error("not_found", "no such control path"))
    assert _call(plane, "POST", "/v1/messages", auth=None) == (404, _error("not_found", "no such control path"))


def test_the_modes_are_read_per_request_and_default_to_claimed_and_client() -> None:
    assert _call(_plane()[0], "GET", "/sessions") == (200, {"ok": True, "sessions": "claimed", "sampling": "client"})
    modes = {"sessions": "claimed", "sampling": "client"}
    plane, _, _ = _plane(sessions_mode=lambda: modes["sessions"], sampling_mode=lambda: modes["sampling"])
    modes.update(sessions="registered", sampling="fixed")
    assert _call(plane, "GET", "/sessions?x=1") == (200, {"ok": True, "sessions": "registered", "sampling": "fixed"})
    assert _call(plane, "GET", "/sessions?x=1?y")[0] == 200  # the query starts at the first "?"
    assert _call(plane, "POST", "/sessions") == (405, _error("invalid_request", "use GET"))
    for what in ("reward", "status", "register"):
        assert _call(plane, "GET", f"/sessions/s/{what}") == (405, _error("invalid_request", "use POST"))
        assert _call(plane, "PUT", f"/sessions/s/{what}", b'{"value": 1}') == (
            405,
            _error("invalid_request", "use POST"),
        )


def test_a_registration_returns_a_fresh_secret_and_the_mode() -> None:
    plane, store, _ = _plane(sessions_mode=lambda: "registered")
    status, reply = _call(plane, "POST", "/sessions/s-1/register", b'{"task": "t", "group": "g", "sample": 2}')
    assert status == 200 and set(reply) == {"ok", "session_id", "secret", "sessions"}
    assert (reply["ok"], reply["session_id"], reply["sessions"]) == (True, "s-1", "registered")
    entry = plane.sessions.lookup(reply["secret"])
    assert (entry.session_id, entry.task_id, entry.group_id, entry.sample_index) == ("s-1", "t", "g", 2)
    assert store.calls == []


def test_a_bad_registration_is_400_and_an_ended_session_409() -> None:
    plane, _, _ = _plane()
    bad_id = _call(plane, "POST", "/sessions/-s/register")
    assert bad_id == (
        400,
        _error("invalid_request", "polar identity: session id must match [A-Za-z0-9][A-Za-z0-9_.:-]{0,127}"),
    )
    bad_body = _call(plane, "POST", "/sessions/s-1/register", b'{"sample": "1"}')
    assert bad_body == (400, _error("invalid_request", "sample must be an integer"))
    assert _call(plane, "POST", "/sessions/s-1/status", b'{"status": "timeout"}')[0] == 200
    again = _call(plane, "POST", "/sessions/s-1/register")
    assert again == (409, _error("conflict", "session s-1 already ended: a session id is never registered again"))


def test_a_reward_is_stored_as_the_proxys() -> None:
    plane, store, ended = _plane()
    reply = _call(plane, "POST", "/sessions/s-1/reward?retry=1", b'{"value": 0.25, "name": "tests"}')
    assert reply == (200, {"ok": True, "session_id": "s-1"})
    assert store.calls == [("reward", "s-1", 0.25, {"name": "tests", "source": "proxy"})]
    assert ended == [] and not plane.sessions.ended("s-1")  # a reward does not end the session
    bad = _call(plane, "POST", "/sessions/s-1/reward", b'{"value": "1"}')
    assert bad == (400, _error("invalid_request", "reward value must be a JSON number"))
    assert len(store.calls) == 1


def test_a_status_ends_the_session_before_it_is_stored_and_frees_its_slot() -> None:
    plane, store, ended = _plane()
    secret = plane.sessions.register(control.registration("s-1", None, None, None))
    before = time.time()
    reply = _call(plane, "POST", "/sessions/s-1/status", b'{"status": "agent_error", "metadata": {"why": "x"}}')
    assert reply == (200, {"ok": True, "session_id": "s-1", "status": "agent_error"})
    [(what, session, fields, already_ended), final] = store.calls
    assert final == ("final", "s-1", "agent_error")
    assert (what, session, already_ended) == ("update", "s-1", True)
    assert set(fields) == {"status", "ended_at", "metadata"}
    assert (fields["status"], fields["metadata"]) == ("agent_error", {"why": "x"})
    assert before <= fields["ended_at"] <= time.time()
    assert ended == ["s-1"]
    with pytest.raises(control.PolarError):
        plane.sessions.lookup(secret)
    bad = _call(plane, "POST", "/sessions/s-2/status", b'{"status": "running"}')
    assert bad[0] == 400 and not plane.sessions.ended("s-2") and ended == ["s-1"]


def test_the_reply_says_the_status_the_store_keeps_and_why() -> None:
    plane, store, _ = _plane(final=("error", "engine e1 taken out"))
    reply = _call(plane, "POST", "/sessions/s-1/status", b'{"status": "completed"}')
    assert reply == (200, {"ok": True, "session_id": "s-1", "status": "error", "final_because": "engine e1 taken out"})
    assert store.calls[-1] == ("final", "s-1", "completed")


def test_a_status_without_a_slot_callback_still_ends_the_session() -> None:
    holder: list[ControlPlane] = []
    plane = ControlPlane(Store(holder), TOKEN)  # type: ignore[arg-type]
    holder.append(plane)
    assert _call(plane, "POST", "/sessions/s-1/status", b'{"status": "completed"}')[0] == 200
    assert plane.sessions.ended("s-1")


def test_a_store_that_cannot_persist_is_a_503_and_the_retry_frees_the_slot(caplog) -> None:
    plane, store, ended = _plane()
    store.unavailable = True
    with caplog.at_level(logging.WARNING, logger="polar"):
        reply = _call(plane, "POST", "/sessions/s-1/status", b'{"status": "completed"}')
    assert reply == (
        503,
        {
            "error": {
                "type": "storage_unavailable",
                "message": "polar control: the store cannot persist right now; retry later",
            }
        },
    )
    assert [r.getMessage() for r in caplog.records] == ["polar: control post not stored: disk full"]
    assert plane.sessions.ended("s-1") and ended == []
    assert _call(plane, "POST", "/sessions/s-1/status", b'{"status": "completed"}')[0] == 200
    assert ended == ["s-1"] and [c[0] for c in store.calls] == ["update", "update", "final"]
