"""Engines built from their specs (polar_addon.engines.make_engine) and the pool that routes sessions to them
(EnginePool): the kind, target, timeout, weight version and per-token versions each spec gives its engine, which
engines take token input, and what a session sees when its engine is taken out or none is live (the status and the
exact words a harness gets, never the engine's address). No engine runs: nothing here sends a request."""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path
from typing import Any

import orjson
import pytest

from polar_addon.canonical import EngineFault, PolarError
from polar_addon.engines import EnginePool, EngineSettings, make_engine, takes_token_input
from polar_addon.engines.affinity import MAX_SESSIONS, MAX_STRIKES, REVIVE_AFTER_S
from polar_addon.engines.local import LocalEngine
from polar_addon.engines.openai_compat import HTTPEngine
from polar_addon.engines.scripted import ScriptedEngine
from polar_addon.engines.sglang import SGLangEngine
from polar_addon.engines.spec import EngineSpec
from polar_addon.engines.vllm import VLLMEngine
from polar_addon.tool_parsers import ParserChoice


class FakeEngine:
    """An Engine that records what the pool asks of it."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.calls: list[Any] = []

    def configure(self, settings: EngineSettings) -> None:
        self.calls.append(("configure", settings))

    def load(self) -> None:
        self.calls.append("load")

    async def close(self) -> None:
        self.calls.append("close")


# --- make_engine ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("spec_type", [str, EngineSpec.parse])
def test_an_sglang_spec_makes_an_sglang_client_with_its_url_timeout_and_version(spec_type: Any) -> None:
    engine = make_engine(spec_type("sglang:http://gpu1:30000/?weight_version=3"), timeout_s=12.5)
    assert type(engine) is SGLangEngine
    assert (engine.url, engine.name, engine.timeout_s) == ("http://gpu1:30000", "sglang:http://gpu1:30000", 12.5)
    assert engine.weight_version == "3"


def test_a_vllm_spec_makes_a_vllm_client_with_per_token_versions_only_when_asked() -> None:
    plain = make_engine("vllm:http://127.0.0.1:8000", timeout_s=7.0)
    assert type(plain) is VLLMEngine
    assert (plain.url, plain.name, plain.timeout_s) == ("http://127.0.0.1:8000", "vllm:http://127.0.0.1:8000", 7.0)
    assert (plain.token_versions, plain.weight_version) == (False, None)
    spans = make_engine("vllm:http://h:1?versions=spans&weight_version=step-4", timeout_s=3.0)
    assert type(spans) is VLLMEngine
    assert (spans.token_versions, spans.weight_version, spans.timeout_s) == (True, "step-4", 3.0)


def test_a_local_spec_makes_an_in_process_engine_with_its_window_and_version() -> None:
    engine = make_engine("local:models/tiny?max_len=64&weight_version=7", timeout_s=1.0)
    assert type(engine) is LocalEngine
    assert (engine.model_dir, engine.max_len_override, engine.weight_version) == ("models/tiny", 64, "7")
    bare = make_engine("local:models/tiny", timeout_s=1.0)
    assert (bare.max_len_override, bare.weight_version) == (0, None)


def test_a_scripted_spec_makes_the_scripted_engine_of_that_script(tmp_path: Path) -> None:
    script = tmp_path / "run.json"
    script.write_bytes(orjson.dumps({"model_dir": "model", "turns": [{"content": "hi"}]}))
    engine = make_engine(f"scripted:{script}", timeout_s=1.0)
    assert type(engine) is ScriptedEngine
    assert engine.name == f"scripted:{script}"
    assert engine.local.model_dir == str(tmp_path / "model")


# --- takes_token_input ------------------------------------------------------------------------------------------


class _Both:
    def complete_tokens(self) -> None: ...

    def continuation(self) -> None: ...


class _NoContinuation:
    def complete_tokens(self) -> None: ...


class _NoCompleteTokens:
    def continuation(self) -> None: ...


class _NotCallable:
    complete_tokens = None
    continuation = "x"


def test_only_an_engine_with_both_token_input_methods_takes_token_input() -> None:
    assert takes_token_input(_Both()) is True  # type: ignore[arg-type]
    assert takes_token_input(_NoContinuation()) is False  # type: ignore[arg-type]
    assert takes_token_input(_NoCompleteTokens()) is False  # type: ignore[arg-type]
    assert takes_token_input(_NotCallable()) is False  # type: ignore[arg-type]
    assert takes_token_input(VLLMEngine("http://h:1")) is True
    assert takes_token_input(SGLangEngine("http://h:1")) is True
    assert takes_token_input(HTTPEngine("http://h:1")) is False  # continuation alone: it cannot sample after ids


# --- EnginePool ------------------------------------------------------------------------------------------------


def test_a_pool_needs_an_engine_and_passes_its_rules_to_the_affinity() -> None:
    with pytest.raises(ValueError, match="^at least one engine is required$"):
        EnginePool([])
    pool = EnginePool([FakeEngine("a")], max_strikes=5, revive_after_s=2.5, max_sessions=9)  # type: ignore[list-item]
    rules = pool.affinity
    assert (rules.max_strikes, rules.revive_after_s, rules.max_sessions) == (5, 2.5, 9)
    default = EnginePool([FakeEngine("a"), FakeEngine("b")]).affinity  # type: ignore[list-item]
    assert (default.max_strikes, default.revive_after_s, default.max_sessions) == (
        MAX_STRIKES,
        REVIVE_AFTER_S,
        MAX_SESSIONS,
    )
    assert default.load() == [0, 0]


def test_a_pool_spec_makes_one_engine_per_spec_in_order_with_the_timeout() -> None:
    pool = EnginePool.from_spec("sglang:http://a:1?weight_version=2, vllm:http://b:2?versions=spans")
    assert [e.name for e in pool.engines] == ["sglang:http://a:1", "vllm:http://b:2"]
    assert [e.timeout_s for e in pool.engines] == [900.0, 900.0]  # type: ignore[attr-defined]
    assert [e.weight_version for e in pool.engines] == ["2", None]  # type: ignore[attr-defined]
    assert pool.engines[1].token_versions is True  # type: ignore[attr-defined]
    timed = EnginePool.from_spec("vllm:http://b:2", timeout_s=30.0)
    assert [e.timeout_s for e in timed.engines] == [30.0]  # type: ignore[attr-defined]


def test_sessions_stick_to_their_engine_and_new_ones_go_to_the_least_loaded() -> None:
    a, b = FakeEngine("a"), FakeEngine("b")
    pool = EnginePool([a, b])  # type: ignore[list-item]
    assert pool.for_session("s1") is a
    assert pool.for_session("s2") is b
    assert pool.for_session("s1") is a
    assert len(pool) == 2
    pool.release("s1")
    assert len(pool) == 1 and pool.affinity.load() == [0, 1]
    assert pool.for_session("s3") is a


def test_a_session_whose_engine_was_taken_out_is_refused_without_the_engines_address(caplog: Any) -> None:
    caplog.set_level(logging.WARNING, logger="polar")
    a, b = FakeEngine("sglang:http://10.0.0.7:30000"), FakeEngine("b")
    pool = EnginePool([a, b], max_strikes=2)  # type: ignore[list-item]
    assert pool.for_session("s1") is a
    fault = EngineFault(502, "api_error", "engine error 500: boom")
    assert pool.failed(a, fault) == []  # one strike of two: still in
    assert pool.failed(a, fault) == ["s1"]  # the second takes it out, with its session
    assert caplog.messages == [
        "polar: engine sglang:http://10.0.0.7:30000 taken out (engine error 500: boom); 1 session(s) on it end as error"
    ]
    with pytest.raises(PolarError) as err:
        pool.for_session("s1")
    assert (err.value.status, err.value.kind) == (502, "api_error")
    assert err.value.message == (
        "the engine serving this session was taken out after failing; "
        "the session cannot go on (it is never moved to another engine mid-session)"
    )
    assert pool.for_session("s2") is b  # new sessions go to the live engine


def test_a_success_clears_the_strikes_and_only_engine_faults_count() -> None:
    a, b = FakeEngine("a"), FakeEngine("b")
    pool = EnginePool([a, b], max_strikes=2)  # type: ignore[list-item]
    pool.for_session("s1")
    fault = EngineFault(502, "api_error", "engine error 500: boom")
    assert pool.failed(a, fault) == []
    pool.succeeded(a)
    assert pool.failed(a, fault) == []  # the count started over: one strike again
    # Busy, timeout, a request the engine cannot take: the engine is alive, however often.
    for err in (
        PolarError(503, "overloaded", "engine busy: full"),
        PolarError(504, "timeout", "slow"),
        PolarError(400, "invalid_request", "bad"),
    ):
        assert pool.failed(a, err) == []
    assert not pool.affinity.is_out(0)
    assert pool.failed(b, fault) == [] and not pool.affinity.is_out(1)  # b's strike is its own
    assert pool.failed(a, fault) == ["s1"] and pool.affinity.is_out(0)


def test_a_refused_connection_takes_the_engine_out_at_once() -> None:
    a, b = FakeEngine("a"), FakeEngine("b")
    pool = EnginePool([a, b], max_strikes=3)  # type: ignore[list-item]
    pool.for_session("s1")
    pool.for_session("s2")
    refused = EngineFault(503, "overloaded", "the engine is unreachable (ClientConnectorError)", refused=True)
    assert pool.failed(b, refused) == ["s2"]
    assert pool.affinity.is_out(1) and not pool.affinity.is_out(0)


def test_with_every_engine_out_a_new_session_is_told_to_retry_later() -> None:
    a, b = FakeEngine("a"), FakeEngine("b")
    pool = EnginePool([a, b], max_strikes=1, revive_after_s=3600.0)  # type: ignore[list-item]
    fault = EngineFault(502, "api_error", "engine error 500: boom")
    assert pool.failed(a, fault) == [] and pool.failed(b, fault) == []  # taken out with no session on them
    with pytest.raises(PolarError) as err:
        pool.for_session("new")
    assert (err.value.status, err.value.kind) == (503, "overloaded")
    assert err.value.message == "every engine of this proxy is failing; retry later"


def test_configure_load_and_close_reach_every_engine_in_order() -> None:
    a, b = FakeEngine("a"), FakeEngine("b")
    pool = EnginePool([a, b])  # type: ignore[list-item]
    settings = EngineSettings(tool_parsers=ParserChoice("hermes"), tokenizer_dir="/tok")
    pool.configure(settings)
    pool.load()
    asyncio.run(pool.close())
    assert a.calls == b.calls == [("configure", settings), "load", "close"]
    assert pool.index(b) == 1 and pool.index(a) == 0
