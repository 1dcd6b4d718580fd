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
import signal
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import pytest

pytest.importorskip("ray")

from polar_addon.store import read_records, read_sessions, validate_store  # noqa: E402
from polar_cli.rollout.ray_backend import WORKER_LOST  # noqa: E402
from tests.support.proxy import REPO  # noqa: E402
from tests.support.ray_cluster import RayCluster, RayNode  # noqa: E402
from tests.support.s3 import AWS_ENV, moto_server, new_bucket, s3_uri  # noqa: E402
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


def _race_task(root: Path, task_id: str) -> Path:
    """One task whose sample 0 answers at once while the others sleep 60 s (tests/support/rollout_agent.py's
    MODE=slow-unless-0), in a workspace of its own."""
    workspace = root / "ws"
    workspace.mkdir()
    (workspace / "README").write_text("start\n")
    tasks = root / "tasks.jsonl"
    tasks.write_text(
        json.dumps(
            {
                "id": task_id,
                "instruction": "MODE=slow-unless-0 write it",
                "workspace": "ws",
                "verify": "test -f answer.txt",
            }
        )
        + "\n"
    )
    return tasks


@pytest.fixture(scope="module")
def moto_port() -> Iterator[int]:
    with moto_server() as port:
        yield port


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory, moto_port: int):
    # The nodes' own environment carries the S3 credentials (as a cloud machine's instance role would), and a journal
    # directory of this test's for a remote store's local journal; the driver's AWS_* variables never reach them.
    root = tmp_path_factory.mktemp("ray")
    started = RayCluster(root, env={**AWS_ENV, "POLAR_JOURNAL_DIR": str(root / "journal")})
    try:
        started.start([{"polar_w0": 1}, {"polar_w1": 1}])
        yield started
    finally:
        started.stop()


def _driver_env() -> dict[str, str]:
    """The driver's environment without any AWS credentials: the nodes must use their own."""
    return {**{k: v for k, v in os.environ.items() if not k.startswith("AWS_")}, "PYTHONPATH": str(REPO)}


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


def test_early_stop_on_a_ray_cluster_writing_to_s3_cancels_the_stragglers_of_every_node(
    cluster: RayCluster, moto_port: int, tiny_model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every node's proxy writes one s3:// store (a real moto server), with the credentials of the nodes' own
    environment (the driver has none). --early-stop 1 on two nodes with one RUN slot each: sample 0 answers at once on
    one node while sample 1 waits 60 s on the other; once sample 0 is usable the driver has the other node cancel
    sample 1 (running: stored error, cancelled) and never hands out sample 2. The summary and manifest go to
    ./polar-rollouts/RUN_ID (the store is remote); `polar shards validate s3://...` passes. Runs before the
    dying-worker test (it kills a node of the cluster)."""
    _, w0, w1 = cluster.nodes
    tasks = _race_task(tmp_path, "race")
    store = s3_uri(new_bucket(moto_port), moto_port)
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "polar_cli.app",
            "rollout",
            str(tasks),
            "--harness",
            f"cmd:{sys.executable} {AGENT} {{instruction}}",
            "--samples",
            "3",
            "--early-stop",
            "1",
            "--engine",
            f"scripted:{_script(tmp_path, tiny_model_dir)}",
            "--out",
            store,
            "--seed",
            "7",
            "--ray",
            cluster.address,
            "--concurrency",
            "1",
            "--ready",
            "0",
            "--confdir",
            str(tmp_path / "conf"),
            "--set",
            "polar_shard_seconds=0.2",
            "--no-progress",
        ],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=300,
        env=_driver_env(),
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    report = tmp_path / "polar-rollouts" / "r7"
    manifest = json.loads((report / "rollout-manifest.json").read_text())
    assert manifest["store"] == store and manifest["ray"] == cluster.address and manifest["interrupted"] is None
    summary = json.loads((report / "rollout-summary.json").read_text())
    assert summary["store"] == store
    results = summary["session_results"]
    got = {s["sample"]: (s["status"], s["ran"]) for s in results}
    assert got == {0: ("completed", True), 1: ("cancelled", True), 2: ("cancelled", False)}, results
    by_sample = {s["sample"]: s for s in results}
    assert by_sample[1]["timings"]["run"] < 50, results  # cancelled, not the 60 s it would have slept
    assert {by_sample[0]["node"], by_sample[1]["node"]} == {w0.node_id(), w1.node_id()}  # one on each node

    for name, value in AWS_ENV.items():  # this process reads the store
        monkeypatch.setenv(name, value)
    wait_for_shards(store)
    assert validate_store(store) == []
    sessions = {s.session_id: s for s in read_sessions(store)}
    assert set(sessions) == {by_sample[0]["session_id"], by_sample[1]["session_id"]}  # 2 never ran: not posted
    for sample in (0, 1):
        stored = sessions[by_sample[sample]["session_id"]]
        assert (stored.metadata["group"], stored.metadata["sample"], stored.metadata["node"]) == (
            "race",
            sample,
            by_sample[sample]["node"],
        )
    assert sessions[by_sample[0]["session_id"]].status == "completed"
    cancelled = sessions[by_sample[1]["session_id"]]
    assert cancelled.status == "error" and cancelled.metadata["cancelled"] is True  # masked
    records = read_records(store, sorted(sessions), include_failed=True)
    # Sample 0's two turns, written by its node's proxy (sample 1 slept before any call).
    assert Counter(r.session_id for r in records if r.status == "ok") == {by_sample[0]["session_id"]: 2}, records
    assert all((r.group_id, r.sample_index) == ("race", 0) for r in records)
    validated = subprocess.run(
        [sys.executable, "-m", "polar_cli.app", "shards", "validate", store],
        capture_output=True,
        text=True,
        timeout=120,
        env={**_driver_env(), **AWS_ENV},
    )
    assert validated.returncode == 0, validated.stdout + validated.stderr


def _alive(pid: int, cmdline: str) -> bool:
    """``pid`` still runs ``cmdline`` (a zombie or a reused pid does not count)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        now = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
    except OSError:
        return False
    return state != "Z" and now == cmdline


def test_ctrl_c_stops_a_ray_rollout_on_every_node(cluster: RayCluster, tiny_model_dir: Path, tmp_path: Path) -> None:
    """SIGINT to `polar rollout --ray` while both nodes run a harness (one RUN slot each; sample 0 answers at once,
    the others sleep 60 s): the driver exits 130 within a bound, the summary and manifest say interrupted by SIGINT;
    sample 0 stays completed with both its calls (nothing acknowledged is lost), the two running sessions are
    stored error + cancelled (masked), the queued one was never handed out; no proxy or harness process of either
    node outlives the run (checked by pid, as found on the nodes while it ran)."""
    _, w0, w1 = cluster.nodes
    tasks = _race_task(tmp_path, "stop")
    store = tmp_path / "store"
    rollout = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "polar_cli.app",
            "rollout",
            str(tasks),
            "--harness",
            f"cmd:{sys.executable} {AGENT} {{instruction}}",
            "--samples",
            "4",
            "--engine",
            f"scripted:{_script(tmp_path, tiny_model_dir)}",
            "--out",
            str(store),
            "--seed",
            "9",
            "--ray",
            cluster.address,
            "--concurrency",
            "1",
            "--ready",
            "0",
            "--confdir",
            str(tmp_path / "conf"),
            "--set",
            "polar_shard_seconds=0.2",
            "--no-progress",
            "--runtime",
            "local",
            "--trust-agent",
        ],  # _harnesses tells sessions by host workspace, which bwrap hides
        cwd=tmp_path,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=_driver_env(),
    )
    try:
        deadline = time.monotonic() + 240
        # Sample 0 stored completed (on either node) and a harness running on each node.
        while not (_harnesses(w0) and _harnesses(w1) and any(_finished_on(store, w.node_id()) for w in (w0, w1))):
            assert rollout.poll() is None and time.monotonic() < deadline, rollout.poll()
            time.sleep(0.3)
        watched = {
            pid: cmd
            for node in (w0, w1)
            for pid, cmd in node.processes().items()
            if str(AGENT) in cmd or "mitmdump" in cmd
        }
        assert sum("mitmdump" in cmd for cmd in watched.values()) == 2, watched  # a proxy per node
        interrupted_at = time.monotonic()
        rollout.send_signal(signal.SIGINT)
        output, _ = rollout.communicate(timeout=120)
        took = time.monotonic() - interrupted_at
    finally:
        if rollout.poll() is None:
            rollout.kill()
    assert rollout.returncode == 130, output
    assert took < 30, (took, output)  # the proxies stop gracefully (SIGINT), not SIGKILLed after their 60 s
    print(f"SIGINT to exit: {took:.1f} s")  # shown with -rP
    assert "interrupted by SIGINT" in output, output
    left = {pid: cmd for pid, cmd in watched.items() if _alive(pid, cmd)}
    assert not left, left  # no proxy, no harness of the run still running on any node

    report = store / "rollouts" / "r9"
    manifest = json.loads((report / "rollout-manifest.json").read_text())
    summary = json.loads((report / "rollout-summary.json").read_text())
    assert manifest["interrupted"] == summary["interrupted"] == "SIGINT"
    results = summary["session_results"]
    got = {s["sample"]: (s["status"], s["ran"]) for s in results}
    assert got == {0: ("completed", True), 1: ("cancelled", True), 2: ("cancelled", True), 3: ("cancelled", False)}, (
        results
    )
    by_sample = {s["sample"]: s for s in results}
    assert {by_sample[1]["node"], by_sample[2]["node"]} == {w0.node_id(), w1.node_id()}  # one running on each

    wait_for_shards(str(store))
    assert validate_store(str(store)) == []
    sessions = {s.session_id: s for s in read_sessions(str(store))}
    assert set(sessions) == {by_sample[i]["session_id"] for i in (0, 1, 2)}  # sample 3 never ran: not posted
    assert sessions[by_sample[0]["session_id"]].status == "completed"
    for i in (1, 2):
        stored = sessions[by_sample[i]["session_id"]]
        assert stored.status == "error" and stored.metadata["cancelled"] is True, stored  # masked
        assert stored.metadata["signal"] == "SIGINT" and stored.metadata["node"] == by_sample[i]["node"]
    records = read_records(str(store), sorted(sessions), include_failed=True)
    assert Counter(r.session_id for r in records if r.status == "ok") == {by_sample[0]["session_id"]: 2}, records


def test_polar_loop_on_a_ray_cluster_trains_between_iterations_and_every_node_serves_the_checkpoint(
    cluster: RayCluster, tiny_model_dir: Path, tmp_path: Path
) -> None:
    """`polar loop --ray` over two iterations of the toy task (its openai-SDK agent, the real tiny model on each
    node's local engine): iteration 0 runs on both workers, `polar train` runs here between the iterations, and
    iteration 1 runs on both workers again with the first checkpoint. What each node served is read off the stored
    calls themselves: their sampled tokens' logprobs are the checkpoint's (the trainer's own computation, fp32),
    not the starting model's, and every call carries weight_version 1. Runs before the dying-worker test (it kills
    a node of the cluster)."""
    _, w0, w1 = cluster.nodes
    toy = REPO / "examples" / "toy_task"
    tasks = tmp_path / "tasks.jsonl"
    tasks.write_text(
        "".join(
            [line for line in (toy / "tasks.jsonl").read_text().splitlines(keepends=True) if line.startswith("{")][:2]
        )
    )
    out = tmp_path / "loop"
    done = subprocess.run(
        [sys.executable, "-m", "polar_cli.app", "loop", str(tasks), "--harness",
         f"cmd:{sys.executable} {toy / 'agent.py'} {{instruction}}", "--model", str(tiny_model_dir),
         "--iterations", "2", "--out", str(out), "--samples", "4", "--concurrency", "2", "--no-progress",
         "--ray", cluster.address, "--lr", "5e-3", "--groups-per-step", "1", "--weight-decay", "0",
         "--eot-token-id", "2"],
        cwd=tmp_path, capture_output=True, text=True, timeout=600, env=_driver_env())  # fmt: skip
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    iterations = json.loads((out / "loop.json").read_text())["iterations"]
    assert len(iterations) == 2 and iterations[0]["train"]["status"] == "trained", iterations
    checkpoint = Path(iterations[0]["train"]["checkpoint"])
    assert iterations[0]["policy"] == str(tiny_model_dir) and iterations[1]["policy"] == str(checkpoint)
    workers = {w0.node_id(), w1.node_id()}
    calls: dict[int, list] = {}
    for i, it in enumerate(iterations):
        shards = out / f"iter-{i:03d}" / "shards"
        wait_for_shards(str(shards))
        assert validate_store(str(shards)) == []
        sessions = read_sessions(str(shards))
        assert len(sessions) == it["sessions"] == 8 and all(s.status == "completed" for s in sessions), sessions
        assert {s.metadata["node"] for s in sessions} == workers  # spread over both workers, the head none
        calls[i] = read_records(str(shards))
        assert calls[i] and {r.weight_version for r in calls[i]} == {str(i)}, {r.weight_version for r in calls[i]}

    from tests.support.tito_sessions import build  # noqa: PLC0415 (torch-heavy helpers, this test only)
    from tests.support.tito_vllm import first_step_ratios, trainer_logprobs  # noqa: PLC0415

    _, traces = build(out / "iter-001" / "shards")
    served = first_step_ratios(traces, trainer_logprobs(checkpoint))
    before = first_step_ratios(traces, trainer_logprobs(tiny_model_dir))
    print(f"iteration 1 vs checkpoint: {served}; vs starting model: {before}")  # shown with -rP
    assert served.tokens > 50 and served.max_abs_dev < 1e-3, served
    assert before.max_abs_dev > 100 * max(served.max_abs_dev, 1e-6), (served, before)


def test_polar_rollout_on_a_ray_cluster_survives_a_dying_worker(
    cluster: RayCluster, tiny_model_dir: Path, tmp_path: Path
) -> None:
    _, w0, w1 = cluster.nodes  # head, worker 0 (polar_w0), worker 1 (polar_w1)
    survivor, victim = w0.node_id(), w1.node_id()
    store = tmp_path / "store"
    # Each harness waits 4 s before its first call: the victim still runs one when its finished one is seen stored.
    harness = f"cmd:sleep 4; {sys.executable} {AGENT} {{instruction}}"
    rollout = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "polar_cli.app",
            "rollout",
            str(SWE_MINI),
            "--harness",
            harness,
            "--samples",
            "2",
            "--engine",
            f"scripted:{_script(tmp_path, tiny_model_dir)}",
            "--out",
            str(store),
            "--seed",
            "5",
            "--ray",
            cluster.address,
            "--concurrency",
            "2",
            "--ready",
            "1",
            "--confdir",
            str(tmp_path / "conf"),
            "--set",
            "polar_shard_seconds=0.2",
            "--no-progress",
            "--runtime",
            "local",
            "--trust-agent",
        ],  # _harnesses tells sessions by host workspace, which bwrap hides
        cwd=tmp_path,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=_driver_env(),
    )
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
    timings = [(s["status"], (s["node"] or "")[:6], {k: round(v, 1) for k, v in s["timings"].items()}) for s in results]
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
            s["task_id"],
            s["group_id"],
            s["sample"],
        )
        assert stored.metadata["node"] == s["node"]
        if s in lost:
            assert stored.status == "error" and stored.metadata["reason"] == WORKER_LOST
        else:
            # 0 lost acknowledged calls: both turns of the script, the dead node's completed sessions included.
            assert stored.status == "completed" and stored.rewards == {"reward": 0.0}
            assert calls[s["session_id"]] == 2, (s, calls)
    for r in records:
        stored = sessions[r.session_id]
        assert (r.task_id, r.group_id, r.sample_index) == (
            stored.metadata["task"],
            stored.metadata["group"],
            stored.metadata["sample"],
        )
    validated = subprocess.run(
        [sys.executable, "-m", "polar_cli.app", "shards", "validate", str(store)],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "PYTHONPATH": str(REPO)},
    )
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
    shown = subprocess.run(
        [sys.executable, "-m", "polar_cli.app", "rollout", "--help"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
    )
    text = " ".join(shown.stdout.replace("│", " ").split())
    assert "Refused with --proxy" in text and "with --ray, on every node" in text
    assert "each node writes with its own credentials" in text and "the driver's AWS_* are not shipped" in text
