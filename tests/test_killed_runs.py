"""A `polar loop` killed by SIGKILL leaves nothing running that can still write data: its mitmdump and harnesses
(each in its own process session, for Ctrl-C handling) die with it through polar_cli.lifeline, and the rerun redoes
the iteration in the same directory with a valid store holding each session once. Real processes throughout: the
loop CLI, mitmdump + addon on the local engine (tiny model), the openai-SDK agent of the rollout tests."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from polar_addon.store import read_sessions, validate_store
from polar_cli.rollout.proxy import WriterAlive, claim_writer, wait_writer_gone
from tests.conftest import free_port

REPO = Path(__file__).resolve().parent.parent
AGENT = REPO / "tests" / "support" / "rollout_agent.py"


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state not in ("Z", "X")  # a zombie cannot write; init reaps it


def _group(pgid: int) -> list[int]:
    """The live processes of process group ``pgid``."""
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        if int(fields[2]) == pgid and fields[0] not in ("Z", "X"):
            found.append(int(stat.parent.name))
    return found


def _mentioning(text: str) -> list[int]:
    found = []
    for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
        try:
            if text.encode() in cmdline.read_bytes() and _alive(int(cmdline.parent.name)):
                found.append(int(cmdline.parent.name))
        except (OSError, ValueError):
            pass
    return found


def _wait(condition, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"after {timeout:g} s: {what}")
        time.sleep(0.05)


def test_a_sigkilled_loop_takes_its_proxy_and_harnesses_down_and_the_rerun_is_clean(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    flag = tmp_path / "hang"
    flag.touch()
    marker = f"killed-loop-{os.getpid()}-{time.monotonic_ns()}"  # in each agent's command line
    tasks = tmp_path / "tasks.jsonl"
    task = {"id": "t", "instruction": f"MODE=hang-if FLAG={flag} {marker}", "verify": "true"}
    tasks.write_text(json.dumps(task) + "\n")
    out = tmp_path / "loop"
    # local: the agent reads the flag, a host path no sandbox shows it.
    cmd = [sys.executable, "-m", "polar_cli.app", "loop", str(tasks), "--harness", f"cmd:{sys.executable} {AGENT} "
           "{instruction}", "--model", str(tiny_model_dir), "--iterations", "1", "--out", str(out), "--samples", "2",
           "--no-progress", "--eot-token-id", "2", "--set", "polar_shard_seconds=0.2",
           "--runtime", "local", "--trust-agent"]  # fmt: skip
    killed = subprocess.Popen(
        cmd, cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True
    )
    children: list[int] = []
    try:
        # Both harnesses made their call (its record is in the store) and now hang: mid-rollout.
        shards = out / "iter-000" / "shards"

        def both_called() -> bool:
            assert killed.poll() is None, "the loop ended before it could be killed"
            return (
                shards.is_dir()
                and len(_mentioning(marker)) >= 2
                and len([s for s in read_sessions(str(shards)) if s.session_id.startswith("it000")]) == 2
            )

        _wait(both_called, 120, "the two harnesses never made their first call")
        proxies = _mentioning(f"polar_out={shards}")
        harnesses = _mentioning(marker)
        children = proxies + harnesses
        assert len(proxies) == 1 and len(harnesses) >= 2
        with pytest.raises(WriterAlive, match=f"pid {proxies[0]}"):  # the proxy holds its directory's fence
            wait_writer_gone(out / "iter-000" / "logs", timeout_s=0.1)
        os.kill(killed.pid, signal.SIGKILL)
        killed.wait()
        # The proxy and every harness process die with the loop, by PID (not merely by name).
        _wait(
            lambda: not [p for p in children if _alive(p)],
            5,
            f"outlived the SIGKILLed loop: {[p for p in children if _alive(p)]} of proxy {proxies}",
        )
        assert _mentioning(marker) == [] and _mentioning(str(out)) == []
    finally:
        if killed.poll() is None:
            killed.kill()
        for pid in children + _mentioning(marker) + _mentioning(str(out)):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass

    flag.unlink()  # the rerun's agents answer and end
    done = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    state = json.loads((out / "loop.json").read_text())
    assert [r["iteration"] for r in state["iterations"]] == [0] and state["iterations"][0]["sessions"] == 2
    assert validate_store(str(shards)) == []
    sessions = [s.session_id for s in read_sessions(str(shards))]
    assert sorted(sessions) == sorted(set(sessions)) and len(sessions) == 2
    assert all(s.status != "running" for s in read_sessions(str(shards)))


def test_the_fence_refuses_a_directory_a_live_proxy_still_writes(tmp_path: Path) -> None:
    """The redo of an interrupted iteration waits for the old proxy (anything holding its inherited lock) to go,
    and refuses the directory while it lives."""
    logs = tmp_path / "logs"
    fd, path = claim_writer(logs)
    holder = subprocess.Popen(["sleep", "60"], pass_fds=(fd,))  # a writer that outlived its run
    os.pwrite(fd, f"{holder.pid}\n".encode(), 0)
    os.close(fd)
    try:
        with pytest.raises(WriterAlive, match=f"pid {holder.pid}"):
            wait_writer_gone(logs, timeout_s=0.3)
    finally:
        holder.kill()
        holder.wait()
    wait_writer_gone(logs, timeout_s=5)  # gone: the lock is free at once
    assert path.is_file()


def test_a_child_tied_from_a_thread_that_ended_dies_with_the_process(tmp_path: Path) -> None:
    """PR_SET_PDEATHSIG fires when the forking *thread* ends (asyncio.to_thread starts vLLM from a worker thread):
    the lifeline is tied to the process, so a group spawned from a finished thread lives while the process lives and
    dies (whole group) when it is SIGKILLed."""
    script = tmp_path / "spawner.py"
    script.write_text(
        "import subprocess, sys, threading, time\n"
        "from polar_cli import lifeline\n"
        "def spawn():\n"
        "    p = subprocess.Popen(['sh', '-c', 'sleep 600 & echo $!; exec sleep 600'], stdout=subprocess.PIPE,\n"
        "                         start_new_session=True, text=True)\n"
        "    lifeline.tie(p.pid)\n"
        "    print(p.pid, p.stdout.readline().strip(), flush=True)\n"
        "t = threading.Thread(target=spawn); t.start(); t.join()\n"
        "time.sleep(600)\n"
    )
    parent = subprocess.Popen(
        [sys.executable, str(script)],
        cwd=REPO,
        stdout=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONPATH": str(REPO)},
        start_new_session=True,
    )
    pids: list[int] = []
    try:
        assert parent.stdout is not None
        pids = [int(p) for p in parent.stdout.readline().split()]
        assert len(pids) == 2 and all(_alive(p) for p in pids)  # the thread ended: still running
        parent.kill()
        parent.wait()
        _wait(lambda: not [p for p in pids if _alive(p)], 5, f"outlived their SIGKILLed parent: {pids}")
    finally:
        parent.kill()
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


@pytest.mark.vllm
def test_a_sigkilled_async_loop_takes_down_the_vllm_it_is_still_starting(tiny_model_dir: Path, tmp_path: Path) -> None:
    """`polar loop --async --engine vllm` starts vLLM from a worker thread (asyncio.to_thread) and waits for it to
    load; SIGKILLed then, the server (its whole process group) dies with it instead of waiting for the next run."""
    if not (REPO / ".venv-vllm" / "bin" / "python").exists():
        from tests.support.prereq import missing

        missing("vLLM CPU venv missing (.venv-vllm); run `make engine`")
    tasks = tmp_path / "tasks.jsonl"
    tasks.write_text(json.dumps({"id": "t", "instruction": "say hi", "verify": "true"}) + "\n")
    out = tmp_path / "loop"
    cmd = [
        sys.executable,
        "-m",
        "polar_cli.app",
        "loop",
        str(tasks),
        "--harness",
        f"cmd:{sys.executable} {AGENT} {{instruction}}",
        "--model",
        str(tiny_model_dir),
        "--iterations",
        "2",
        "--out",
        str(out),
        "--samples",
        "2",
        "--no-progress",
        "--async",
        "--engine",
        "vllm",
        "--vllm-arg=--enforce-eager",
        "--eot-token-id",
        "2",
    ]
    killed = subprocess.Popen(
        cmd, cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True
    )
    server = 0
    try:

        def started() -> bool:
            nonlocal server
            assert killed.poll() is None, "the loop ended before it could be killed"
            for state in (out / ".engines").glob("engine-*.json"):
                server = json.loads(state.read_text()).get("pid", 0)
            return bool(server) and _alive(server)

        _wait(started, 60, "the loop started no vLLM")
        log = next((out / ".engines").glob("engine-*.log"))
        assert "Application startup complete" not in log.read_text(errors="replace")  # still starting
        os.kill(killed.pid, signal.SIGKILL)
        killed.wait()
        _wait(lambda: not _group(server), 10, f"vLLM's group {server} outlived the SIGKILLed loop: {_group(server)}")
    finally:
        if killed.poll() is None:
            killed.kill()
        if server:
            try:
                os.killpg(server, signal.SIGKILL)
            except ProcessLookupError:
                pass


def test_a_sigkilled_rollout_leaves_no_container(tmp_path: Path) -> None:
    """An oci sandbox's container lives under podman's conmon, outside every process group of polar: the lifeline
    removes it (podman rm -f) when the process that started it is SIGKILLed."""
    import shutil

    if not shutil.which("podman"):
        from tests.support.prereq import missing

        missing("podman missing (`make sandbox`)")
    from tests.support.oci_image import build_test_image

    image = build_test_image()
    (tmp_path / "ca.pem").write_text("not a real CA\n")
    script = tmp_path / "starter.py"
    script.write_text(
        "import asyncio, sys, time\n"
        "from pathlib import Path\n"
        "from polar_cli.rollout.runtimes import oci\n"
        "from polar_cli.rollout.runtimes.base import ProxyEndpoints, SandboxSpec\n"
        "tmp = Path(sys.argv[1])\n"
        "spec = SandboxSpec(name='killed', workspace=tmp / 'ws', home=tmp / 'home', network='none',\n"
        "                   proxy=ProxyEndpoints(1, 2, tmp / 'ca.pem'))\n"
        "box = asyncio.run(oci.make(image=sys.argv[2]).start(spec))\n"
        "print(box.container, flush=True)\n"
        "time.sleep(600)\n"
    )
    starter = subprocess.Popen(
        [sys.executable, str(script), str(tmp_path), image],
        cwd=REPO,
        stdout=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONPATH": str(REPO)},
        start_new_session=True,
    )
    container = ""
    try:
        assert starter.stdout is not None
        container = starter.stdout.readline().strip()
        assert container and _container_exists(container), starter.communicate(timeout=5)
        starter.kill()
        starter.wait()
        _wait(lambda: not _container_exists(container), 30, f"container {container} outlived its SIGKILLed starter")
    finally:
        starter.kill()
        if container:
            subprocess.run(["podman", "rm", "-f", "-t", "0", container], capture_output=True)


def _container_exists(name: str) -> bool:
    return subprocess.run(["podman", "container", "exists", name], capture_output=True).returncode == 0


def test_polar_proxy_started_with_sigint_blocked_still_stops_on_sigint(tiny_model_dir: Path, tmp_path: Path) -> None:
    """A blocked signal survives exec, and Ray blocks SIGINT in the processes it starts (an xdist worker that had run
    Ray code once left every later `polar proxy` deaf to Ctrl-C: 120 s, then SIGKILL). Every polar command unblocks
    SIGINT/SIGTERM first, so a Ctrl-C stops `polar proxy` and its mitmdump gracefully."""
    script = tmp_path / "script.json"
    script.write_text(json.dumps({"model_dir": str(tiny_model_dir), "cycle": True, "turns": [{"content": "hi"}]}))
    out = tmp_path / "shards"
    proxy = subprocess.Popen(
        [sys.executable, "-m", "polar_cli.app", "proxy", "--engine", f"scripted:{script}", "--out", str(out),
         "--port", str(free_port()), "--reverse-port", str(free_port()), "--confdir", str(tmp_path / "conf")],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=tmp_path,
        env={**os.environ, "PYTHONPATH": str(REPO)},
        preexec_fn=lambda: signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT, signal.SIGTERM}),
    )  # fmt: skip
    try:
        assert proxy.stdout is not None
        for line in proxy.stdout:  # printed once both listeners are up
            if "Point each harness at it" in line:
                break
        mitmdumps = [pid for pid in _mentioning(str(out)) if pid != proxy.pid]
        assert mitmdumps
        proxy.send_signal(signal.SIGINT)
        assert proxy.wait(timeout=30) == 0
        _wait(lambda: not any(_alive(pid) for pid in mitmdumps), 10, "mitmdump to stop")
    finally:
        if proxy.poll() is None:
            proxy.kill()
            proxy.wait()
