"""The rollout proxy's parts that need no mitmdump (polar_cli.rollout.proxy): a running proxy's endpoints, a
rollout directory's writer fence, the session-mode check, and the control client on a mock transport (its
retries, refusals and answers, each in its exact words)."""

from __future__ import annotations

import asyncio
import fcntl
import os
import subprocess
import threading
import time
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import httpx
import pytest

import polar_cli.rollout.proxy as proxy_module
from polar_cli.rollout.proxy import (
    CLAIMED_REFUSAL,
    ControlClient,
    ControlError,
    ExternalProxy,
    StartedProxy,
    WriterAlive,
    check_sessions_mode,
    claim_writer,
    proxy_sessions_mode,
    wait_writer_gone,
)
from polar_cli.rollout.runtimes.base import ProxyEndpoints

TOKEN = "control-token-0123456789abcdef"

# -- a running proxy's endpoints ------------------------------------------------------------------------------------


@pytest.fixture
def ca(tmp_path: Path) -> Path:
    path = tmp_path / "mitmproxy-ca-cert.pem"
    path.write_text("cert")
    return path


def test_the_reverse_listener_defaults_to_the_next_port(ca: Path) -> None:
    assert ExternalProxy("http://127.0.0.1:8080", TOKEN, ca=ca).endpoints() == ProxyEndpoints(8080, 8081, ca)
    assert ExternalProxy("localhost:9000", TOKEN, ca=ca).endpoints() == ProxyEndpoints(9000, 9001, ca)
    given = ExternalProxy("127.0.0.1:8080", TOKEN, reverse_url="http://localhost:7000", ca=ca)
    assert given.endpoints() == ProxyEndpoints(8080, 7000, ca)


def test_the_ca_path_is_expanded_and_must_be_a_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HOME", str(tmp_path))
    (tmp_path / "conf").mkdir()
    (tmp_path / "conf" / "ca.pem").write_text("cert")
    home = ExternalProxy("127.0.0.1:1", TOKEN, ca=Path("~/conf/ca.pem"))
    assert home.endpoints().ca == tmp_path / "conf" / "ca.pem"
    for missing in (tmp_path / "nowhere.pem", tmp_path / "conf"):  # absent, or a directory
        with pytest.raises(ValueError) as refused:
            ExternalProxy("127.0.0.1:1", TOKEN, ca=missing).endpoints()
        assert str(refused.value) == f"{missing}: no mitmproxy CA certificate there (give the proxy's confdir)"
    assert ExternalProxy("127.0.0.1:1", TOKEN).ca == Path("~/.mitmproxy/mitmproxy-ca-cert.pem")
    assert ExternalProxy("127.0.0.1:1", TOKEN).trust_claimed is False


@pytest.mark.parametrize(
    ("forward", "reverse", "named", "url"),
    [
        ("http://10.0.0.5:8080", None, "--proxy", "http://10.0.0.5:8080"),
        ("http://127.0.0.1", None, "--proxy", "http://127.0.0.1"),  # no port
        ("proxy.example:8080", None, "--proxy", "proxy.example:8080"),
        ("127.0.0.1:8080", "http://0.0.0.0:8081", "--reverse-url", "http://0.0.0.0:8081"),
        ("127.0.0.1:8080", "127.0.0.2:8081", "--reverse-url", "127.0.0.2:8081"),
    ],
)
def test_only_a_loopback_url_with_a_port_is_taken(
    ca: Path, forward: str, reverse: str | None, named: str, url: str
) -> None:
    with pytest.raises(ValueError) as refused:
        ExternalProxy(forward, TOKEN, reverse_url=reverse, ca=ca).endpoints()
    assert str(refused.value) == (
        f"{named} {url!r}: give http://127.0.0.1:PORT (sandboxes reach the proxy on this host's loopback)"
    )


def test_a_started_proxys_log_is_read_whole_even_when_it_is_not_utf8(tmp_path: Path) -> None:
    log = tmp_path / "mitmdump.log"
    log.write_bytes(b"listening\n\xff bad byte\n")
    started = StartedProxy(ProxyEndpoints(1, 2, tmp_path), TOKEN, log, None)  # type: ignore[arg-type]
    assert started.logs() == "listening\n\ufffd bad byte\n"


# -- the writer fence -----------------------------------------------------------------------------------------------


def _locked(path: Path) -> bool:
    fd = os.open(path, os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    finally:
        os.close(fd)
    return False


def test_a_claim_is_a_fresh_exclusively_locked_lock_file_in_a_made_directory(tmp_path: Path) -> None:
    logs = tmp_path / "iter-000" / "logs"
    fd, path = claim_writer(logs)
    other_fd, other = claim_writer(logs)  # a second proxy (another Ray node) holds its own
    try:
        assert path.parent == logs and path.name.startswith("proxy-") and path.name.endswith(".lock")
        assert other != path and _locked(path) and _locked(other)
    finally:
        os.close(fd)
        os.close(other_fd)
    assert not _locked(path)


def test_no_directory_or_no_live_writer_is_no_wait(tmp_path: Path) -> None:
    wait_writer_gone(tmp_path / "never-made", timeout_s=0)
    logs = tmp_path / "logs"
    fd, _ = claim_writer(logs)
    os.close(fd)  # its proxy is gone
    started = time.monotonic()
    wait_writer_gone(logs, timeout_s=5)
    assert time.monotonic() - started < 1


def test_a_live_writer_is_refused_at_the_deadline_with_its_pid(tmp_path: Path) -> None:
    logs = tmp_path / "run" / "logs"
    fd, path = claim_writer(logs)
    os.pwrite(fd, b"4242\n", 0)
    try:
        started = time.monotonic()
        with pytest.raises(WriterAlive) as alive:
            wait_writer_gone(logs, timeout_s=0.3)
        assert time.monotonic() - started >= 0.3
        assert str(alive.value) == (
            f"a proxy of an earlier run (pid 4242) still writes into {tmp_path / 'run'}: stop it, or use another"
            " directory"
        )
        assert alive.value.__suppress_context__
        os.ftruncate(fd, 0)
        os.pwrite(fd, b"\xff7\n", 0)
        with pytest.raises(WriterAlive, match=r"\(pid \ufffd7\)"):
            wait_writer_gone(logs, timeout_s=0)
        os.ftruncate(fd, 0)  # the pid not written yet
        with pytest.raises(WriterAlive, match=r"\(pid \?\)"):
            wait_writer_gone(logs, timeout_s=0)
    finally:
        os.close(fd)
    assert path.is_file()  # the fence is the caller's to remove


def test_a_pid_is_read_from_the_start_of_the_fence(tmp_path: Path) -> None:
    fd, _ = claim_writer(tmp_path)
    os.pwrite(fd, b"1234567890123456789012345678901234567890\n", 0)
    try:
        with pytest.raises(WriterAlive, match=r"\(pid 12345678901234567890123456789012\)"):
            wait_writer_gone(tmp_path, timeout_s=0)
    finally:
        os.close(fd)


def test_only_the_proxy_fences_are_waited_on(tmp_path: Path) -> None:
    other = tmp_path / "engine.lock"
    other.write_text("1\n")
    fd = os.open(other, os.O_RDONLY)
    fcntl.flock(fd, fcntl.LOCK_EX)
    try:
        wait_writer_gone(tmp_path, timeout_s=0)
    finally:
        os.close(fd)


def test_a_writer_that_goes_during_the_wait_ends_it_at_once(tmp_path: Path) -> None:
    fd, _ = claim_writer(tmp_path)
    os.pwrite(fd, b"77\n", 0)
    threading.Timer(0.15, os.close, (fd,)).start()
    started = time.monotonic()
    wait_writer_gone(tmp_path, timeout_s=10)
    # polled every 50 ms: well before the next second
    assert 0.1 <= time.monotonic() - started < 0.9


def test_every_fence_is_waited_on(tmp_path: Path) -> None:
    gone_fd, _ = claim_writer(tmp_path)
    os.close(gone_fd)
    claims = sorted((claim_writer(tmp_path) for _ in range(2)), key=lambda claim: claim[1])
    for pid, (fd, _) in enumerate(claims, start=100):
        os.pwrite(fd, f"{pid}\n".encode(), 0)
    try:
        with pytest.raises(WriterAlive, match=r"\(pid 100\)"):
            wait_writer_gone(tmp_path, timeout_s=0)
        os.close(claims[0][0])
        with pytest.raises(WriterAlive, match=r"\(pid 101\)"):  # the second live one, after the first went
            wait_writer_gone(tmp_path, timeout_s=0)
    finally:
        os.close(claims[1][0])
    wait_writer_gone(tmp_path, timeout_s=0)


def test_a_fence_removed_meanwhile_is_skipped(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    fd, path = claim_writer(tmp_path)
    real_open = os.open

    def racing_open(name: Any, flags: int, *args: Any) -> int:
        if Path(name) == path:
            raise FileNotFoundError(name)  # removed between the listing and the open
        return real_open(name, flags, *args)

    monkeypatch.setattr(os, "open", racing_open)
    try:
        wait_writer_gone(tmp_path, timeout_s=0)
    finally:
        monkeypatch.undo()
        os.close(fd)


def test_the_fences_after_one_removed_meanwhile_are_still_waited_on(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    claims = sorted((claim_writer(tmp_path) for _ in range(2)), key=lambda claim: claim[1])
    (_, removed), (live_fd, _) = claims
    os.pwrite(live_fd, b"55\n", 0)
    real_open = os.open

    def racing_open(name: Any, flags: int, *args: Any) -> int:
        if Path(name) == removed:
            raise FileNotFoundError(name)
        return real_open(name, flags, *args)

    monkeypatch.setattr(os, "open", racing_open)
    try:
        with pytest.raises(WriterAlive, match=r"\(pid 55\)"):
            wait_writer_gone(tmp_path, timeout_s=0)
    finally:
        monkeypatch.undo()
        for fd, _ in claims:
            os.close(fd)


def test_a_writer_in_another_process_holds_the_fence(tmp_path: Path) -> None:
    fd, _ = claim_writer(tmp_path)
    holder = subprocess.Popen(["sleep", "30"], pass_fds=(fd,))
    os.pwrite(fd, f"{holder.pid}\n".encode(), 0)
    os.close(fd)
    try:
        with pytest.raises(WriterAlive, match=f"pid {holder.pid}"):
            wait_writer_gone(tmp_path, timeout_s=0.1)
    finally:
        holder.kill()
        holder.wait()
    wait_writer_gone(tmp_path, timeout_s=5)


def test_the_default_wait_is_fifteen_seconds(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    fd, _ = claim_writer(tmp_path)
    clock = iter([1000.0, 1014.9, 1015.0])
    monkeypatch.setattr(proxy_module, "time", SimpleNamespace(monotonic=lambda: next(clock), sleep=lambda _s: None))
    try:
        with pytest.raises(WriterAlive):
            wait_writer_gone(tmp_path)
        assert next(clock, "spent") == "spent"  # 14.9 s still waits, 15.0 s does not
    finally:
        os.close(fd)


# -- the session mode -----------------------------------------------------------------------------------------------


def test_a_registered_proxy_is_taken_silently_trusted_or_not() -> None:
    assert check_sessions_mode("registered", False) is None
    assert check_sessions_mode("registered", True) is None


def test_a_claimed_proxy_is_refused_unless_trusted_then_warned_about() -> None:
    with pytest.raises(ControlError) as refused:
        check_sessions_mode("claimed", False)
    assert str(refused.value) == CLAIMED_REFUSAL
    assert CLAIMED_REFUSAL == (
        "the proxy runs polar_sessions=claimed: an agent in one session could write calls into another and relabel"
        " task, group and sample (trust on claim). Restart it with --set polar_sessions=registered, or pass"
        " --trust-claimed-sessions if every agent is trusted"
    )
    assert check_sessions_mode("claimed", True) == (
        "WARNING: the proxy runs polar_sessions=claimed: an agent in one session could write calls into another and"
        " relabel task, group and sample (trust on claim).: used anyway (--trust-claimed-sessions)"
    )


@pytest.mark.parametrize("trusted", [False, True])
def test_any_other_mode_is_refused_even_trusted(trusted: bool) -> None:
    for mode in ("None", "open", "Registered"):
        with pytest.raises(ControlError) as refused:
            check_sessions_mode(mode, trusted)
        assert str(refused.value) == f"the proxy's session mode is {mode!r}, not registered"


# -- the control client ---------------------------------------------------------------------------------------------

Handler = Callable[[httpx.Request], httpx.Response]


class _Transport:
    """Stands in for httpx in the module: the client it builds answers through ``handler``; what it was built with
    and every request are kept."""

    def __init__(self, handler: Handler) -> None:
        self.handler = handler
        self.built: list[dict[str, Any]] = []
        self.requests: list[httpx.Request] = []
        self.closed = False

    def client(self, **kwargs: Any) -> httpx.AsyncClient:
        self.built.append(kwargs)

        def answer(request: httpx.Request) -> httpx.Response:
            self.requests.append(request)
            return self.handler(request)

        transport = self

        class Client(httpx.AsyncClient):
            async def aclose(self) -> None:
                transport.closed = True
                await super().aclose()

        return Client(transport=httpx.MockTransport(answer), headers=kwargs["headers"], timeout=kwargs["timeout"])


@pytest.fixture
def sleeps(monkeypatch: pytest.MonkeyPatch) -> list[float]:
    slept: list[float] = []

    async def sleep(delay: float) -> None:
        slept.append(delay)

    monkeypatch.setattr(proxy_module.asyncio, "sleep", sleep)
    return slept


def _client(monkeypatch: pytest.MonkeyPatch, handler: Handler, attempts: int = 5) -> tuple[ControlClient, _Transport]:
    transport = _Transport(handler)
    monkeypatch.setattr(
        proxy_module, "httpx", SimpleNamespace(AsyncClient=transport.client, TransportError=httpx.TransportError)
    )
    return ControlClient(4321, TOKEN, attempts=attempts), transport


def _json(request: httpx.Request) -> Any:
    import json

    return json.loads(request.content) if request.content else None


def test_the_client_goes_through_the_forward_listener_with_the_token(
    monkeypatch: pytest.MonkeyPatch, sleeps: list[float]
) -> None:
    client, transport = _client(monkeypatch, lambda r: httpx.Response(200, json={}))
    asyncio.run(client.reward("s1", 0.5))
    assert transport.built == [
        {"proxy": "http://127.0.0.1:4321", "timeout": 60, "headers": {"authorization": f"Bearer {TOKEN}"}}
    ]
    [request] = transport.requests
    assert request.method == "POST" and str(request.url) == "http://polar.local/sessions/s1/reward"
    assert request.headers["authorization"] == f"Bearer {TOKEN}"
    assert _json(request) == {"value": 0.5, "name": "reward"}
    assert sleeps == []
    asyncio.run(client.aclose())
    assert transport.closed


def test_a_reward_with_its_name(monkeypatch: pytest.MonkeyPatch, sleeps: list[float]) -> None:
    client, transport = _client(monkeypatch, lambda r: httpx.Response(200, json={"ok": True}))
    assert asyncio.run(client.reward("s2", 1.0, name="tests")) is None
    assert _json(transport.requests[0]) == {"value": 1.0, "name": "tests"}


def test_a_503_is_retried_with_a_growing_pause_until_the_store_persists(
    monkeypatch: pytest.MonkeyPatch, sleeps: list[float]
) -> None:
    answers = iter([httpx.Response(503, text="cannot persist")] * 4 + [httpx.Response(200, json={"status": "x"})])
    client, transport = _client(monkeypatch, lambda r: next(answers))
    assert asyncio.run(client._post("s1", "status", {"status": "x"})) == {"status": "x"}
    assert sleeps == [0.5, 1.0, 1.5, 2.0] and len(transport.requests) == 5


def test_the_last_503_is_the_error_with_the_answers_text(monkeypatch: pytest.MonkeyPatch, sleeps: list[float]) -> None:
    client, transport = _client(monkeypatch, lambda r: httpx.Response(503, text="x" * 600), attempts=3)
    with pytest.raises(ControlError) as failed:
        asyncio.run(client.reward("s1", 1.0))
    assert str(failed.value) == "reward of s1: HTTP 503: " + "x" * 500
    assert sleeps == [0.5, 1.0] and len(transport.requests) == 3


@pytest.mark.parametrize("code", [400, 401, 404, 500, 502])
def test_any_other_status_is_the_error_at_once(monkeypatch: pytest.MonkeyPatch, sleeps: list[float], code: int) -> None:
    client, transport = _client(monkeypatch, lambda r: httpx.Response(code, text="no such session"))
    with pytest.raises(ControlError) as failed:
        asyncio.run(client.reward("s7", 1.0))
    assert str(failed.value) == f"reward of s7: HTTP {code}: no such session"
    assert sleeps == [] and len(transport.requests) == 1


def test_a_transport_error_is_retried_and_the_last_one_is_the_error(
    monkeypatch: pytest.MonkeyPatch, sleeps: list[float]
) -> None:
    def refuse(request: httpx.Request) -> httpx.Response:
        raise httpx.ConnectError("connection refused")

    client, transport = _client(monkeypatch, refuse, attempts=2)
    with pytest.raises(ControlError) as failed:
        asyncio.run(client.reward("s1", 1.0))
    assert str(failed.value) == "reward of s1: connection refused"
    assert isinstance(failed.value.__cause__, httpx.ConnectError)
    assert sleeps == [0.5] and len(transport.requests) == 2

    answers = iter([httpx.ConnectError("down"), httpx.Response(200, json={"secret": "k", "sessions": "registered"})])

    def flaky(request: httpx.Request) -> httpx.Response:
        answer = next(answers)
        if isinstance(answer, Exception):
            raise answer
        return answer

    client, _ = _client(monkeypatch, flaky)
    assert asyncio.run(client.register("s1", "t", "g", 0)) == ("k", "registered")


def test_a_200_that_is_no_json_object_is_an_empty_answer(monkeypatch: pytest.MonkeyPatch, sleeps: list[float]) -> None:
    for body in (b"not json", b"[1, 2]", b"", b"null"):
        client, _ = _client(monkeypatch, lambda r, body=body: httpx.Response(200, content=body))
        assert asyncio.run(client._request("GET", "http://polar.local/sessions", "probe")) == {}
        assert asyncio.run(client.status("s1", "completed")) == ("completed", None)


def test_register_sends_the_labels_and_needs_a_secret(monkeypatch: pytest.MonkeyPatch, sleeps: list[float]) -> None:
    client, transport = _client(monkeypatch, lambda r: httpx.Response(200, json={"secret": "sek", "sessions": None}))
    assert asyncio.run(client.register("s3", "task-a", "group-a", 2)) == ("sek", "None")
    assert str(transport.requests[0].url) == "http://polar.local/sessions/s3/register"
    assert _json(transport.requests[0]) == {"task": "task-a", "group": "group-a", "sample": 2}
    for answer in ({}, {"secret": ""}, {"secret": 5}, {"secret": None}):
        client, _ = _client(monkeypatch, lambda r, answer=answer: httpx.Response(200, json=answer))
        with pytest.raises(ControlError) as refused:
            asyncio.run(client.register("s3", "t", "g", 0))
        assert str(refused.value) == "register of s3: the proxy returned no secret"


def test_a_status_is_posted_with_its_metadata_only_when_there_is_some(
    monkeypatch: pytest.MonkeyPatch, sleeps: list[float]
) -> None:
    client, transport = _client(monkeypatch, lambda r: httpx.Response(200, json={"status": "failed"}))
    assert asyncio.run(client.status("s4", "failed", {"reason": "tests"})) == ("failed", None)
    assert asyncio.run(client.status("s4", "failed", {})) == ("failed", None)
    assert str(transport.requests[0].url) == "http://polar.local/sessions/s4/status"
    assert [_json(r) for r in transport.requests] == [
        {"status": "failed", "metadata": {"reason": "tests"}},
        {"status": "failed"},
    ]


def test_a_status_the_store_overrode_says_what_it_is_and_why(
    monkeypatch: pytest.MonkeyPatch, sleeps: list[float]
) -> None:
    answers = {
        "s1": {"status": "error", "final_because": "the proxy ended it: body too large"},
        "s2": {"status": "error"},
        "s3": {"status": "error", "final_because": None},
        "s4": {"status": 3},
    }
    client, _ = _client(monkeypatch, lambda r: httpx.Response(200, json=answers[r.url.path.split("/")[2]]))
    assert asyncio.run(client.status("s1", "completed")) == ("error", "the proxy ended it: body too large")
    assert asyncio.run(client.status("s2", "completed")) == ("error", "")
    assert asyncio.run(client.status("s3", "completed")) == ("error", "")
    assert asyncio.run(client.status("s4", "completed")) == ("completed", None)  # not a status: an older proxy


def test_the_modes_are_asked_with_a_get_and_a_sampling_mode_only_when_it_is_text(
    monkeypatch: pytest.MonkeyPatch, sleeps: list[float]
) -> None:
    answers = iter(
        [{"sessions": "registered", "sampling": "fixed"}, {"sessions": "claimed", "sampling": 1}, {}, {"x": 1}]
    )
    client, transport = _client(monkeypatch, lambda r: httpx.Response(200, json=next(answers)))
    assert asyncio.run(client.modes()) == ("registered", "fixed")
    assert asyncio.run(client.modes()) == ("claimed", None)
    assert asyncio.run(client.sessions_mode()) == "None"
    assert asyncio.run(client.sessions_mode()) == "None"
    assert {(r.method, str(r.url), r.content) for r in transport.requests} == {
        ("GET", "http://polar.local/sessions", b"")
    }


def test_a_proxy_that_predates_the_modes_is_a_control_error(
    monkeypatch: pytest.MonkeyPatch, sleeps: list[float]
) -> None:
    client, _ = _client(monkeypatch, lambda r: httpx.Response(404, text="Not Found"))
    with pytest.raises(ControlError) as failed:
        asyncio.run(client.sessions_mode())
    assert str(failed.value) == "the session mode: HTTP 404: Not Found"


def test_the_default_is_five_attempts(monkeypatch: pytest.MonkeyPatch, sleeps: list[float]) -> None:
    transport = _Transport(lambda r: httpx.Response(503))
    monkeypatch.setattr(
        proxy_module, "httpx", SimpleNamespace(AsyncClient=transport.client, TransportError=httpx.TransportError)
    )
    with pytest.raises(ControlError, match="HTTP 503"):
        asyncio.run(ControlClient(1, TOKEN).reward("s", 1.0))
    assert len(transport.requests) == 5


# -- asking a running proxy before a rollout starts on it -----------------------------------------------------------


def _external(monkeypatch: pytest.MonkeyPatch, answer: dict[str, Any]) -> _Transport:
    transport = _Transport(lambda r: httpx.Response(200, json=answer))
    monkeypatch.setattr(
        proxy_module, "httpx", SimpleNamespace(AsyncClient=transport.client, TransportError=httpx.TransportError)
    )
    return transport


def test_a_registered_fixed_sampling_proxy_is_taken_silently(
    monkeypatch: pytest.MonkeyPatch, ca: Path, capsys: pytest.CaptureFixture[str], sleeps: list[float]
) -> None:
    transport = _external(monkeypatch, {"sessions": "registered", "sampling": "fixed"})
    proxy = ExternalProxy("http://127.0.0.1:5555", TOKEN, ca=ca)
    assert proxy_sessions_mode(proxy) == "registered"
    assert transport.built[0]["proxy"] == "http://127.0.0.1:5555" and transport.closed
    assert transport.requests[0].headers["authorization"] == f"Bearer {TOKEN}"
    assert capsys.readouterr().err == ""


def test_a_proxy_is_asked_once_without_retrying(monkeypatch: pytest.MonkeyPatch, ca: Path, sleeps: list[float]) -> None:
    transport = _Transport(lambda r: httpx.Response(503))
    monkeypatch.setattr(
        proxy_module, "httpx", SimpleNamespace(AsyncClient=transport.client, TransportError=httpx.TransportError)
    )
    with pytest.raises(ControlError, match="the session mode: HTTP 503"):
        proxy_sessions_mode(ExternalProxy("127.0.0.1:5555", TOKEN, ca=ca))
    assert len(transport.requests) == 1 and transport.closed


def test_a_client_sampling_proxy_is_refused_unless_trusted_then_warned_about(
    monkeypatch: pytest.MonkeyPatch, ca: Path, capsys: pytest.CaptureFixture[str], sleeps: list[float]
) -> None:
    _external(monkeypatch, {"sessions": "registered", "sampling": "client"})
    with pytest.raises(ControlError) as refused:
        proxy_sessions_mode(ExternalProxy("127.0.0.1:5555", TOKEN, ca=ca))
    assert str(refused.value).startswith("the proxy at 127.0.0.1:5555 runs polar_sampling=client, which ")
    assert refused.value.__suppress_context__ and refused.value.__cause__ is None
    _external(monkeypatch, {"sessions": "claimed"})
    assert proxy_sessions_mode(ExternalProxy("127.0.0.1:5555", TOKEN, ca=ca, trust_claimed=True)) == "claimed"
    assert capsys.readouterr().err == (
        "WARNING: the proxy at 127.0.0.1:5555 does not report its sampling mode (polar_sampling): used anyway"
        " (--trust-claimed-sessions)\n"
    )


def test_a_claimed_untrusted_proxys_mode_is_returned_unchecked_for_its_own_refusal(
    monkeypatch: pytest.MonkeyPatch, ca: Path, sleeps: list[float]
) -> None:
    # Its sampling would be refused too: the session mode's refusal (check_sessions_mode) must come first.
    _external(monkeypatch, {"sessions": "claimed", "sampling": "client"})
    assert proxy_sessions_mode(ExternalProxy("127.0.0.1:5555", TOKEN, ca=ca)) == "claimed"
