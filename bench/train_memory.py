"""Peak memory of `polar train`'s forward + backward: the log-prob head, and the token budget per forward.

Two measurements, each case in a fresh subprocess (peak RSS, ``ru_maxrss``, above the process's RSS once the model
is loaded and the batch built: what the case itself adds), side by side in one run:

1. **Log-prob head** on a Qwen-shaped model with Qwen2.5's 151,936-entry vocabulary and hidden size 896 (its head
   is the real 0.5B model's, 136M parameters), one issue-24-like row: a 1,650-token trace of which 250 positions
   are trained. Cases: ``full`` (logits over the whole vocabulary at every position, then log_softmax: what a
   plain ``model(...).logits`` loss does), ``trl`` (TRL 1.16's fused head as it runs on CPU: tiled, but every
   position is projected), ``trained`` (polar's: TRL's kernel on the trained positions only).
2. **Token budget**: one real `TraceGRPOTrainer` step (``_build_step`` + ``_compute_loss`` + backward, TRL's loss)
   over 8 rows of 1,650 tokens on the same model with ``--layers`` decoder layers: ``--token-budget 0`` (the old
   default: the 8 rows in one forward) against budgets that put 2 rows, then 1, in a forward.

    .venv/bin/python bench/train_memory.py            # both; a few minutes on 2 cores
    .venv/bin/python bench/train_memory.py --only head

Prints a table and writes bench/train_memory.json.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
VOCAB = 151936
SHAPE = dict(hidden_size=896, intermediate_size=4864, num_attention_heads=14, num_key_value_heads=2)


def _status(field: str) -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) / 1024
    return 0.0


def rss_mib() -> float:
    """The current RSS, after resetting the peak (VmHWM) to it: what a case adds is then VmHWM - this."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    return _status("VmRSS")


def peak_mib() -> float:
    return _status("VmHWM")


def build_model(out: Path, layers: int, dtype: str) -> Path:
    import shutil

    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from polar_cli.tiny_model import build_tiny_model

    if (out / "config.json").is_file():
        return out
    tiny = build_tiny_model(out.parent / "tokenizer-source")
    torch.manual_seed(0)
    config = Qwen2Config(vocab_size=VOCAB, num_hidden_layers=layers, tie_word_embeddings=False, dtype=dtype, **SHAPE)
    Qwen2ForCausalLM(config).to(getattr(torch, dtype)).save_pretrained(out, safe_serialization=True)
    for name in os.listdir(tiny):
        if name.startswith("tokenizer") or name in ("special_tokens_map.json", "chat_template.jinja"):
            shutil.copy(tiny / name, out / name)
    return out


def head_case(model_dir: Path, case: str, tokens: int, trained: int) -> dict:
    """One forward + backward of the summed trained log-probs; the backbone is in all three."""
    import torch
    from transformers import AutoModelForCausalLM

    from polar_cli.train.logprobs import add_trained_positions_head, trained_labels

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(model_dir)  # the checkpoint's dtype (bf16)
    model.train()
    ids = torch.randint(0, VOCAB, (1, tokens))
    attention = torch.ones_like(ids)
    keep = trained  # the completion window: its positions are the trained ones here
    mask = torch.ones((1, keep), dtype=torch.long)
    if case == "trl":
        from trl.trainer.utils import add_fused_lm_head

        add_fused_lm_head(model, outputs=("log_probs", "entropy"))
    elif case == "trained":
        add_trained_positions_head(model, 1.0, outputs=("log_probs", "entropy"))
    base, started = rss_mib(), time.perf_counter()
    if case == "full":
        logits = model(input_ids=ids, attention_mask=attention).logits[:, :-1].float()
        logps = torch.log_softmax(logits, -1).gather(-1, ids[:, 1:].unsqueeze(-1)).squeeze(-1)[:, -keep:]
    else:
        labels = ids.clone()
        labels[:, :-keep] = -100  # TRL's labels: the completion window
        if case == "trained":
            labels = trained_labels(ids, mask)
        logps = model(input_ids=ids, attention_mask=attention, labels=labels, fused_lm_head=True).log_probs[:, -keep:]
    logps.sum().backward()
    return {"case": case, "peak_mib": peak_mib() - base, "seconds": time.perf_counter() - started}


def budget_case(model_dir: Path, budget: int, rows: int, tokens: int, trained: int) -> dict:
    import torch

    from polar_cli.trace import Trace
    from polar_cli.train.config import TrainConfig
    from polar_cli.train.dataset import prepare_rows
    from polar_cli.train.run import build_trainer

    rng = random.Random(0)
    traces = []
    for s in range(rows):
        completion = [rng.randrange(VOCAB) for _ in range(trained)]
        traces.append(
            Trace(
                trace_id=f"t{s}",
                session_id=f"s{s}",
                group_id="g",
                task_id="g",
                prompt_ids=[rng.randrange(VOCAB) for _ in range(tokens - trained)],
                completion_ids=completion,
                loss_mask=[1] * trained,
                behavior_logprobs=[-12.0] * trained,
                reward=float(s % 2),
            )
        )
    data = prepare_rows(traces, max_length=tokens)
    cfg = TrainConfig(
        inputs=[],
        model=str(model_dir),
        output=Path(os.environ.get("TMPDIR", "/tmp")) / "polar-bench-train-memory-out",
        groups_per_step=1,
        max_steps=1,
        progress=False,
        dtype="float32",
        clip_against="step",
        token_budget=budget,
        gradient_checkpointing=False,
    )
    trainer = build_trainer(cfg, data)
    trainer.model.train()
    trainer.current_gradient_accumulation_steps = 1
    batches = trainer._build_step([0])
    base, started = rss_mib(), time.perf_counter()
    for batch in batches:
        trainer._compute_loss(trainer.model, batch).backward()
    forwards = sum(len(b["chunks"]) for b in batches)
    widest = max(c["input_ids"].numel() for b in batches for c in b["chunks"])
    return {
        "budget": budget,
        "forwards": forwards,
        "widest_forward_tokens": widest,
        "peak_mib": peak_mib() - base,
        "seconds": time.perf_counter() - started,
        "grad_norm": float(
            torch.sqrt(sum((p.grad.float() ** 2).sum() for p in trainer.model.parameters() if p.grad is not None))
        ),
    }


def in_subprocess(kind: str, **kw) -> dict:
    code = (
        f"import json, sys; sys.path.insert(0, {str(REPO / 'bench')!r}); import train_memory as b; "
        "from pathlib import Path; kw = json.loads(sys.argv[1]); kw['model_dir'] = Path(kw['model_dir']); "
        "print('RESULT' + json.dumps(getattr(b, sys.argv[2])(**kw)))"
    )
    kw = {k: str(v) if isinstance(v, Path) else v for k, v in kw.items()}
    out = subprocess.run(
        [sys.executable, "-c", code, json.dumps(kw), kind],
        capture_output=True,
        text=True,
        check=True,
        env={**os.environ, "PYTHONPATH": str(REPO)},
    )
    line = next(x for x in out.stdout.splitlines() if x.startswith("RESULT"))
    return json.loads(line[len("RESULT") :])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--work", type=Path, default=Path(os.environ.get("TMPDIR", "/tmp")) / "polar-bench-memory")
    parser.add_argument("--tokens", type=int, default=1650)
    parser.add_argument("--trained", type=int, default=250)
    parser.add_argument("--rows", type=int, default=8)
    parser.add_argument("--layers", type=int, default=1)
    parser.add_argument("--only", choices=("head", "budget"), default=None)
    parser.add_argument("--out", type=Path, default=REPO / "bench" / "train_memory.json")
    args = parser.parse_args()
    report: dict = {"tokens": args.tokens, "trained": args.trained, "vocab": VOCAB, **SHAPE}
    if args.only in (None, "head"):
        model = build_model(args.work / "qwen2-bf16-1layer", 1, "bfloat16")
        rows = [head_case_sub(model, c, args) for c in ("full", "trl", "trained")]
        report["head"] = rows
        print(f"\nlog-prob head, bf16, 1 x {args.tokens} tokens ({args.trained} trained), vocab {VOCAB:,}:")
        ours = rows[-1]["peak_mib"]
        for r in rows:
            ratio = r["peak_mib"] / ours
            print(f"  {r['case']:8s} peak +{r['peak_mib']:8.0f} MiB  ({ratio:5.1f}x)  {r['seconds']:6.1f} s")
    if args.only in (None, "budget"):
        model = build_model(args.work / f"qwen2-bf16-{args.layers}layer", args.layers, "bfloat16")
        budgets = [0, 2 * args.tokens, args.tokens]
        rows = [
            in_subprocess(
                "budget_case", model_dir=model, budget=b, rows=args.rows, tokens=args.tokens, trained=args.trained
            )
            for b in budgets
        ]
        report["budget"] = rows
        print(
            f"\none training step, {args.rows} x {args.tokens} tokens, {args.layers} layers of width 896, "
            "fp32 master weights (as `polar train` on CPU):"
        )
        for r in rows:
            print(
                f"  --token-budget {r['budget']:6d}: {r['forwards']} forwards (widest {r['widest_forward_tokens']:,} "
                f"tokens)  peak +{r['peak_mib']:7.0f} MiB  {r['seconds']:6.1f} s  grad norm {r['grad_norm']:.6g}"
            )
    args.out.write_text(json.dumps(report, indent=2) + "\n")


def head_case_sub(model: Path, case: str, args: argparse.Namespace) -> dict:
    return in_subprocess("head_case", model_dir=model, case=case, tokens=args.tokens, trained=args.trained)


if __name__ == "__main__":
    main()
