"""Task loaders (JSONL and Harbor directories), the task-set hash, reward files, the registries, workspaces and
patches, and the local runtime: plain functions and real subprocesses, no proxy."""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import sys
import time
from pathlib import Path

import pytest

from polar_addon.identity import SESSION_ID
from polar_cli.rollout import workspace as ws
from polar_cli.rollout.harnesses import get_preset
from polar_cli.rollout.harnesses.base import SessionContext
from polar_cli.rollout.runner import session_ids
from polar_cli.rollout.runtimes import get_runtime
from polar_cli.rollout.runtimes.base import ProxyEndpoints, RuntimeUnavailable, SandboxSpec
from polar_cli.rollout.tasks import TaskFileError, image_free_copies, load_tasks, task_set_hash
from polar_cli.rollout.verify import NoReward, file_rewards, harbor_rewards, resolve_env


def _jsonl(tmp_path: Path, *lines: object) -> Path:
    path = tmp_path / "tasks.jsonl"
    path.write_text("".join((line if isinstance(line, str) else json.dumps(line)) + "\n" for line in lines))
    return path


def test_jsonl_tasks_resolve_paths_and_timeouts(tmp_path: Path) -> None:
    (tmp_path / "repo").mkdir()
    path = _jsonl(tmp_path, "# a comment", "",
                  {"id": "a", "instruction": "fix it", "workspace": "repo", "setup": "true", "verify": "pytest -q",
                   "timeouts": {"agent": 30, "verify": 5}, "metadata": {"level": 1}},
                  {"id": 7, "instruction": "clone", "repo": "repo", "revision": "v1", "verify": "true",
                   "reward_file": "r.json", "verify_timeout_s": 9})  # fmt: skip
    a, b = load_tasks(path)
    assert (a.id, a.workspace, a.agent_timeout_s, a.verify_timeout_s, a.setup_timeout_s) == (
        "a",
        tmp_path / "repo",
        30.0,
        5.0,
        300.0,
    )
    assert a.metadata == {"level": 1} and a.source == f"{path}:3"
    assert (b.id, b.repo, b.revision, b.reward_file, b.workspace) == ("7", str(tmp_path / "repo"), "v1", "r.json", None)
    assert b.verify_timeout_s == 9.0  # Task's own field name works at the top level too
    assert [t.id for t in load_tasks(path, limit=1)] == ["a"]
    assert [t.id for t in load_tasks(tmp_path)] == ["a", "7"]  # a directory of *.jsonl


@pytest.mark.parametrize(("line", "message"), [
    ("{not json", ":2: not valid JSON"),
    ('["a"]', ":2: a task line must be a JSON object"),
    ('{"id": "b", "instruction": "x"}', ":2: missing 'verify'"),
    ('{"id": "b", "instruction": "x", "verify": "true", "wrokspace": "."}', ":2: unknown field(s) ['wrokspace']"),
    ('{"id": "b", "instruction": "x", "verify": "true", "workspace": "nowhere"}', "nowhere is not a directory"),
    ('{"id": "a", "instruction": "x", "verify": "true"}', ":2: task id 'a' already used at"),
    (
        '{"id": "b", "instruction": "x", "verify": "true", "timeouts": {"agent": -1}}',
        ":2: timeouts.agent must be a positive",
    ),
    ('{"id": "b", "instruction": "", "verify": "true"}', ":2: 'instruction' must be a non-empty string"),
    ('{"id": "b", "instruction": "x", "verify": "true", "agent_timeout_s": 5, "timeouts": {"agent": 5}}',
     ":2: agent_timeout_s given twice"),
])  # fmt: skip
def test_bad_jsonl_lines_name_file_and_line(tmp_path: Path, line: str, message: str) -> None:
    path = _jsonl(tmp_path, {"id": "a", "instruction": "x", "verify": "true"}, line)
    with pytest.raises(TaskFileError) as err:
        load_tasks(path)
    assert message in str(err.value) and str(path) in str(err.value)


def _harbor(root: Path, name: str = "fix-bug", toml: str | None = None) -> Path:
    task = root / name
    (task / "environment" / "src").mkdir(parents=True)
    (task / "tests").mkdir()
    (task / "task.toml").write_text(
        toml
        if toml is not None
        else (
            'version = "1.0"\n[metadata]\ndifficulty = "easy"\n[verifier]\ntimeout_sec = 45.0\n'
            'env = {TOKEN = "${POLAR_TEST_UNSET:-d}"}\n'
            "[agent]\ntimeout_sec = 120.0\n[environment]\ncpus = 2\nmemory_mb = 1024\nallow_internet = false\n"
        )
    )
    (task / "instruction.md").write_text("<!-- canary GUID 1234 -->\n\nFix the bug in calc.py.\n")
    (task / "environment" / "Dockerfile").write_text(
        "FROM python:3.11-slim\nWORKDIR /app\nCOPY src/ /app/\nCOPY extra.txt notes/\nRUN pip install pytest\n"
    )
    (task / "environment" / "src" / "calc.py").write_text("def add(a, b):\n    return a - b\n")
    (task / "environment" / "extra.txt").write_text("x")
    (task / "tests" / "test.sh").write_text("#!/bin/bash\necho 1 > /logs/verifier/reward.txt\n")
    return task


def test_harbor_task_directory(tmp_path: Path) -> None:
    task_dir = _harbor(tmp_path)
    [task] = load_tasks(task_dir)
    assert (task.id, task.format, task.instruction) == ("fix-bug", "harbor", "Fix the bug in calc.py.\n")
    assert (task.agent_timeout_s, task.verify_timeout_s, task.cpus, task.memory_mb, task.allow_internet) == (
        120.0,
        45.0,
        2.0,
        1024,
        False,
    )
    assert task.tests_dir == task_dir / "tests" and task.dockerfile == task_dir / "environment" / "Dockerfile"
    assert (
        task.workdir == "/app"
        and task.metadata == {"difficulty": "easy"}
        and "bash /tests/test.sh" in (task.verify or "")
    )
    assert resolve_env(dict(task.verify_env)) == {"TOKEN": "d"}
    copies = {rel: src.name for src, rel in image_free_copies(task)}
    assert copies == {".": "src", "notes/extra.txt": "extra.txt"}
    # A directory of Harbor tasks, by name; [task] name wins over the directory's.
    _harbor(tmp_path, "b-task", toml='[task]\nname = "org/b"\n')
    assert [t.id for t in load_tasks(tmp_path)] == ["org/b", "fix-bug"]


def test_bad_harbor_tasks_say_where(tmp_path: Path) -> None:
    task_dir = _harbor(tmp_path, toml="[agent]\ntimeout_sec = 1\n[verifier\n")
    with pytest.raises(TaskFileError, match=rf"{task_dir}/task.toml:3: invalid TOML"):
        load_tasks(task_dir)
    (task_dir / "task.toml").write_text('[agent]\ntimeout_sec = "soon"\n')
    with pytest.raises(TaskFileError, match=r"\[agent\] timeout_sec must be a positive number"):
        load_tasks(task_dir)
    (task_dir / "task.toml").write_text("")
    (task_dir / "tests" / "test.sh").unlink()
    with pytest.raises(TaskFileError, match="without tests/test.sh"):
        load_tasks(task_dir)
    with pytest.raises(TaskFileError, match="no tasks"):
        load_tasks(task_dir / "environment")


def test_task_set_hash_follows_the_files(tmp_path: Path) -> None:
    task_dir = _harbor(tmp_path)
    first = task_set_hash(load_tasks(task_dir))
    assert task_set_hash(load_tasks(task_dir)) == first
    (task_dir / "tests" / "test.sh").write_text("#!/bin/bash\necho 0 > /logs/verifier/reward.txt\n")
    assert task_set_hash(load_tasks(task_dir)) != first


def test_reward_files_read_as_harbor_reads_them() -> None:
    """For a task whose tests write reward.json (tests/security/test_verifier.py: one whose tests never do)."""
    assert harbor_rewards(None, "0.5\n", honour_json=True) == {"reward": 0.5}
    assert harbor_rewards('{"reward": 1, "style": 0.2, "note": "x"}', "0", honour_json=True) == {
        "reward": 1.0,
        "style": 0.2,
    }
    assert harbor_rewards('{"tests": 1.0, "lint": 0.0}', None, honour_json=True) == {
        "reward": 0.5,
        "tests": 1.0,
        "lint": 0.0,
    }
    assert harbor_rewards('{"tests": 1.0}', "0.25", honour_json=True) == {"reward": 0.25, "tests": 1.0}
    for bad in [(None, None), (None, ""), (None, "pass"), ("[1]", None), ('{"reward": NaN}', None)]:
        with pytest.raises(NoReward):
            harbor_rewards(*bad, honour_json=True)
    assert file_rewards("1\n", "r.txt") == {"reward": 1.0}
    assert file_rewards('{"reward": 0.3}', "r.json") == {"reward": 0.3}


def test_registries_name_what_exists() -> None:
    with pytest.raises(ValueError, match="unknown harness .no-such.; available: .*cmd:"):
        get_preset("no-such")
    with pytest.raises(ValueError, match="unknown runtime 'no-such'; available: .*local"):
        get_runtime("no-such")
    preset = get_preset("cmd:agent --task {instruction} --model {model}")
    ctx = SessionContext("s-1", "t/1", "t/1", 3, "tiny", "http://127.0.0.1:8080", "http://127.0.0.1:8081", "/ca.pem",
                         "/home/x", "/ws", "psk-s3cr3t/+")  # fmt: skip
    argv = preset.command("it's $(rm -rf /)", ctx)
    assert argv == ["sh", "-c", "agent --task 'it'\"'\"'s $(rm -rf /)' --model tiny"]
    env = preset.env(ctx)
    # The credential is the session's secret alone; the labels are information (the proxy has them registered).
    assert env["OPENAI_API_KEY"] == "polar:psk-s3cr3t/+"
    assert env["OPENAI_BASE_URL"] == "http://127.0.0.1:8081/v1" and env["SSL_CERT_FILE"] == "/ca.pem"
    assert env["HTTPS_PROXY"] == "http://polar:psk-s3cr3t%2F%2B@127.0.0.1:8080"
    assert (env["POLAR_SESSION"], env["POLAR_TASK"], env["POLAR_SAMPLE"]) == ("s-1", "t/1", "3")
    assert "psk-s3cr3t" not in repr(ctx)


def test_session_ids_are_valid_and_fixed_by_the_run_id() -> None:
    from polar_cli.rollout.tasks import Task

    tasks = [Task(id="org/task with spaces", instruction="x"), Task(id="b", instruction="y")]
    plan = session_ids(tasks, 3, "r7")
    assert [s for _, _, s in plan] == [s for _, _, s in session_ids(tasks, 3, "r7")]
    assert len({s for _, _, s in plan}) == 6 and all(SESSION_ID.fullmatch(s) for _, _, s in plan)
    assert [(t.id, n) for t, n, _ in plan][:3] == [
        ("org/task with spaces", 0),
        ("org/task with spaces", 1),
        ("org/task with spaces", 2),
    ]


def test_patch_round_trip_ignores_the_agents_git(tmp_path: Path) -> None:
    start = tmp_path / "start"
    start.mkdir()
    (start / "keep.py").write_text("a = 1\n")
    (start / "gone.txt").write_text("bye\n")
    (start / ".gitignore").write_text("*.log\n")

    async def go() -> bytes:
        agent = tmp_path / "agent"
        await ws.copy_template(start, agent)
        await ws.ensure_repo(agent)
        base = await ws.snapshot(agent, tmp_path / "base.git")
        (agent / "keep.py").write_text("a = 2\n")
        (agent / "gone.txt").unlink()
        (agent / "blob.bin").write_bytes(bytes(range(256)))
        (agent / "noise.log").write_text("ignored\n")
        shutil.rmtree(agent / ".git")  # the agent wrecks its repository: the patch does not care
        patch = await ws.diff(agent, tmp_path / "base.git", base)
        fresh = tmp_path / "fresh"
        await ws.copy_template(start, fresh)
        await ws.apply(fresh, tmp_path / "apply.git", patch)
        assert (fresh / "keep.py").read_text() == "a = 2\n" and not (fresh / "gone.txt").exists()
        assert (fresh / "blob.bin").read_bytes() == bytes(range(256)) and not (fresh / "noise.log").exists()
        assert await ws.diff(fresh, tmp_path / "base.git", base) == patch
        return patch

    assert b".git/" not in asyncio.run(go())


def _spec(tmp_path: Path, **fields: object) -> SandboxSpec:
    (tmp_path / "ws").mkdir(exist_ok=True)
    (tmp_path / "home").mkdir(exist_ok=True)
    endpoints = ProxyEndpoints(8080, 8081, tmp_path / "ca.pem")
    return SandboxSpec(
        name="s1", workspace=tmp_path / "ws", home=tmp_path / "home", proxy=endpoints, network="host", **fields
    )  # type: ignore[arg-type]


def test_local_runtime_env_limits_and_refusals(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("POLAR_CONTROL_TOKEN", "secret-token-never-inside")
    runtime = get_runtime("local")

    async def go() -> None:
        sandbox = await runtime.start(_spec(tmp_path, memory_mb=300))
        try:
            done = await sandbox.exec("env; pwd", env={"EXTRA": "1"})
            assert done.exit_code == 0 and "secret-token-never-inside" not in done.stdout
            assert f"HOME={tmp_path / 'home'}" in done.stdout and "EXTRA=1" in done.stdout
            assert done.stdout.rstrip().endswith(str(tmp_path / "ws"))
            # prlimit's address-space limit: 300 MB cannot hold a 600 MB buffer, 50 MB fits
            big = await sandbox.exec([sys.executable, "-c", "bytearray(600 * 2**20)"])
            small = await sandbox.exec([sys.executable, "-c", "bytearray(50 * 2**20)"])
            assert big.exit_code != 0 and "MemoryError" in big.stderr and small.exit_code == 0
        finally:
            await sandbox.stop()
        for spec, word in [
            (_spec(tmp_path, binds={"/tests": tmp_path}), "bwrap"),
            (SandboxSpec(**{**_spec(tmp_path).__dict__, "network": "proxy-only"}), "bwrap"),
        ]:
            with pytest.raises(RuntimeUnavailable, match=word):
                await runtime.start(spec)

    asyncio.run(go())


def test_local_runtime_timeout_and_cancel_kill_the_whole_group(tmp_path: Path) -> None:
    runtime = get_runtime("local")
    # The grandchild is found on the host by its argv: in the exec's own pid namespace, `$!` is not a host pid.
    seconds = f"300.{os.getpid()}{time.monotonic_ns() % 100000}"

    async def go() -> None:
        sandbox = await runtime.start(_spec(tmp_path))
        started = time.monotonic()
        job = asyncio.create_task(sandbox.exec(f"sh -c 'sleep {seconds} & wait'", timeout_s=3))
        deadline = time.monotonic() + 10
        while not _sleeping(seconds) and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        assert _sleeping(seconds), "the grandchild never started"  # the probe below can fire
        done = await job
        assert done.timed_out and done.exit_code == -1 and time.monotonic() - started < 12
        await asyncio.sleep(0.2)
        assert not _sleeping(seconds), "the grandchild outlived the timeout"
        job = asyncio.create_task(sandbox.exec("sleep 300"))
        await asyncio.sleep(0.5)
        await sandbox.cancel()
        cancelled = await asyncio.wait_for(job, 10)
        assert cancelled.cancelled and cancelled.exit_code == -1
        await sandbox.stop()

    asyncio.run(go())


def _sleeping(seconds: str) -> list[int]:
    """Host pids of live ``sleep SECONDS`` processes."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            if (entry / "cmdline").read_bytes() == f"sleep\0{seconds}\0".encode() and _alive(int(entry.name)):
                found.append(int(entry.name))
        except OSError:
            continue
    return found


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    stat = Path(f"/proc/{pid}/stat").read_text().split()
    return stat[2] != "Z"
