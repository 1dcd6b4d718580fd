"""The isolated sandbox runtimes, bwrap (bubblewrap) and oci (podman, on an image built from the host's binaries):
real sandboxes, real socat bridges, a real mitmdump with the scripted engine, no mocks.

Every isolation claim is checked twice: the probe fails in the isolated sandbox AND succeeds where the isolation is
deliberately absent (network=host, or the secret bound in), so a probe that could never succeed proves nothing.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import subprocess
import threading
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import orjson
import pytest

from polar_cli.mitm import REPO, Proxy, free_port, mitmdump_command, wait_for_port
from polar_cli.rollout.runtimes import bwrap, oci
from polar_cli.rollout.runtimes.base import ProxyEndpoints, RuntimeUnavailable, SandboxSpec
from tests.support.oci_image import build_test_image
from tests.support.shards import session_records

ANSWER = "Sandboxed hello."


@contextmanager
def two_listener_proxy(engine: str, root: Path) -> Iterator[tuple[Proxy, int]]:
    """mitmdump with the addon, a forward listener and a reverse one (to api.openai.com), as `polar rollout` runs it."""
    fwd, rev = free_port(), free_port()
    out, confdir, log = root / "store", root / "mitmproxy-conf", root / "mitmdump.log"
    confdir.mkdir(parents=True, exist_ok=True)
    cmd = mitmdump_command(
        engine,
        out,
        port=None,
        confdir=confdir,
        modes=[f"regular@{fwd}", f"reverse:https://api.openai.com@{rev}"],
        options={"polar_shard_seconds": "0.2", "polar_block_other": "true"},
    )
    with open(log, "wb") as fh:
        process = subprocess.Popen(cmd, stdout=fh, stderr=subprocess.STDOUT, cwd=REPO, start_new_session=True)
    try:
        wait_for_port(fwd, 120, process, log)
        wait_for_port(rev, 120, process, log)
        yield Proxy(fwd, confdir, out, log, process), rev
    finally:
        os.killpg(process.pid, signal.SIGINT)
        try:
            process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()


@pytest.fixture(scope="module")
def proxy(tiny_model_dir, tmp_path_factory):
    root = tmp_path_factory.mktemp("sandbox-proxy")
    script = root / "script.json"
    script.write_bytes(orjson.dumps({"model_dir": str(tiny_model_dir), "cycle": True, "turns": [{"content": ANSWER}]}))
    with two_listener_proxy(f"scripted:{script}", root) as (p, rev):
        # The token exists once the addon has loaded (the first model call would create it otherwise).
        deadline = time.monotonic() + 30
        while not (p.out / ".control-token").exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        yield p, rev


@pytest.fixture(scope="module")
def oci_image() -> str:
    return build_test_image()


@pytest.fixture(params=["bwrap", "oci"])
def make_runtime(request):
    """A factory of the runtime under test (each test's event loop gets its own instance)."""
    if request.param == "bwrap":
        return bwrap.make
    image = request.getfixturevalue("oci_image")
    return lambda: oci.make(image=image)


@pytest.fixture(scope="module")
def host_listener() -> Iterator[int]:
    """Another service on the host (all interfaces): what a proxy-only sandbox must not reach."""
    server = socket.socket()
    server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    server.bind(("0.0.0.0", 0))
    server.listen(16)

    def serve() -> None:
        while True:
            try:
                conn, _ = server.accept()
            except OSError:
                return
            conn.sendall(b"host-secret-service\n")
            conn.close()

    threading.Thread(target=serve, daemon=True).start()
    yield server.getsockname()[1]
    server.close()


def host_ip() -> str | None:
    """The host's non-loopback address (a route out exists from it), if it has one."""
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect(("192.0.2.123", 9))  # no packet is sent: this only picks the source address of the route
            ip = s.getsockname()[0]
    except OSError:
        return None
    return None if ip.startswith("127.") else ip


def spec_for(tmp: Path, name: str, proxy_ends: ProxyEndpoints, **kw) -> SandboxSpec:
    return SandboxSpec(name=name, workspace=tmp / name / "ws", home=tmp / name / "home", proxy=proxy_ends, **kw)


def endpoints(tmp: Path) -> ProxyEndpoints:
    ca = tmp / "ca.pem"
    ca.write_text("not a real CA\n")
    return ProxyEndpoints(free_port(), free_port(), ca)


def run(coro):
    return asyncio.run(coro)


def test_runs_as_unprivileged_user_and_cannot_write_the_host(tmp_path):
    marker = f"polar-sandbox-{uuid.uuid4().hex}"

    async def main():
        box = await bwrap.make().start(spec_for(tmp_path, "a", endpoints(tmp_path), network="none"))
        try:
            result = await box.exec(
                f"id -u; cat /etc/shadow; ls /etc/ssh; touch /usr/{marker}; touch /etc/{marker}; "
                "mount -o remount,rw /usr; "
                f"echo ok > {box.workspace}/w; echo h > $HOME/h; echo t > /tmp/t; "
                f"cat {box.ca_path}"
            )
        finally:
            await box.stop()
        return box, result

    box, result = run(main())
    assert result.stdout.splitlines()[0] == "1000"
    # /etc/shadow is root's 0640 file: not in the sandbox's /etc (an allowlist), and its uid is not root's anyway.
    assert Path("/etc/shadow").stat().st_size > 0 and "root:" not in result.stdout
    assert "Read-only file system" in result.stderr
    assert not Path(f"/usr/{marker}").exists() and not Path(f"/etc/{marker}").exists()
    assert "not a real CA" in result.stdout  # the CA is readable inside
    # The workspace and HOME are the host directories; /tmp is the sandbox's own and goes with it.
    assert (tmp_path / "a" / "ws" / "w").read_text() == "ok\n"
    assert (tmp_path / "a" / "home" / "h").read_text() == "h\n"
    assert not box.scratch.exists()
    assert box.host_workspace == tmp_path / "a" / "ws"


def test_sessions_share_state_across_exec_but_not_across_sandboxes(make_runtime, tmp_path):
    async def main():
        rt = make_runtime()
        ends = endpoints(tmp_path)
        a = await rt.start(spec_for(tmp_path, "a", ends, network="none"))
        b = await rt.start(spec_for(tmp_path, "b", ends, network="none"))
        try:
            await a.exec("echo secret-a > /workspace/mine; echo tmp-a > /tmp/mine")
            again = await a.exec("cat /workspace/mine /tmp/mine")
            a_host_ws = str(tmp_path / "a" / "ws")
            probe = await b.exec(f"cat /workspace/mine; cat /tmp/mine; ls {a_host_ws}; ls {tmp_path}; ls /work")
            own = await a.exec(f"ls {a_host_ws}")
        finally:
            await a.stop()
            await b.stop()
        return again, probe, own

    again, probe, own = run(main())
    assert again.stdout == "secret-a\ntmp-a\n"
    assert "secret-a" not in probe.stdout and "tmp-a" not in probe.stdout
    assert probe.stderr.count("No such file or directory") == 5, probe.stderr
    # Host paths do not exist inside at all, not even the sandbox's own workspace's.
    assert own.exit_code != 0


def test_cannot_read_the_control_token_nor_the_store(make_runtime, proxy, tmp_path):
    p, rev = proxy
    token = p.out / ".control-token"
    assert token.exists() and p.out.is_dir()
    probe = f"cat {token}; ls {p.out}; ls {p.confdir}"

    async def main(read_only):
        ends = ProxyEndpoints(p.port, rev, p.ca)
        box = await make_runtime().start(spec_for(tmp_path, f"s{len(read_only)}", ends, read_only=read_only))
        try:
            return await box.exec(probe)
        finally:
            await box.stop()

    denied = run(main(()))
    assert denied.exit_code != 0 and p.control_token not in denied.stdout
    assert denied.stderr.count("No such file or directory") == 3
    # The same probe with the store deliberately mounted does list it: the probe can detect a leak. The token is
    # root's 0600 file: readable where the sandbox's uid is polar's own (polar not root), not where polar runs as
    # root (bwrap's uid and oci's mapped uids are then unprivileged host ones).
    leaked = run(main((p.out,)))
    assert "_journal" in leaked.stdout
    if os.geteuid() == 0:
        assert p.control_token not in leaked.stdout and "Permission denied" in leaked.stderr
    else:
        assert p.control_token in leaked.stdout


def test_proxy_only_reaches_the_proxy_and_nothing_else(make_runtime, proxy, host_listener, tmp_path):
    p, rev = proxy
    ip = host_ip()
    chat = json.dumps({"model": "m", "messages": [{"role": "user", "content": "hi"}]})
    session = f"sbx-{uuid.uuid4().hex[:8]}"

    async def main(network: str):
        ends = ProxyEndpoints(p.port, rev, p.ca)
        box = await make_runtime().start(spec_for(tmp_path, network, ends, network=network))
        curl = "curl -sS --max-time 20 -H 'content-type: application/json' -H 'authorization: Bearer k'"
        try:
            forward = await box.exec(
                f"{curl} --proxy http://{session}@127.0.0.1:{p.port} --cacert {box.ca_path} "
                f"https://api.openai.com/v1/chat/completions -d '{chat}'",
                timeout_s=60,
            )
            reverse = await box.exec(f"{curl} {box.reverse_url}/v1/chat/completions -d '{chat}'", timeout_s=60)
            loopback = await box.exec(
                f"curl -sS --max-time 3 telnet://127.0.0.1:{host_listener} </dev/null", timeout_s=30
            )
            lan = await box.exec(f"curl -sS --max-time 3 telnet://{ip}:{host_listener} </dev/null", timeout_s=30)
            # Through the proxy itself: polar_block_other (which a proxy serving sandboxes must set) refuses the rest.
            via_proxy = await box.exec(
                f"curl -sS --max-time 5 --proxy {box.proxy_url} http://127.0.0.1:{host_listener}/ -w ' %{{http_code}}'",
                timeout_s=30,
            )
            dns = await box.exec("getent hosts api.openai.com example.com", timeout_s=30)
            routes = await box.exec("tail -n +3 /proc/net/dev; echo ROUTES; tail -n +2 /proc/net/route", timeout_s=30)
        finally:
            await box.stop()
        return forward, reverse, loopback, lan, dns, routes, via_proxy

    forward, reverse, loopback, lan, dns, routes, via_proxy = run(main("proxy-only"))
    assert json.loads(forward.stdout)["choices"][0]["message"]["content"] == ANSWER, forward
    assert json.loads(reverse.stdout)["choices"][0]["message"]["content"] == ANSWER, reverse
    assert "host-secret-service" not in loopback.stdout and loopback.exit_code != 0
    assert "host-secret-service" not in lan.stdout and lan.exit_code != 0
    assert dns.exit_code != 0 and not dns.stdout
    assert via_proxy.stdout.endswith(" 403") and "host-secret-service" not in via_proxy.stdout, via_proxy
    links, table = routes.stdout.split("ROUTES\n")
    assert [line.split(":")[0].strip() for line in links.splitlines()] == ["lo"]
    assert table.strip() == ""
    # The forward call is stored under the session the sandbox named.
    assert len(session_records(p.out, session, at_least=1)) == 1

    # The same probes with the host's network do reach the other service: the negative checks are not vacuous.
    _, _, loopback, lan, _, routes, _ = run(main("host"))
    assert "host-secret-service" in loopback.stdout
    if ip:
        assert "host-secret-service" in lan.stdout
    assert routes.stdout.split("ROUTES\n")[1].strip()


def test_exec_timeout_and_cancel_kill_the_whole_process_tree(make_runtime, tmp_path):
    def alive(tag: str) -> int:
        """How many ``sleep TAG`` processes exist on the host (the tree's three, not bwrap's own command line)."""
        count = 0
        for proc in Path("/proc").iterdir():
            try:
                count += proc.name.isdigit() and (proc / "cmdline").read_bytes() == f"sleep\0{tag}\0".encode()
            except OSError:
                pass
        return count

    # A daemonised grandchild in its own session, and a child ignoring SIGTERM: neither may survive.
    def tree(tag: str) -> str:
        return (
            f"setsid sh -c 'sleep {tag}' </dev/null >/dev/null 2>&1 & sh -c 'trap \"\" TERM; sleep {tag}' & sleep {tag}"
        )

    async def main():
        box = await make_runtime().start(spec_for(tmp_path, "t", endpoints(tmp_path), network="none"))
        try:
            tag1 = f"{900 + (uuid.uuid4().int % 1000) / 1000:.3f}"
            started = time.monotonic()
            timed = await box.exec(tree(tag1), timeout_s=1.5)
            elapsed = time.monotonic() - started
            await asyncio.sleep(0.3)
            after_timeout = alive(tag1)

            tag2 = f"{800 + (uuid.uuid4().int % 1000) / 1000:.3f}"
            task = asyncio.create_task(box.exec(tree(tag2), timeout_s=60))
            deadline = time.monotonic() + 10
            while alive(tag2) < 3 and time.monotonic() < deadline:
                await asyncio.sleep(0.05)
            before_cancel = alive(tag2)
            await box.cancel()
            cancelled = await task
            await asyncio.sleep(0.3)
            after_cancel = alive(tag2)
            # A cancel while an exec is still starting (its process not spawned yet) stops it too.
            started = time.monotonic()
            early = asyncio.create_task(box.exec("sleep 30", timeout_s=60))
            await asyncio.sleep(0)
            await box.cancel()
            early = await early
            assert early.cancelled and time.monotonic() - started < 10
            still_usable = await box.exec("echo fine")
        finally:
            await box.stop()
        return timed, elapsed, after_timeout, before_cancel, cancelled, after_cancel, still_usable

    timed, elapsed, after_timeout, before_cancel, cancelled, after_cancel, still_usable = run(main())
    assert timed.timed_out and timed.exit_code == -1 and elapsed < 10
    assert not after_timeout
    assert before_cancel == 3  # the probe sees the whole tree while it runs
    assert cancelled.cancelled and cancelled.exit_code == -1
    assert not after_cancel
    assert still_usable.stdout == "fine\n"


def test_upload_download_binds_and_environment(make_runtime, tmp_path):
    src = tmp_path / "src"
    (src / "pkg").mkdir(parents=True)
    (src / "pkg" / "a.py").write_text("print('a')\n")
    (src / "top.txt").write_text("top\n")
    tests_dir, logs_dir = tmp_path / "tests", tmp_path / "logs"
    tests_dir.mkdir()
    (tests_dir / "test.sh").write_text("echo 0.75 > /logs/verifier/reward.txt\n")
    outside = tmp_path / "outside-secret"
    outside.write_text("host secret\n")

    async def main():
        box = await make_runtime().start(
            spec_for(
                tmp_path,
                "u",
                endpoints(tmp_path),
                network="none",
                env={"FROM_SPEC": "spec"},
                binds={"/tests": tests_dir, "/logs/verifier": logs_dir},
                read_only=(REPO / ".harness",),
            )
        )
        try:
            await box.upload(src, "/tmp/in/src")
            await box.upload(src / "top.txt", "/workspace/top.txt")
            listing = await box.exec(
                "find /tmp/in -type f | sort; cat /workspace/top.txt; sh /tests/test.sh; "
                "echo $FROM_SPEC $FROM_EXEC $PWD; ls " + str(REPO / ".harness"),
                env={"FROM_EXEC": "exec"},
                cwd="/tmp",
            )
            # An agent plants links pointing out of the sandbox; downloading must not follow them on the host.
            await box.exec(
                f"mkdir -p /workspace/out && echo mine > /workspace/out/f && "
                f"ln -s {outside} /workspace/out/abs && ln -s ../../../../outside-secret /workspace/out/rel"
            )
            await box.download("/workspace/out", tmp_path / "got")
            await box.download("/tmp/in/src/pkg/a.py", tmp_path / "a.py")
            with pytest.raises(FileNotFoundError):
                await box.download("/workspace/missing", tmp_path / "missing")
        finally:
            await box.stop()
        return listing

    listing = run(main())
    assert listing.stdout.splitlines()[:4] == ["/tmp/in/src/pkg/a.py", "/tmp/in/src/top.txt", "top", "spec exec /tmp"]
    assert "node_modules" in listing.stdout  # a read-only path (the harness CLIs) is visible at its own path
    assert (logs_dir / "reward.txt").read_text() == "0.75\n"
    assert (tmp_path / "a.py").read_text() == "print('a')\n"
    assert (tmp_path / "got" / "f").read_text() == "mine\n"
    for link in ("abs", "rel"):
        assert not (tmp_path / "got" / link).exists() and not (tmp_path / "got" / link).is_symlink()


def test_harness_cli_runs_inside(tmp_path):
    """node and an installed harness CLI run inside (its install bound read-only, HOME writable)."""
    harness = REPO / ".harness"

    async def main():
        box = await bwrap.make().start(
            spec_for(tmp_path, "h", endpoints(tmp_path), network="none", read_only=(harness,))
        )
        try:
            return await box.exec([str(harness / "node_modules" / ".bin" / "codex"), "--version"], timeout_s=60)
        finally:
            await box.stop()

    result = run(main())
    assert result.exit_code == 0 and "codex" in result.stdout.lower(), result


def test_oci_limits_host_untouched_and_dockerfile_built_once(oci_image, tmp_path):
    marker = f"polar-oci-{uuid.uuid4().hex}"
    context = tmp_path / "environment"
    context.mkdir()
    (context / "Dockerfile").write_text(f"FROM {oci_image}\nRUN echo {marker} > /built\nWORKDIR /app\n")

    async def main():
        rt = oci.make()
        spec = spec_for(
            tmp_path,
            "l",
            endpoints(tmp_path),
            network="none",
            dockerfile=context / "Dockerfile",
            workdir="/app",
            cpus=0.5,
            memory_mb=256,
            pids=64,
        )
        box = await rt.start(spec)
        assert box.host_workspace is None  # an empty workspace: the image's own /app, brought out by download
        try:
            probe = await box.exec(
                f"cat /built; touch /usr/{marker}; "
                "cat /sys/fs/cgroup/memory/memory.limit_in_bytes /sys/fs/cgroup/pids/pids.max "
                "/sys/fs/cgroup/cpu/cpu.cfs_quota_us /sys/fs/cgroup/cpu/cpu.cfs_period_us; pwd"
            )
        finally:
            await box.stop()
        started = time.monotonic()
        again = await rt.start(
            spec_for(tmp_path, "l2", endpoints(tmp_path), network="none", dockerfile=context / "Dockerfile")
        )
        second_start = time.monotonic() - started
        await again.stop()
        gone = subprocess.run(["podman", "container", "exists", box.container]).returncode
        for tag in rt.built:  # each run builds a new image (the marker): do not pile them up
            subprocess.run(["podman", "rmi", "-f", tag], capture_output=True)
        return probe, second_start, gone

    probe, second_start, gone = run(main())
    built, memory, pids, quota, period, cwd = probe.stdout.split()
    assert built == marker
    assert not Path(f"/usr/{marker}").exists()  # the container's /usr is the image's, not the host's
    assert int(memory) == 256 * 2**20 and int(pids) == 64 and int(quota) / int(period) == 0.5
    assert cwd == "/app"
    assert second_start < 5  # the image was built once (a build with RUN takes longer)
    assert gone != 0  # stop removed the container


def test_oci_task_image_is_rebuilt_when_its_base_changes(oci_image, tmp_path):
    """An offline user re-loads the base a Dockerfile names (same name, new image): the task's image is rebuilt on
    it, not taken from the cache built on the old one; and the build does not try to pull the local base."""
    base = f"localhost/polar-base-probe:{uuid.uuid4().hex[:12]}"
    context = tmp_path / "environment"
    context.mkdir()
    (context / "Dockerfile").write_text(f"FROM --platform=linux/amd64 {base}\nWORKDIR /app\n")
    newer = tmp_path / "newer"
    newer.mkdir()
    (newer / "Dockerfile").write_text(f"FROM {oci_image}\nRUN echo newer > /base-version\n")
    tags: list[str] = []

    async def main() -> str:
        rt = oci.make()
        spec = spec_for(tmp_path, "b", endpoints(tmp_path), network="none", dockerfile=context / "Dockerfile")
        subprocess.run(["podman", "tag", oci_image, base], check=True)
        tags.append(await rt.image_for(spec))
        subprocess.run(
            ["podman", "build", *rt._engine_flags(), "-t", base, str(newer)], check=True, capture_output=True
        )
        tags.append(await oci.make().image_for(spec))
        box = await rt.start(spec)
        try:
            return (await box.exec("cat /base-version")).stdout
        finally:
            await box.stop()

    try:
        seen = run(main())
    finally:
        subprocess.run(["podman", "rmi", "-f", *tags, base], capture_output=True)
    assert tags[0] != tags[1] and seen == "newer\n"
    assert oci.from_images("FROM a AS x\nRUN true\nfrom --platform=p b\nFROM x\n") == ["a", "b", "x"]


def test_bwrap_limits_hold_for_the_sandbox(tmp_path):
    # 60 background sleeps against a pids limit of 30; a 200 MiB buffer (tail holds a line without newline)
    # against 64 MiB. The same commands without limits succeed, so the failures are the limits'.
    forks = "i=0; while [ $i -lt 60 ]; do sleep 2 & i=$((i+1)); done; echo forked; kill $(jobs -p) 2>/dev/null"
    memory = "head -c 200000000 /dev/zero | tail > /dev/null; echo survived $?"

    async def main(limited: bool):
        box = await bwrap.make().start(
            spec_for(
                tmp_path,
                f"lim{limited}",
                endpoints(tmp_path),
                network="none",
                pids=30 if limited else None,
                memory_mb=64 if limited else None,
                cpus=0.5 if limited else None,
            )
        )
        try:
            assert (box.cgroup is not None) == limited
            return await box.exec(forks, timeout_s=60), await box.exec(memory, timeout_s=60)
        finally:
            await box.stop()

    (fork, mem) = run(main(True))
    assert "forked" not in fork.stdout and "Cannot fork" in fork.stderr, fork
    assert mem.stdout == "survived 137\n", mem  # the OOM killer's SIGKILL
    (fork, mem) = run(main(False))
    assert "forked" in fork.stdout and not fork.stderr, fork
    assert "survived 0" in mem.stdout, mem


@pytest.mark.harness
def test_codex_tool_loop_inside_bwrap_proxy_only(tiny_model_dir, tmp_path):
    """A real harness CLI (Codex, node) in a proxy-only bwrap sandbox: two model calls through the reverse
    listener and the tool call it runs inside; the calls are stored under the session."""
    script = tmp_path / "codex-script.json"
    script.write_bytes(orjson.dumps({"model_dir": str(tiny_model_dir), "cycle": True, "turns": [
        {"content": None, "tool_calls": [{"type": "function", "function": {
            "name": "exec_command", "arguments": {"cmd": "echo polar-was-here > proof.txt; cat /proc/net/route"}}}]},
        {"content": "Done."},
    ]}))  # fmt: skip
    harness = REPO / ".harness"
    with two_listener_proxy(f"scripted:{script}", tmp_path) as (p, rev):

        async def main():
            spec = spec_for(tmp_path, "codex", ProxyEndpoints(p.port, rev, p.ca), read_only=(harness,))
            box = await bwrap.make().start(spec)
            try:
                (spec.home / ".codex").mkdir()
                (spec.home / ".codex" / "config.toml").write_text(
                    'model = "tiny"\nmodel_provider = "polar"\n\n[model_providers.polar]\nname = "polar"\n'
                    f'base_url = "{box.reverse_url}/v1"\nenv_key = "POLAR_API_KEY"\nwire_api = "responses"\n'
                    "supports_websockets = false\nrequest_max_retries = 0\nstream_max_retries = 0\n"
                )
                env = {
                    "CODEX_HOME": f"{box.home}/.codex",
                    "POLAR_API_KEY": "polar:session=codex-bwrap",
                    "RUST_LOG": "warn",
                }
                return await box.exec(
                    [
                        str(harness / "node_modules" / ".bin" / "codex"),
                        "exec",
                        "--skip-git-repo-check",
                        "--dangerously-bypass-approvals-and-sandbox",
                        "Write proof.txt.",
                    ],
                    env=env,
                    timeout_s=240,
                )
            finally:
                await box.stop()

        result = run(main())
        assert result.exit_code == 0, result.stdout + result.stderr
        records = session_records(p.out, "codex-bwrap", at_least=2)
    assert "Done." in result.stdout, result.stdout + result.stderr
    tool_output = records[1].messages[-1]["content"]
    # The tool ran inside: the route table it printed is empty (the host's has eth0 and a default route).
    assert "Iface" in tool_output and "eth" not in tool_output and "00000000\t" not in tool_output, tool_output
    assert (tmp_path / "codex" / "ws" / "proof.txt").read_text() == "polar-was-here\n"
    assert [r.status for r in records] == ["ok", "ok"]


def test_a_missing_mount_is_an_infrastructure_error(make_runtime, tmp_path):
    async def main():
        with pytest.raises(RuntimeUnavailable, match="do not exist: /nonexistent/harness"):
            await make_runtime().start(
                spec_for(tmp_path, "m", endpoints(tmp_path), network="none", read_only=(Path("/nonexistent/harness"),))
            )

    run(main())
