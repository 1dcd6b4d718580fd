"""The gateway's newer code (issue 29 audit): a fixed-sampling proxy replaces the client's policy parameters and keeps
what it asked aside, a call that does not continue its session's chain records the chain's reason, and the chain a
call leaves remembers how its turn ended (the next continuation closes the turn by it)."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path
from typing import Any

import orjson
import pytest

from polar_addon.gateway import Gateway, GatewayConfig
from polar_addon.store import read_records
from tests.test_gateway_units import CHAT, MESSAGES, anthropic, call, run


@pytest.fixture()
def script(tiny_model_dir: Path, tmp_path: Path) -> Path:
    path = tmp_path / "script.json"
    path.write_text(json.dumps({"model_dir": str(tiny_model_dir), "cycle": True, "turns": [{"content": "Hi there."}]}))
    return path


POLICY = {"temperature": 0.3, "top_p": 0.5, "seed": 7}


def _parsed(script: Path, out: Path, config: GatewayConfig, bodies: list[dict[str, Any]]) -> list[Any]:
    async def steps(gateway: Gateway) -> list[Any]:
        provider, route = gateway.match("POST", CHAT)
        return [gateway._parse(provider, route, call(CHAT, body)) for body in bodies]

    return run(script, out, steps, config)


def test_a_fixed_sampling_proxy_samples_with_its_own_parameters_and_keeps_what_the_client_asked(
    script: Path, tmp_path: Path
) -> None:
    plain = {"model": "m", "messages": [{"role": "user", "content": "x"}]}
    asking = {**plain, **POLICY, "top_p": None}  # an explicit null asks nothing
    quiet, hostile = _parsed(script, tmp_path / "a", GatewayConfig(sampling_fixed=True), [plain, asking])
    assert hostile.sampling == quiet.sampling  # the client's choice changes nothing the engine samples with
    assert hostile.extra["client_sampling"] == {"temperature": 0.3, "seed": 7}
    assert "client_sampling" not in quiet.extra
    [kept] = _parsed(script, tmp_path / "b", GatewayConfig(sampling_fixed=False), [asking])
    assert (kept.sampling.temperature, kept.sampling.seed) == (0.3, 7) and "client_sampling" not in kept.extra


def test_a_call_that_does_not_continue_its_chain_records_the_chains_reason_and_the_turn_end_is_remembered(
    script: Path, tmp_path: Path
) -> None:
    out = tmp_path / "shards"

    async def steps(gateway: Gateway) -> Any:
        first = orjson.loads((await gateway.handle(call(MESSAGES, anthropic(), session="t"))).body)
        [chain] = gateway.tito.chains("t")
        ended = (chain.finish_reason, chain.matched_stop)
        edited = [
            {"role": "user", "content": "hi"},
            {"role": "assistant", "content": [{"type": "text", "text": "not what the model said"}]},
            {"role": "user", "content": "and then?"},
        ]
        assert first["content"] != edited[1]["content"]
        assert (await gateway.handle(call(MESSAGES, anthropic(messages=edited), session="t"))).status == 200
        return ended

    ended = run(script, out, steps)
    first, second = sorted(read_records(str(out)), key=lambda r: r.seq)
    assert ended == (first.finish_reason, first.matched_stop) and ended[0] == "stop"
    assert (first.prompt_source, first.prompt_reason) == ("fresh", "first_call")
    # The chain's own reason, judged against the session's engine (not a lost state, not another engine's chain).
    assert (second.prompt_source, second.prompt_reason) == ("fresh", "edited_history")


def test_the_chain_a_call_leaves_remembers_the_stop_string_that_ended_its_turn(script: Path, tmp_path: Path) -> None:
    async def steps(gateway: Gateway) -> Any:
        engine = gateway.pool.engines[0]
        real = engine.complete

        async def stopped_by_a_string(request: Any) -> Any:
            return replace(await real(request), matched_stop="</answer>")

        engine.complete = stopped_by_a_string  # type: ignore[method-assign]
        assert (await gateway.handle(call(MESSAGES, anthropic(), session="t"))).status == 200
        [chain] = gateway.tito.chains("t")
        return chain.finish_reason, chain.matched_stop

    assert run(script, tmp_path / "shards", steps) == ("stop", "</answer>")
