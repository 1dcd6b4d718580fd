"""`polar rollout --ray`: a real local Ray cluster (a head node without CPUs and two worker nodes, each `ray start`
its own process session on loopback) runs a swe_mini rollout with the scripted engine and a `cmd:` agent written with
the official openai SDK; every node runs its own real mitmdump + polar addon, all writing one store.

The first run goes through the CLI: every session lands once, under its group, spread over both workers (each
session's node in its stored metadata). The second kills one worker node mid-run (every process of it, its proxy
and harnesses included, as a machine dies): the run completes, the sessions that node held are stored as error
(reason worker_lost), the rest ran on the other node, nothing is duplicated or lost, `polar shards validate` passes."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import threading
import time
from collections import Counter
from pathlib import Path

import pytest

ray = pytest.importorskip("ray")

from polar_addon.store import read_records, read_sessions, validate_store  # noqa: E402
from polar_cli.rollout.ray_backend import WORKER_LOST, RayOptions, run_rollout_ray  # noqa: E402
from polar_cli.rollout.runner import RolloutConfig, RolloutProgress  # noqa: E402
from polar_cli.rollout.tasks import load_tasks  # noqa: E402
from tests.support.proxy import REPO  # noqa: E402
from tests.support.ray_cluster import RayCluster  # noqa: E402
from tests.support.shards import wait_for_shards  # noqa: E402

SWE_MINI = REPO / "examples" / "swe_mini" / "tasks.jsonl"
AGENT = REPO / "tests" / "support" / "rollout_agent.py"


def _script(root: Path, model_dir: Path) -> Path:
    # The same answer for every task (no fix: each verifier runs the task's tests and gives reward 0).
    script = root / "script.json"
    turns = [{"content": "", "tool_calls": [{"type": "function", "function": {
                 "name": "write_file", "arguments": {"path": "answer.txt", "content": "42"}}}]},
             {"content": "fixed"}]  # fmt: skip
    script.write_text(json.dumps({"model_dir": str(model_dir), "turns": turns}))
    return script


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory):
    started = RayCluster(tmp_path_factory.mktemp("ray"))
    try:
        started.start([{"polar_w0": 1}, {"polar_w1": 1}])
        yield started
    finally:
        started.stop()


def _node_ids(address: str) -> dict[str, str]:
    """worker name (polar_w0, polar_w1) -> Ray node id."""
    ray.init(address=address, logging_level="warning", log_to_driver=False)
    try:
        return {name: n["NodeID"] for n in ray.nodes() if n["Alive"]
                for name in n["Resources"] if name.startswith("polar_w")}
    finally:
        ray.shutdown()


def _check_store(store: str, plan_ids: set[str]) -> dict:
    wait_for_shards(store)
    assert validate_store(store) == []
    sessions = {s.session_id: s for s in read_sessions(store)}
    assert set(sessions) == plan_ids  # 0 lost: every session of the plan has its final status
    records = read_records(store, sorted(plan_ids), include_failed=True)
    assert len({r.record_id for r in records}) == len(records)  # 0 duplicated
    assert len({(r.session_id, r.seq) for r in records}) == len(records)
    for r in records:
        stored = sessions[r.session_id]
        assert (r.task_id, r.group_id, r.sample_index) == (stored.metadata["task"], stored.metadata["group"],
                                                           stored.metadata["sample"])
    return sessions


def test_polar_rollout_on_a_ray_cluster(cluster: RayCluster, tiny_model_dir: Path, tmp_path: Path) -> None:
    nodes = _node_ids(cluster.address)
    store = tmp_path / "store"
    harness = f"cmd:{sys.executable} {AGENT} {{instruction}}"
    done = subprocess.run(
        [sys.executable, "-m", "polar_cli.app", "rollout", str(SWE_MINI), "--harness", harness, "--samples", "2",
         "--engine", f"scripted:{_script(tmp_path, tiny_model_dir)}", "--out", str(store), "--seed", "5",
         "--ray", cluster.address, "--concurrency", "2", "--confdir", str(tmp_path / "conf"),
         "--set", "polar_shard_seconds=0.2", "--no-progress"],
        cwd=tmp_path, capture_output=True, text=True, timeout=600, env={**os.environ, "PYTHONPATH": str(REPO)})
    assert done.returncode == 0, done.stdout + done.stderr
    assert "6 sessions (6 completed)" in done.stdout, done.stdout
    summary = json.loads((store / "rollouts" / "r5" / "rollout-summary.json").read_text())
    manifest = json.loads((store / "rollouts" / "r5" / "rollout-manifest.json").read_text())
    assert manifest["ray"] == cluster.address
    assert {g: v["rewards"] for g, v in summary["groups"].items()} == {
        "calc-add": [0.0, 0.0], "text-shout": [0.0, 0.0], "stats-mean": [0.0, 0.0]}
    ran_on = Counter(s["node"] for s in summary["session_results"])
    assert set(ran_on) == set(nodes.values()), ran_on  # both workers ran sessions, the head none

    sessions = _check_store(str(store), {s["session_id"] for s in summary["session_results"]})
    for s in summary["session_results"]:
        stored = sessions[s["session_id"]]
        assert stored.status == "completed" and stored.metadata["node"] == s["node"]
        assert stored.metadata["group"] == s["task_id"] and stored.rewards == {"reward": s["reward"]}
        assert read_records(str(store), [s["session_id"]]), f"{s['session_id']} has no captured call"


def test_a_worker_node_dies_mid_run(cluster: RayCluster, tiny_model_dir: Path, tmp_path: Path) -> None:
    nodes = _node_ids(cluster.address)
    victim, survivor = nodes["polar_w1"], nodes["polar_w0"]
    store = tmp_path / "store"
    progress = RolloutProgress()
    # Each harness waits 3 s before its first call: the victim holds running sessions when it dies.
    config = RolloutConfig(
        tasks=load_tasks(SWE_MINI), harness=f"cmd:sleep 3; {sys.executable} {AGENT} {{instruction}}", samples=4,
        engine=f"scripted:{_script(tmp_path, tiny_model_dir)}", out=str(store), concurrency=2, ready=1, seed=9,
        confdir=tmp_path / "conf", proxy_options={"polar_shard_seconds": "0.2"}, progress=progress,
        stop_on_signals=False)  # fmt: skip
    outcome: dict = {}

    def drive() -> None:
        try:
            outcome["result"] = asyncio.run(run_rollout_ray(config, RayOptions(cluster.address)))
        except BaseException as exc:  # reported below
            outcome["error"] = exc

    thread = threading.Thread(target=drive)
    thread.start()
    deadline = time.monotonic() + 240
    # Once both nodes finished a session and sessions are running, the victim dies.
    while not (len(progress.nodes) == 2 and progress.stages.get("run", 0) >= 2):
        assert thread.is_alive() and time.monotonic() < deadline, (outcome, progress)
        time.sleep(0.1)
    assert cluster.nodes[2].kill() > 0  # nodes: head, worker0 (polar_w0), worker1 (polar_w1)
    thread.join(300)
    assert not thread.is_alive() and "error" not in outcome, outcome
    result = outcome["result"]

    assert len(result.sessions) == 12 and len({s.session_id for s in result.sessions}) == 12
    lost = [s for s in result.sessions if s.status == "error"]
    assert lost and all(s.node == victim and "died" in (s.reason or "") for s in lost), \
        [(s.session_id, s.status, s.node, s.reason) for s in result.sessions]
    assert all(s.status == "completed" for s in result.sessions if s not in lost)
    assert Counter(s.node for s in result.sessions if s.status == "completed")[survivor] > 0
    sessions = _check_store(str(store), {s.session_id for s in result.sessions})
    for s in result.sessions:
        stored = sessions[s.session_id]
        if s in lost:
            assert stored.status == "error" and stored.metadata["reason"] == WORKER_LOST
            assert stored.metadata["node"] == victim
        else:
            assert stored.status == "completed" and stored.metadata["node"] in (victim, survivor)
    done = subprocess.run([sys.executable, "-m", "polar_cli.app", "shards", "validate", str(store)],
                          capture_output=True, text=True, timeout=120, env={**os.environ, "PYTHONPATH": str(REPO)})
    assert done.returncode == 0, done.stdout + done.stderr
