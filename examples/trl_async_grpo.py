"""Train with TRL's own ``AsyncGRPOTrainer`` on rollouts of a real, unmodified agent through polar.

polar is the trainer's rollout worker (``rollout_worker=``) and weight transfer (``weight_transfer=``): each batch is
``polar rollout`` of every task x ``--samples`` through the proxy (the harness sees an ordinary model API), the
samples TRL trains on are the captured tokens and logprobs, and each weight sync is a checkpoint the next batch is
served from (``local``: a new proxy on it; ``vllm``: a restart; ``sglang:URL``: in place).

On this machine (2 CPU cores, no GPU), the default: the toy shout task (reward = fraction of capital letters in the
answer) through its openai-SDK agent, the tiny model on the embedded engine, bwrap sandbox; ~3 min for 3 steps::

    .venv/bin/python examples/trl_async_grpo.py --out runs/trl-async --steps 3

On a GPU, with any harness and a real model served by vLLM (restarted on each sync; ``--engine sglang:URL`` loads in
place), e.g. Pi on the HumanEval train split (``examples/humaneval/build_tasks.py``)::

    python examples/trl_async_grpo.py --gpu --model Qwen/Qwen3-8B --engine vllm --harness pi \\
        --tasks runs/humaneval/train --samples 8 --steps 200 --lr 1e-6 --max-length 32768 --out runs/trl-pi

``--gpu`` leaves TRL's FlashAttention-3 kernel and its MFU probe alone; without it they are replaced by a pure-torch
stand-in (``polar_cli.trl_async.run_trainer_on_cpu``). The run's batches (shards, logs, live progress for
``polar dashboard``) are in ``OUT/batch-NNNN/``, the checkpoints TRL pushed in ``OUT/weights/``, one record per batch
in ``OUT/worker.json``, TRL's own logs in ``OUT/trainer/``.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
TOY = REPO / "examples" / "toy_task"


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", type=Path, default=REPO / "models" / "tiny")
    p.add_argument("--tasks", type=Path, default=TOY / "tasks.jsonl")
    p.add_argument("--task-limit", type=int, default=None, help="the first K tasks only")
    p.add_argument("--harness", default=f"cmd:{sys.executable} {TOY / 'agent.py'} {{instruction}}")
    p.add_argument("--engine", default="local", help="local | vllm | sglang:URL (as polar loop --engine)")
    p.add_argument("--vllm-arg", action="append", default=[], help="an extra vLLM flag (--engine vllm), repeatable")
    p.add_argument("--ray", default=None, help="run each batch on this Ray cluster (as polar rollout --ray)")
    p.add_argument("--runtime", default="bwrap")
    p.add_argument("--samples", type=int, default=8, help="sessions per task: the GRPO group")
    p.add_argument("--concurrency", type=int, default=8)
    p.add_argument("--steps", type=int, default=3, help="optimizer steps (TRL's max_steps)")
    p.add_argument("--batch-size", type=int, default=16, help="samples per optimizer step")
    p.add_argument("--lr", type=float, default=5e-3, help="the tiny model's rate; ~1e-6 for a real model")
    p.add_argument("--max-length", type=int, default=2048, help="prompt + completion tokens per sample")
    p.add_argument("--token-budget", type=int, default=None, help="tokens per packed row (default --max-length)")
    p.add_argument("--max-staleness", type=int, default=1)
    p.add_argument("--temperature", type=float, default=1.0, help="must be what the harness sampled at")
    p.add_argument("--eot-token-id", type=int, default=2, help="the tiny model's end of turn (polar build's option)")
    p.add_argument("--gpu", action="store_true", help="keep TRL's GPU kernels (FlashAttention-3, MFU probe)")
    p.add_argument("--out", type=Path, required=True)
    return p.parse_args(argv)


def make_trainer(args: argparse.Namespace) -> tuple[Any, Any]:
    """TRL's trainer wired to polar's worker and weight transfer, ready to ``train()``."""
    from trl.experimental.async_grpo import AsyncGRPOConfig, AsyncGRPOTrainer

    from polar_cli.rollout.loop import LoopConfig
    from polar_cli.rollout.tasks import load_tasks
    from polar_cli.trl_async import PolarRolloutWorker, PolarWorkerConfig, run_trainer_on_cpu

    if not args.gpu:
        run_trainer_on_cpu()
    loop = LoopConfig(
        tasks=load_tasks(args.tasks, args.task_limit), harness=args.harness, model=args.model.resolve(), iterations=0,
        out=args.out.resolve(), samples=args.samples, engine=args.engine, runtime=args.runtime,
        concurrency=args.concurrency, vllm_args=args.vllm_arg, ray=args.ray,
    )  # fmt: skip
    options = PolarWorkerConfig(
        max_length=args.max_length, temperature=args.temperature, build_options={"eot_token_id": args.eot_token_id}
    )
    worker = PolarRolloutWorker(loop, options)
    config = AsyncGRPOConfig(
        output_dir=str(args.out / "trainer"), max_steps=args.steps, learning_rate=args.lr,
        per_device_train_batch_size=args.batch_size, num_generations=args.samples, temperature=args.temperature,
        max_staleness=args.max_staleness, token_budget=args.token_budget or args.max_length, weight_sync_steps=1,
        use_cpu=not args.gpu, dtype="float32" if not args.gpu else "bfloat16", report_to="none",
        save_strategy="no", logging_steps=1, heartbeat_stale_after_s=900.0,
    )  # fmt: skip
    trainer = AsyncGRPOTrainer(
        model=str(loop.model),
        args=config,
        train_dataset=worker.train_dataset(),
        rollout_worker=worker,
        weight_transfer=worker.weight_transfer(),
    )
    return trainer, worker


def main() -> None:
    trainer, worker = make_trainer(parse())
    trainer.train()
    for record in worker.batches:
        print(
            f"batch {record['batch']}: version {record['version']}, {record['rewarded']} rewarded sessions, "
            f"reward {record['reward_mean']:.3f}, {record['samples']} samples"
        )


if __name__ == "__main__":
    main()
