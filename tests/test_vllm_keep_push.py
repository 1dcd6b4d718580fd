"""New weights pushed into a running vLLM while requests are in flight (``reload_vllm_in_place(keep=True)``, what
``polar loop --async --drain keep`` does): no request is lost, and every sampled token is labelled with the version
that sampled it and carries that version's logprob. Checked against plain transformers forward passes of both
models: the tokens the engine labels version 0 have the starting model's logprobs, those it labels 1 the
checkpoint's (the running requests are recomputed on the new weights, never sampled on KV of the old ones), so a
label off by one token fails. The model is the tiny one, untied (vLLM reloads only those in place)."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import httpx
import pytest
import torch

from polar_addon.canonical import CanonicalRequest, SamplingParams, VersionSpan
from polar_addon.engines import make_engine
from polar_cli.serving import label_version, load_state, reload_engine, serve_vllm, stop_engine
from polar_cli.tiny_model import untie_embeddings
from tests.conftest import free_port
from tests.test_vllm_inplace_push import REPO, _perturbed

PROMPT = [1, 17, 250, 31, 9, 77, 402, 5, 66, 12, 300, 41]


def _reference(model: Path, prompt: list[int], response: list[int]) -> list[float]:
    from transformers import AutoModelForCausalLM

    net = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32).eval()
    ids = prompt + response
    with torch.inference_mode():
        logits = net(input_ids=torch.tensor([ids])).logits[0]
    logprobs = torch.log_softmax(logits[len(prompt) - 1 : -1], dim=-1)
    return logprobs.gather(1, torch.tensor(response)[:, None])[:, 0].tolist()


def _generated(url: str) -> float:
    """Tokens the server has sampled so far (its Prometheus counter)."""
    for line in httpx.get(f"{url}/metrics", timeout=10).text.splitlines():
        if line.startswith("vllm:generation_tokens_total"):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError("vLLM's /metrics has no vllm:generation_tokens_total")


@pytest.mark.vllm
def test_a_push_under_load_loses_no_call_and_labels_every_token_with_the_version_that_sampled_it(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    if not (REPO / ".venv-vllm" / "bin" / "python").exists():
        from tests.support.prereq import missing

        missing("vLLM CPU venv missing (.venv-vllm); run `make engine`")
    base = untie_embeddings(tiny_model_dir, tmp_path / "base")
    ckpt = _perturbed(base, tmp_path / "ckpt")
    state = tmp_path / "engines"
    server = serve_vllm(
        str(base), port=free_port(), served_model_name="policy", state_dir=state, push="in-place",
        extra_args=["--enforce-eager", "--dtype=float32", "--max-model-len=2048"],
    )  # fmt: skip
    try:
        assert "--enable-scale-out" in server.command
        label_version(server.url, "0")

        async def run() -> tuple[list, float]:
            engine = make_engine(f"vllm:{server.url}?weight_version=0&versions=spans", timeout_s=300)
            calls = [
                CanonicalRequest(
                    api="openai_chat",
                    model="policy",
                    messages=[],
                    sampling=SamplingParams(temperature=1.0, max_tokens=700, seed=seed),
                )  # fmt: skip
                for seed in range(6)
            ]
            running = [asyncio.create_task(engine.complete_tokens(c, PROMPT)) for c in calls]
            while _generated(server.url) < 300:  # the requests are decoding (a loaded machine prefills slowly)
                await asyncio.sleep(0.05)
            started = time.monotonic()
            line = await asyncio.to_thread(
                reload_engine, server.spec, ckpt, state_dir=state, weight_version="1", keep=True
            )
            push_s = time.monotonic() - started
            assert "in place" in line, line
            done = await asyncio.gather(*running)
            after = await engine.complete_tokens(calls[0], PROMPT)  # a call that starts after the push
            await engine.close()
            return [*done, after], push_s

        completions, push_s = asyncio.run(run())
        print(f"push under load: {push_s:.2f} s; spans {[c.weight_versions for c in completions]}")
        assert push_s < 30, push_s
        mixed = [c for c in completions if c.weight_versions and len(c.weight_versions) == 2]
        assert mixed, "no request was running when the weights were pushed"
        assert completions[-1].weight_versions == [VersionSpan("1", 0, len(completions[-1].response_ids))]
        compared = {"0": 0, "1": 0}
        for c in completions:
            assert c.finish_reason in ("length", "stop") and c.response_ids, c.finish_reason
            assert [s.version for s in c.weight_versions or []] in (["0"], ["1"], ["0", "1"])
            assert c.weight_version == c.weight_versions[0].version  # the oldest: what the staleness bound reads
            references = {"0": _reference(base, PROMPT, c.response_ids), "1": _reference(ckpt, PROMPT, c.response_ids)}
            for span in c.weight_versions or []:
                got = c.logprobs[span.start : span.end]
                want = references[span.version][span.start : span.end]
                other = references["1" if span.version == "0" else "0"][span.start : span.end]
                assert max(abs(a - b) for a, b in zip(got, want, strict=True)) < 1e-3, (span, c.weight_versions)
                assert max(abs(a - b) for a, b in zip(got, other, strict=True)) > 1e-2  # the versions differ
                compared[span.version] += span.end - span.start
        assert compared["0"] >= 100 and compared["1"] >= 100, compared
        managed = load_state(state, server.port)
        assert managed.weight_version == "1" and managed.model == str(ckpt.resolve())
        assert httpx.get(f"{server.url}/health", timeout=10).status_code == 200  # resumed, serving
    finally:
        stop_engine(server.url, state_dir=state)
