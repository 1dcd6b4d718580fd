"""Two proxies and two engines behind one store (``polar_engine=a,b`` on each proxy, as every node of a fleet runs
its own), end to end: two real mitmdumps with the polar addon writing one store, the official SDKs as clients
(each session always through the same proxy, as a session stays on its node), and two engine servers answering like
SGLang (the SGLang contract server, real tokens from the scripted engine over the tiny model underneath; SGLang
itself needs a GPU).

Each session's calls all go to one engine (recorded per call), sessions spread over both; when one engine's server
stops, only the sessions on it get errors (in their provider's shape, recorded failed, session status error, on
both proxies), never moved to the other engine mid-session; the others and new sessions go on on the live engine; a
status ``completed`` the rollout runner posts afterwards does not turn such a session back; the store validates."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path
from typing import Any

import anthropic
import httpx
import openai
import pytest
from typer.testing import CliRunner

from polar_addon.engines.scripted import ScriptedEngine
from polar_addon.store import read_records, read_sessions
from polar_cli.app import app
from tests.support.proxy import run_mitmdump
from tests.support.shards import wait_for_shards

SESSIONS = 12
TURNS = 3


def _speaks_anthropic(session: str) -> bool:
    # Sessions alternate between the engines: s-0, s-1 Anthropic, s-2, s-3 OpenAI, ... puts both shapes on each.
    return int(session.rsplit("-", 1)[1]) % 4 < 2


def _call(url: str, session: str, history: list[dict]) -> str:
    """One turn of ``session`` through the proxy, in the Anthropic or the OpenAI shape."""
    if _speaks_anthropic(session):
        msg = anthropic.Anthropic(base_url=url, api_key=f"polar:{session}", max_retries=0).messages.create(
            model="tiny", max_tokens=64, messages=history
        )
        return msg.content[0].text
    reply = openai.OpenAI(base_url=url + "/v1", api_key=f"polar:{session}", max_retries=0).chat.completions.create(
        model="tiny", max_tokens=64, messages=history
    )
    return reply.choices[0].message.content or ""


def _proxy_of(session: str, proxies: list) -> Any:
    """The proxy a session always talks to: the first half of the sessions through one, the rest through the other
    (each proxy then holds both shapes on both engines)."""
    if not session.startswith("s-"):
        return proxies[int(session.rsplit("-", 1)[1]) % len(proxies)]
    return proxies[int(session.rsplit("-", 1)[1]) * len(proxies) // SESSIONS]


def _turn(proxies: list, session: str, histories: dict[str, list[dict]]) -> None:
    url = _proxy_of(session, proxies).url
    history = histories.setdefault(session, [])
    history.append({"role": "user", "content": f"step {len(history) // 2} of {session}"})
    history.append({"role": "assistant", "content": _call(url, session, history)})


@pytest.mark.timeout(300)
def test_two_proxies_keep_sessions_on_one_engine_and_a_dead_engine_fails_only_its_sessions(
    tiny_model_dir: Path, sglang_protocol, tmp_path: Path
) -> None:
    from tests.support.sglang_contract_server import SGLangContractServer

    protocol = sglang_protocol
    script = tmp_path / "script.json"
    script.write_text(
        json.dumps(
            {
                "model_dir": str(tiny_model_dir),
                "cycle": True,
                "turns": [{"content": "Looking."}, {"content": "Found it."}, {"content": "Done."}],
            }
        )
    )
    out = tmp_path / "shards"
    a = SGLangContractServer(ScriptedEngine(script), protocol=protocol).__enter__()
    b = SGLangContractServer(ScriptedEngine(script), protocol=protocol).__enter__()
    b_stopped = False
    try:
        engines, options = f"sglang:{a.url},sglang:{b.url}", {"polar_shard_seconds": "0.2"}
        # Started one after the other: the first creates the store's control token and the CA the second reuses.
        with (
            run_mitmdump(engines, out, mode="reverse:https://api.anthropic.com", options=options) as first,
            run_mitmdump(engines, out, mode="reverse:https://api.anthropic.com", options=options) as second,
        ):
            proxies = [first, second]
            histories: dict[str, list[dict]] = {}
            sessions = [f"s-{i}" for i in range(SESSIONS)]
            for _ in range(TURNS):  # interleaved: each round, every session makes its next call
                for session in sessions:
                    _turn(proxies, session, histories)
            wait_for_shards(out)
            engine_of = {}
            for session in sessions:
                engines = {r.engine for r in read_records(str(out), [session])}
                assert len(engines) == 1, (session, engines)  # affinity: every call on one engine
                engine_of[session] = engines.pop()
            assert Counter(engine_of.values()) == {f"sglang:{a.url}": SESSIONS // 2, f"sglang:{b.url}": SESSIONS // 2}
            assert len(a.requests) == len(b.requests) == SESSIONS // 2 * TURNS

            b.__exit__(None, None, None)  # engine b's server is gone: connections to it are refused
            b_stopped = True
            on_b = sorted(s for s in sessions if engine_of[s] == f"sglang:{b.url}")
            errors = {}
            for session in sessions:
                try:
                    _turn(proxies, session, histories)
                except (anthropic.APIStatusError, openai.APIStatusError) as exc:
                    errors[session] = exc
            assert sorted(errors) == on_b  # only the dead engine's sessions fail, each in its provider's shape
            assert {type(e).__module__.split(".")[0] for e in errors.values()} == {"anthropic", "openai"}
            for _, exc in errors.items():
                assert exc.status_code in (502, 503)
                if isinstance(exc, anthropic.APIStatusError):
                    assert exc.body["type"] == "error" and exc.body["error"]["type"] in (
                        "api_error",
                        "overloaded_error",
                    )
                else:
                    assert exc.body["type"] in ("server_error", "overloaded") and exc.body["message"]
                assert b.url.split("//")[1] not in str(exc.body)  # the engine's address stays in the proxy log
            # Its sessions stay ended: never moved to engine a mid-session.
            with pytest.raises(anthropic.APIStatusError) as again:
                _turn(proxies, next(s for s in on_b if _speaks_anthropic(s)), histories)
            assert again.value.status_code == 502 and "taken out" in again.value.message
            for i in range(4):  # new sessions go to the live engine
                _turn(proxies, f"new-{i}", histories)
            # The rollout runner posts how the harness ended (it exited 0) after the proxy ended the session: the
            # proxy's error stands.
            late = on_b[0]
            posted = httpx.post(
                f"{_proxy_of(late, proxies).url}/sessions/{late}/status",
                json={"status": "completed"},
                headers=first.control_headers(),
                timeout=30,
            )
            assert posted.status_code == 200, posted.text
            # ... and the proxy answers with the status the store keeps, so the runner's summary says error too.
            assert posted.json()["status"] == "error" and "taken out" in posted.json()["final_because"]
            wait_for_shards(out)
    finally:
        a.__exit__(None, None, None)
        if not b_stopped:
            b.__exit__(None, None, None)

    records = read_records(str(out))
    for session in sessions:
        mine = [r for r in records if r.session_id == session]
        if session in on_b:
            assert [r.status for r in mine].count("ok") == TURNS and mine[-1].status == "failed"
            assert all(r.engine in (f"sglang:{b.url}", None) for r in mine)
        else:
            assert [r.status for r in mine] == ["ok"] * (TURNS + 1)
            assert {r.engine for r in mine} == {f"sglang:{a.url}"}
    assert {r.engine for r in records if r.session_id.startswith("new-")} == {f"sglang:{a.url}"}
    status = {s.session_id: s.status for s in read_sessions(str(out))}
    assert {s for s in sessions if status[s] == "error"} == set(on_b)  # on_b[0] too, posted completed after
    result = CliRunner().invoke(app, ["shards", "validate", str(out)])
    assert result.exit_code == 0, result.output
