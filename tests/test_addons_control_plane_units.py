"""The control plane addon (polar_addon.addons.control_plane), in-process on mitmproxy test flows: which flows it
answers (polar.local, a reverse listener's control paths; never a provider host), with the control token read from
the Authorization header alone, and where that token comes from. A reward or status post is the agent's way to
rewrite its own outcome: only the holder of the token may make one."""

from __future__ import annotations

import asyncio
import logging
import os
import stat
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import orjson
import pytest
from mitmproxy import exceptions, http
from mitmproxy.proxy.mode_specs import ProxyMode
from mitmproxy.test import taddons, tflow, tutils

from polar_addon.addons import ControlPlaneAddon, Shared
from polar_addon.control import ControlPlane

TOKEN = "k" * 24
BEARER = f"Bearer {TOKEN}"
UNAUTHORIZED = {
    "error": {
        "type": "authentication_error",
        "message": "polar control: Authorization: Bearer <control token> required "
        "(the session's own credentials do not suffice)",
    }
}


class _CaptureOptions:
    """The capture addon's options the control plane reads (polar_out, polar_sampling), without its gateway."""

    def load(self, loader) -> None:
        loader.add_option("polar_out", str, "shards", "Where shards go.")
        loader.add_option("polar_sampling", str, "client", "Whose sampling.")


class _Store:
    def __init__(self) -> None:
        self.calls: list[tuple] = []

    async def add_reward(self, session_id: str, value: float, **kwargs: Any) -> None:
        self.calls.append(("reward", session_id, value, kwargs))


def _gateway(released: list[str] | None = None) -> SimpleNamespace:
    return SimpleNamespace(
        store=_Store(), pool=SimpleNamespace(release=(released if released is not None else []).append)
    )


def make_flow(
    host: str,
    path: str,
    method: str = "POST",
    *,
    body: bytes | None = b"",
    headers: dict[str, str] | None = None,
    mode: str = "regular",
) -> http.HTTPFlow:
    request = tutils.treq(
        host=host,
        port=443,
        method=method.encode(),
        scheme=b"https",
        path=path.encode(),
        headers=http.Headers([(k.encode(), v.encode()) for k, v in (headers or {}).items()]),
        content=body,
    )
    flow = tflow.tflow(req=request)
    flow.client_conn.proxy_mode = ProxyMode.parse(mode)
    return flow


def answer(shared: Shared, flow: http.HTTPFlow) -> tuple[int, Any] | None:
    asyncio.run(ControlPlaneAddon(shared).request(flow))
    if flow.response is None:
        return None
    assert flow.response.headers["content-type"] == "application/json"
    return flow.response.status_code, orjson.loads(flow.response.content)


def plane_shared() -> tuple[Shared, _Store]:
    store = _Store()
    shared = Shared(control=ControlPlane(store, TOKEN))  # type: ignore[arg-type]
    return shared, store


# --- which flows it answers -------------------------------------------------------------------------------------------


def test_a_reward_post_on_polar_local_with_the_token_is_stored() -> None:
    shared, store = plane_shared()
    flow = make_flow("polar.local", "/sessions/s1/reward", body=b'{"value": 0.5}', headers={"authorization": BEARER})
    assert answer(shared, flow) == (200, {"ok": True, "session_id": "s1"})
    assert store.calls == [("reward", "s1", 0.5, {"name": "reward", "source": "proxy"})]


@pytest.mark.parametrize(
    "headers",
    [
        {},
        {"authorization": "Bearer " + "x" * 24},
        # The session's own proxy credentials never stand in for the control token.
        {"proxy-authorization": BEARER},
        {"x-authorization": BEARER},
    ],
    ids=["none", "wrong", "proxy-authorization", "other-header"],
)
def test_a_post_without_the_token_in_the_authorization_header_is_refused(headers: dict[str, str]) -> None:
    shared, store = plane_shared()
    flow = make_flow("polar.local", "/sessions/s1/reward", body=b'{"value": 1}', headers=headers)
    assert answer(shared, flow) == (401, UNAUTHORIZED)
    assert store.calls == []


def test_a_get_without_a_body_reads_the_modes() -> None:
    shared, _ = plane_shared()
    flow = make_flow("POLAR.LOCAL.", "/sessions?x=1", "GET", body=None, headers={"authorization": BEARER})
    assert answer(shared, flow) == (200, {"ok": True, "sessions": "claimed", "sampling": "client"})


def test_a_post_without_a_body_is_read_as_an_empty_one() -> None:
    shared, store = plane_shared()
    flow = make_flow("polar.local", "/sessions/s1/reward", body=None, headers={"authorization": BEARER})
    assert answer(shared, flow) == (
        400,
        {"error": {"type": "invalid_request", "message": 'polar control: missing "value"'}},
    )
    assert store.calls == []


def test_any_other_path_on_polar_local_is_a_404_never_forwarded() -> None:
    shared, _ = plane_shared()
    flow = make_flow("polar.local", "/v1/messages", headers={"authorization": BEARER})
    assert answer(shared, flow) == (404, {"error": {"type": "not_found", "message": "polar control: no such path"}})


def test_a_reverse_listener_answers_its_control_paths() -> None:
    shared, store = plane_shared()
    reverse = "reverse:http://engine.local:8000"
    flow = make_flow(
        "engine.local", "/sessions/s2/reward", body=b'{"value": 1}', headers={"authorization": BEARER}, mode=reverse
    )
    assert answer(shared, flow) == (200, {"ok": True, "session_id": "s2"})
    assert store.calls[0][:3] == ("reward", "s2", 1.0)
    assert answer(shared, make_flow("engine.local", "/v1/messages", mode=reverse)) is None


def test_a_control_path_on_a_provider_host_is_not_the_control_planes() -> None:
    shared, store = plane_shared()
    flow = make_flow("api.openai.com", "/sessions/s1/reward", body=b'{"value": 1}', headers={"authorization": BEARER})
    assert answer(shared, flow) is None  # refused 404 by the scope, never stored
    assert store.calls == []


def test_nothing_is_answered_before_the_plane_exists_or_twice() -> None:
    flow = make_flow("polar.local", "/sessions", "GET", headers={"authorization": BEARER})
    assert answer(Shared(), flow) is None
    shared, _ = plane_shared()
    flow.response = http.Response.make(413, b"too large")
    asyncio.run(ControlPlaneAddon(shared).request(flow))
    assert flow.response.status_code == 413 and flow.response.content == b"too large"


# --- the plane and its token ------------------------------------------------------------------------------------------


@pytest.fixture(autouse=True)
def _elsewhere(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A token generated for the default polar_out ("shards", relative) lands in the test's directory."""
    monkeypatch.chdir(tmp_path)


def test_the_plane_is_made_once_on_the_gateways_store_and_the_token_can_be_changed(tmp_path: Path) -> None:
    released: list[str] = []
    gateway = _gateway(released)
    shared = Shared()
    addon = ControlPlaneAddon(shared)
    with taddons.context(_CaptureOptions(), addon) as tctx:
        tctx.configure(addon, polar_control_token=TOKEN)
        assert shared.control is None  # no gateway yet
        shared.gateway = gateway  # type: ignore[assignment]
        tctx.configure(addon, ssl_insecure=True)
        assert shared.control is None  # not one of polar's options
        tctx.configure(addon, polar_out=str(tmp_path / "out"))
        control = shared.control
        assert control is not None and control.token == TOKEN and control.store is gateway.store
        control.on_session_end("s1")
        assert released == ["s1"]
        assert (control.sessions_mode(), control.sampling_mode()) == ("claimed", "client")
        tctx.configure(addon, polar_sessions="registered", polar_sampling="fixed")
        assert (control.sessions_mode(), control.sampling_mode()) == ("registered", "fixed")
        # A new token keeps the plane, and with it the registry: an ended session stays ended.
        control.sessions.end("ended-before")
        tctx.configure(addon, polar_control_token="n" * 16)
        assert shared.control is control and control.token == "n" * 16
        assert control.sessions.ended("ended-before")


def test_a_token_too_short_or_with_a_space_fails_at_start() -> None:
    addon = ControlPlaneAddon(Shared(gateway=_gateway()))  # type: ignore[arg-type]
    said = "polar: polar_control_token must be at least 16 printable ASCII characters without spaces"
    with taddons.context(_CaptureOptions(), addon) as tctx:
        for bad in ("k" * 15, "k" * 8 + " " + "k" * 8):
            with pytest.raises(exceptions.OptionsError) as err:
                tctx.configure(addon, polar_control_token=bad)
            assert str(err.value) == said
        tctx.configure(addon, polar_control_token="k" * 16)
        assert addon.shared.control.token == "k" * 16


def test_without_a_token_one_is_generated_next_to_a_local_store(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    addon = ControlPlaneAddon(Shared(gateway=_gateway()))  # type: ignore[arg-type]
    with taddons.context(_CaptureOptions(), addon) as tctx:
        with caplog.at_level(logging.INFO, logger="polar"):
            tctx.configure(addon, polar_out=str(tmp_path / "out"))
        path = tmp_path / "out" / ".control-token"
        token = path.read_text().strip()
        assert addon.shared.control.token == token and len(token) >= 32
        assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
        assert f"polar: control token (for reward/status posts) in {path}" in caplog.messages


def test_a_remote_stores_token_is_kept_in_the_confdir(tmp_path: Path) -> None:
    addon = ControlPlaneAddon(Shared(gateway=_gateway()))  # type: ignore[arg-type]
    with taddons.context(_CaptureOptions(), addon) as tctx:
        tctx.configure(addon, confdir=str(tmp_path / "conf"), polar_out="s3://bucket/prefix")
        token = (tmp_path / "conf" / "polar-control-token").read_text().strip()
        assert addon.shared.control.token == token
