"""Issue 29: the oci runtime's process handling, with the engine CLI faked by a shell script that records its argv:
one engine call (output, stdin, timeout, cancel, the disk bound, a cancelled caller), the kill of the container's
processes, cancel, stop (the container removed, the helpers, the setid bits, the scratch dir), the runner's own
engine calls, and the proxy-only namespace holder (bwrap or nsenter, its environment, a holder that fails). The
fake never runs what it is asked to run inside: no container, no real podman, no `kill -1`."""

from __future__ import annotations

import asyncio
import os
import stat
import time
from collections.abc import Awaitable, Iterator
from pathlib import Path
from typing import TypeVar

import pytest

from polar_cli.rollout.runtimes import oci
from polar_cli.rollout.runtimes.base import ProxyEndpoints, RuntimeUnavailable, SandboxSpec
from polar_cli.rollout.runtimes.oci import OciRuntime, OciSandbox

# The engine: records each call (a file per call, named by its start time; its args separated by \037), then for
# the container kill (`exec CTR /bin/sh -c KILL_ALL`) runs $FAKE_KILL, for anything else $FAKE_DO. Both print on
# stdout and stderr so that a call meant to be silent shows if its output is not discarded.
ENGINE = r"""#!/bin/sh
call="$FAKE_LOG/$(date +%s%N).$$"
{ for a in "$@"; do printf '%s\037' "$a"; done; } > "$call.part" && mv "$call.part" "$call"
if [ "$1" = exec ] && [ "$3" = /bin/sh ] && [ "$4" = -c ] && [ "$5" = "$FAKE_KILL_ALL" ]; then
  eval "$FAKE_KILL"
  echo kill-out; echo kill-err >&2; exit 0
fi
eval "$FAKE_DO"
"""
# The holder's tool (bwrap or nsenter): records its argv, its POLAR_BRIDGE, one inherited variable and what its stdin
# held, then does
# $FAKE_HOLDER (prints a pid, or not).
HOLDER = r"""#!/bin/sh
IFS= read -r stdin || true
{ for a in "$@"; do printf '%s\037' "$a"; done
  printf '\036%s\036%s\036%s\036' "$POLAR_BRIDGE" "$FAKE_MARK" "$stdin"; } > "$FAKE_HOLDER_LOG"
eval "$FAKE_HOLDER"
"""


def _script(path: Path, text: str) -> Path:
    path.write_text(text)
    path.chmod(0o755)
    return path


@pytest.fixture(autouse=True)
def leaky_stdin() -> Iterator[None]:
    """fd 0 of the test holds "LEAK": a child given the runner's own stdin instead of none would read it."""
    read, write = os.pipe()
    os.write(write, b"LEAK\n")
    os.close(write)
    saved = os.dup(0)
    os.dup2(read, 0)
    os.close(read)
    try:
        yield
    finally:
        os.dup2(saved, 0)
        os.close(saved)


class Fake:
    """The faked engine binary and what it was asked."""

    def __init__(self, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
        self.binary = _script(tmp_path / "podman", ENGINE)
        self.log = tmp_path / "engine-calls"
        self.log.mkdir()
        monkeypatch.setenv("FAKE_LOG", str(self.log))
        monkeypatch.setenv("FAKE_KILL_ALL", oci.KILL_ALL)
        monkeypatch.setenv("FAKE_KILL", "")
        monkeypatch.setenv("FAKE_DO", "")
        self.monkeypatch = monkeypatch
        self.ties: list[str] = []
        self.cancelled: list[str] = []
        monkeypatch.setattr(oci.lifeline, "tie", lambda pid: self.ties.append(f"+{pid}"))
        monkeypatch.setattr(oci.lifeline, "untie", lambda pid: self.ties.append(f"-{pid}"))
        monkeypatch.setattr(oci.lifeline, "cancel", lambda key: self.cancelled.append(key))

    def do(self, script: str) -> None:
        self.monkeypatch.setenv("FAKE_DO", script)

    def calls(self) -> list[list[str]]:
        # A call killed before it was recorded leaves only a .part file (or nothing).
        done = sorted((p for p in self.log.iterdir() if p.suffix != ".part"), key=lambda p: int(p.name.split(".")[0]))
        return [p.read_text().split("\037")[:-1] for p in done]

    def kills(self) -> list[list[str]]:
        return [call for call in self.calls() if call[-1:] == [oci.KILL_ALL]]


@pytest.fixture
def fake(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Fake:
    return Fake(tmp_path, monkeypatch)


def _spec(tmp_path: Path, **fields: object) -> SandboxSpec:
    ca = tmp_path / "ca.pem"
    ca.write_text("cert")
    base: dict = dict(
        name="sess-1",
        workspace=tmp_path / "ws",
        home=tmp_path / "home",
        proxy=ProxyEndpoints(forward_port=8080, reverse_port=8081, ca=ca),
        image="img:1",
        network="host",
        pids=None,
    )
    spec = SandboxSpec(**{**base, **fields})
    spec.home.mkdir(exist_ok=True)
    return spec


def _runtime(monkeypatch: pytest.MonkeyPatch, binary: Path, **options: object) -> OciRuntime:
    monkeypatch.setattr(oci.os, "geteuid", lambda: 1000)  # rootless: no uid map to reason about
    return OciRuntime(binary=str(binary), oci_runtime="", **options)  # type: ignore[arg-type]


def _sandbox(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, fake: Fake, **options: object) -> OciSandbox:
    scratch = tmp_path / "scratch"
    scratch.mkdir()
    runtime = _runtime(monkeypatch, fake.binary, **options)
    return OciSandbox(runtime, _spec(tmp_path), "ctr", scratch, [])


T = TypeVar("T")


def _run(call: Awaitable[T]) -> T:
    """``_run(call)``, the loop kept a moment after it so that it sees its killed processes' pipes close (no
    subprocess transport left to a closed loop, whose collection later warns in another test)."""

    async def settled() -> T:
        try:
            return await call
        finally:
            await asyncio.sleep(0.03)

    return asyncio.run(settled())


KILL = ["exec", "ctr", "/bin/sh", "-c", oci.KILL_ALL]


# --- one engine call -------------------------------------------------------------------------------------------


def test_an_engine_call_passes_its_args_and_stdin_and_returns_its_streams_and_exit(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, fake: Fake
) -> None:
    sandbox = _sandbox(tmp_path, monkeypatch, fake)
    fake.do("cat; printf 'err\\377' >&2; exit 7")
    # (Bounded in time: an engine whose stdin is left open would wait on it for ever.)
    result = _run(sandbox._cli("exec", "ctr", "a b", stdin=b"in\n", timeout_s=5))
    assert result == (7, b"in\n", b"err\xff", False, False, None)
    assert fake.calls() == [["exec", "ctr", "a b"]]
    # No stdin: the engine reads an end at once (never the runner's own stdin, nor a pipe left open).
    fake.do("cat")
    assert _run(sandbox._cli("ps", timeout_s=5)) == (0, b"", b"", False, False, None)
    assert len(fake.ties) == 4 and [t[0] for t in fake.ties] == ["+", "-", "+", "-"]
    assert fake.ties[0][1:] == fake.ties[1][1:] and fake.ties[2][1:] == fake.ties[3][1:]
    assert sandbox.running == set() and fake.kills() == []


def test_the_engine_runs_in_its_own_session_and_is_tied_to_polars_life(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, fake: Fake
) -> None:
    sandbox = _sandbox(tmp_path, monkeypatch, fake)
    fake.do("ps -o pgid= -p $$ | tr -d ' '; echo $$")
    code, out, *_ = _run(sandbox._cli("x"))
    pgid, pid = out.decode().split()
    assert code == 0 and pgid == pid  # its own process group: kill_group reaches it and its children
    assert fake.ties == [f"+{pid}", f"-{pid}"]


def test_what_the_agent_prints_is_bounded_and_the_runners_calls_are_whole(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, fake: Fake
) -> None:
    sandbox = _sandbox(tmp_path, monkeypatch, fake)
    size = 3 * 2**20
    fake.do(f"head -c {size} /dev/zero; head -c {size} /dev/zero >&2")
    code, out, err, *_ = _run(sandbox._cli("cp", "ctr:/x", "-"))
    assert (code, len(out), len(err)) == (0, size, size)
    code, out, err, *_ = _run(sandbox._cli("exec", bounded=True))
    assert code == 0 and len(out) < size and len(err) < size
    assert b"bytes of output dropped here" in out and b"bytes of output dropped here" in err


def test_a_timeout_kills_the_engine_call_and_the_containers_processes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, fake: Fake
) -> None:
    sandbox = _sandbox(tmp_path, monkeypatch, fake)
    fake.do("echo started; sleep 8; echo never")
    began = time.monotonic()
    code, out, err, timed_out, cancelled, over = _run(sandbox._cli("exec", "ctr", "x", timeout_s=0.5))
    assert time.monotonic() - began < 5
    assert (code, out, err, timed_out, cancelled, over) == (-9, b"started\n", b"", True, False, None)
    assert fake.calls() == [["exec", "ctr", "x"], KILL] and sandbox.running == set()


def test_a_cancel_before_the_engine_started_stops_it_at_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, fake: Fake
) -> None:
    sandbox = _sandbox(tmp_path, monkeypatch, fake)
    fake.do("sleep 8")
    sandbox.cancels = 2
    began = time.monotonic()
    code, out, err, timed_out, cancelled, over = _run(sandbox._cli("exec", "ctr", "x", since=1))
    assert time.monotonic() - began < 5
    assert (code, timed_out, cancelled, over) == (-9, False, True, None)
    assert fake.kills() == [KILL]
    # Begun at the current count: nothing to stop.
    fake.do("true")
    assert _run(sandbox._cli("exec", "ctr", "y", since=2))[:5] == (0, b"", b"", False, False)
    assert _run(sandbox._cli("exec", "ctr", "z"))[4] is False
    assert len(fake.kills()) == 1


def test_a_cancelled_caller_takes_the_engine_call_and_the_containers_processes_down(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, fake: Fake
) -> None:
    sandbox = _sandbox(tmp_path, monkeypatch, fake)
    fake.do("sleep 8")

    async def scenario() -> asyncio.subprocess.Process:
        call = asyncio.ensure_future(sandbox._cli("exec", "ctr", "x"))
        while not sandbox.running:
            await asyncio.sleep(0.01)
        (proc,) = sandbox.running
        call.cancel()
        with pytest.raises(asyncio.CancelledError):
            await call
        await asyncio.wait_for(proc.wait(), 5)
        return proc

    proc = _run(scenario())
    assert proc.returncode == -9 and sandbox.running == set()
    assert fake.kills() == [KILL] and fake.ties == [f"+{proc.pid}", f"-{proc.pid}"]


def test_the_disk_bound_kills_an_agents_call_and_says_so(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, fake: Fake
) -> None:
    sandbox = _sandbox(tmp_path, monkeypatch, fake, disk_mb=1)
    (sandbox.spec.home / "big").write_bytes(b"x" * (2 * 2**20))
    fake.do("sleep 8")
    began = time.monotonic()
    code, out, err, timed_out, cancelled, over = _run(sandbox._cli("exec", "ctr", "x", bounded=True))
    assert time.monotonic() - began < 5
    line = "\npolar: disk limit 1 MiB exceeded (the workspace, HOME and the sandbox's other directories held 2 MiB)\n"
    assert (code, out, err, timed_out, cancelled, over) == (-9, b"", line.encode(), False, False, line)
    assert fake.kills() == [KILL]  # the container's processes too, not only the engine's client
    # The runner's own calls (a download of the same directories) are not watched.
    fake.do("true")
    assert _run(sandbox._cli("cp", "ctr:/x", "-")) == (0, b"", b"", False, False, None)


def test_the_disk_bound_counts_files_too(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, fake: Fake) -> None:
    sandbox = _sandbox(tmp_path, monkeypatch, fake, disk_files=2)
    for name in "abc":
        (sandbox.spec.home / name).write_text("")
    fake.do("sleep 8")
    *_, over = _run(sandbox._cli("exec", "ctr", "x", bounded=True))
    assert over is not None and "held more than 2 files" in over


def test_the_disk_watch_ends_with_its_call(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, fake: Fake) -> None:
    sandbox = _sandbox(tmp_path, monkeypatch, fake, disk_mb=1)

    async def scenario() -> tuple:
        result = await sandbox._cli("exec", "ctr", "x", bounded=True)
        # Written after the call: no exec is running, nothing may be killed for it.
        (sandbox.spec.home / "big").write_bytes(b"x" * (2 * 2**20))
        await asyncio.sleep(0.6)
        return result

    assert _run(scenario()) == (0, b"", b"", False, False, None)
    assert fake.kills() == []


# --- the container's processes: kill, cancel, stop -------------------------------------------------------------


def test_kill_inside_asks_the_engine_to_kill_all_but_pid_1_and_waits_for_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, fake: Fake, capfd: pytest.CaptureFixture[str]
) -> None:
    sandbox = _sandbox(tmp_path, monkeypatch, fake)
    monkeypatch.setenv("FAKE_KILL", f"sleep 0.2; touch {tmp_path / 'done'}")
    _run(sandbox._kill_inside())
    assert (tmp_path / "done").exists()  # returned once the engine's exec had finished
    assert fake.calls() == [KILL]
    assert capfd.readouterr() == ("", "")  # its output discarded


def test_cancel_kills_the_running_call_and_sweeps_the_container_twice(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, fake: Fake
) -> None:
    sandbox = _sandbox(tmp_path, monkeypatch, fake)
    _run(sandbox.cancel())
    assert sandbox.cancels == 1 and fake.calls() == []  # nothing running: no engine call
    fake.do("sleep 8")

    async def scenario() -> tuple:
        call = asyncio.ensure_future(sandbox._cli("exec", "ctr", "x"))
        while not (sandbox.running and fake.calls()):  # the engine runs, and _cli holds it
            await asyncio.sleep(0.01)
        await sandbox.cancel()
        return await asyncio.wait_for(call, 5)

    code, _, _, timed_out, cancelled, _ = _run(scenario())
    assert (code, timed_out, cancelled, sandbox.cancels) == (-9, False, True, 2)
    # Once before the kill, once after: a killed exec client may have started its process inside in between.
    assert fake.calls() == [["exec", "ctr", "x"], KILL, KILL]


@pytest.mark.parametrize(("engine", "remove"), [("podman", ["rm", "-f", "-t", "0"]), ("docker", ["rm", "-f"])])
def test_stop_removes_the_container_its_helpers_setid_bits_and_scratch(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    fake: Fake,
    capfd: pytest.CaptureFixture[str],
    engine: str,
    remove: list[str],
) -> None:
    sandbox = _sandbox(tmp_path, monkeypatch, fake, engine=engine, trust_root=True)
    sandbox.lifeline_key = "k1"
    fake.do("echo rm-out; echo rm-err >&2")
    (sandbox.scratch / "env-x").write_text("")
    setuid = sandbox.spec.home / "tool"
    setuid.write_text("")
    setuid.chmod(0o6755)

    async def scenario() -> list[asyncio.subprocess.Process]:
        running = await asyncio.create_subprocess_exec("sleep", "30", start_new_session=True)
        helper = await asyncio.create_subprocess_exec("sleep", "30", start_new_session=True)
        sandbox.running.add(running)
        sandbox.helpers.append(helper)
        await sandbox.stop()
        await asyncio.wait_for(running.wait(), 5)
        await sandbox.stop()  # a second stop does nothing
        return [running, helper]

    running, helper = _run(scenario())
    assert sandbox.stopped and (running.returncode, helper.returncode) == (-9, -9)
    assert fake.calls() == [[*remove, "ctr"]]
    assert fake.cancelled == ["k1"] and f"-{helper.pid}" in fake.ties
    assert stat.S_IMODE(setuid.stat().st_mode) == 0o755
    assert not sandbox.scratch.exists()
    assert capfd.readouterr() == ("", "")


def test_stop_after_the_scratch_dir_is_gone_still_removes_the_container(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, fake: Fake
) -> None:
    sandbox = _sandbox(tmp_path, monkeypatch, fake)
    sandbox.scratch.rmdir()  # e.g. a tmp cleaner: nothing left to clean is no failure
    _run(sandbox.stop())
    assert sandbox.stopped and fake.calls() == [["rm", "-f", "-t", "0", "ctr"]]


def test_stop_without_a_lifeline_key_cancels_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, fake: Fake
) -> None:
    sandbox = _sandbox(tmp_path, monkeypatch, fake)
    monkeypatch.setenv("FAKE_DO", f"sleep 0.2; touch {tmp_path / 'removed'}")
    _run(sandbox.stop())
    assert (tmp_path / "removed").exists()  # stop waited for the removal
    assert fake.cancelled == [] and not sandbox.scratch.exists()


# --- the runner's own engine calls ------------------------------------------------------------------------------


def test_a_runner_call_merges_stderr_into_its_output_in_the_directory_asked(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, fake: Fake
) -> None:
    runtime = _runtime(monkeypatch, fake.binary)
    fake.do("printf 'out\\377\\n'; echo err >&2; pwd; cat; exit 3")
    (tmp_path / "cwd").mkdir()
    assert _run(runtime._run("image", "inspect", cwd=tmp_path / "cwd")) == (
        3,
        f"out\ufffd\nerr\n{tmp_path / 'cwd'}\n",
    )
    assert fake.calls() == [["image", "inspect"]]
    fake.do("pwd")
    assert _run(runtime._run("info")) == (0, f"{os.getcwd()}\n")


# --- the proxy-only namespace holder ----------------------------------------------------------------------------


class Holder:
    def __init__(self, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, fake: Fake) -> None:
        self.bwrap = _script(tmp_path / "bwrap", HOLDER)
        self.nsenter = _script(tmp_path / "nsenter", HOLDER)
        self.log = tmp_path / "holder.log"
        self.tools: dict[str, str | None] = {"nsenter": str(self.nsenter), "socat": "/usr/bin/socat"}
        monkeypatch.setattr(oci, "find_bwrap", lambda: self.found_bwrap)
        monkeypatch.setattr(oci.shutil, "which", lambda name: self.tools.get(name))
        monkeypatch.setenv("FAKE_HOLDER_LOG", str(self.log))
        monkeypatch.setenv("FAKE_MARK", "inherited")
        monkeypatch.setenv("FAKE_HOLDER", "echo 4242; exec sleep 8")
        self.found_bwrap: str | None = str(self.bwrap)
        self.runtime = _runtime(monkeypatch, fake.binary)
        self.spec = _spec(tmp_path, network="proxy-only")
        self.fake = fake

    def asked(self) -> tuple[list[str], str, str]:
        argv, bridge, mark, stdin, _ = self.log.read_text().split("\036")
        assert stdin == ""  # none: never the runner's own
        return argv.split("\037")[:-1], bridge, mark

    def start(self, join: str | None = None) -> tuple[int, int, int, int | None]:
        """The holder's (pid, process group, pid it printed, exit code after being killed)."""

        async def scenario() -> tuple[int, int, int, int | None]:
            try:
                holder, printed = await self.runtime._network_holder(self.spec, Path("/s/sockets"), join=join)
            except RuntimeUnavailable:
                await asyncio.sleep(0.1)  # the killed holder's exit seen while the loop runs (no warning at exit)
                raise
            group = os.getpgid(holder.pid)
            oci.kill_group(holder)
            await holder.wait()
            return holder.pid, group, printed, holder.returncode

        return _run(scenario())


TAIL = ["--", "/bin/sh", "-c", oci.BRIDGE_SCRIPT, "bridge", "/bin/sh", "-c", "echo $$; exec sleep infinity"]
BWRAP = ["--bind", "/", "/", "--dev-bind", "/dev", "/dev", "--unshare-net", "--die-with-parent", *TAIL]


def test_a_fresh_namespace_holder_is_a_bwrap_with_the_bridges_ports(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, fake: Fake
) -> None:
    holder = Holder(tmp_path, monkeypatch, fake)
    pid, group, printed, _ = holder.start()
    assert (group, printed) == (pid, 4242)  # its own session: stopped with its group
    assert fake.ties == [f"+{pid}"]  # untied by stop_processes with the other helpers
    argv, bridge, mark = holder.asked()
    assert argv == ["--unshare-user", *BWRAP]  # not root: bwrap makes its own user namespace
    assert bridge == "8080=/s/sockets/forward.sock 8081=/s/sockets/reverse.sock"
    assert mark == "inherited"  # the runner's environment, plus POLAR_BRIDGE
    monkeypatch.setattr(oci.os, "geteuid", lambda: 0)
    holder.start()
    assert holder.asked()[0] == BWRAP


def test_the_holder_of_a_containers_own_namespace_enters_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, fake: Fake
) -> None:
    holder = Holder(tmp_path, monkeypatch, fake)
    holder.found_bwrap = None  # not needed to join
    pid, group, printed, _ = holder.start(join="/proc/77/ns/net")
    assert (group, printed) == (pid, 4242)
    assert holder.asked() == (
        ["--net=/proc/77/ns/net", *TAIL],
        "8080=/s/sockets/forward.sock 8081=/s/sockets/reverse.sock",
        "inherited",
    )


@pytest.mark.parametrize(
    ("join", "missing", "message"),
    [
        (None, "bwrap", "oci runtime: proxy-only needs bwrap and socat on the host (`make sandbox`)"),
        (None, "socat", "oci runtime: proxy-only needs bwrap and socat on the host (`make sandbox`)"),
        ("/proc/1/ns/net", "nsenter", "oci runtime: proxy-only needs nsenter and socat on the host (`make sandbox`)"),
        ("/proc/1/ns/net", "socat", "oci runtime: proxy-only needs nsenter and socat on the host (`make sandbox`)"),
    ],
)
def test_a_holder_without_its_tools_is_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, fake: Fake, join: str | None, missing: str, message: str
) -> None:
    holder = Holder(tmp_path, monkeypatch, fake)
    if missing == "bwrap":
        holder.found_bwrap = None
    else:
        holder.tools[missing] = None
    with pytest.raises(RuntimeUnavailable) as refused:
        holder.start(join=join)
    assert str(refused.value) == message and not holder.log.exists()


def test_a_holder_that_prints_no_pid_is_killed_and_its_error_told(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, fake: Fake
) -> None:
    holder = Holder(tmp_path, monkeypatch, fake)
    monkeypatch.setenv("FAKE_HOLDER", "printf 'bwrap: no netns \\377\\n' >&2; echo oops; exec sleep 8")
    began = time.monotonic()
    with pytest.raises(RuntimeUnavailable) as failed:
        holder.start()
    assert time.monotonic() - began < 5  # killed: its stderr ends
    assert str(failed.value) == "oci runtime: the proxy-only network namespace did not start: bwrap: no netns \ufffd\n"


def test_a_holder_that_never_answers_is_given_up_after_15_s(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, fake: Fake
) -> None:
    holder = Holder(tmp_path, monkeypatch, fake)
    monkeypatch.setenv("FAKE_HOLDER", "echo 'stuck' >&2; exec sleep 8")
    waited: list[float] = []
    wait_for = asyncio.wait_for

    async def shortened(awaitable: object, timeout: float) -> object:
        waited.append(timeout)
        return await wait_for(awaitable, 0.3)  # type: ignore[arg-type]

    monkeypatch.setattr(oci.asyncio, "wait_for", shortened)
    with pytest.raises(RuntimeUnavailable) as failed:
        holder.start()
    assert waited == [15]
    assert str(failed.value) == "oci runtime: the proxy-only network namespace did not start: stuck\n"
