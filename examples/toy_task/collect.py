"""Capture toy-task sessions with the real rollout runner, for tests and benches that need a store of rewarded,
grouped, multi-turn sessions: ``groups`` tasks of ``tasks.jsonl`` x ``samples`` sessions each, the ``cmd:`` preset
running ``agent.py`` (``turns`` turns of at most ``max_tokens``), the local engine on ``model_dir``, the task's
verifier's shout score as the reward, token continuity as ``tito`` (``polar_tito``: auto, on or off) says. Shards
are sealed on return.

    from collect import collect   # with examples/toy_task on sys.path
    sessions = collect(Path("models/tiny"), Path("runs/x/shards"), groups=2, samples=3, turns=3, max_tokens=8)
"""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path

from polar_cli.rollout.runner import RolloutConfig, SessionResult, run_rollout
from polar_cli.rollout.tasks import load_tasks

HERE = Path(__file__).resolve().parent


def collect(
    model_dir: Path,
    shards: Path,
    *,
    groups: int,
    samples: int,
    turns: int = 2,
    max_tokens: int = 16,
    seed: int = 0,
    concurrency: int = 4,
    tito: str = "auto",
) -> list[SessionResult]:
    tasks = load_tasks(HERE / "tasks.jsonl")
    if groups > len(tasks):
        raise ValueError(f"the toy task set has {len(tasks)} tasks; asked for {groups} groups")
    agent = f"cmd:{sys.executable} {HERE / 'agent.py'} {{instruction}} --turns {turns} --max-tokens {max_tokens}"
    config = RolloutConfig(
        tasks=tasks[:groups],
        harness=agent,
        samples=samples,
        out=str(shards),
        engine=f"local:{model_dir}",
        concurrency=concurrency,
        seed=seed,
        work_dir=shards.parent / "sessions",
        logs_dir=shards.parent / "logs",
        proxy_options={"polar_shard_seconds": "1", "polar_tito": tito},
    )
    shards.parent.mkdir(parents=True, exist_ok=True)
    result = asyncio.run(run_rollout(config))
    failed = [s for s in result.sessions if s.status != "completed"]
    if failed:
        raise RuntimeError(f"{len(failed)} toy sessions failed: {[(s.session_id, s.reason) for s in failed][:3]}")
    return result.sessions
