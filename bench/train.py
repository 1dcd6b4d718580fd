"""Training cost of the two trajectory builders on the same captured sessions.

The paper's ablation (same model and hardware, only the builder changes): per_request 1,185
trainer updates and 189.5 min, prefix_merging 218 and 35.2 min (5.39x). Here: multi-turn agent
sessions are captured once through mitmdump + the polar addon (local engine, the toy agent with
its shout verifier as reward), then ``polar train``'s code trains the same starting model on them
twice, once per builder, with the same settings. per_request traces get their session's reward
(``--broadcast-rewards``), as in the paper's baseline. The model is ``polar tiny-model --size
small`` (~10M parameters) by default: large enough that forward/backward compute, not per-step
overhead, dominates a CPU step, so the wall-clock ratio can be compared with the token ratio.

    .venv/bin/python bench/train.py                      # capture 4 x 4 sessions x 8 turns, then train twice
    .venv/bin/python bench/train.py --shards DIR         # an existing trace store instead of a capture

Reported per builder: trainer samples (traces = what the paper counts as trainer updates),
optimizer steps, tokens processed (prompt + completion forwarded), padded tokens (forwarded but
not real, after length bucketing), tokens trained (loss mask 1), training wall-clock
(``Trainer.train``), and the step-1 importance ratios (1 means the traces are token-faithful to
what the engine sampled).
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import time
from pathlib import Path

import orjson

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "examples" / "toy_task"))
os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")

STRATEGIES = ("per_request", "prefix_merging")


def train_once(strategy: str, shards: Path, args: argparse.Namespace) -> dict:
    from polar_cli.train.config import TrainConfig
    from polar_cli.train.dataset import load_traces
    from polar_cli.train.run import run_training

    t0 = time.perf_counter()
    traces = load_traces(
        [shards], strategy, tokenizer=args.model, broadcast_rewards=strategy == "per_request", eot_token_id=args.eot
    )
    build_s = time.perf_counter() - t0
    cfg = TrainConfig(
        inputs=[shards], model=str(args.model), output=args.out / strategy, strategy=strategy,
        learning_rate=args.lr, epochs=args.epochs, groups_per_step=args.groups_per_step, grad_accum=args.grad_accum,
        weight_decay=0.0, progress=False, plot=False, drop_zero_advantage=False,
    )  # fmt: skip
    t0 = time.perf_counter()
    result = run_training(cfg, traces=traces)
    total_s = time.perf_counter() - t0
    logs = [r for r in map(orjson.loads, result.metrics_path.read_text().splitlines()) if "loss" in r]
    return {
        "strategy": strategy,
        "traces": result.stats["rows"],
        "steps": result.steps,
        "tokens_processed": int(sum(r["tokens/forward"] for r in logs)),
        "tokens_padded": int(sum(r["tokens/padded"] for r in logs)),
        "tokens_trained": int(sum(r["tokens/trainable"] for r in logs)),
        "train_s": result.train_seconds,
        "train_with_setup_s": total_s,
        "build_s": build_s,
        "step1_is_min": logs[0]["is_ratio/min"],
        "step1_is_max": logs[0]["is_ratio/max"],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shards", type=Path, help="an existing trace store (default: capture one)")
    parser.add_argument("--model", type=Path, default=None, help="default: build `polar tiny-model --size small`")
    parser.add_argument("--size", default="small", help="shape built when --model is not given")
    parser.add_argument("--out", type=Path, default=REPO / "runs" / "bench_train")
    parser.add_argument("--groups", type=int, default=4)
    parser.add_argument("--samples", type=int, default=4)
    parser.add_argument("--turns", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--epochs", type=float, default=1.0)
    parser.add_argument("--groups-per-step", type=int, default=1)
    parser.add_argument("--grad-accum", type=int, default=1)
    args = parser.parse_args()
    if args.model is None:
        from polar_cli.tiny_model import build_tiny_model

        args.model = args.out.parent / f"bench_model_{args.size}"
        if not (args.model / "config.json").is_file():
            build_tiny_model(args.model, size=args.size)
    if not (args.model / "config.json").is_file():
        raise SystemExit(f"{args.model} missing: run `make model`")
    from transformers import AutoTokenizer

    # The template's end-of-turn token (<|im_end|>), named explicitly: a random model sometimes
    # stops with its other eos (<|endoftext|>), which the template never writes.
    args.eot = AutoTokenizer.from_pretrained(args.model).eos_token_id

    from rich.console import Console
    from rich.table import Table

    console = Console()
    shards = args.shards
    if shards is None:
        from collect import collect

        shutil.rmtree(args.out, ignore_errors=True)
        shards = args.out / "capture" / "shards"
        t0 = time.perf_counter()
        sessions = collect(args.model, shards, groups=args.groups, samples=args.samples,
                           turns=args.turns, max_tokens=args.max_tokens)  # fmt: skip
        console.print(f"captured {len(sessions)} sessions x {args.turns} turns in {time.perf_counter() - t0:.0f} s")
    results = [train_once(s, shards, args) for s in STRATEGIES]

    table = Table(title=f"bench/train.py: same sessions, two builders ({shards})")
    table.add_column("")
    for r in results:
        table.add_column(r["strategy"], justify="right")
    table.add_column("ratio", justify="right")
    rows = [
        ("trainer samples (traces)", "traces", "{:,}"),
        ("optimizer steps", "steps", "{:,}"),
        ("tokens processed", "tokens_processed", "{:,}"),
        ("padded tokens (not in the above)", "tokens_padded", "{:,}"),
        ("tokens trained (mask 1)", "tokens_trained", "{:,}"),
        ("training wall-clock (s)", "train_s", "{:.2f}"),
        ("  incl. model load + TRL setup (s)", "train_with_setup_s", "{:.2f}"),
        ("build (s)", "build_s", "{:.2f}"),
        ("step-1 IS ratio min", "step1_is_min", "{:.4f}"),
        ("step-1 IS ratio max", "step1_is_max", "{:.4f}"),
    ]
    pr, pm = results
    for label, key, fmt in rows:
        comparable = not key.startswith("step1") and pm[key]
        ratio = pr[key] / pm[key] if comparable else None
        table.add_row(label, fmt.format(pr[key]), fmt.format(pm[key]), f"{ratio:.2f}x" if ratio else "")
    console.print(table)
    for r in results:
        console.print(f"{r['strategy']}: padded / real tokens {r['tokens_padded'] / r['tokens_processed']:.1%}")
    token_ratio = pr["tokens_processed"] / pm["tokens_processed"]
    wall_ratio = pr["train_s"] / pm["train_s"]
    console.print(f"wall-clock ratio {wall_ratio:.2f}x vs tokens-processed ratio {token_ratio:.2f}x "
                  f"({wall_ratio / token_ratio:.0%} of it; target >= 75%)")  # fmt: skip
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "results.json").write_bytes(orjson.dumps(results, option=orjson.OPT_INDENT_2))
    console.print(f"results: {args.out / 'results.json'}")


if __name__ == "__main__":
    main()
