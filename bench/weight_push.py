"""Push latency of a checkpoint into a running vLLM, restart vs in place, side by side in one run.

Latency = from the checkpoint being on disk to the first token served by its weights (``polar engine reload``'s code,
then one completion that must carry the new weights' logprob). One vLLM server is started with ``--push in-place``;
the pushes alternate between two checkpoints (the model and a perturbed copy), ``--rounds`` in place, then
``--rounds`` by restart (``restart_vllm``: the same server restarted on the checkpoint), and every push is checked:
the served logprob must be the pushed weights' (the value probed before from a server known to hold them).
A third kind, ``keep``, pushes in place under load (``polar loop --async --drain keep``): ``--load`` long requests are
decoding when the push starts (paused with ``mode=keep``, reloaded, recomputed, resumed), its latency is measured
the same way (the probe queues behind the running requests), and every one of those requests must finish whole.
A fourth, ``adapter``, is a second server started with ``--push adapter`` on the same model: the pushes alternate
between two LoRA adapters (rank 8, every linear layer, random weights; what ``polar train --lora-r`` saves in a
checkpoint's ``adapter/``) loaded in place under ``policy-adapter``, each checked the same way.

Default model: the tiny test model with untied embeddings (vLLM 0.32 loads a tied LM head only half in place, so
polar restarts those: ``serving.in_place_refusal``). ``--model DIR`` takes any untied model (the imported
Qwen2.5-Coder-0.5B: ``make real-model``). On a GPU, drop ``--enforce-eager`` from ``--vllm-arg`` to see what CUDA
graph capture adds to a restart.

    .venv/bin/python bench/weight_push.py [--model DIR | --size 0.5b] [--rounds 3]

On a GPU (``bench/gpu_check.sh`` style, well within 15 minutes): ``--size 0.5b --vllm-arg=--max-model-len=4096``
(CUDA graphs on: a restart then pays their capture).
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import httpx  # noqa: E402
import torch  # noqa: E402
from safetensors.torch import load_file, save_file  # noqa: E402

from polar_cli.serving import reload_vllm_in_place, restart_vllm, serve_vllm, stop_engine  # noqa: E402
from polar_cli.tiny_model import build_tiny_model, untie_embeddings  # noqa: E402
from tests.support.lora import random_adapter  # noqa: E402

PROMPT = [1, 17, 250, 31, 9, 77, 402, 5]


def perturbed(model: Path, dest: Path) -> Path:
    shutil.copytree(model, dest)
    for file in dest.glob("*.safetensors"):
        weights = load_file(str(file))
        gen = torch.Generator().manual_seed(0)
        for name, t in weights.items():
            if t.is_floating_point() and t.dim() == 2:
                weights[name] = (t.float() + 0.05 * t.float().std() * torch.randn(t.shape, generator=gen)).to(t.dtype)
        save_file(weights, str(file), metadata={"format": "pt"})
    return dest


def first_token(url: str, model: str = "policy") -> float:
    """The logprob of the greedy first token after PROMPT (one request: the 'first token served')."""
    answer = httpx.post(
        f"{url}/v1/completions",
        json={"model": model, "prompt": PROMPT, "max_tokens": 1, "temperature": 0.0, "logprobs": 0},
        timeout=300,
    ).json()
    return float(answer["choices"][0]["logprobs"]["token_logprobs"][0])


def generated(url: str) -> float:
    """Tokens the server has sampled so far (its Prometheus counter)."""
    for line in httpx.get(f"{url}/metrics", timeout=30).text.splitlines():
        if line.startswith("vllm:generation_tokens_total"):
            return float(line.rsplit(" ", 1)[1])
    raise RuntimeError("vLLM's /metrics has no vllm:generation_tokens_total")


def under_load(url: str, requests: int, tokens: int, push: Callable[[], None]) -> None:
    """Run ``push`` while ``requests`` long completions decode; each must still finish with all its tokens."""
    from concurrent.futures import ThreadPoolExecutor

    def long_request(seed: int) -> int:
        answer = httpx.post(
            f"{url}/v1/completions",
            json={"model": "policy", "prompt": PROMPT, "max_tokens": tokens, "temperature": 1.0, "seed": seed,
                  "ignore_eos": True},
            timeout=900,
        ).json()  # fmt: skip
        if "usage" not in answer:
            raise RuntimeError(f"a request under load failed: {answer}")
        return int(answer["usage"]["completion_tokens"])

    before = generated(url)
    with ThreadPoolExecutor(requests) as pool:
        running = [pool.submit(long_request, seed) for seed in range(requests)]
        while generated(url) < before + 8 * requests and not any(r.done() for r in running):
            time.sleep(0.02)
        push()
        lengths = [r.result() for r in running]
    assert lengths == [tokens] * requests, f"a request lost tokens across the push: {lengths}"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", type=Path, default=None, help="an untied model directory (default: the tiny one)")
    p.add_argument("--rounds", type=int, default=3, help="pushes of each kind")
    p.add_argument(
        "--size",
        default="tiny",
        help="without --model: the random model's shape (polar tiny-model --size: tiny, "
        "small, 0.5b = Qwen3-0.6B's shape, stored in bf16), untied",
    )
    p.add_argument("--port", type=int, default=8391)
    p.add_argument("--load", type=int, default=4, help="keep: requests decoding during the push")
    p.add_argument(
        "--load-tokens", type=int, default=900, help="keep: tokens each of those requests samples (within the window)"
    )
    p.add_argument("--vllm-arg", action="append", default=None, help="vLLM flags (default --enforce-eager)")
    args = p.parse_args()
    vllm_args = args.vllm_arg if args.vllm_arg is not None else ["--enforce-eager", "--max-model-len=1024"]
    with tempfile.TemporaryDirectory(prefix="weight-push-") as tmp:
        root = Path(tmp)
        if args.model is None:
            dtype = "float32" if args.size == "tiny" else "bfloat16"
            base = untie_embeddings(build_tiny_model(root / "tiny", size=args.size, dtype=dtype), root / "base")
        else:
            base = args.model.resolve()
        other = perturbed(base, root / "pushed")
        state = root / "engines"
        server = serve_vllm(
            str(base), port=args.port, served_model_name="policy", state_dir=state, push="in-place",
            extra_args=vllm_args, dtype="auto",
        )  # fmt: skip
        try:
            expected = {base: first_token(server.url)}
            reload_vllm_in_place(server.url, str(other), state_dir=state)
            expected[other] = first_token(server.url)
            assert abs(expected[base] - expected[other]) > 1e-3, "the perturbed copy serves the same logprob"
            reload_vllm_in_place(server.url, str(base), state_dir=state)
            times: dict[str, list[float]] = {"in-place": [], "keep": [], "restart": []}
            for kind in times:
                for i in range(args.rounds):
                    target = other if i % 2 == 0 else base
                    served = 0.0

                    def push(kind: str = kind, target: Path = target) -> None:
                        nonlocal served
                        started = time.monotonic()
                        if kind == "restart":
                            restart_vllm(server.url, str(target), state_dir=state, tie=True)
                        else:
                            reload_vllm_in_place(server.url, str(target), state_dir=state, keep=kind == "keep")
                        served = first_token(server.url)
                        times[kind].append(time.monotonic() - started)

                    if kind == "keep":
                        under_load(server.url, args.load, args.load_tokens, push)
                    else:
                        push()
                    assert abs(served - expected[target]) < 1e-3, (kind, i, served, expected[target])
        finally:
            stop_engine(server.url, state_dir=state)
        adapters = [random_adapter(base, root / f"adapter-{i}", seed=i) for i in range(2)]
        server = serve_vllm(
            str(base), port=args.port, served_model_name="policy", state_dir=state, push="adapter", lora_rank=8,
            extra_args=vllm_args, dtype="auto",
        )  # fmt: skip
        try:
            for target in adapters:
                reload_vllm_in_place(server.url, str(target), state_dir=state)
                expected[target] = first_token(server.url, "policy-adapter")
            assert abs(expected[adapters[0]] - expected[adapters[1]]) > 1e-3, "the adapters serve the same logprob"
            times["adapter"] = []
            for i in range(args.rounds):
                target = adapters[i % 2]
                started = time.monotonic()
                reload_vllm_in_place(server.url, str(target), state_dir=state)
                served = first_token(server.url, "policy-adapter")
                times["adapter"].append(time.monotonic() - started)
                assert abs(served - expected[target]) < 1e-3, ("adapter", i, served, expected[target])
        finally:
            stop_engine(server.url, state_dir=state)
    inplace, restart = statistics.median(times["in-place"]), statistics.median(times["restart"])
    print(f"model {args.model or f'random {args.size} (untied)'}, vLLM flags {' '.join(vllm_args)}")
    print(f"{'push':10s} {'median s':>9s} {'each (s)':s}")
    for kind, values in times.items():
        print(f"{kind:10s} {statistics.median(values):9.3f} {' '.join(f'{v:.3f}' for v in values)}")
    keep = statistics.median(times["keep"])
    print(f"in-place / restart = {inplace / restart:.4f} (goal <= 0.10); every push served the pushed weights")
    print(
        f"keep (under {args.load} decoding requests) / restart = {keep / restart:.4f}; every request running "
        f"during a keep push finished with all {args.load_tokens} tokens"
    )
    adapter = statistics.median(times["adapter"])
    print(f"adapter (LoRA rank 8, every linear layer) / restart = {adapter / restart:.4f}; / in-place = "
          f"{adapter / inplace:.2f}; every push served the pushed adapter")  # fmt: skip


if __name__ == "__main__":
    main()
