"""Engine reload: what it refuses, SGLang's in-place weight update, and helpers for checking what an engine serves.

vLLM serving the trained checkpoint after `polar engine reload` is checked by tests/test_readme.py (the README's
serve -> train -> reload loop): the served logprobs equal the checkpoint's."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

import httpx
import pytest

from polar_cli.serving import EngineError, reload_engine
from polar_cli.train.config import TrainConfig
from polar_cli.train.run import run_training
from tests.support.train_traces import TraceFactory, two_group_specs

REPO = Path(__file__).resolve().parent.parent


def chat(url: str, content: str, model: str = "policy") -> dict:
    body = {
        "model": model, "messages": [{"role": "user", "content": content}], "max_tokens": 8,
        "temperature": 1.0, "seed": 7, "logprobs": True, "return_token_ids": True,
    }  # fmt: skip
    r = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()


def hf_logprobs(model_dir: Path, prompt_ids: Sequence[int], ids: list[int]) -> list[float]:
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        logits = model(torch.tensor([list(prompt_ids) + ids])).logits[0, len(prompt_ids) - 1 : -1]
    return torch.log_softmax(logits, -1).gather(1, torch.tensor(ids)[:, None])[:, 0].tolist()


def test_reload_refuses_what_it_cannot_do(tmp_path: Path, tiny_model_dir: Path) -> None:
    with pytest.raises(EngineError, match="not a model checkpoint"):
        reload_engine("vllm:http://127.0.0.1:1", tmp_path)
    with pytest.raises(EngineError, match="was started by `polar engine serve`"):
        reload_engine("vllm:http://127.0.0.1:1", tiny_model_dir, state_dir=tmp_path)
    with pytest.raises(EngineError, match="restart the proxy"):
        reload_engine("local:x", tiny_model_dir)
    with pytest.raises(EngineError, match="unknown engine kind"):
        reload_engine("tgi:http://x:1", tiny_model_dir)


def test_sglang_reload_updates_weights_in_place(sglang_protocol, tiny_model_dir: Path, tmp_path: Path) -> None:
    import asyncio

    from polar_addon.canonical import CanonicalRequest, SamplingParams
    from polar_addon.engines.local import LocalEngine
    from polar_addon.engines.sglang import SGLangEngine
    from tests.support.sglang_contract_server import SGLangContractServer

    ckpt = tmp_path / "ckpt"
    traces = TraceFactory(tiny_model_dir, temperature=1.0, seed=6).traces(two_group_specs())
    cfg = TrainConfig(inputs=[], model=str(tiny_model_dir), output=ckpt, learning_rate=1e-2, max_steps=2,
                      groups_per_step=2, progress=False, plot=False)  # fmt: skip
    run_training(cfg, traces=traces)

    async def complete(url: str):
        engine = SGLangEngine(url, timeout_s=60)
        try:
            request = CanonicalRequest(api="openai_chat", model="tiny", messages=[{"role": "user", "content": "hi"}],
                                       sampling=SamplingParams(temperature=1.0, max_tokens=6, seed=3))  # fmt: skip
            return await engine.complete(request)
        finally:
            await engine.close()

    with SGLangContractServer(LocalEngine(tiny_model_dir), protocol=sglang_protocol) as server:
        proc = subprocess.run(
            [sys.executable, "-m", "polar_cli.app", "engine", "reload", str(ckpt), "--engine", f"sglang:{server.url}",
             "--weight-version", "step-2"],
            cwd=REPO, capture_output=True, text=True, timeout=300,
        )  # fmt: skip
        assert proc.returncode == 0, proc.stdout + proc.stderr
        assert "loaded" in proc.stdout
        assert server.requests[-1] == {"model_path": str(ckpt.resolve()), "weight_version": "step-2"}
        completion = asyncio.run(complete(server.url))
    assert completion.weight_version == "step-2"
    trained = hf_logprobs(ckpt, completion.prompt_ids, completion.response_ids)
    assert max(abs(a - b) for a, b in zip(completion.logprobs, trained, strict=True)) < 1e-4
