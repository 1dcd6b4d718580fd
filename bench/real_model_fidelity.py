"""Fidelity of captured logprobs on a real model: what the engine said it sampled against what the trainer computes.

For every usable call in a trace store (status ok, sampled ids with their logprobs, sampling the trainer can
recompute: no top-p / top-k / min-p truncation), one plain transformers forward pass over prompt + sampled ids gives
log_softmax(logits / T) of the sampled ids, as `polar train` computes them before its first update: fp32 master
parameters (the checkpoint's bf16 weights widen exactly), the forward in fp32 or under bf16 autocast
(``polar train --dtype``). The first-step importance ratio of each token is exp(recomputed - captured): 1 for a
perfect capture; PPO's clip (0.2 / 0.28) and TIS act on it, so its spread is the off-policy noise the engine/trainer
numerics add before any learning.

    python bench/real_model_fidelity.py STORE MODEL_DIR [--dtype float32 --dtype bfloat16] [--limit 64]

Prints one row per compute dtype: calls, tokens, |Δ logprob| mean / p99 / max, ratio min / max, mean |r - 1|, and
the fraction of tokens a 0.2 / 0.28 clip would cut.
"""

from __future__ import annotations

import argparse
import math
from dataclasses import dataclass

import torch

from polar_addon.store import read_records

CLIP_LOW, CLIP_HIGH = 0.2, 0.28


@dataclass
class Call:
    prompt_ids: list[int]
    response_ids: list[int]
    logprobs: list[float]
    temperature: float


@dataclass
class Row:
    dtype: str
    calls: int
    tokens: int
    abs_mean: float
    abs_p99: float
    abs_max: float
    ratio_min: float
    ratio_max: float
    ratio_dev: float
    clipped: float


def usable_calls(store: str, limit: int | None) -> tuple[list[Call], str]:
    calls, engines = [], set()
    for r in read_records(store):
        truncated = (r.top_p is not None and r.top_p < 1) or bool(r.top_k and r.top_k > 0) or bool(r.min_p)
        if r.status != "ok" or not r.response_ids or len(r.logprobs) != len(r.response_ids) or truncated:
            continue
        calls.append(Call(list(r.prompt_ids), list(r.response_ids), list(r.logprobs), r.temperature or 1.0))
        engines.add(r.engine or "?")
        if limit and len(calls) >= limit:
            break
    return calls, ", ".join(sorted(engines))


def recompute(model: torch.nn.Module, call: Call, dtype: torch.dtype) -> list[float]:
    ids = torch.tensor([call.prompt_ids + call.response_ids])
    with torch.inference_mode(), torch.autocast("cpu", dtype=dtype, enabled=dtype != torch.float32):
        logits = model(input_ids=ids).logits[0, len(call.prompt_ids) - 1 : -1].float()
    logprobs = torch.log_softmax(logits / call.temperature, dim=-1)
    return logprobs.gather(1, torch.tensor(call.response_ids)[:, None])[:, 0].tolist()


def measure(model: torch.nn.Module, calls: list[Call], dtype_name: str) -> Row:
    dtype = getattr(torch, dtype_name)
    deltas: list[float] = []
    for call in calls:
        deltas += [new - old for new, old in zip(recompute(model, call, dtype), call.logprobs, strict=True)]
    d = torch.tensor(deltas, dtype=torch.float64)
    ratio = d.exp()
    return Row(
        dtype=dtype_name,
        calls=len(calls),
        tokens=len(deltas),
        abs_mean=d.abs().mean().item(),
        abs_p99=d.abs().quantile(0.99).item(),
        abs_max=d.abs().max().item(),
        ratio_min=ratio.min().item(),
        ratio_max=ratio.max().item(),
        ratio_dev=(ratio - 1).abs().mean().item(),
        clipped=((ratio < 1 - CLIP_LOW) | (ratio > 1 + CLIP_HIGH)).double().mean().item(),
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("store")
    parser.add_argument("model_dir")
    parser.add_argument("--dtype", action="append", choices=["float32", "bfloat16"])
    parser.add_argument("--limit", type=int, default=64, help="At most this many calls (0: all).")
    args = parser.parse_args()
    from transformers import AutoModelForCausalLM

    calls, engines = usable_calls(args.store, args.limit or None)
    if not calls:
        raise SystemExit(f"no usable calls in {args.store} (status ok, logprobs, untruncated sampling)")
    model = AutoModelForCausalLM.from_pretrained(args.model_dir, dtype=torch.float32).eval()
    torch.set_num_threads(max(1, torch.get_num_threads()))
    print(f"engine: {engines}; model: {args.model_dir}")
    print(
        "| trainer dtype | calls | tokens | |Δ| mean | |Δ| p99 | |Δ| max | ratio min | ratio max | mean |r-1| "
        "| clipped |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for name in args.dtype or ["float32", "bfloat16"]:
        r = measure(model, calls, name)
        assert math.isfinite(r.abs_max), r
        print(
            f"| {r.dtype} | {r.calls} | {r.tokens} | {r.abs_mean:.4f} | {r.abs_p99:.4f} | {r.abs_max:.4f} | "
            f"{r.ratio_min:.3f} | {r.ratio_max:.3f} | {r.ratio_dev:.4f} | {r.clipped:.2%} |"
        )


if __name__ == "__main__":
    main()
