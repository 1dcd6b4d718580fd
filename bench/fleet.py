"""Fleet benchmark, in one run: the asynchronous loop against the synchronous one on the toy task, and `polar rollout
--ray` sessions per minute with 1 and with 2 Ray worker nodes.

Both run `polar loop` for real (the runner, mitmdump, the local engine, examples/toy_task's openai-SDK agent and its
verifier, `polar train` in its own process) from the same starting model, tasks and training options; then one table
puts side by side the wall-clock of each iteration (sync: its rollout + its training; async: the time between two
trainings ending, then the last measuring batch; sync's rollout time excludes starting its proxy, async's batches
include it, so the end-to-end time of each `polar loop` is the fair total), the reward per policy version (mean ±
standard error of the first whole batch on it), and the fraction of wall time the rollout side and the trainer were
busy (Polar's figure 5).

Ray: a real cluster on this machine's loopback (tests/support/ray_cluster.py: a head without CPUs and two worker
nodes, each `ray start` in its own process session); the same toy rollout (the local engine on the starting model,
one proxy per node) runs on worker 0 only (`--ray-resource`), then on both. On one machine the two "nodes" share its
cores, so this measures the backend's overhead and scaling on this box, not a fleet's.

    .venv/bin/python bench/fleet.py                                # 4 tasks x 8 samples, 4 iterations
    .venv/bin/python bench/fleet.py --tasks 2 --samples 2 --iterations 3 --turns 1 --max-tokens 4   # small
    .venv/bin/python bench/fleet.py --no-loops --ray-samples 8     # only the Ray part

``--engine vllm`` runs three loops on the vLLM CPU engine instead (an untied tiny model, so it loads in place):
synchronous, async with each push a restart (``--vllm-push restart --drain wait``), and async with the push in
place under the running batch (``--drain keep``), and reports per loop the trainings per hour (end to end, the
engine's start included), the seconds per training step in steady state, the busy fractions, the tokens sampled per
second and the fraction of them that a training step took. ``--cpu-split 0:1`` gives the
rollout side (the loop, vLLM, proxies, harnesses) and each `polar train` their own CPU sets (``polar loop
--rollout-cpus/--train-cpus``): on shared cores the two sides cannot overlap.

    .venv/bin/python bench/fleet.py --engine vllm --cpu-split 0:1 --no-ray --tasks 2 --samples 4 --iterations 6 \
        --max-tokens 64   # a batch about as long as a training: what the overlap can win
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
TOY = REPO / "examples" / "toy_task"


def run_loop(out: Path, args: argparse.Namespace, model: Path, tasks: Path, extra: list[str]) -> float:
    harness = (
        f"cmd:{sys.executable} {TOY / 'agent.py'} --turns {args.turns} --max-tokens {args.max_tokens} {{instruction}}"
    )
    cmd = [sys.executable, "-m", "polar_cli.app", "loop", str(tasks), "--harness", harness, "--model", str(model),
           "--iterations", str(args.iterations), "--out", str(out), "--samples", str(args.samples),
           "--concurrency", str(args.concurrency), "--no-progress", "--lr", str(args.lr), "--epochs", "2",
           "--groups-per-step", "1", "--weight-decay", "0", "--eot-token-id", "2", *extra]  # fmt: skip
    started = time.monotonic()
    done = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True)
    if done.returncode != 0:
        sys.exit(f"{' '.join(cmd[3:5])} {' '.join(extra)} failed ({done.returncode}):\n{done.stderr[-3000:]}")
    return time.monotonic() - started


def run_ray_rollout(
    cluster: Any, resource: str, out: Path, args: argparse.Namespace, model: Path, tasks: Path
) -> dict[str, Any]:
    harness = (
        f"cmd:{sys.executable} {TOY / 'agent.py'} --turns {args.turns} --max-tokens {args.max_tokens} {{instruction}}"
    )
    cmd = [sys.executable, "-m", "polar_cli.app", "rollout", str(tasks), "--harness", harness, "--samples",
           str(args.ray_samples), "--engine", f"local:{model}", "--out", str(out), "--seed", "0", "--ray",
           cluster.address, "--ray-resource", resource, "--concurrency", str(args.ray_concurrency), "--no-progress",
           "--confdir", str(out.parent / "conf")]  # fmt: skip
    done = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True)
    if done.returncode != 0:
        sys.exit(f"polar rollout --ray --ray-resource {resource} failed ({done.returncode}):\n{done.stderr[-3000:]}")
    return json.loads((out / "rollouts" / "r0" / "rollout-summary.json").read_text())


def ray_rows(root: Path, args: argparse.Namespace, model: Path, tasks: Path) -> list[tuple[int, dict[str, Any]]]:
    """(workers, rollout summary) with 1 and 2 Ray worker nodes, on one cluster started here."""
    sys.path.insert(0, str(REPO))
    from tests.support.ray_cluster import RayCluster

    cluster = RayCluster(root / "ray")
    (root / "ray").mkdir()
    try:
        # polar_all on both: the two-worker run; polar_w0 on the first only: the one-worker run.
        cluster.start([{"polar_w0": 1, "polar_all": 1}, {"polar_all": 1}])
        return [
            (1, run_ray_rollout(cluster, "polar_w0", root / "ray1" / "store", args, model, tasks)),
            (2, run_ray_rollout(cluster, "polar_all", root / "ray2" / "store", args, model, tasks)),
        ]
    finally:
        cluster.stop()


def sync_rows(state: dict[str, Any]) -> tuple[list[float], list[str], float, float, float]:
    its = state["iterations"]
    walls = [r["rollout_s"] + ((r.get("train") or {}).get("seconds") or 0.0) for r in its]
    rewards = [_reward(r["reward_mean"], r["reward_se"]) for r in its]
    wall = sum(walls)
    rollout = sum(r["rollout_s"] for r in its) / wall
    trainer = sum((r.get("train") or {}).get("seconds") or 0.0 for r in its) / wall
    return walls, rewards, wall, rollout, trainer


def async_rows(state: dict[str, Any]) -> tuple[list[float], list[str], float, float, float]:
    steps, batches, summary = state["steps"], state["batches"], state["summary"]
    start = min(b["started_at"] for b in batches)
    ends = [s["ended_at"] for s in steps] + [batches[-1]["ended_at"]]
    walls = [b - a for a, b in zip([start, *ends[:-1]], ends)]
    rewards = []
    for version in range(summary["final_version"] + 1):
        on = [b for b in batches if b["version"] == version and not b["cut"]]
        rewards.append(_reward(on[0]["reward_mean"], on[0]["reward_se"]) if on else "-")
    return walls, rewards, summary["wall_s"], summary["rollout_util"], summary["trainer_util"]


def steady_step_s(walls: list[float]) -> float:
    """Mean wall-clock per training step in steady state: the per-step walls (sync: each iteration's rollout and
    training; async: the time between two trainings ending) without the first, which no overlap can shorten (the first
    batch, then the first training), and the last, the batch that only measures the final policy. The engine's start
    and the loop's own setup count in the end-to-end figure, not here."""
    inner = walls[1:-1] or walls
    return sum(inner) / len(inner)


def sampled_tokens(shards: str) -> int:
    """Response tokens of every call in a store."""
    import pyarrow.compute as pc

    from polar_addon.store.reader import read_table

    column = read_table(shards, columns=["response_ids"]).column(0)
    return int(pc.sum(pc.list_value_length(column)).as_py() or 0) if len(column) else 0


def token_use(state: dict[str, Any], out: Path) -> tuple[int, int]:
    """(tokens sampled across the run, tokens in the stores a training step took)."""
    from polar_cli.rollout.loop import iteration_dir

    if state.get("mode") == "async":
        stores = [(b["shards"], b["step"] is not None and not b["dropped_groups"]) for b in state["batches"]]
    else:
        stores = [
            (str(iteration_dir(out, i) / "shards"), (r.get("train") or {}).get("status") == "trained")
            for i, r in enumerate(state["iterations"])
        ]
    counts = [(sampled_tokens(shards), used) for shards, used in stores]
    return sum(n for n, _ in counts), sum(n for n, used in counts if used)


def _reward(mean: float | None, se: float | None) -> str:
    return "-" if mean is None else f"{mean:.3f} ± {se or 0.0:.3f}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tasks", type=int, default=4, help="the first N tasks of examples/toy_task")
    parser.add_argument("--samples", type=int, default=8)
    parser.add_argument("--iterations", type=int, default=4)
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--turns", type=int, default=2)
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--lr", type=float, default=1e-2)
    parser.add_argument("--max-staleness", type=int, default=1)
    parser.add_argument("--drain", default="wait")
    parser.add_argument("--model", type=Path, help="default: a fresh tiny model (polar_cli.tiny_model)")
    parser.add_argument("--no-loops", action="store_true", help="skip the async vs sync loops")
    parser.add_argument("--no-ray", action="store_true", help="skip the Ray rollouts")
    parser.add_argument("--ray-samples", type=int, default=8, help="Ray rollouts: sessions per task")
    parser.add_argument("--ray-concurrency", type=int, default=4, help="Ray rollouts: harnesses at once per node")
    parser.add_argument("--engine", default="local", help="local (default) or vllm: sync vs async restart vs keep")
    parser.add_argument("--cpu-split", help="ROLLOUT:TRAIN CPU lists for polar loop, e.g. 0:1 or 0-7:8-15")
    args = parser.parse_args()
    if args.engine == "vllm":
        return vllm_loops(args)

    with tempfile.TemporaryDirectory(prefix="polar-fleet-") as tmp:
        root = Path(tmp)
        model = args.model
        if model is None:
            from polar_cli.tiny_model import build_tiny_model

            model = build_tiny_model(root / "tiny", generation_defaults="qwen3")
        lines = [ln for ln in (TOY / "tasks.jsonl").read_text().splitlines() if ln.startswith("{")][: args.tasks]
        tasks = root / "tasks.jsonl"
        tasks.write_text("\n".join(lines) + "\n")
        if not args.no_loops:
            sync_s = run_loop(root / "sync", args, model, tasks, [])
            async_s = run_loop(
                root / "async",
                args,
                model,
                tasks,
                ["--async", "--max-staleness", str(args.max_staleness), "--drain", args.drain],
            )
            sync = sync_rows(json.loads((root / "sync" / "loop.json").read_text()))
            asyn = async_rows(json.loads((root / "async" / "loop.json").read_text()))
        ray = [] if args.no_ray else ray_rows(root, args, model, tasks)

    if not args.no_loops:
        print_loops(args, len(lines), sync_s, async_s, sync, asyn)
    if ray:
        print(
            f"polar rollout --ray, toy task: {len(lines)} tasks x {args.ray_samples} samples, --concurrency "
            f"{args.ray_concurrency} per node, local engine (a proxy per node)"
        )
        print(f"{'workers':>7}  {'sessions':>8}  {'seconds':>7}  {'sessions/min':>12}  per node")
        for workers, summary in ray:
            per_node = sorted(Counter(s["node"][:6] for s in summary["session_results"]).values())
            print(
                f"{workers:>7}  {summary['sessions']:>8}  {summary['seconds']:>7.0f}  "
                f"{summary['sessions_per_minute']:>12.1f}  {per_node}"
            )
        print(
            f"2 workers / 1 worker: {ray[1][1]['sessions_per_minute'] / ray[0][1]['sessions_per_minute']:.2f}x "
            "sessions/min (seconds: from the driver's start, the nodes' proxy starts included)"
        )


VLLM_FLAGS = ["--vllm-arg=--enforce-eager", "--vllm-arg=--max-model-len=4096", "--vllm-arg=--dtype=float32"]
VLLM_LOOPS = {
    "sync": ["--engine", "vllm"],
    "async restart": ["--engine", "vllm", "--async", "--vllm-push", "restart", "--drain", "wait"],
    "async keep": ["--engine", "vllm", "--async", "--drain", "keep"],
}


def vllm_loops(args: argparse.Namespace) -> None:
    """The three vLLM loops side by side, in one run, from the same model and tasks."""
    from polar_cli.tiny_model import build_tiny_model, untie_embeddings

    split = []
    if args.cpu_split:
        rollout, _, train = args.cpu_split.partition(":")
        split = ["--rollout-cpus", rollout, "--train-cpus", train]
    results = {}
    with tempfile.TemporaryDirectory(prefix="polar-fleet-") as tmp:
        root = Path(tmp)
        model = args.model or untie_embeddings(build_tiny_model(root / "tiny", generation_defaults="qwen3"), root / "m")
        lines = [ln for ln in (TOY / "tasks.jsonl").read_text().splitlines() if ln.startswith("{")][: args.tasks]
        tasks = root / "tasks.jsonl"
        tasks.write_text("\n".join(lines) + "\n")
        for name, extra in VLLM_LOOPS.items():
            out = root / name.replace(" ", "-")
            seconds = run_loop(out, args, model, tasks, [*extra, *VLLM_FLAGS, *split])
            state = json.loads((out / "loop.json").read_text())
            rows = async_rows(state) if state.get("mode") == "async" else sync_rows(state)
            sampled, used = token_use(state, out)
            trainings = (
                sum(s["status"] == "trained" for s in state["steps"])
                if state.get("mode") == "async"
                else sum((r.get("train") or {}).get("status") == "trained" for r in state["iterations"])
            )
            results[name] = (seconds, rows, sampled, used, trainings, state.get("summary", {}).get("versions"))
    print(
        f"vLLM CPU loops, toy task: {len(lines)} tasks x {args.samples} samples, {args.iterations} iterations, "
        f"--turns {args.turns} --max-tokens {args.max_tokens}, CPU split {args.cpu_split or 'none (shared cores)'}"
    )
    print(f"{'loop':14s} {'wall s':>7s} {'trainings/h':>11s} {'s/step':>7s} {'rollout busy':>12s} "
          f"{'trainer busy':>12s} {'tokens/s':>8s} {'tokens used':>11s}")  # fmt: skip
    for name, (seconds, rows, sampled, used, trainings, _) in results.items():
        print(f"{name:14s} {seconds:7.0f} {trainings / seconds * 3600:11.1f} {steady_step_s(rows[0]):7.1f} "
              f"{rows[3]:12.0%} {rows[4]:12.0%} {sampled / seconds:8.1f} {used / max(sampled, 1):11.0%}")  # fmt: skip
    sync_rate = results["sync"][4] / results["sync"][0]
    sync_step = steady_step_s(results["sync"][1][0])
    for name in ("async restart", "async keep"):
        print(
            f"{name} / sync: trainings per hour end to end {results[name][4] / results[name][0] / sync_rate:.2f}x, "
            f"steps per hour in steady state {sync_step / steady_step_s(results[name][1][0]):.2f}x"
        )
    if results["async keep"][5]:
        print(f"async keep, sampled across a push: {results['async keep'][5]}")


def print_loops(args: argparse.Namespace, tasks: int, sync_s: float, async_s: float, sync: tuple, asyn: tuple) -> None:
    print(
        f"toy task: {tasks} tasks x {args.samples} samples, {args.iterations} iterations, "
        f"async --max-staleness {args.max_staleness} --drain {args.drain}"
    )
    print(f"{'iter':>4}  {'sync s':>7}  {'async s':>7}  {'sync reward':>15}  {'async reward':>15}")
    for i in range(args.iterations):

        def cell(rows: list, j: int, fmt: str = "{:7.0f}") -> str:
            return (
                fmt.format(rows[j])
                if j < len(rows) and not isinstance(rows[j], str)
                else (rows[j] if j < len(rows) else "-")
            )

        print(f"{i:>4}  {cell(sync[0], i):>7}  {cell(asyn[0], i):>7}  {cell(sync[1], i):>15}  {cell(asyn[1], i):>15}")
    # The end-to-end times are the fair comparison: sync's per-iteration rollout time starts once its proxy is up,
    # async's batches include starting their proxy (that is its reload).
    print(
        f"end to end: sync {sync_s:.0f} s, async {async_s:.0f} s (async/sync {async_s / sync_s:.2f}); "
        f"sum of phases: sync {sync[2]:.0f} s, async {asyn[2]:.0f} s"
    )
    print(f"busy: rollout sync {sync[3]:.0%} async {asyn[3]:.0%}; trainer sync {sync[4]:.0%} async {asyn[4]:.0%}")


if __name__ == "__main__":
    main()
