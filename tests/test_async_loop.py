"""`polar loop --async`: the staleness rule and utilisation as plain functions, and one real async loop on the toy
task (the real runner, mitmdump, the local engine on the tiny model, `polar train` in its own process)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from polar_cli.rollout.async_loop import busy_fraction, group_versions, select_groups

REPO = Path(__file__).resolve().parent.parent
AGENT = REPO / "examples" / "toy_task" / "agent.py"


def test_groups_within_the_bound_are_kept_and_staler_ones_dropped_whole() -> None:
    versions = {"fresh": ["3", "3"], "one-behind": ["2", "3"], "two-behind": ["1", "3", "3"], "untagged": ["3", None]}
    chosen = select_groups(versions, current=3, max_staleness=1)
    assert chosen.kept == ["fresh", "one-behind"]
    assert chosen.stale == {"two-behind": 2}  # one old call is enough: the group goes whole
    assert chosen.untagged == ["untagged"]
    assert select_groups(versions, current=3, max_staleness=0).kept == ["fresh"]
    assert select_groups(versions, current=3, max_staleness=2).kept == ["fresh", "one-behind", "two-behind"]


def test_the_staleness_rule_refuses_nonsense() -> None:
    with pytest.raises(ValueError, match="newer than 1"):
        select_groups({"g": ["2"]}, current=1, max_staleness=1)  # a version the trainer has not made yet
    with pytest.raises(ValueError, match="0 or more"):
        select_groups({"g": ["0"]}, current=0, max_staleness=-1)
    assert select_groups({"g": ["v1"]}, current=1, max_staleness=5).untagged == ["g"]  # not a version number


def test_busy_fraction_counts_overlaps_once_and_clips_to_the_window() -> None:
    assert busy_fraction([(0, 4), (2, 6)], 0, 10) == pytest.approx(0.6)
    assert busy_fraction([(-5, 2), (8, 20)], 0, 10) == pytest.approx(0.4)
    assert busy_fraction([(1, 2)], 3, 3) == 0.0
    assert busy_fraction([], 0, 10) == 0.0


def test_async_loop_trains_while_rolling_out_and_drops_groups_past_the_bound(tiny_model_dir: Path, tmp_path: Path) -> None:
    tasks = tmp_path / "tasks.jsonl"
    # The toy task's question, but a random reward: two 4-token answers of the tiny model often score the same
    # fraction of capitals (nothing to train, no new version); the loop's mechanics are what is tested here.
    task = {"id": "shout-0", "instruction": "what is the capital of france", "reward_file": "reward.txt",
            "verify": "python3 -c 'import random; print(random.random())' > reward.txt"}
    tasks.write_text(json.dumps(task) + "\n")
    out = tmp_path / "loop"
    harness = f"cmd:{sys.executable} {AGENT} --turns 1 --max-tokens 4 {{instruction}}"
    # --max-staleness 0: batch 1 starts the moment batch 0 ends, before training 0 can have made version 1, so it is
    # sampled by version 0 and is one version behind when step 1 trains version 1: dropped, deterministically.
    cmd = [sys.executable, "-m", "polar_cli.app", "loop", str(tasks), "--harness", harness, "--model",
           str(tiny_model_dir), "--iterations", "3", "--out", str(out), "--samples", "2", "--no-progress", "--async",
           "--max-staleness", "0", "--lr", "1e-3", "--eot-token-id", "2"]  # fmt: skip
    done = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    state = json.loads((out / "loop.json").read_text())
    batches, steps, summary = state["batches"], state["steps"], state["summary"]
    assert [s["status"] for s in steps] == ["trained", "trained"] and [s["version"] for s in steps] == [0, 1]

    # Overlap: batch 1 ran while training 0 ran.
    b1, t0 = batches[1], steps[0]
    assert b1["version"] == 0 and b1["started_at"] < t0["ended_at"] and b1["ended_at"] > t0["started_at"]
    # The bound: batch 1 (version 0) was dropped by step 1 (version 1), not trained on.
    assert b1["step"] == 1 and b1["dropped_groups"] == {"shout-0": 1}
    assert 1 not in steps[1]["batches"] and steps[1]["groups_dropped"] >= 1 and summary["groups_dropped"] >= 1
    assert all(batches[i]["version"] == 1 for i in steps[1]["batches"])

    # The store: each batch's calls carry the version that sampled them, and versions rise across the run.
    tagged = [sorted({v for vs in group_versions(b["shards"]).values() for v in vs}) for b in batches]
    assert tagged == [[str(b["version"])] for b in batches]
    versions = [b["version"] for b in batches]
    assert versions == sorted(versions) and versions[0] == 0 and versions[-1] == 2 == summary["final_version"]

    # Utilisation, per step and for the run, is in loop.json and printed.
    for record in (*steps, summary):
        assert 0.0 < record["rollout_util"] <= 1.0 and 0.0 < record["trainer_util"] <= 1.0
    assert "rollout busy" in done.stdout and "trainer busy" in done.stdout

    again = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=120)
    assert again.returncode == 2 and "does not resume" in again.stderr
    sync = subprocess.run([c for c in cmd if c != "--async"], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert sync.returncode == 2 and "holds an async loop" in sync.stderr


def test_async_refuses_a_vllm_engine_and_an_unknown_drain(tiny_model_dir: Path, tmp_path: Path) -> None:
    tasks = tmp_path / "tasks.jsonl"
    tasks.write_text(json.dumps({"id": "t", "instruction": "hi", "verify": "true"}) + "\n")
    base = [sys.executable, "-m", "polar_cli.app", "loop", str(tasks), "--harness", "cmd:true", "--model",
            str(tiny_model_dir), "--iterations", "2", "--out", str(tmp_path / "o"), "--async"]  # fmt: skip
    vllm = subprocess.run([*base, "--engine", "vllm"], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert vllm.returncode == 2 and "--async needs --engine local" in vllm.stderr
    drain = subprocess.run([*base, "--drain", "later"], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert drain.returncode == 2 and "wait or cut" in drain.stderr
    assert not (tmp_path / "o").exists()


def test_a_cut_ends_the_running_sessions_as_masked_errors(tiny_model_dir: Path, tmp_path: Path) -> None:
    """Drain "cut": the rollout's stop event interrupts it as a signal would; sessions that ran are posted as error
    (masked from training), none stays running in the store."""
    import asyncio

    from polar_addon.store import read_sessions
    from polar_cli.rollout.proxy import start_proxy
    from polar_cli.rollout.runner import RolloutConfig, RolloutProgress, run_rollout
    from polar_cli.rollout.tasks import load_tasks

    script = tmp_path / "script.json"
    script.write_text(json.dumps({"model_dir": str(tiny_model_dir), "turns": [{"content": "hi"}]}))
    tasks = tmp_path / "tasks.jsonl"
    tasks.write_text(json.dumps({"id": "hang", "instruction": "MODE=hang", "verify": "true"}) + "\n")
    agent = REPO / "tests" / "support" / "rollout_agent.py"
    store = tmp_path / "store"
    progress = RolloutProgress()

    async def cut_once_running() -> object:
        stop = asyncio.Event()
        config = RolloutConfig(tasks=load_tasks(tasks), harness=f"cmd:{sys.executable} {agent} {{instruction}}",
                               samples=2, concurrency=1, engine=f"scripted:{script}", out=str(store),
                               confdir=tmp_path / "conf", logs_dir=tmp_path / "logs", progress=progress, stop=stop,
                               stop_on_signals=False, proxy_options={"polar_shard_seconds": "0.2"})  # fmt: skip
        rollout = asyncio.create_task(run_rollout(config))
        while progress.stages.get("run", 0) < 1 and not rollout.done():
            await asyncio.sleep(0.1)
        await asyncio.sleep(1.0)
        stop.set()
        return await asyncio.wait_for(rollout, 120)

    result = asyncio.run(cut_once_running())
    assert result.interrupted == "stop"
    assert sorted((s.status, s.ran) for s in result.sessions) == [("cancelled", False), ("cancelled", True)]
    (ran,) = [s for s in result.sessions if s.ran]
    stored = {s.session_id: s for s in read_sessions(str(store))}
    assert stored[ran.session_id].status == "error" and stored[ran.session_id].metadata.get("cancelled") is True


def test_a_local_engine_spec_tags_its_calls_with_a_weight_version(tmp_path: Path) -> None:
    from polar_addon.engines import make_engine, parse_local_target

    engine = make_engine(f"local:{tmp_path}?weight_version=3&max_len=64", timeout_s=10)
    assert engine.weight_version == "3" and engine.max_len_override == 64  # type: ignore[attr-defined]
    assert make_engine(f"local:{tmp_path}", timeout_s=10).weight_version is None  # type: ignore[attr-defined]
    assert parse_local_target(f"{tmp_path}?weight_version=3") == (str(tmp_path), 0)
    with pytest.raises(ValueError, match="weight_version"):
        parse_local_target(f"{tmp_path}?version=3")
