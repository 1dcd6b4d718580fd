"""Harness presets (``polar_cli.rollout.harnesses``) drive the real CLIs through a swe_mini bug fix.

For each of Claude Code, Codex, Qwen Code, Pi and Gemini CLI: the preset writes its config into a fresh HOME,
its env and command run the real CLI (``.harness``) in a copy of a swe_mini workspace against one shared
mitmdump (forward and reverse listeners) whose scripted engine replays that harness's own fix
(``examples/swe_mini/scripts/HARNESS.json``: its own tool names and argument shapes; the tiny random model
would never call a tool). The harness must exit 0, the task's verifier must pass (reward 1.0), and every call
must be stored under the session, task, group and sample the preset gave it.

The swe_mini tasks themselves are checked in both formats: each JSONL verifier and each Harbor ``tests/test.sh``
(run in bubblewrap with ``/app``, ``/tests`` and ``/logs/verifier`` where Harbor puts them) gives 0 on the
bug and 1 after ``solution/solve.sh``.
"""

from __future__ import annotations

import importlib
import json
import os
import shutil
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from polar_addon.store.validate import validate_store
from polar_cli.mitm import REPO, free_port, mitmdump_command, wait_for_port
from polar_cli.rollout.harnesses.base import SessionContext
from tests.support.harnesses import BIN
from tests.support.shards import session_records

SWE_MINI = REPO / "examples" / "swe_mini"
SCRIPTS = SWE_MINI / "scripts"
HARNESSES = ["claude-code", "codex", "qwen-code", "pi", "gemini-cli"]
SYSTEM_PYTHON = "/usr/bin/python3"  # what a sandbox has; the verifiers use nothing else
# Above every harness's prompt (Claude Code's is ~33k tokens), so no harness compacts mid-script.
WINDOW, MAX_OUTPUT = 131072, 4096
# Harnesses with an output-cap setting: each call they make asks for MAX_OUTPUT tokens (Codex has none).
CAPPED = {"claude-code", "qwen-code", "pi", "gemini-cli"}


def jsonl_tasks() -> dict[str, dict]:
    lines = (SWE_MINI / "tasks.jsonl").read_text().splitlines()
    return {task["id"]: task for task in map(json.loads, lines)}


def model_name(harness: str) -> str:
    return f"swe-{harness}"


def script(harness: str) -> dict:
    return json.loads((SCRIPTS / f"{harness}.json").read_text())


@dataclass
class SharedProxy:
    forward: int
    reverse: int
    ca: Path
    out: Path
    log: Path
    sessions: Path  # SESSIONS/HARNESS/{workspace,home}: fixed paths, so the scripts can name files by them


@pytest.fixture(scope="module")
def proxy(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[SharedProxy]:
    """One mitmdump for all five harnesses: its scripted engine picks each harness's turns by model name."""
    base = tmp_path_factory.mktemp("presets-proxy")
    by_model = {}
    for harness in HARNESSES:
        # The scripts name files under {workspace}: the session's workspace as the harness sees it.
        turns = json.dumps(script(harness)["turns"]).replace("{workspace}", str(base / "sessions" / harness / "workspace"))
        by_model[model_name(harness)] = json.loads(turns)
    (base / "script.json").write_text(json.dumps({"model_dir": str(tiny_model_dir), "cycle": False, "by_model": by_model}))
    forward, reverse = free_port(), free_port()
    out, confdir, log = base / "shards", base / "conf", base / "mitmdump.log"
    confdir.mkdir()
    cmd = mitmdump_command(f"scripted:{base / 'script.json'}", out, port=None, confdir=confdir,
                           modes=[f"regular@{forward}", f"reverse:https://api.openai.com@{reverse}"],
                           options={"polar_shard_seconds": "0.5"})
    with open(log, "wb") as fh:
        process = subprocess.Popen(cmd, stdout=fh, stderr=subprocess.STDOUT, cwd=REPO, start_new_session=True)
    try:
        for port in (forward, reverse):
            wait_for_port(port, 120, process, log)
        yield SharedProxy(forward, reverse, confdir / "mitmproxy-ca-cert.pem", out, log, base / "sessions")
    finally:
        if process.poll() is None:
            os.killpg(process.pid, 2)  # SIGINT: mitmdump seals its open shard
            try:
                process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(process.pid, 9)
                process.wait()


def run_preset(harness: str, ctx: SessionContext, instruction: str) -> subprocess.CompletedProcess:
    """configure -> env -> command, as the runner does, with the CLI from ``.harness`` and nothing inherited
    that would steer it (proxy variables)."""
    preset = importlib.import_module(f"polar_cli.rollout.harnesses.{harness.replace('-', '_')}").make(None)
    home = Path(ctx.home)
    preset.configure(home, ctx)
    argv = preset.command(instruction, ctx)
    assert argv[0] in preset.binaries
    binary = BIN / argv[0]
    if not binary.exists():
        pytest.skip(f"{binary} missing: run `make harnesses`")
    base = {k: v for k, v in os.environ.items() if not k.upper().endswith("_PROXY")}
    env = {**base, "HOME": str(home), "XDG_CONFIG_HOME": str(home / ".config"), **preset.env(ctx)}
    return subprocess.run([str(binary), *argv[1:]], env=env, cwd=ctx.workspace, capture_output=True, text=True,
                          timeout=240, stdin=subprocess.DEVNULL)


def verify(task: dict, workspace: Path) -> float:
    command = task["verify"].replace("python3", SYSTEM_PYTHON, 1)
    result = subprocess.run(command, shell=True, cwd=workspace, capture_output=True, text=True, timeout=60)
    return 1.0 if result.returncode == 0 else 0.0


@pytest.mark.harness
@pytest.mark.parametrize("harness", HARNESSES)
def test_preset_runs_the_scripted_fix(harness: str, proxy: SharedProxy) -> None:
    turns = script(harness)["turns"]
    if harness == "qwen-code":
        turns = turns[1:]  # its own startup acknowledgement (see the script's note)
    task = jsonl_tasks()[script(harness)["task"]]
    workspace, home = proxy.sessions / harness / "workspace", proxy.sessions / harness / "home"
    shutil.copytree(SWE_MINI / task["workspace"], workspace)
    home.mkdir()
    assert verify(task, workspace) == 0.0  # the bug is there
    session = f"{harness}-0"
    ctx = SessionContext(session_id=session, task_id=task["id"], group_id=f"{task['id']}@grp", sample=3,
                         model=model_name(harness), proxy_url=f"http://127.0.0.1:{proxy.forward}",
                         reverse_url=f"http://127.0.0.1:{proxy.reverse}", ca_path=str(proxy.ca), home=str(home),
                         workspace=str(workspace), context_window=WINDOW, max_output_tokens=MAX_OUTPUT)
    result = run_preset(harness, ctx, task["instruction"])
    log = result.stdout[-3000:] + result.stderr[-3000:] + proxy.log.read_text(errors="replace")[-3000:]
    assert result.returncode == 0, log
    assert verify(task, workspace) == 1.0, log

    records = sorted(session_records(proxy.out, session, at_least=len(turns)), key=lambda r: r.started_at)
    summary = [(r.status, r.error, len(r.messages), r.response_message) for r in records]
    assert [r.status for r in records] == ["ok"] * len(turns), summary
    assert {(r.task_id, r.group_id, r.sample_index) for r in records} == {(task["id"], f"{task['id']}@grp", 3)}
    called = [[c["name"] for c in (r.response_message or {}).get("tool_calls") or []] for r in records]
    assert called == [[c["function"]["name"] for c in t.get("tool_calls", [])] for t in turns], summary
    assert records[-1].response_message["content"] == turns[-1]["content"]
    if harness in CAPPED:
        assert {r.max_tokens for r in records} == {MAX_OUTPUT}
    # Each call after the first carries the previous tool's real output back to the model.
    assert all(len(r.messages) > len(records[0].messages) for r in records[1:])
    assert validate_store(str(proxy.out)) == []


# --- the task set in both formats ---------------------------------------------------------------------------


def bwrap_harbor(task_dir: Path, app: Path, logs: Path, script_path: str) -> subprocess.CompletedProcess:
    """Run a Harbor script with /app, /tests and /logs/verifier where Harbor puts them (no network)."""
    cmd = ["bwrap", "--unshare-user", "--uid", "1000", "--unshare-net", "--die-with-parent",
           "--ro-bind", "/usr", "/usr", "--symlink", "usr/bin", "/bin", "--symlink", "usr/lib", "/lib",
           "--symlink", "usr/lib64", "/lib64", "--ro-bind", "/etc", "/etc", "--proc", "/proc", "--dev", "/dev",
           "--tmpfs", "/tmp", "--bind", str(app), "/app", "--ro-bind", str(task_dir / "tests"), "/tests",
           "--ro-bind", str(task_dir / "solution"), "/solution", "--bind", str(logs), "/logs/verifier",
           "--chdir", "/app", "bash", script_path]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=60)


@pytest.mark.parametrize("task_id", sorted(jsonl_tasks()))
def test_swe_mini_task_in_both_formats(task_id: str, tmp_path: Path) -> None:
    if shutil.which("bwrap") is None:
        pytest.skip("bubblewrap missing (apt-get install bubblewrap)")
    task = jsonl_tasks()[task_id]
    harbor = SWE_MINI / "harbor" / task_id
    assert (SWE_MINI / task["workspace"]).resolve() == (harbor / "environment" / "app").resolve()
    assert task["instruction"] == (harbor / "instruction.md").read_text().strip()
    assert "COPY app/ /app/" in (harbor / "environment" / "Dockerfile").read_text()
    import tomllib

    config = tomllib.loads((harbor / "task.toml").read_text())
    assert config["verifier"]["timeout_sec"] > 0 and config["agent"]["timeout_sec"] > 0

    app, logs = tmp_path / "app", tmp_path / "logs"
    shutil.copytree(harbor / "environment" / "app", app)
    logs.mkdir()
    assert verify(task, app) == 0.0
    result = bwrap_harbor(harbor, app, logs, "/tests/test.sh")
    assert result.returncode == 0 and (logs / "reward.txt").read_text().strip() == "0", result.stderr

    result = bwrap_harbor(harbor, app, logs, "/solution/solve.sh")
    assert result.returncode == 0, result.stderr
    diff = subprocess.run(["diff", "-r", str(harbor / "environment" / "app"), str(app)], capture_output=True, text=True)
    assert len([line for line in diff.stdout.splitlines() if line.startswith(("<", ">"))]) == 2  # a one-line fix
    assert verify(task, app) == 1.0
    result = bwrap_harbor(harbor, app, logs, "/tests/test.sh")
    assert result.returncode == 0 and (logs / "reward.txt").read_text().strip() == "1", result.stderr
