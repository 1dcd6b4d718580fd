"""`polar rollout --ray`: a real local Ray cluster (a head node without CPUs and two worker nodes, each `ray start`
its own process session on loopback) runs a swe_mini rollout with the scripted engine and a `cmd:` agent written with
the official openai SDK; every node runs its own real mitmdump + polar addon, all writing one store.

One run through the CLI (one cluster start: the cluster is the expensive part) proves both the happy path and the
fault path: once each worker has finished a session and worker 1 has started its next, worker 1 dies (every process
of it, its proxy and harnesses included, as a machine dies). The run completes; every session lands once, under its
group; both workers ran sessions, the head none; the sessions worker 1 held end error (reason worker_lost, masked),
the rest completed on either node; nothing is duplicated, no acknowledged call is lost (every completed session's
calls are in the store, those of the dead node's proxy included), `polar shards validate` passes."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import pytest

pytest.importorskip("ray")

from polar_addon.store import read_records, read_sessions, validate_store  # noqa: E402
from polar_cli.rollout.ray_backend import WORKER_LOST  # noqa: E402
from tests.support.proxy import REPO  # noqa: E402
from tests.support.ray_cluster import RayCluster, RayNode  # noqa: E402
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


def _harnesses(node: RayNode) -> set[str]:
    """The sessions whose harness runs on ``node`` now, by workspace (the harness's shell and agent share it)."""
    running = set()
    for pid, cmd in node.processes().items():
        if str(AGENT) in cmd:
            try:
                running.add(os.readlink(f"/proc/{pid}/cwd"))
            except OSError:
                continue
    return running


def _finished_on(store: Path, node: str) -> bool:
    """A session that ran on ``node`` is stored completed (its proxy seals shards every 0.2 s)."""
    try:
        return any(s.status == "completed" and s.metadata.get("node") == node for s in read_sessions(str(store)))
    except (OSError, ValueError):  # no shard yet
        return False


def test_early_stop_on_a_ray_cluster_cancels_the_stragglers_of_every_node(cluster: RayCluster, tiny_model_dir: Path,
                                                                         tmp_path: Path) -> None:
    """--early-stop 1 on two nodes with one RUN slot each: sample 0 answers at once on one node while sample 1 waits
    60 s on the other; once sample 0 is usable the driver has the other node cancel sample 1 (running: stored error,
    cancelled) and never hands out sample 2. Runs before the dying-worker test (it kills a node of the cluster)."""
    _, w0, w1 = cluster.nodes
    workspace = tmp_path / "ws"
    workspace.mkdir()
    (workspace / "README").write_text("start\n")
    tasks = tmp_path / "tasks.jsonl"
    tasks.write_text(json.dumps({"id": "race", "instruction": "MODE=slow-unless-0 write it", "workspace": "ws",
                                 "verify": "test -f answer.txt"}) + "\n")
    store = tmp_path / "store"
    done = subprocess.run(
        [sys.executable, "-m", "polar_cli.app", "rollout", str(tasks), "--harness",
         f"cmd:{sys.executable} {AGENT} {{instruction}}", "--samples", "3", "--early-stop", "1",
         "--engine", f"scripted:{_script(tmp_path, tiny_model_dir)}", "--out", str(store), "--seed", "7",
         "--ray", cluster.address, "--concurrency", "1", "--ready", "0", "--confdir", str(tmp_path / "conf"),
         "--set", "polar_shard_seconds=0.2", "--no-progress"],
        cwd=tmp_path, capture_output=True, text=True, timeout=300, env={**os.environ, "PYTHONPATH": str(REPO)})
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    results = json.loads((store / "rollouts" / "r7" / "rollout-summary.json").read_text())["session_results"]
    got = {s["sample"]: (s["status"], s["ran"]) for s in results}
    assert got == {0: ("completed", True), 1: ("cancelled", True), 2: ("cancelled", False)}, results
    by_sample = {s["sample"]: s for s in results}
    assert by_sample[1]["timings"]["run"] < 50, results  # cancelled, not the 60 s it would have slept
    assert {by_sample[0]["node"], by_sample[1]["node"]} == {w0.node_id(), w1.node_id()}  # one on each node
    wait_for_shards(str(store))
    sessions = {s.session_id: s for s in read_sessions(str(store))}
    cancelled = sessions[by_sample[1]["session_id"]]
    assert cancelled.status == "error" and cancelled.metadata["cancelled"] is True  # masked
    assert by_sample[2]["session_id"] not in sessions  # never ran, nothing posted


def test_polar_rollout_on_a_ray_cluster_survives_a_dying_worker(cluster: RayCluster, tiny_model_dir: Path,
                                                                tmp_path: Path) -> None:
    _, w0, w1 = cluster.nodes  # head, worker 0 (polar_w0), worker 1 (polar_w1)
    survivor, victim = w0.node_id(), w1.node_id()
    store = tmp_path / "store"
    # Each harness waits 4 s before its first call: the victim still runs one when its finished one is seen stored.
    harness = f"cmd:sleep 4; {sys.executable} {AGENT} {{instruction}}"
    rollout = subprocess.Popen(
        [sys.executable, "-m", "polar_cli.app", "rollout", str(SWE_MINI), "--harness", harness, "--samples", "2",
         "--engine", f"scripted:{_script(tmp_path, tiny_model_dir)}", "--out", str(store), "--seed", "5",
         "--ray", cluster.address, "--concurrency", "2", "--ready", "1", "--confdir", str(tmp_path / "conf"),
         "--set", "polar_shard_seconds=0.2", "--no-progress"],
        cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        env={**os.environ, "PYTHONPATH": str(REPO)})
    try:
        # The victim dies once it has stored a finished session and runs a harness again.
        deadline = time.monotonic() + 300
        while not (_harnesses(w1) and _finished_on(store, victim)):
            assert rollout.poll() is None and time.monotonic() < deadline, rollout.poll()
            time.sleep(0.3)
        assert w1.kill() > 0
        output, _ = rollout.communicate(timeout=400)
    finally:
        if rollout.poll() is None:
            rollout.kill()
    assert rollout.returncode == 0, output
    summary = json.loads((store / "rollouts" / "r5" / "rollout-summary.json").read_text())
    manifest = json.loads((store / "rollouts" / "r5" / "rollout-manifest.json").read_text())
    assert manifest["ray"] == cluster.address
    results = summary["session_results"]
    timings = [(s["status"], (s["node"] or "")[:6], {k: round(v, 1) for k, v in s["timings"].items()})
               for s in results]
    print(output, summary["seconds"], json.dumps(timings))  # shown with -rP: where the time went
    assert len(results) == 6 and len({s["session_id"] for s in results}) == 6
    assert Counter(s["task_id"] for s in results) == {"calc-add": 2, "text-shout": 2, "stats-mean": 2}
    lost = [s for s in results if s["status"] == "error"]
    assert lost and all(s["node"] == victim and "died" in s["reason"] for s in lost), results
    done = [s for s in results if s["status"] != "error"]
    assert all(s["status"] == "completed" and s["reward"] == 0.0 for s in done), results
    # Both workers completed sessions (the victim before it died), the head none.
    assert set(Counter(s["node"] for s in done)) == {survivor, victim}, timings
    assert f"6 sessions ({len(done)} completed, {len(lost)} error)" in output, output

    wait_for_shards(str(store))
    assert validate_store(str(store)) == []
    sessions = {s.session_id: s for s in read_sessions(str(store))}
    assert set(sessions) == {s["session_id"] for s in results}  # 0 lost: every session has its final status
    records = read_records(str(store), sorted(sessions), include_failed=True)
    assert len({r.record_id for r in records}) == len(records)  # 0 duplicated
    assert len({(r.session_id, r.seq) for r in records}) == len(records)
    calls = Counter(r.session_id for r in records if r.status == "ok")
    for s in results:
        stored = sessions[s["session_id"]]
        assert (stored.metadata["task"], stored.metadata["group"], stored.metadata["sample"]) == (
            s["task_id"], s["group_id"], s["sample"])
        assert stored.metadata["node"] == s["node"]
        if s in lost:
            assert stored.status == "error" and stored.metadata["reason"] == WORKER_LOST
        else:
            # 0 lost acknowledged calls: both turns of the script, the dead node's completed sessions included.
            assert stored.status == "completed" and stored.rewards == {"reward": 0.0}
            assert calls[s["session_id"]] == 2, (s, calls)
    for r in records:
        stored = sessions[r.session_id]
        assert (r.task_id, r.group_id, r.sample_index) == (stored.metadata["task"], stored.metadata["group"],
                                                           stored.metadata["sample"])
    validated = subprocess.run([sys.executable, "-m", "polar_cli.app", "shards", "validate", str(store)],
                               capture_output=True, text=True, timeout=120, env={**os.environ, "PYTHONPATH": str(REPO)})
    assert validated.returncode == 0, validated.stdout + validated.stderr


def test_ray_refuses_a_running_proxy_and_help_says_so(tmp_path: Path) -> None:
    """--proxy cannot work with --ray (every node starts its own proxy): refused before anything starts, and --help
    says so (and that --early-stop spans every node)."""
    tasks = tmp_path / "tasks.jsonl"
    tasks.write_text(json.dumps({"id": "t", "instruction": "hi", "verify": "true"}) + "\n")
    env = {**os.environ, "COLUMNS": "200"}
    proxy = subprocess.run([sys.executable, "-m", "polar_cli.app", "rollout", str(tasks), "--harness", "cmd:true",
                            "--ray", "auto", "--out", str(tmp_path / "store"), "--proxy", "127.0.0.1:9"],
                           cwd=REPO, capture_output=True, text=True, timeout=120, env=env)  # fmt: skip
    assert proxy.returncode == 2 and "give --engine (not --proxy)" in proxy.stderr, proxy.stderr
    assert not (tmp_path / "store").exists()
    shown = subprocess.run([sys.executable, "-m", "polar_cli.app", "rollout", "--help"], cwd=REPO,
                           capture_output=True, text=True, timeout=120, env=env)
    text = " ".join(shown.stdout.replace("│", " ").split())
    assert "Refused with --proxy" in text and "with --ray, on every node" in text
