"""The trained checkpoint is served by vLLM as is, and `polar engine reload` swaps it into a running server."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

import httpx
import pytest

from polar_cli.train.config import TrainConfig
from polar_cli.train.reload import EngineError, is_running, load_state, reload_engine, serve_vllm, stop_engine
from polar_cli.train.run import run_training
from tests.conftest import free_port
from tests.support.train_traces import TraceFactory, two_group_specs

REPO = Path(__file__).resolve().parent.parent
VLLM_ARGS = ["--gpu-memory-utilization", "0.2", "--enable-auto-tool-choice", "--tool-call-parser", "hermes"]


def chat(url: str, content: str) -> dict:
    body = {
        "model": "policy", "messages": [{"role": "user", "content": content}], "max_tokens": 8,
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


@pytest.mark.vllm
def test_vllm_serves_the_trained_checkpoint_after_reload(tiny_model_dir: Path, tmp_path: Path) -> None:
    if not (REPO / ".venv-vllm" / "bin" / "python").exists():
        pytest.skip("vLLM CPU venv missing; run `make engine`")
    ckpt = tmp_path / "ckpt"
    traces = TraceFactory(tiny_model_dir, temperature=1.0, seed=5).traces(two_group_specs())
    cfg = TrainConfig(inputs=[], model=str(tiny_model_dir), output=ckpt, learning_rate=1e-2, max_steps=2,
                      groups_per_step=2, progress=False, plot=False)  # fmt: skip
    run_training(cfg, traces=traces)

    state = tmp_path / "state"
    server = serve_vllm(
        str(tiny_model_dir), port=free_port(), served_model_name="policy", state_dir=state, dtype="float32",
        max_model_len=4096, extra_args=VLLM_ARGS, env={"VLLM_CPU_KVCACHE_SPACE": "1"},
    )  # fmt: skip
    try:
        before = chat(server.url, "hello")
        assert before["choices"][0]["token_ids"]

        # the CLI, from another process, finds the server by its URL and restarts it with the checkpoint
        env = dict(os.environ, POLAR_STATE_DIR=str(state))
        proc = subprocess.run(
            [sys.executable, "-m", "polar_cli.app", "engine", "reload", str(ckpt), "--engine", server.spec],
            cwd=REPO, env=env, capture_output=True, text=True, timeout=900,
        )  # fmt: skip
        assert proc.returncode == 0, proc.stdout + proc.stderr
        restarted = load_state(state, server.port)
        assert restarted.model == str(ckpt.resolve()) and restarted.pid != server.pid
        assert not is_running(server) and is_running(restarted)
        models = httpx.get(f"{server.url}/v1/models").json()["data"]
        assert [(m["id"], m["root"]) for m in models] == [("policy", str(ckpt.resolve()))]

        after = chat(server.url, "hello")
        choice = after["choices"][0]
        served = [entry["logprob"] for entry in choice["logprobs"]["content"]]
        prompt_ids, ids = after["prompt_token_ids"], choice["token_ids"]
        # vLLM's logprobs are the trained weights' (not the start model's)
        trained = hf_logprobs(ckpt, prompt_ids, ids)
        start = hf_logprobs(tiny_model_dir, prompt_ids, ids)
        assert max(abs(a - b) for a, b in zip(served, trained, strict=True)) < 2e-3
        assert max(abs(a - b) for a, b in zip(served, start, strict=True)) > 1e-2
    finally:
        stopped, _ = stop_engine(server.url, state_dir=state)
    assert not is_running(stopped)


@pytest.fixture(scope="module")
def sglang_protocol():
    from tests.support.sglang_contract_server import ContractUnavailable, load_protocol

    try:
        return load_protocol()
    except ContractUnavailable as exc:
        pytest.fail(f"SGLang 0.5.23 protocol unavailable ({exc}); run `make sglang-contract`")


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
