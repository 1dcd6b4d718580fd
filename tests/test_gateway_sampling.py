"""What a call samples with is explicit, sent to the engine and recorded; logprobs no sampled token can
have are refused at capture. In-process gateway with real providers, a real TraceStore, the local engine
and the SGLang contract server (SGLang 0.5.23's own request validation)."""

from __future__ import annotations

import asyncio
import math
from pathlib import Path

import orjson
import pytest

from polar_addon.canonical import CanonicalRequest, SamplingDefaults, SamplingParams, with_defaults
from polar_addon.capture import Identity, logprob_problem
from polar_addon.engines import EnginePool
from polar_addon.engines.local import LocalEngine
from polar_addon.engines.openai_compat import chat_body
from polar_addon.engines.sglang import SGLangEngine
from polar_addon.gateway import Gateway, GatewayConfig, IncomingCall
from polar_addon.store import TraceStore, read_records
from polar_cli.view import logprob_color

MESSAGES = [{"role": "user", "content": "Say something."}]


def chat_call(session: str, **body) -> IncomingCall:
    payload = {"model": "tiny", "max_tokens": 6, "messages": MESSAGES, **body}
    return IncomingCall(
        method="POST",
        path="/v1/chat/completions",
        headers={"user-agent": "openai-python"},
        body=orjson.dumps(payload),
        identity=Identity(session_id=session, source="header"),
    )


def test_omitted_parameters_are_filled_and_sent_explicitly() -> None:
    filled = with_defaults(SamplingParams(max_tokens=5), SamplingDefaults())
    assert (filled.temperature, filled.top_p, filled.top_k, filled.min_p) == (1.0, 1.0, 0, 0.0)
    body = chat_body(CanonicalRequest(api="openai_chat", model="m", messages=MESSAGES, sampling=filled), "m")
    # Nothing left for an engine to take from the model's generation_config.
    assert {k: body[k] for k in ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")} == {
        "temperature": 1.0,
        "top_p": 1.0,
        "top_k": -1,
        "min_p": 0.0,
        "repetition_penalty": 1.0,
    }
    # A caller that filled nothing (an engine used directly) still leaves nothing to the engine.
    raw = chat_body(CanonicalRequest(api="openai_chat", model="m", messages=MESSAGES), "m")
    assert {k: raw[k] for k in ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")} == {
        "temperature": 1.0,
        "top_p": 1.0,
        "top_k": -1,
        "min_p": 0.0,
        "repetition_penalty": 1.0,
    }
    # The client's own values win; its spellings of "no top-k" (-1, 0) are one value.
    mine = with_defaults(SamplingParams(temperature=0.7, top_p=0.9, top_k=-1, min_p=0.05), SamplingDefaults(top_k=20))
    assert (mine.temperature, mine.top_p, mine.top_k, mine.min_p) == (0.7, 0.9, 0, 0.05)
    with pytest.raises(ValueError, match="top_p"):
        SamplingDefaults(top_p=0.0)


@pytest.mark.parametrize("tiny", [5e-324, 1e-300, 9.99e-6])
def test_a_temperature_engines_treat_as_greedy_is_recorded_as_greedy(tiny: float) -> None:
    # Found by the fuzzer: 5e-324 divided logits into inf and the logprob into NaN (a 502).
    assert with_defaults(SamplingParams(temperature=tiny), SamplingDefaults()).temperature == 0.0
    assert with_defaults(SamplingParams(temperature=1e-5), SamplingDefaults()).temperature == 1e-5
    assert with_defaults(SamplingParams(), SamplingDefaults(temperature=tiny)).temperature == 0.0


def test_records_carry_the_defaults_the_engine_got(tiny_model_dir: Path, tmp_path: Path) -> None:
    out = tmp_path / "shards"
    defaults = SamplingDefaults(temperature=0.7, top_p=0.9, top_k=5, min_p=0.01)

    async def main() -> None:
        gateway = Gateway(
            EnginePool([LocalEngine(str(tiny_model_dir))]),
            TraceStore(str(out)),
            GatewayConfig(sampling_defaults=defaults),
        )
        assert (await gateway.handle(chat_call("d-1", seed=1))).status == 200
        assert (await gateway.handle(chat_call("d-2", seed=1, temperature=1.0, top_p=1.0, top_k=0))).status == 200
        await gateway.close()

    asyncio.run(main())
    by_session = {r.session_id: r for r in read_records(str(out))}
    assert [(r.temperature, r.top_p, r.top_k, r.min_p) for r in (by_session["d-1"], by_session["d-2"])] == [
        (0.7, 0.9, 5, 0.01),
        (1.0, 1.0, 0, 0.01),
    ]  # OpenAI clients have no min_p: the default stays


@pytest.fixture(scope="module")
def sglang(tiny_model_dir, sglang_protocol):
    from tests.support.sglang_contract_server import SGLangContractServer

    with SGLangContractServer(LocalEngine(tiny_model_dir), protocol=sglang_protocol, context_len=4096) as srv:
        yield srv


def _through_sglang(server, out: Path, call: IncomingCall):

    async def main():
        gateway = Gateway(EnginePool([SGLangEngine(server.url, timeout_s=60)]), TraceStore(str(out)))
        try:
            return await gateway.handle(call)
        finally:
            await gateway.close()

    return asyncio.run(main())


def test_sglang_gets_every_sampling_parameter(sglang, tmp_path: Path) -> None:
    reply = _through_sglang(sglang, tmp_path / "shards", chat_call("sg-1", seed=2))
    assert reply.status == 200, reply.body
    sent = sglang.requests[-1]  # accepted by SGLang's own ChatCompletionRequest
    assert {k: sent[k] for k in ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")} == {
        "temperature": 1.0,
        "top_p": 1.0,
        "top_k": -1,
        "min_p": 0.0,
        "repetition_penalty": 1.0,
    }
    [record] = read_records(str(tmp_path / "shards"))
    assert (record.temperature, record.top_p, record.top_k, record.min_p) == (1.0, 1.0, 0, 0.0)


def test_a_sentinel_logprob_fails_the_call_in_the_clients_shape(sglang, tmp_path: Path) -> None:
    with sglang.configured(fail="sentinel_logprob"):
        reply = _through_sglang(sglang, tmp_path / "shards", chat_call("sg-2", seed=2))
    assert reply.status == 502
    error = orjson.loads(reply.body)["error"]
    assert error["type"] == "server_error" and "-9999" in error["message"]  # OpenAI's shape of a 502
    [record] = read_records(str(tmp_path / "shards"))
    assert record.status == "failed" and "-9999" in record.error and record.response_ids == []


@pytest.mark.parametrize(
    ("logprobs", "problem"),
    [
        ([-0.5, -9999.0], "token 1 has logprob -9999.0 (below -100"),
        ([-0.5, float("nan")], "not finite"),
        ([float("-inf")], "not finite"),
        ([-0.1, 0.5], "> 0"),
        ([-0.1, 800.0], "> 0"),
    ],
)
def test_logprob_problems_are_named(logprobs: list[float], problem: str) -> None:
    assert problem in (logprob_problem(logprobs) or "")


def test_plausible_logprobs_pass() -> None:
    # Engines round a near-certain token's logprob to a hair above 0.
    assert logprob_problem([-99.9, -12.0, 0.0, 3e-7]) is None
    assert logprob_problem([]) is None


@pytest.mark.parametrize("logprob", [800.0, -9999.0, float("nan"), float("inf"), float("-inf")])
def test_view_colours_any_stored_logprob(logprob: float) -> None:
    # Stores written before capture refused them may hold such values; exp(800) used to overflow.
    assert logprob_color(logprob).startswith("hsl(")
    assert math.isfinite(float(logprob_color(logprob)[4:].split(",")[0]))
