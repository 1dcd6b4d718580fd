"""`polar rollout` end to end: the runner with the local runtime and a `cmd:` preset running a small agent written
with the official openai SDK (tests/support/rollout_agent.py), through a real mitmdump + polar addon answering with
the scripted engine. One proxy serves the library-level runs (as a running proxy: the control token is given);
the CLI test starts its own, as users do."""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from polar_addon.store import read_records, read_sessions, validate_store
from polar_cli.build.output import read_traces
from polar_cli.rollout.harnesses.base import SessionContext
from polar_cli.rollout.harnesses.codex import Codex
from polar_cli.rollout.harnesses.pi import Pi
from polar_cli.rollout.proxy import ControlClient, ExternalProxy, StartedProxy, start_proxy
from polar_cli.rollout.runner import RolloutConfig, RolloutResult, run_rollout, session_ids
from polar_cli.rollout.tasks import load_tasks
from tests.support.prereq import missing
from tests.support.proxy import REPO
from tests.support.shards import session_records, wait_for_shards

AGENT = REPO / "tests" / "support" / "rollout_agent.py"
HARNESS = f"cmd:{sys.executable} {AGENT} {{instruction}}"
HANG_DEADLINE_S = 25  # long enough for the agent's first call on a loaded 2-core machine


def _script(root: Path, model_dir: Path) -> Path:
    script = root / "script.json"
    turns = [{"content": "", "tool_calls": [{"type": "function", "function": {
                 "name": "write_file", "arguments": {"path": "answer.txt", "content": "42"}}}]},
             {"content": "done"}]  # fmt: skip
    script.write_text(json.dumps({"model_dir": str(model_dir), "turns": turns}))
    return script


def _tasks(root: Path, *entries: dict) -> Path:
    workspace = root / "ws"
    workspace.mkdir(exist_ok=True)
    (workspace / "README").write_text("the task's starting tree\n")
    path = root / "tasks.jsonl"
    path.write_text("".join(json.dumps({"workspace": "ws", "verify": "true", **e}) + "\n" for e in entries))
    return path


@pytest.fixture(scope="module")
def proxy(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory):
    root = tmp_path_factory.mktemp("rollout-proxy")
    with start_proxy(
        f"scripted:{_script(root, tiny_model_dir)}",
        str(root / "store"),
        confdir=root / "conf",
        log_dir=root,
        options={"polar_shard_seconds": "0.2"},
    ) as started:
        yield started


def _run(proxy: StartedProxy, tasks: Path, **fields) -> RolloutResult:
    external = ExternalProxy(
        f"http://127.0.0.1:{proxy.endpoints.forward_port}",
        proxy.control_token,
        f"http://127.0.0.1:{proxy.endpoints.reverse_port}",
        proxy.endpoints.ca,
    )
    # The local runtime unless a test names another (RolloutConfig defaults to bwrap).
    defaults = {"harness": HARNESS, "runtime": "local", "trust_agent": True}
    config = RolloutConfig(tasks=load_tasks(tasks), proxy=external, **{**defaults, **fields})
    return asyncio.run(run_rollout(config))


def _store(proxy: StartedProxy) -> str:
    return str(Path(proxy.log).parent / "store")


def test_rollout_rewards_from_the_verifier_and_every_failure_mode(proxy: StartedProxy, tmp_path: Path) -> None:
    marker = tmp_path / "setup-failed-once"
    tasks = _tasks(tmp_path,
        {"id": "pass", "instruction": "Write the answer.", "verify": 'test "$(cat answer.txt)" = 42'},
        {"id": "fail", "instruction": "Write the answer.", "verify": 'test "$(cat answer.txt)" = 43'},
        {"id": "crash", "instruction": "MODE=crash"},
        {"id": "hang", "instruction": "MODE=hang", "timeouts": {"agent": HANG_DEADLINE_S}},
        # The agent posts reward 0.77 for itself three ways; the verifier checks each was refused (401).
        {"id": "self", "instruction": "MODE=self-reward", "verify": "grep -qx '401 401 401 401 401' self-reward.txt"},
        {"id": "flaky-setup", "instruction": "Write the answer.", "verify": "test -f answer.txt",
         # mkdir is atomic: exactly one of the two concurrent setups fails once.
         "setup": f"if mkdir {marker} 2>/dev/null; then exit 1; fi"},
        {"id": "broken-setup", "instruction": "never runs", "setup": "echo no disk >&2; exit 3"},
        # The agent writes answer.txt ("42"); a verifier that writes no reward file must not pass it off as one.
        {"id": "planted", "instruction": "Write the answer.", "reward_file": "answer.txt"},
        # The harness's final answer (its stdout, "done"), saved by the runner outside the workspace.
        {"id": "stdout", "instruction": "Write the answer.",
         "verify": 'test "$(cat "$POLAR_AGENT_OUTPUT")" = done && '
                   'case "$POLAR_AGENT_OUTPUT" in "$PWD"/*) exit 1;; esac'},
    )  # fmt: skip
    result = _run(proxy, tasks, samples=2, concurrency=4, ready=4, init_attempts=2, seed=11, logs_dir=tmp_path / "logs")
    by_task: dict[str, list] = {}
    for s in result.sessions:
        by_task.setdefault(s.task_id, []).append(s)
    statuses = {t: sorted(s.status for s in ss) for t, ss in by_task.items()}
    # A harness that kills itself is failed (reward 0, trained), not masked; a verifier that wrote no reward file
    # scores 0 (the code under test could have stopped it); only the broken setup (infrastructure) is an error.
    assert statuses == {
        "pass": ["completed"] * 2,
        "fail": ["completed"] * 2,
        "crash": ["failed"] * 2,
        "hang": ["timeout"] * 2,
        "self": ["completed"] * 2,
        "flaky-setup": ["completed"] * 2,
        "broken-setup": ["error"] * 2,
        "planted": ["completed"] * 2,
        "stdout": ["completed"] * 2,
    }, [(s.session_id, s.task_id, s.reason) for s in result.sessions]
    rewards = {t: sorted(s.reward for s in ss if s.reward is not None) for t, ss in by_task.items()}
    assert rewards["pass"] == [1.0, 1.0] and rewards["fail"] == [0.0, 0.0] and rewards["self"] == [1.0, 1.0]
    assert rewards["stdout"] == [1.0, 1.0] and rewards["crash"] == [0.0, 0.0] and rewards["planted"] == [0.0, 0.0]
    assert sorted(s.init_attempts for s in by_task["flaky-setup"]) == [1, 2]  # one session met the failure, retried
    assert all(s.init_attempts == 2 and not s.ran and "exited 3" in (s.reason or "") for s in by_task["broken-setup"])
    assert all(s.ran and s.exit_code not in (0, None) for s in by_task["crash"])
    assert all(s.session_id.startswith("r11-") for s in result.sessions)
    assert all("wrote no answer.txt: scored 0" in (s.reason or "") for s in by_task["planted"])
    summary = result.summary()
    assert summary["statuses"] == {"completed": 12, "failed": 2, "timeout": 2, "error": 2, "cancelled": 0}
    assert summary["mask_rate"] == 2 / 18 and summary["groups"]["broken-setup"]["mask_rate"] == 1.0
    assert summary["groups"]["crash"] == {
        "rewards": [0.0, 0.0],
        "mean": 0.0,
        "sessions": 2,
        "masked": 0,
        "mask_rate": 0.0,
    }

    store = _store(proxy)
    wait_for_shards(store)
    assert validate_store(store) == []  # the killed harness left no corrupt shard
    sessions = {s.session_id: s for s in read_sessions(store)}
    for s in result.sessions:
        stored = sessions[s.session_id]
        assert stored.status == {"failed": "agent_error"}.get(s.status, s.status), s.session_id
        assert stored.rewards == ({"reward": s.reward} if s.status == "completed" else {})
        assert all(r.source == "proxy" for r in stored.reward_history)  # posted by the runner, never the agent
        assert stored.metadata["task"] == s.task_id and stored.metadata["sample"] == s.sample
        if s.task_id in ("pass", "fail", "self", "hang", "crash", "stdout"):
            records = read_records(store, [s.session_id])
            assert records, f"{s.session_id} ({s.task_id}) has no captured call"
            assert {(r.task_id, r.group_id, r.sample_index) for r in records} == {(s.task_id, s.task_id, s.sample)}
    assert 0.77 not in {r.value for s in sessions.values() for r in s.reward_history}
    # The hang's partial trace: its first call is kept, its status says how it ended.
    assert all(len(read_records(store, [s.session_id])) == 1 for s in by_task["hang"])
    patch = (tmp_path / "logs" / "sessions" / by_task["pass"][0].session_id / "patch.diff").read_text()
    assert "+++ b/answer.txt" in patch and "+42" in patch


def test_early_stop_cancels_the_stragglers(proxy: StartedProxy, tmp_path: Path) -> None:
    # Sample 0 answers at once; samples 1 and 2 would wait 60 s. One RUN slot: sample 1 is cancelled while
    # running, sample 2 before it ever runs.
    tasks = _tasks(
        tmp_path, {"id": "race", "instruction": "MODE=slow-unless-0 write it", "verify": "test -f answer.txt"}
    )
    started = time.monotonic()
    result = _run(proxy, tasks, samples=3, concurrency=1, ready=1, early_stop=1)
    assert time.monotonic() - started < 50
    got = {s.sample: (s.status, s.ran) for s in result.sessions}
    assert got == {0: ("completed", True), 1: ("cancelled", True), 2: ("cancelled", False)}
    store = _store(proxy)
    wait_for_shards(store)
    sessions = {s.session_id: s for s in read_sessions(store)}
    cancelled = next(s for s in result.sessions if s.sample == 1)
    assert sessions[cancelled.session_id].status == "error"  # masked: the store has no "cancelled" status
    assert sessions[cancelled.session_id].metadata["cancelled"] is True
    assert next(s for s in result.sessions if s.sample == 2).session_id not in sessions  # never ran, nothing posted


def test_a_session_the_store_holds_as_error_does_not_early_stop_its_group(proxy: StartedProxy, tmp_path: Path) -> None:
    """The proxy ended sample 0 as error before it finished (as when its engine is taken out): its completed post is
    answered error, so it is not usable and must not cancel the group's other samples; sample 1 is the usable one."""
    tasks = _tasks(tmp_path, {"id": "ended", "instruction": "write it", "verify": "test -f answer.txt"})
    first = next(sid for _task, sample, sid in session_ids(load_tasks(tasks), 3, "estop") if sample == 0)

    async def end_first() -> None:
        control = ControlClient(proxy.endpoints.forward_port, proxy.control_token)
        try:
            await control.status(first, "error", {"error": "engine taken out mid-session"})
        finally:
            await control.aclose()

    asyncio.run(end_first())
    result = _run(proxy, tasks, samples=3, concurrency=1, ready=1, early_stop=1, run_id="estop")
    got = {s.sample: s.status for s in result.sessions}
    assert got == {0: "error", 1: "completed", 2: "cancelled"}, [
        (s.sample, s.status, s.reason) for s in result.sessions
    ]


def _polar(*args: str, env: dict | None = None, cwd: Path = REPO) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "polar_cli.app", *args],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=600,
        env={**os.environ, **(env or {})},
    )


def test_polar_rollout_command_then_build(tiny_model_dir: Path, tmp_path: Path, proxy: StartedProxy) -> None:
    tasks = _tasks(tmp_path,
        {"id": "pass", "instruction": "Write the answer.", "verify": 'test "$(cat answer.txt)" = 42'},
        {"id": "fail", "instruction": "Write the answer.", "verify": 'test "$(cat answer.txt)" = 43'})  # fmt: skip
    store = tmp_path / "store"
    # Relative --out and --work-dir, as `make demo` gives them: git and mitmdump run from other directories.
    done = _polar(
        "rollout",
        str(tasks),
        "--harness",
        HARNESS,
        "--samples",
        "2",
        "--engine",
        f"scripted:{_script(tmp_path, tiny_model_dir)}",
        "--out",
        "store",
        "--work-dir",
        "work",
        "--seed",
        "3",
        "--confdir",
        str(tmp_path / "conf"),
        "--set",
        "polar_shard_seconds=0.2",
        cwd=tmp_path,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert "4 sessions (4 completed)" in done.stdout
    report = store / "rollouts" / "r3"
    summary = json.loads((report / "rollout-summary.json").read_text())
    manifest = json.loads((report / "rollout-manifest.json").read_text())
    assert summary["groups"]["pass"]["rewards"] == [1.0, 1.0] and summary["groups"]["fail"]["mean"] == 0.0
    assert manifest["seed"] == 3 and len(manifest["task_set_hash"]) == 64 and manifest["versions"]["polar"]
    assert manifest["command"][1:3] == ["rollout", str(tasks)]

    built = tmp_path / "built"
    assert _polar("build", str(store), "--out", str(built)).returncode == 0
    traces = read_traces(built)
    assert sorted((t.group_id, t.sample_index, t.reward, t.trainable) for t in traces) == [
        ("fail", 0, 0.0, True),
        ("fail", 1, 0.0, True),
        ("pass", 0, 1.0, True),
        ("pass", 1, 1.0, True),
    ]

    # Every session failing is a failed command; here through the running proxy and its control token.
    broken = _tasks(
        tmp_path / "broken" if (tmp_path / "broken").mkdir() is None else tmp_path,
        {"id": "broken", "instruction": "x", "setup": "exit 1"},
    )
    failed = _polar(
        "rollout",
        str(broken),
        "--harness",
        HARNESS,
        "--proxy",
        f"http://127.0.0.1:{proxy.endpoints.forward_port}",
        "--reverse-url",
        f"http://127.0.0.1:{proxy.endpoints.reverse_port}",
        "--confdir",
        str(Path(proxy.endpoints.ca).parent),
        "--init-attempts",
        "1",
        "--report-dir",
        str(tmp_path / "report"),
        env={"POLAR_CONTROL_TOKEN": proxy.control_token},
    )
    assert failed.returncode == 1, failed.stdout + failed.stderr
    assert "no session was usable" in failed.stderr
    assert json.loads((tmp_path / "report" / "rollout-summary.json").read_text())["statuses"]["error"] == 1


def _harbor_task(root: Path, name: str, test_sh: str) -> None:
    task = root / name
    (task / "environment" / "app").mkdir(parents=True)
    (task / "tests").mkdir()
    (task / "task.toml").write_text('version = "1.0"\n[agent]\ntimeout_sec = 120.0\n[verifier]\ntimeout_sec = 60.0\n')
    (task / "instruction.md").write_text("<!-- harbor-canary GUID x -->\nWrite the answer into answer.txt.\n")
    (task / "environment" / "Dockerfile").write_text("FROM python:3.11-slim\nWORKDIR /app\nCOPY app/ /app/\n")
    (task / "environment" / "app" / "README").write_text("start\n")
    (task / "tests" / "test.sh").write_text("#!/bin/bash\ncd /app\n" + test_sh)


def test_harbor_tasks_verified_in_bwrap(proxy: StartedProxy, tmp_path: Path) -> None:
    """Harbor directories unchanged: the workspace at the Dockerfile's WORKDIR, tests/ at /tests for the verifier
    only, the reward from /logs/verifier (reward.txt, or reward.json's named rewards), the agent proxy-only."""
    if not shutil.which("bwrap") or not shutil.which("socat"):
        missing("bubblewrap/socat missing (make sandbox)")
    tasks = tmp_path / "harbor"
    _harbor_task(
        tasks,
        "txt",
        'test "$(cat answer.txt)" = 42 && echo 1 > /logs/verifier/reward.txt || echo 0 > /logs/verifier/reward.txt\n',
    )
    _harbor_task(
        tasks,
        "json",
        "test -e /tests/test.sh && test ! -e /app/tests && "
        'echo \'{"tests": 1, "style": 0, "note": "x"}\' > /logs/verifier/reward.json\n',
    )
    _harbor_task(tasks, "silent", "true\n")  # writes no reward: a 0, never a mask
    # The harness's stdout at Harbor's /logs/agent, and in POLAR_AGENT_OUTPUT as for JSONL tasks.
    _harbor_task(
        tasks,
        "stdout",
        'test "$(cat /logs/agent/stdout.txt)" = done && test "$POLAR_AGENT_OUTPUT" = /logs/agent/stdout.txt && '
        "echo 1 > /logs/verifier/reward.txt\n",
    )
    # The cmd: preset shows the venv and the agent script it names read-only inside; nothing else of the host.
    result = _run(proxy, tasks, samples=1, concurrency=3, runtime="bwrap")
    got = {s.task_id: (s.status, s.rewards) for s in result.sessions}
    assert got["stdout"] == ("completed", {"reward": 1.0}), next(
        s.reason for s in result.sessions if s.task_id == "stdout"
    )
    assert got["txt"] == ("completed", {"reward": 1.0})
    assert got["json"] == ("completed", {"reward": 0.5, "tests": 1.0, "style": 0.0})
    # No reward is a 0 (the code under test could have killed test.sh before it wrote one), never a mask.
    silent = next(s for s in result.sessions if s.task_id == "silent")
    assert (silent.status, silent.reward) == ("completed", 0.0), silent.reason
    assert "wrote no /logs/verifier/reward.txt: scored 0" in (silent.reason or "")
    # Local cannot place /tests: refused before any session runs, naming the runtimes that can.
    with pytest.raises(ValueError, match="the local runtime cannot place: use --runtime bwrap or --runtime oci"):
        _run(proxy, tasks / "txt", samples=1, init_attempts=1, runtime="local")


class _PiShowingItsConfig(Pi):
    """Pi's own configure; its command prints the config the session's HOME holds instead of running Pi (what Pi
    does with the window is tests/test_rollout_presets.py's)."""

    def command(self, instruction: str, ctx: SessionContext) -> list[str]:
        return ["cat", f"{ctx.home}/.pi/agent/models.json"]


class _CodexShowingItsConfig(Codex):
    def command(self, instruction: str, ctx: SessionContext) -> list[str]:
        return ["cat", f"{ctx.home}/.codex/config.toml"]


def _harness_stdout(logs: Path, result: RolloutResult) -> str:
    (session,) = result.sessions
    assert session.status == "completed", session.reason
    log = (logs / "sessions" / session.session_id / "harness.log").read_text()
    return log.split("--- stdout\n")[1].split("\n--- stderr\n")[0]


def test_the_engines_window_reaches_the_harness_config(tiny_model_dir: Path, tmp_path: Path) -> None:
    """No --context-window: the started proxy's engine serves 3000 tokens (local:DIR?max_len), so Pi's models.json
    in the session's HOME says so; --set polar_max_tokens is its output cap."""
    tasks = _tasks(tmp_path, {"id": "window", "instruction": "x"})
    config = RolloutConfig(
        tasks=load_tasks(tasks),
        harness=_PiShowingItsConfig(),
        out=str(tmp_path / "store"),
        engine=f"local:{tiny_model_dir}?max_len=3000",
        confdir=tmp_path / "conf",
        logs_dir=tmp_path / "logs",
        proxy_options={"polar_max_tokens": "256"},
        runtime="local",
        trust_agent=True,
    )
    result = asyncio.run(run_rollout(config))
    models = json.loads(_harness_stdout(tmp_path / "logs", result))["providers"]["polar"]["models"]
    assert models == [{"id": "policy", "contextWindow": 3000, "maxTokens": 256}]
    assert (result.context_window, result.max_output_tokens) == (3000, 256)


def test_a_given_window_reaches_the_harness_config(proxy: StartedProxy, tmp_path: Path) -> None:
    tasks = _tasks(tmp_path, {"id": "window", "instruction": "x"})
    result = _run(proxy, tasks, harness=_CodexShowingItsConfig(), context_window=5000, logs_dir=tmp_path / "logs")
    config = _harness_stdout(tmp_path / "logs", result)
    assert "model_context_window = 5000\n" in config and "model_auto_compact_token_limit = 4000\n" in config


def test_sigint_mid_run_cancels_every_session_and_keeps_the_traces(proxy: StartedProxy, tmp_path: Path) -> None:
    """Ctrl-C on `polar rollout` while two harnesses hang after their first call and a third session waits: the
    harnesses' process trees die, no session stays `running` in the store, the captured calls are kept, the summary
    says so, and the exit status is 130."""
    marker = f"sigint-{os.getpid()}-{time.monotonic_ns()}"  # in each agent's command line
    tasks = _tasks(tmp_path, {"id": "hangs", "instruction": f"MODE=hang {marker}"})
    report = tmp_path / "report"
    process = subprocess.Popen(
        [sys.executable, "-m", "polar_cli.app", "rollout", str(tasks), "--harness", HARNESS, "--samples", "3",
         "--concurrency", "2", "--seed", "7", "--proxy", f"http://127.0.0.1:{proxy.endpoints.forward_port}",
         "--reverse-url", f"http://127.0.0.1:{proxy.endpoints.reverse_port}",
         "--confdir", str(Path(proxy.endpoints.ca).parent), "--report-dir", str(report), "--no-progress"],
        cwd=REPO, env={**os.environ, "POLAR_CONTROL_TOKEN": proxy.control_token},
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)  # fmt: skip
    store = _store(proxy)
    ids = [sid for _, _, sid in session_ids(load_tasks(tasks), 3, "r7")]
    try:
        running = []
        deadline = time.monotonic() + 180
        while len(running) < 2:  # two RUN slots: the first two sessions to start made their call and now hang
            if process.poll() is not None or time.monotonic() > deadline:
                raise AssertionError(
                    f"{process.communicate(timeout=5)}: {list((report / 'logs').rglob('*.log'))} "
                    f"{(report / 'rollout-summary.json').read_text()[-3000:]}"
                )
            running = [sid for sid in ids if session_records(store, sid, timeout=10)]
            time.sleep(0.2)
        process.send_signal(signal.SIGINT)
        out, err = process.communicate(timeout=120)
    finally:
        process.kill()
    assert process.returncode == 130, out + err
    assert "interrupted by SIGINT" in err
    summary = json.loads((report / "rollout-summary.json").read_text())
    assert summary["interrupted"] == "SIGINT" and summary["statuses"]["cancelled"] == 3
    assert sorted(s["ran"] for s in summary["session_results"]) == [False, True, True]
    assert json.loads((report / "rollout-manifest.json").read_text())["interrupted"] == "SIGINT"
    wait_for_shards(store)
    stored = {s.session_id: s for s in read_sessions(store) if s.session_id in ids}
    assert sorted(stored) == sorted(running)  # the session that never ran made no call and is not stored
    for sid in running:
        assert stored[sid].status == "error" and stored[sid].metadata["cancelled"] is True
        assert stored[sid].metadata["signal"] == "SIGINT" and stored[sid].metadata["stage"] == "run"
        assert len(read_records(store, [sid])) == 1  # the call made before the signal is kept
    alive = [p for p in Path("/proc").glob("[0-9]*/cmdline") if marker.encode() in _read_or_empty(p)]
    assert alive == [], "a harness outlived the interrupted rollout"


def _read_or_empty(path: Path) -> bytes:
    try:
        return path.read_bytes()
    except OSError:
        return b""


def test_a_session_the_proxy_ended_as_error_is_error_in_the_summary_too(tiny_model_dir: Path, tmp_path: Path) -> None:
    """The proxy ends a session as error when its engine is taken out mid-session; the harness still exits 0 and
    the verifier still rewards it, so the runner posts completed afterwards. The store keeps error (error is final);
    the proxy answers the post with it, and the runner's result, summary and counts say error as well."""
    from polar_addon.engines.scripted import ScriptedEngine
    from polar_cli.rollout.runner import RolloutProgress
    from tests.support.sglang_contract_server import SGLangContractServer

    script = _script(tmp_path, tiny_model_dir)
    first, dead = tmp_path / "first-call-done", tmp_path / "engine-dead"
    agent = tmp_path / "agent.py"
    # One call, then (once the test stopped the engines) another that fails; it exits 0 whatever happened.
    agent.write_text(f"""import os, pathlib, time
from openai import OpenAI
client = OpenAI(max_retries=0, timeout=60)
ask = lambda: client.chat.completions.create(model=os.environ["POLAR_MODEL"], max_tokens=8,
                                             messages=[{{"role": "user", "content": "hi"}}])
ask()
pathlib.Path({str(first)!r}).write_text("1")
deadline = time.monotonic() + 60
while not pathlib.Path({str(dead)!r}).exists() and time.monotonic() < deadline:
    time.sleep(0.1)
try:
    ask()
except Exception as exc:
    print("second call failed:", exc)
""")
    tasks = _tasks(tmp_path, {"id": "t", "instruction": "go"})
    a = SGLangContractServer(ScriptedEngine(script)).__enter__()
    b = SGLangContractServer(ScriptedEngine(script)).__enter__()
    running = [a, b]
    try:
        config = RolloutConfig(tasks=load_tasks(tasks), harness=f"cmd:{sys.executable} {agent} {{instruction}}",
                               samples=1, engine=f"sglang:{a.url},sglang:{b.url}", out=str(tmp_path / "store"),
                               confdir=tmp_path / "conf", logs_dir=tmp_path / "logs", stop_on_signals=False,
                               proxy_options={"polar_shard_seconds": "0.2"}, progress=RolloutProgress(),
                               runtime="local", trust_agent=True)  # fmt: skip

        async def run() -> RolloutResult:
            rollout = asyncio.create_task(run_rollout(config))
            deadline = time.monotonic() + 120
            while not first.exists() and not rollout.done() and time.monotonic() < deadline:
                await asyncio.sleep(0.1)
            # Both engines gone (the session is on one of them): connection refused takes its engine out at once.
            for server in (a, b):
                await asyncio.to_thread(server.__exit__, None, None, None)
                running.remove(server)
            dead.write_text("1")
            return await asyncio.wait_for(rollout, 180)

        result = asyncio.run(run())
    finally:
        for server in running:
            server.__exit__(None, None, None)
    (session,) = result.sessions
    stored = {s.session_id: s for s in read_sessions(str(tmp_path / "store"))}[session.session_id]
    assert stored.status == "error" and "taken out" in str(stored.metadata.get("error"))
    assert session.status == "error" and "taken out" in (session.reason or "")
    summary = result.summary()
    assert summary["statuses"]["error"] == 1 and summary["statuses"]["completed"] == 0
    assert summary["reward_mean"] is None and summary["groups"]["t"]["rewards"] == []
    assert [s["status"] for s in summary["session_results"]] == ["error"] and result.all_failed
    assert (
        config.progress is not None
        and config.progress.statuses["error"] == 1
        and config.progress.statuses["completed"] == 0
    )
    assert config.progress.group_rewards.get("t", []) == []
