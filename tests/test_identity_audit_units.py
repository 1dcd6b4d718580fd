"""The session registry and registered-mode resolution (issue 29 audit of polar_addon/identity.py's newer half): each
refusal's status and exact text (what a harness's user reads), registration's labels, a re-registration's revoked
secret after the session ends, ending a session never registered, the bound on what ended sessions keep, and secrets
that are not valid UTF-8."""

from __future__ import annotations

import base64

import pytest

from polar_addon.canonical import PolarError
from polar_addon.identity import (
    Registration,
    SessionEnded,
    SessionRegistry,
    from_proxy_authorization,
    registration,
    resolve_registered,
)

UNKNOWN = (
    "polar identity: unknown session credential: this proxy takes calls only from sessions registered with it "
    "(polar rollout gives each session its own)"
)
ENDED = "polar identity: this session has ended (its final status was posted): its credential is refused"


def refusal(call) -> tuple[int, str, str]:
    with pytest.raises(PolarError) as caught:
        call()
    return caught.value.status, caught.value.kind, caught.value.message


def test_a_registration_keeps_absent_labels_absent_and_needs_a_session_id() -> None:
    assert registration("s1", None, None, None) == Registration("s1", None, None, None)
    assert registration("s1", "", "", None) == Registration("s1", None, None, None)
    assert registration("s1", "t", "g", 0) == Registration("s1", "t", "g", 0)
    assert refusal(lambda: registration("", "t", "g", 1)) == (
        400,
        "invalid_request",
        "polar identity: a registration needs a session id",
    )


def test_a_session_that_ended_cannot_register_again() -> None:
    registry = SessionRegistry()
    registry.register(registration("s1", None, None, None))
    registry.end("s1")
    with pytest.raises(SessionEnded, match="^session s1 already ended$"):
        registry.register(registration("s1", None, None, None))


def test_an_unknown_secret_is_401_and_an_ended_sessions_is_403() -> None:
    registry = SessionRegistry()
    assert refusal(lambda: registry.lookup("psk-never-issued")) == (401, "authentication", UNKNOWN)
    secret = registry.register(registration("s1", "t", None, None))
    assert registry.lookup(secret) == Registration("s1", "t", None, None)
    registry.end("s1")
    assert refusal(lambda: registry.lookup(secret)) == (403, "authentication", ENDED)


def test_a_secret_revoked_by_a_re_registration_stays_unknown_after_the_session_ends() -> None:
    registry = SessionRegistry()
    old = registry.register(registration("s1", None, None, None))
    new = registry.register(registration("s1", None, None, None))  # the runner retried INIT
    assert refusal(lambda: registry.lookup(old))[:2] == (401, "authentication")
    registry.end("s1")
    assert refusal(lambda: registry.lookup(old)) == (401, "authentication", UNKNOWN)
    assert refusal(lambda: registry.lookup(new)) == (403, "authentication", ENDED)


def test_ending_a_session_never_registered_marks_it_ended() -> None:
    registry = SessionRegistry()
    registry.end("ghost")
    assert registry.ended("ghost")
    with pytest.raises(SessionEnded):
        registry.register(registration("ghost", None, None, None))


def test_sessions_ended_past_the_bound_are_forgotten_with_their_secrets() -> None:
    registry = SessionRegistry(max_ended=2)
    secrets = {sid: registry.register(registration(sid, None, None, None)) for sid in ("a", "b", "c")}
    for sid in ("a", "b", "c"):
        registry.end(sid)
    assert not registry.ended("a") and registry.ended("b") and registry.ended("c")
    # What the registry holds stays bounded: the oldest ended session's secret goes with it.
    assert sorted(registry._by_digest.values()) == ["b", "c"]
    assert refusal(lambda: registry.lookup(secrets["a"])) == (401, "authentication", UNKNOWN)
    assert refusal(lambda: registry.lookup(secrets["c"])) == (403, "authentication", ENDED)


def test_a_secret_that_is_not_valid_utf8_is_looked_up_not_crashed_on() -> None:
    assert refusal(lambda: SessionRegistry().lookup("psk-\udcff"))[:2] == (401, "authentication")


def test_each_registered_mode_refusal_with_its_status_and_text() -> None:
    registry = SessionRegistry()
    a = registry.register(registration("a", None, None, None))
    b = registry.register(registration("b", None, None, None))
    assert refusal(lambda: resolve_registered(None, {"x-polar-session": "a"}, registry)) == (
        403,
        "authentication",
        "polar identity: x-polar-* headers are refused: this proxy takes the session, task, group and sample from "
        "the session's registration",
    )
    assert refusal(lambda: resolve_registered(None, {}, registry)) == (
        401,
        "authentication",
        "polar identity: no session credential (the API key polar:SECRET, or the proxy URL "
        "http://polar:SECRET@HOST:PORT, of a session registered with this proxy)",
    )
    assert refusal(lambda: resolve_registered(None, {"x-api-key": "polar:session=a"}, registry)) == (
        403,
        "authentication",
        "polar identity: claimed identities are refused: this proxy takes the session, task, group and sample from "
        "the session's registration; the credential is its secret alone",
    )
    two = {"x-api-key": f"polar:{a}", "authorization": f"Bearer polar:{b}"}
    assert refusal(lambda: resolve_registered(None, two, registry)) == (
        403,
        "authentication",
        "polar identity: the call carries the credentials of more than one session",
    )
    assert resolve_registered(None, {"x-api-key": f"polar:{a}"}, registry).session_id == "a"


def test_a_malformed_proxy_authorization_is_refused_with_the_exact_text() -> None:
    assert refusal(lambda: from_proxy_authorization("Basic !!!not-base64")) == (
        400,
        "invalid_request",
        "polar identity: malformed Proxy-Authorization header",
    )
    token = base64.b64encode(b"s1:task=t").decode()
    assert from_proxy_authorization(f"Basic {token}").task_id == "t"
