"""The gateway against the real vLLM CPU engine: token exactness, keep-alive under a slow engine, engine failures."""

from __future__ import annotations

import ssl

import anthropic
import httpx
import openai
import pytest

from polar_addon.store.validate import validate_store
from tests.support.proxy import free_port, run_mitmdump
from tests.support.shards import session_records
from tests.support.slow_forwarder import slow_forwarder

pytestmark = pytest.mark.vllm

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "lookup",
            "description": "Look a word up.",
            "parameters": {"type": "object", "properties": {"word": {"type": "string"}}},
        },
    }
]


def client_for(proxy, session: str, timeout: float | httpx.Timeout = 120) -> httpx.Client:
    return httpx.Client(
        proxy=proxy.proxy_url(session), verify=ssl.create_default_context(cafile=str(proxy.ca)), timeout=timeout
    )


def test_captured_tokens_equal_the_engines(vllm_server, reference_logprobs, tmp_path):
    out = tmp_path / "shards"
    messages = [{"role": "system", "content": "You look words up."}, {"role": "user", "content": "What is a tensor?"}]
    with run_mitmdump(f"vllm:{vllm_server}", out, options={"polar_shard_seconds": "0.3"}) as proxy:
        client = openai.OpenAI(api_key="x", http_client=client_for(proxy, "vx-1"), max_retries=0)
        for temperature in (0.0, 0.8):
            client.chat.completions.create(
                model="tiny", messages=messages, tools=TOOLS, max_tokens=20, temperature=temperature, seed=7
            )
        records = session_records(out, "vx-1")
    assert len(records) == 2 and validate_store(str(out)) == []
    # The engine's own tokenization of the same request.
    tokenized = httpx.post(
        f"{vllm_server}/tokenize",
        json={"model": "tiny", "messages": messages, "tools": TOOLS, "add_generation_prompt": True},
    ).json()
    direct = httpx.post(
        f"{vllm_server}/v1/chat/completions",
        json={
            "model": "tiny",
            "messages": messages,
            "tools": TOOLS,
            "max_tokens": 20,
            "temperature": 0.0,
            "seed": 7,
            "top_p": 1.0,
            "top_k": -1,
            "min_p": 0.0,
            "repetition_penalty": 1.0,  # what the proxy sends
            "logprobs": True,
            "return_token_ids": True,
        },
        timeout=120,
    ).json()
    greedy = next(r for r in records if r.temperature == 0.0)
    assert greedy.prompt_ids == tokenized["tokens"] == direct["prompt_token_ids"]
    assert greedy.response_ids == direct["choices"][0]["token_ids"]
    assert greedy.logprobs == pytest.approx(
        [c["logprob"] for c in direct["choices"][0]["logprobs"]["content"]], abs=1e-6
    )
    for rec in records:
        ref = reference_logprobs(rec.prompt_ids, rec.response_ids, rec.temperature)
        diff = sum(abs(a - b) for a, b in zip(rec.logprobs, ref)) / len(ref)
        assert diff <= 1e-3, (rec.temperature, diff)


@pytest.mark.parametrize("api", ["anthropic", "openai"])
def test_slow_engine_keeps_streaming_clients_alive(vllm_server, tmp_path, api):
    out = tmp_path / "shards"
    with (
        slow_forwarder(vllm_server, delay_s=4.0) as slow_url,
        run_mitmdump(
            f"vllm:{slow_url}", out, options={"polar_keepalive": "0.5", "polar_shard_seconds": "0.3"}
        ) as proxy,
    ):
        # Any 2 s without a byte would fail the read; the engine takes 4 s.
        timeout = httpx.Timeout(30, read=2.0)
        if api == "anthropic":
            client = anthropic.Anthropic(api_key="x", http_client=client_for(proxy, "slow-a", timeout), max_retries=0)
            with client.messages.stream(
                model="tiny", max_tokens=8, messages=[{"role": "user", "content": "hi"}]
            ) as stream:
                final = stream.get_final_message()
            assert final.usage.output_tokens > 0
            with pytest.raises(anthropic.APITimeoutError):  # without a stream there is nothing to keep alive
                client.messages.create(model="tiny", max_tokens=8, messages=[{"role": "user", "content": "hi"}])
        else:
            client = openai.OpenAI(api_key="x", http_client=client_for(proxy, "slow-o", timeout), max_retries=0)
            chunks = list(
                client.chat.completions.create(
                    model="tiny", max_tokens=8, stream=True, messages=[{"role": "user", "content": "hi"}]
                )
            )
            assert chunks[-1].choices[0].finish_reason in {"stop", "length"}
        # The raw stream: keep-alives first, then the events, as they are written.
        raw = client_for(proxy, "slow-raw", timeout)
        url = (
            "https://api.anthropic.com/v1/messages"
            if api == "anthropic"
            else "https://api.openai.com/v1/chat/completions"
        )
        body = {"model": "tiny", "max_tokens": 4, "stream": True, "messages": [{"role": "user", "content": "hi"}]}
        # The 2 s read timeout over a 4 s engine already proves they arrived over time, not in one burst.
        with raw.stream("POST", url, json=body) as response:
            lines = [line for line in response.iter_lines() if line]
        keepalive = "event: ping" if api == "anthropic" else ": keep-alive"
        first_event = next(i for i, line in enumerate(lines) if line.startswith("data: {") and "ping" not in line)
        pings = [line for line in lines[:first_event] if line.startswith(keepalive)]
        assert len(pings) >= 3, lines[:first_event]


def test_engine_down_gives_provider_errors_and_failed_records(tmp_path):
    out = tmp_path / "shards"
    dead = f"http://127.0.0.1:{free_port()}"
    with run_mitmdump(f"vllm:{dead}", out, options={"polar_shard_seconds": "0.3"}) as proxy:
        with pytest.raises(anthropic.APIStatusError) as ant_err:
            anthropic.Anthropic(api_key="x", http_client=client_for(proxy, "down-a"), max_retries=0).messages.create(
                model="tiny", max_tokens=8, messages=[{"role": "user", "content": "hi"}]
            )
        assert ant_err.value.status_code >= 500 and ant_err.value.body["error"]["type"] == "overloaded_error"
        with pytest.raises(openai.InternalServerError) as oai_err:
            openai.OpenAI(api_key="x", http_client=client_for(proxy, "down-o"), max_retries=0).chat.completions.create(
                model="tiny", max_tokens=8, messages=[{"role": "user", "content": "hi"}]
            )
        assert oai_err.value.status_code == 503
        records = session_records(out, "down-a") + session_records(out, "down-o")
    assert [r.status for r in records] == ["failed", "failed"] and validate_store(str(out)) == []
    assert all("overloaded" in r.error and r.response_ids == [] for r in records)


def _direct(vllm_server: str, messages: list, **sampling) -> dict:
    body = {
        "model": "tiny",
        "messages": messages,
        "max_tokens": 16,
        "seed": 5,
        "logprobs": True,
        "return_token_ids": True,
        **sampling,
    }
    choice = httpx.post(f"{vllm_server}/v1/chat/completions", json=body, timeout=120).json()["choices"][0]
    return {"ids": choice["token_ids"], "logprobs": [c["logprob"] for c in choice["logprobs"]["content"]]}


def test_a_client_that_omits_sampling_is_recorded_with_what_vllm_used(vllm_server, reference_logprobs, tmp_path):
    """The tiny model's generation_config.json has Qwen3's defaults (T=0.6, top_p 0.95, top_k 20), which vLLM
    applies to a request that leaves them out; the proxy must send polar's defaults and record exactly them."""
    messages = [{"role": "user", "content": "Say something."}]
    out = tmp_path / "shards"
    with run_mitmdump(f"vllm:{vllm_server}", out, options={"polar_shard_seconds": "0.3"}) as proxy:
        client = openai.OpenAI(api_key="x", http_client=client_for(proxy, "defaults-1"), max_retries=0)
        client.chat.completions.create(model="tiny", messages=messages, max_tokens=16, seed=5)
        [record] = session_records(out, "defaults-1")
    assert (record.temperature, record.top_p, record.top_k, record.min_p) == (1.0, 1.0, 0, 0.0)

    # The server really falls back to the model's defaults when a request says nothing...
    fallback = _direct(vllm_server, messages)
    assert fallback == _direct(vllm_server, messages, temperature=0.6, top_p=0.95, top_k=20)
    # ...and the record is what an explicit T=1, untruncated request samples, not that fallback.
    explicit = _direct(vllm_server, messages, temperature=1.0, top_p=1.0, top_k=-1, min_p=0.0, repetition_penalty=1.0)
    assert record.response_ids == explicit["ids"]
    assert record.logprobs == pytest.approx(explicit["logprobs"], abs=1e-6)
    assert record.logprobs != pytest.approx(fallback["logprobs"], abs=1e-3)
    # and it is log_softmax(logits / 1) over the whole vocabulary, what the trainer recomputes.
    ref = reference_logprobs(record.prompt_ids, record.response_ids, 1.0)
    assert max(abs(a - b) for a, b in zip(record.logprobs, ref)) <= 1e-3
