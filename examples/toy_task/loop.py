"""Proof that the loop learns: rollouts -> `polar train` -> reload -> rollouts, on CPU, in minutes.

The task: the agent (official openai SDK, ``agent.py``) is asked to answer in CAPITAL LETTERS;
the verifier scores the fraction of capital letters in what it wrote. The tiny random model starts
near 5%. Each iteration:

1. starts mitmdump + the polar addon with the local engine on the current policy (this is the
   reload: the local engine lives in the proxy process, so a new checkpoint means a new proxy);
2. runs ``groups x samples`` agent sessions through it and posts each session's reward;
3. prints the reward mean with its standard error;
4. trains on that iteration's raw shards with ``polar train`` (built on the fly, prefix_merging),
   and the checkpoint becomes the next iteration's policy.

    python examples/toy_task/loop.py                  # defaults: ~5 min on 2 cores
    python examples/toy_task/loop.py --iterations 3   # a quicker look
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
sys.path.insert(0, str(HERE))

from rollout import collect, mean_se  # noqa: E402

POLAR = Path(sys.executable).parent / "polar"


def train(policy: Path, shards: Path, out: Path, args: argparse.Namespace) -> bool:
    """One `polar train` run; False when there was nothing to learn from (every reward equal)."""
    cmd = [
        str(POLAR), "train", str(shards), "--model", str(policy), "--output", str(out),
        "--lr", str(args.lr), "--epochs", str(args.epochs), "--groups-per-step", "1", "--weight-decay", "0",
        "--eot-token-id", str(args.eot), "--no-progress",
    ]  # fmt: skip
    done = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO)
    if done.returncode == 3:  # polar train: nothing to train
        return False
    if done.returncode != 0:
        raise SystemExit(f"polar train failed:\n{done.stdout[-2000:]}\n{done.stderr[-4000:]}")
    return True


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", type=Path, default=REPO / "models" / "tiny")
    parser.add_argument("--out", type=Path, default=REPO / "runs" / "toy_task")
    parser.add_argument("--iterations", type=int, default=6, help="rollout rounds (training happens between them)")
    parser.add_argument("--groups", type=int, default=4)
    parser.add_argument("--samples", type=int, default=8)
    parser.add_argument("--lr", type=float, default=1e-2)
    parser.add_argument("--epochs", type=float, default=2.0)
    args = parser.parse_args()
    if not (args.model / "config.json").is_file():
        raise SystemExit(f"{args.model} missing: run `make model`")
    shutil.rmtree(args.out, ignore_errors=True)
    from transformers import AutoTokenizer

    # The template's end-of-turn token (<|im_end|>): turns here mostly end at max_tokens, and a
    # random model that stops by itself may do so with its other eos, which no template writes.
    args.eot = AutoTokenizer.from_pretrained(args.model).eos_token_id

    started = time.monotonic()
    policy = args.model
    history: list[tuple[float, float]] = []
    for it in range(args.iterations):
        run = args.out / f"iter-{it}"
        t0 = time.monotonic()
        sessions = collect(policy, run / "shards", tag=f"it{it}", groups=args.groups, samples=args.samples)
        mean, se = mean_se([s.reward for s in sessions])
        history.append((mean, se))
        best = max(sessions, key=lambda s: s.reward)
        print(f"iteration {it}: reward {mean:.3f} ± {se:.3f} (n={len(sessions)}, rollouts {time.monotonic() - t0:.0f} s)"
              f"  best reply: {best.replies[0][:40]!r}", flush=True)  # fmt: skip
        if it == args.iterations - 1:
            break
        t0 = time.monotonic()
        if train(policy, run / "shards", run / "checkpoint", args):
            policy = run / "checkpoint"
            print(f"  trained -> {policy.relative_to(REPO) if policy.is_relative_to(REPO) else policy}"
                  f" ({time.monotonic() - t0:.0f} s)", flush=True)  # fmt: skip
        else:
            print("  every reward equal: nothing to learn, policy kept", flush=True)

    (m0, s0), (m1, s1) = history[0], history[-1]
    z = (m1 - m0) / max((s0**2 + s1**2) ** 0.5, 1e-12)
    print(f"\nreward {m0:.3f} ± {s0:.3f} -> {m1:.3f} ± {s1:.3f}: +{m1 - m0:.3f}, {z:.1f} standard errors "
          f"(whole loop {time.monotonic() - started:.0f} s)")  # fmt: skip
    if z < 5:
        raise SystemExit("the reward did not rise far outside the noise")


if __name__ == "__main__":
    main()
