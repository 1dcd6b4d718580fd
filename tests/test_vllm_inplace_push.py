"""vLLM loads a checkpoint in place (``polar engine serve --push in-place`` then ``polar engine reload``): no restart,
and what it serves afterwards is the checkpoint, token for token against a plain transformers forward pass, with no
KV of the old weights reused for a prompt it had cached. The model is the tiny one with untied embeddings (as
Qwen3-8B and the imported Qwen2.5-Coder-0.5B are): a tied one is restarted instead (vLLM 0.32's in-place reload
leaves a tied LM head half loaded, see ``serving.in_place_refusal``)."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
import torch
from safetensors.torch import load_file, save_file

from polar_cli.serving import in_place_refusal, load_state, serve_vllm, stop_engine
from polar_cli.tiny_model import untie_embeddings
from tests.conftest import free_port

REPO = Path(__file__).resolve().parent.parent
PROMPT = [1, 17, 250, 31, 9, 77, 402, 5, 66, 12, 300, 41]


def _perturbed(model: Path, dest: Path) -> Path:
    shutil.copytree(model, dest)
    weights = load_file(str(dest / "model.safetensors"))
    generator = torch.Generator().manual_seed(0)
    for name, tensor in weights.items():
        if tensor.is_floating_point() and tensor.dim() == 2:
            weights[name] = tensor + 0.05 * torch.randn(tensor.shape, generator=generator, dtype=tensor.dtype)
    save_file(weights, str(dest / "model.safetensors"), metadata={"format": "pt"})
    return dest


def test_tied_embeddings_are_not_loaded_in_place(tiny_model_dir: Path, tmp_path: Path) -> None:
    assert "tied embeddings" in (in_place_refusal(tiny_model_dir) or "")
    assert in_place_refusal(untie_embeddings(tiny_model_dir, tmp_path / "untied")) is None
    (tmp_path / "bad").mkdir()
    assert in_place_refusal(tmp_path / "bad") is not None


def _reference(model: Path, ids: list[int]) -> list[float]:
    from transformers import AutoModelForCausalLM

    net = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32).eval()
    with torch.inference_mode():
        logits = net(input_ids=torch.tensor([ids])).logits[0]
    logprobs = torch.log_softmax(logits[:-1], dim=-1)
    return logprobs.gather(1, torch.tensor(ids[1:])[:, None])[:, 0].tolist()


def _served(url: str) -> tuple[list[int], list[float]]:
    """Four sampled tokens after PROMPT, and the engine's logprob of each."""
    answer = httpx.post(
        f"{url}/v1/completions",
        json={"model": "policy", "prompt": PROMPT, "max_tokens": 4, "temperature": 1.0, "seed": 0, "logprobs": 0,
              "return_tokens_as_token_ids": True, "ignore_eos": True},
        timeout=120,
    ).json()  # fmt: skip
    lp = answer["choices"][0]["logprobs"]
    return [int(t.split(":", 1)[1]) for t in lp["tokens"]], lp["token_logprobs"]


def _reload(url: str, checkpoint: Path, state: Path, version: str) -> tuple[str, float]:
    started = time.monotonic()
    done = subprocess.run(
        [sys.executable, "-m", "polar_cli.app", "engine", "reload", str(checkpoint), "--engine", f"vllm:{url}",
         "--state-dir", str(state), "--weight-version", version],
        cwd=REPO, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    return done.stdout, time.monotonic() - started


@pytest.mark.vllm
def test_vllm_serves_the_checkpoint_after_an_in_place_reload(tiny_model_dir: Path, tmp_path: Path) -> None:
    if not (REPO / ".venv-vllm" / "bin" / "python").exists():
        from tests.support.prereq import missing

        missing("vLLM CPU venv missing (.venv-vllm); run `make engine`")
    base_model = untie_embeddings(tiny_model_dir, tmp_path / "base")
    ckpt = _perturbed(base_model, tmp_path / "ckpt")
    state = tmp_path / "engines"
    server = serve_vllm(
        str(base_model), port=free_port(), served_model_name="policy", state_dir=state, push="in-place",
        extra_args=["--enforce-eager", "--dtype=float32", "--max-model-len=1024"],
    )  # fmt: skip
    try:
        pid = server.pid
        for model, version in ((None, None), (ckpt, "1"), (base_model, "2")):
            if model is not None:
                line, seconds = _reload(server.url, model, state, version)
                assert "in place" in line and "restarted" not in line, line
                assert seconds < 30, seconds  # a restart of this server takes ~30-50 s on 2 cores
            tokens, logprobs = _served(server.url)
            expected = _reference(model or base_model, PROMPT + tokens)[len(PROMPT) - 1 :]
            assert max(abs(a - b) for a, b in zip(logprobs, expected, strict=True)) < 1e-3, (model, logprobs, expected)
            if model == ckpt:
                base = _reference(base_model, PROMPT + tokens)[len(PROMPT) - 1 :]
                assert max(abs(a - b) for a, b in zip(logprobs, base, strict=True)) > 1e-2  # new weights, not old
        managed = load_state(state, server.port)
        assert managed.pid == pid and managed.model == str(base_model.resolve()) and managed.weight_version == "2"
        assert managed.history[-2:] == [str(ckpt.resolve()), str(base_model.resolve())]
    finally:
        stop_engine(server.url, state_dir=state)


@pytest.mark.vllm
def test_a_loop_loads_each_checkpoint_into_vllm_in_place_and_serves_it(tiny_model_dir: Path, tmp_path: Path) -> None:
    """`polar loop --engine vllm` (``--vllm-push in-place``, the default) on the untied tiny model: iteration 1 runs on
    the checkpoint loaded in place (the same server, no restart), and its calls' logprobs are the checkpoint's: the
    first-step importance ratios of its traces against the checkpoint are within 1e-3 of 1, far from the start's."""
    if not (REPO / ".venv-vllm" / "bin" / "python").exists():
        from tests.support.prereq import missing

        missing("vLLM CPU venv missing (.venv-vllm); run `make engine`")
    model = untie_embeddings(tiny_model_dir, tmp_path / "untied")
    toy = REPO / "examples" / "toy_task"
    tasks = tmp_path / "tasks.jsonl"
    tasks.write_text("".join((toy / "tasks.jsonl").read_text().splitlines(keepends=True)[1:3]))
    out = tmp_path / "loop"
    cmd = [sys.executable, "-m", "polar_cli.app", "loop", str(tasks), "--harness",
           f"cmd:{sys.executable} {toy / 'agent.py'} {{instruction}}", "--model", str(model), "--engine", "vllm",
           "--vllm-arg=--enforce-eager", "--vllm-arg=--max-model-len=4096", "--vllm-arg=--dtype=float32",
           "--iterations", "2", "--out", str(out), "--samples", "4", "--concurrency", "8", "--no-progress",
           "--lr", "5e-3", "--eot-token-id", "2", "--epsilon-high", "1.0"]  # fmt: skip
    done = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    iterations = json.loads((out / "loop.json").read_text())["iterations"]
    assert iterations[0]["train"]["status"] == "trained", iterations
    checkpoint = Path(iterations[0]["train"]["checkpoint"])
    assert iterations[1]["policy"] == str(checkpoint) and iterations[1]["push_s"] < 30, iterations[1]
    log = "".join(p.read_text() for p in (out / ".engines").glob("engine-*.log"))
    assert f"polar engine reload: {checkpoint.resolve()} (in place)" in log and log.count("Starting vLLM server") == 1
    from tests.support.tito_sessions import build  # noqa: PLC0415 (torch-heavy helpers, this test only)
    from tests.support.tito_vllm import first_step_ratios, trainer_logprobs  # noqa: PLC0415

    _, traces = build(out / "iter-001" / "shards")
    served = first_step_ratios(traces, trainer_logprobs(checkpoint))
    before = first_step_ratios(traces, trainer_logprobs(model))
    print(f"iteration 1 vs checkpoint: {served}; vs starting model: {before}")
    assert served.tokens > 50 and served.max_abs_dev < 1e-3, served
    assert before.max_abs_dev > 100 * max(served.max_abs_dev, 1e-6), (served, before)
