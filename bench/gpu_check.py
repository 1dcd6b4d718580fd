"""GPU check of `polar train` on a model shaped like a real one (see bench/gpu_check.sh).

A randomly initialised Qwen3 of Qwen3-0.6B's shape (``polar tiny-model --size 0.5b``, ~0.44B
parameters, stored in bf16, no download) samples a few GRPO groups of traces on the device; the
behaviour logprobs are its own, as an exact engine would report them. Then `polar train`'s code
takes steps at lr 1e-6, full fine-tuning and LoRA, with bf16 autocast over fp32 master weights,
and checks:

- the first step is on-policy: every importance ratio pi_theta / pi_behavior within 1e-3 of 1;
- the weights move at lr 1e-6 (full: > 99% of the master weights; LoRA: every adapter B);
- the checkpoint written is the trained policy: its tensors are exactly bf16(fp32 master, LoRA
  merged in fp32); the sequence-logprob gap between it and the fp32 master is reported.

``--cpu`` runs the same checks on the tiny shape, so the script itself can be verified anywhere.
Exit status 0 only when every check passes; a table of the figures is printed either way.
"""

from __future__ import annotations

import argparse
import os
import random
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import torch  # noqa: E402

from polar_cli.trace import Trace  # noqa: E402

RATIO_TOL = 1e-3


@torch.no_grad()
def sample_traces(model_dir: Path, device: str, *, groups: int, samples: int, tokens: int, temperature: float,
                  autocast: bool, seed: int = 0) -> list[Trace]:  # fmt: skip
    """Prefix-merged-shaped traces (a1 | interstitial | a2) sampled by the model itself."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).to(device).eval()
    gen = torch.Generator(device=device).manual_seed(seed)
    rng = random.Random(seed)

    def logits_of(ids: list[int]) -> torch.Tensor:
        with torch.autocast(device_type=device, dtype=torch.bfloat16, enabled=autocast):
            return model(torch.tensor([ids], device=device)).logits[0].float() / temperature

    def sample(ids: list[int], n: int) -> list[int]:
        out: list[int] = []
        for _ in range(n):
            probs = torch.softmax(logits_of(ids + out)[-1], -1)
            out.append(int(torch.multinomial(probs, 1, generator=gen)))
        return out

    traces = []
    u = tok.encode("<|im_end|>\n<|im_start|>user\nok<|im_end|>\n<|im_start|>assistant\n", add_special_tokens=False)
    for g in range(groups):
        for s in range(samples):
            prompt = tok.apply_chat_template([{"role": "user", "content": f"task {g}: go"}], add_generation_prompt=True,
                                             tokenize=True, return_dict=False)  # fmt: skip
            a1 = sample(prompt, tokens)
            a2 = sample(prompt + a1 + u, tokens)
            completion = a1 + u + a2
            mask = [1] * len(a1) + [0] * len(u) + [1] * len(a2)
            ids = prompt + completion
            lp = torch.log_softmax(logits_of(ids)[:-1], -1).gather(1, torch.tensor(ids[1:], device=device)[:, None])
            lps = lp.squeeze(1).tolist()[len(prompt) - 1 :]
            traces.append(Trace(
                trace_id=f"g{g}-s{s}", session_id=f"g{g}-s{s}", group_id=f"g{g}", task_id=f"g{g}", prompt_ids=prompt,
                completion_ids=completion, loss_mask=mask,
                behavior_logprobs=[x if m else 0.0 for x, m in zip(lps, mask)],
                reward=float(rng.random() < 0.5) if s > 1 else float(s), temperature=temperature, calls_merged=2,
            ))  # fmt: skip
    return traces


@torch.no_grad()
def sequence_logps(model, trainer, traces: list[Trace]) -> torch.Tensor:
    from polar_cli.train.dataset import prepare_rows

    data = prepare_rows(traces, max_length=1 << 20, drop_zero_advantage=False)
    out = []
    for row in data.rows:
        # a plain forward (a freshly loaded model lacks TRL's fused logprob head)
        chunk = trainer._chunk([row])
        ids, keep = chunk["input_ids"], chunk["logits_to_keep"]
        logits = model(input_ids=ids, attention_mask=chunk["attention_mask"]).logits[:, -keep - 1 : -1].float()
        lp = torch.log_softmax(logits / trainer.args.temperature, -1).gather(2, ids[:, -keep:, None]).squeeze(2)
        out.append((lp * chunk["loss_mask"]).sum())
    return torch.stack(out)


def check(mode: str, model_dir: Path, traces: list[Trace], out: Path, args) -> dict:
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    from polar_cli.train.config import TrainConfig
    from polar_cli.train.dataset import prepare_rows
    from polar_cli.train.run import build_trainer, save_checkpoint, serving_dtype

    cfg = TrainConfig(
        inputs=[], model=str(model_dir), output=out, learning_rate=1e-6, max_steps=args.steps,
        groups_per_step=args.groups, dtype=args.dtype, lora_r=16 if mode == "lora" else 0, progress=False, plot=False,
        weight_decay=0.0,
    )  # fmt: skip
    data = prepare_rows(traces, max_length=cfg.max_length)
    trainer = build_trainer(cfg, data)
    start = {n: p.detach().clone() for n, p in trainer.model.named_parameters() if p.requires_grad}
    t0 = time.perf_counter()
    trainer.train()
    train_s = time.perf_counter() - t0
    logs = [r for r in trainer.state.log_history if "is_ratio/max" in r]
    params = {n: p.detach() for n, p in trainer.model.named_parameters() if p.requires_grad}
    moved = sum(int((params[n] != start[n]).sum()) for n in start)
    total = sum(v.numel() for v in start.values())
    if mode == "lora":
        b_names = [n for n in start if "lora_B" in n]
        b_moved = sum(not torch.equal(params[n], start[n]) for n in b_names) / len(b_names)
    save_checkpoint(trainer, out, serving_dtype(cfg.model))

    # the checkpoint vs the policy in memory: tensors exactly, then the logprobs it assigns
    saved = load_file(out / "model.safetensors")
    policy = trainer.accelerator.unwrap_model(trainer.model)
    if mode == "lora":
        policy = policy.merge_and_unload(safe_merge=True)  # fp32 master + fp32 delta, merged in fp32
    expected = {k: v.detach().to(torch.bfloat16) for k, v in policy.state_dict().items()}
    tensor_mismatch = sum(not torch.equal(saved[k].cpu(), expected[k].cpu()) for k in saved)
    served = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).to(policy.device).eval()
    # information, not a check: what serving the fp32 master in bf16 costs in sequence logprob
    lp_saved = sequence_logps(served, trainer, traces)
    lp_policy = sequence_logps(policy.eval(), trainer, traces)
    return {
        "mode": mode,
        "step1_ratio_min": logs[0]["is_ratio/min"],
        "step1_ratio_max": logs[0]["is_ratio/max"],
        "weights_moved": moved / total,
        "lora_B_moved": b_moved if mode == "lora" else None,
        "tensor_mismatch": tensor_mismatch,
        "logp_max_diff": float((lp_saved - lp_policy).abs().max()),
        "train_s": train_s,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cpu", action="store_true", help="tiny shape on the CPU: checks the script itself")
    parser.add_argument("--size", default=None, help="model shape (default: 0.5b, or tiny with --cpu)")
    parser.add_argument("--dtype", default=None, help="compute dtype (default: bfloat16)")
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--groups", type=int, default=2)
    parser.add_argument("--samples", type=int, default=4)
    parser.add_argument("--tokens", type=int, default=24)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    device = "cpu" if args.cpu else "cuda"
    if device == "cuda" and not torch.cuda.is_available():
        print("no CUDA device: run with --cpu to check the script on the CPU", file=sys.stderr)
        return 2
    args.size = args.size or ("tiny" if args.cpu else "0.5b")
    args.dtype = args.dtype or "bfloat16"
    out = args.out or Path(tempfile.mkdtemp(prefix="polar-gpu-check-"))

    from polar_cli.tiny_model import build_tiny_model

    model_dir = build_tiny_model(out / "model", dtype="bfloat16", size=args.size)
    from safetensors.torch import load_file

    n_params = sum(p.numel() for p in load_file(model_dir / "model.safetensors").values())
    traces = sample_traces(model_dir, device, groups=args.groups, samples=args.samples, tokens=args.tokens,
                           temperature=0.6, autocast=args.dtype == "bfloat16")  # fmt: skip
    results = [check(mode, model_dir, traces, out / mode, args) for mode in ("full", "lora")]

    failures = []
    print(f"model {args.size}: {n_params / 1e6:.1f}M parameters (bf16), compute {args.dtype}, lr 1e-6, {device}")
    header = (
        f"{'':6} {'ratio min':>10} {'ratio max':>10} {'moved':>8} {'lora B':>7} {'ckpt diff':>9} "
        f"{'seq logp gap':>12} {'train s':>8}"
    )
    print(header)
    for r in results:
        lb = "" if r["lora_B_moved"] is None else f"{r['lora_B_moved']:.0%}"
        print(f"{r['mode']:6} {r['step1_ratio_min']:10.6f} {r['step1_ratio_max']:10.6f} {r['weights_moved']:8.2%} "
              f"{lb:>7} {r['tensor_mismatch']:9d} {r['logp_max_diff']:12.2e} {r['train_s']:8.1f}")  # fmt: skip
        if not (abs(r["step1_ratio_min"] - 1) <= RATIO_TOL and abs(r["step1_ratio_max"] - 1) <= RATIO_TOL):
            failures.append(f"{r['mode']}: first-step ratios not within {RATIO_TOL} of 1")
        if r["mode"] == "full" and r["weights_moved"] <= 0.99:
            failures.append("full: fewer than 99% of the master weights moved at lr 1e-6")
        if r["mode"] == "lora" and r["lora_B_moved"] < 1.0:
            failures.append("lora: an adapter B did not move at lr 1e-6")
        if r["tensor_mismatch"]:
            failures.append(f"{r['mode']}: the checkpoint is not the trained policy rounded to bf16")
    for f in failures:
        print("FAIL", f)
    print("OK" if not failures else f"{len(failures)} check(s) failed", f"(outputs in {out})")
    return 1 if failures else 0


if __name__ == "__main__":
    raise SystemExit(main())
