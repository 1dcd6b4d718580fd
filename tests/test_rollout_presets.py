"""Harness presets (``polar_cli.rollout.harnesses``) drive the real CLIs through a swe_mini bug fix.

For each of Claude Code, Codex, Qwen Code, Pi and Gemini CLI, ``polar rollout --runtime bwrap --network
proxy-only`` runs the real CLI (``.harness``) on a swe_mini task against one shared mitmdump (forward and
reverse listeners) whose scripted engine replays that harness's own fix (``examples/swe_mini/scripts/HARNESS.json``:
its own tool names and argument shapes; the tiny random model would never call a tool). The harness must exit 0,
the runner's verifier must give 1.0, and every call must be stored under the session, task, group and sample.

The swe_mini tasks themselves are checked in both formats: each JSONL verifier and each Harbor ``tests/test.sh``
(run in bubblewrap with ``/app``, ``/tests`` and ``/logs/verifier`` where Harbor puts them) gives 0 on the
bug and 1 after ``solution/solve.sh``.
"""

from __future__ import annotations

import importlib
import json
import re
import shutil
import subprocess
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from polar_addon.store.validate import validate_store
from polar_cli.mitm import REPO
from polar_cli.rollout.harnesses.base import SessionContext
from tests.support.atif import check_atif_export
from tests.support.prereq import missing
from tests.support.proxy import SharedProxy, shared_proxy
from tests.support.shards import session_records

SWE_MINI = REPO / "examples" / "swe_mini"
SCRIPTS = SWE_MINI / "scripts"
HARNESSES = ["claude-code", "codex", "qwen-code", "pi", "gemini-cli"]
SYSTEM_PYTHON = "/usr/bin/python3"  # what a sandbox has; the verifiers use nothing else
WINDOW, MAX_OUTPUT = 131072, 4096


def jsonl_tasks() -> dict[str, dict]:
    lines = (SWE_MINI / "tasks.jsonl").read_text().splitlines()
    return {task["id"]: task for task in map(json.loads, lines)}


def model_name(harness: str) -> str:
    return f"swe-{harness}"


def script(harness: str) -> dict:
    return json.loads((SCRIPTS / f"{harness}.json").read_text())


# Registered sessions, fixed sampling and non-model traffic refused, as `polar rollout --proxy` requires of a running
# proxy.
PROXY_OPTIONS = {"polar_sessions": "registered", "polar_block_other": "true", "polar_sampling": "fixed"}


# flow_detail=1: every flow the proxy sees is in its log, so anything but what polar answers shows
# (assert_only_polar_flows).
# termlog_verbosity=info: polar's line for each CONNECT it refuses (mitmproxy logs no flow for those).
LOG_EVERY_FLOW = {"termlog_verbosity": "info", "flow_detail": "1"}


@contextmanager
def preset_proxy(
    model_dir: Path, base: Path, scripts: dict[str, dict], options: dict[str, str] | None = None
) -> Iterator[SharedProxy]:
    """One mitmdump for several harnesses: its scripted engine picks each harness's turns by model name
    (``scripts``: model name -> the harness's script); it logs every flow."""
    # The scripts name files under {workspace}: the session's workspace as the harness sees it (bwrap: /workspace).
    by_model = {
        name: json.loads(json.dumps(s["turns"]).replace("{workspace}", "/workspace")) for name, s in scripts.items()
    }
    (base / "script.json").write_text(json.dumps({"model_dir": str(model_dir), "cycle": False, "by_model": by_model}))
    options = {**PROXY_OPTIONS, **LOG_EVERY_FLOW, **(options or {})}
    with shared_proxy(base / "script.json", base / "shards", options, quiet=False) as started:
        yield started


@pytest.fixture(scope="module")
def proxy(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[SharedProxy]:
    """One mitmdump for all five harnesses."""
    scripts = {model_name(h): script(h) for h in HARNESSES}
    with preset_proxy(tiny_model_dir, tmp_path_factory.mktemp("presets-proxy"), scripts) as started:
        yield started


def verify(task: dict, workspace: Path) -> float:
    command = task["verify"].replace("python3", SYSTEM_PYTHON, 1)
    result = subprocess.run(command, shell=True, cwd=workspace, capture_output=True, text=True, timeout=60)
    return 1.0 if result.returncode == 0 else 0.0


@pytest.mark.parametrize("harness", HARNESSES)
def test_preset_writes_the_window(harness: str, tmp_path: Path) -> None:
    """Each preset puts the served window and output cap where its CLI reads them (see the README's table)."""
    preset = importlib.import_module(f"polar_cli.rollout.harnesses.{harness.replace('-', '_')}").make(None)
    ctx = SessionContext(
        session_id="s",
        task_id="t",
        group_id="g",
        sample=0,
        model="m",
        proxy_url="http://127.0.0.1:1",
        reverse_url="http://127.0.0.1:2",
        ca_path="/ca.pem",
        home=str(tmp_path),
        workspace="/workspace",
        secret="psk-test",
        context_window=WINDOW,
        max_output_tokens=MAX_OUTPUT,
    )
    preset.configure(tmp_path, ctx)
    env = preset.env(ctx)
    if harness == "claude-code":
        assert (
            env["CLAUDE_CODE_MAX_CONTEXT_TOKENS"],
            env["CLAUDE_CODE_AUTO_COMPACT_WINDOW"],
            env["CLAUDE_CODE_MAX_OUTPUT_TOKENS"],
        ) == (str(WINDOW), str(WINDOW), str(MAX_OUTPUT))
    elif harness == "codex":
        import tomllib

        config = tomllib.loads((tmp_path / ".codex" / "config.toml").read_text())
        assert (config["model_context_window"], config["model_auto_compact_token_limit"]) == (WINDOW, int(WINDOW * 0.8))
        assert config["model"] == "m" and env["HTTPS_PROXY"] == "http://polar:psk-test@127.0.0.1:1"
    elif harness == "qwen-code":
        settings = json.loads((tmp_path / ".qwen" / "settings.json").read_text())
        assert settings["model"]["generationConfig"]["contextWindowSize"] == WINDOW
        assert env["QWEN_CODE_MAX_OUTPUT_TOKENS"] == str(MAX_OUTPUT)
    elif harness == "pi":
        (provider,) = json.loads((tmp_path / ".pi" / "agent" / "models.json").read_text())["providers"].values()
        assert provider["models"] == [{"id": "m", "contextWindow": WINDOW, "maxTokens": MAX_OUTPUT}]
    else:
        settings = json.loads((tmp_path / ".gemini" / "settings.json").read_text())
        assert settings["model"]["compressionThreshold"] * 1_048_576 == pytest.approx(0.5 * WINDOW)
        (override,) = settings["modelConfigs"]["overrides"]
        assert override["modelConfig"]["generateContentConfig"]["maxOutputTokens"] == MAX_OUTPUT
    # No window given: no window setting written (the CLI keeps its own defaults).
    bare = SessionContext(**{**ctx.__dict__, "context_window": None, "max_output_tokens": None})
    home = tmp_path / "bare"
    home.mkdir()
    preset.configure(home, bare)
    written = " ".join(p.read_text() for p in home.rglob("*") if p.is_file()) + json.dumps(preset.env(bare))
    assert str(WINDOW) not in written and str(MAX_OUTPUT) not in written


def test_claude_code_caps_its_output_so_it_can_compact_below_the_window() -> None:
    """Claude Code compacts proactively only with an auto-compact window set, past ``window - min(output cap,
    20000) - 13000``: with its own 32k default cap a 32k window leaves a negative threshold, so with a window and
    no cap given the preset caps answers at an eighth."""
    from polar_cli.rollout.harnesses.claude_code import ClaudeCode

    ctx = SessionContext(
        session_id="s",
        task_id="t",
        group_id="g",
        sample=0,
        model="m",
        proxy_url="http://127.0.0.1:1",
        reverse_url="http://127.0.0.1:2",
        ca_path="/ca.pem",
        home="/h",
        workspace="/w",
        secret="psk-test",
        context_window=32_768,
    )
    env = ClaudeCode().env(ctx)
    assert (
        env["CLAUDE_CODE_MAX_CONTEXT_TOKENS"],
        env["CLAUDE_CODE_AUTO_COMPACT_WINDOW"],
        env["CLAUDE_CODE_MAX_OUTPUT_TOKENS"],
    ) == ("32768", "32768", "4096")


# --- the task set in both formats ---------------------------------------------------------------------------


def bwrap_harbor(task_dir: Path, app: Path, logs: Path, script_path: str) -> subprocess.CompletedProcess:
    """Run a Harbor script with /app, /tests and /logs/verifier where Harbor puts them (no network)."""
    cmd = [
        "bwrap",
        "--unshare-user",
        "--uid",
        "1000",
        "--unshare-net",
        "--die-with-parent",
        "--ro-bind",
        "/usr",
        "/usr",
        "--symlink",
        "usr/bin",
        "/bin",
        "--symlink",
        "usr/lib",
        "/lib",
        "--symlink",
        "usr/lib64",
        "/lib64",
        "--ro-bind",
        "/etc",
        "/etc",
        "--proc",
        "/proc",
        "--dev",
        "/dev",
        "--tmpfs",
        "/tmp",
        "--bind",
        str(app),
        "/app",
        "--ro-bind",
        str(task_dir / "tests"),
        "/tests",
        "--ro-bind",
        str(task_dir / "solution"),
        "/solution",
        "--bind",
        str(logs),
        "/logs/verifier",
        "--chdir",
        "/app",
        "bash",
        script_path,
    ]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=60)


@pytest.mark.parametrize("task_id", sorted(jsonl_tasks()))
def test_swe_mini_task_in_both_formats(task_id: str, tmp_path: Path) -> None:
    if shutil.which("bwrap") is None:
        missing("bubblewrap missing (make sandbox)")
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


def rollout_through(
    proxy: SharedProxy, tasks: Path, harness: str, runtime: str, seed: int, report: Path
) -> tuple[dict, str]:
    """`polar rollout` of one sample of ``tasks`` through the shared proxy in a proxy-only ``runtime`` sandbox;
    returns the session's summary (asserted completed with reward 1.0) and the tail of its logs."""
    from polar_addon.control import token_file

    token = token_file(str(proxy.out), str(proxy.ca.parent)).read_text().strip()
    cmd = [
        str(REPO / ".venv" / "bin" / "polar"),
        "rollout",
        str(tasks),
        "--harness",
        harness,
        "--samples",
        "1",
        "--proxy",
        f"http://127.0.0.1:{proxy.forward}",
        "--reverse-url",
        f"http://127.0.0.1:{proxy.reverse}",
        "--control-token",
        token,
        "--confdir",
        str(proxy.ca.parent),
        "--out",
        str(proxy.out),
        "--runtime",
        runtime,
        "--network",
        "proxy-only",
        "--model",
        model_name(harness),
        "--seed",
        str(seed),
        "--no-progress",
        "--report-dir",
        str(report),
    ]
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=REPO)
    logs = (
        "\n".join(p.read_text(errors="replace")[-3000:] for p in sorted((report / "logs").rglob("*")) if p.is_file())
        if (report / "logs").exists()
        else ""
    )
    assert result.returncode == 0, result.stdout + result.stderr + logs
    summary = json.loads((report / "rollout-summary.json").read_text())
    (session,) = summary["session_results"]
    assert (session["status"], session["reward"], session["exit_code"]) == ("completed", 1.0, 0), (session, logs)
    return session, logs


def assert_scripted_calls_stored(proxy: SharedProxy, session: dict, task_id: str, turns: list[dict]) -> None:
    """Every scripted turn is one ok call under (task, group = task, sample 0), calling the scripted tools."""
    records = sorted(session_records(proxy.out, session["session_id"], at_least=len(turns)), key=lambda r: r.started_at)
    assert [r.status for r in records] == ["ok"] * len(turns), [r.error for r in records]
    # The real harness's own prompts set off none of the side-job markers: every call is its agent's.
    assert [(r.role, r.role_reason) for r in records] == [("agent", None)] * len(turns)
    assert {(r.task_id, r.group_id, r.sample_index) for r in records} == {(task_id, task_id, 0)}
    called = [[c["name"] for c in (r.response_message or {}).get("tool_calls") or []] for r in records]
    assert called == [[c["function"]["name"] for c in t.get("tool_calls", [])] for t in turns]
    assert validate_store(str(proxy.out)) == []
    assert_exports_to_atif(proxy, session["session_id"], called)
    assert_only_polar_flows(proxy)


def assert_exports_to_atif(proxy: SharedProxy, session_id: str, called: list[list[str]]) -> None:
    """The session's ATIF export validates against Harbor's models and holds every tool call it made (main chain and
    side chains together)."""
    (trajectory,) = check_atif_export(str(proxy.out), [session_id]).values()
    parts = [trajectory, *(trajectory.subagent_trajectories or [])]
    exported = [c.function_name for part in parts for step in part.steps for c in step.tool_calls or []]
    assert sorted(exported) == sorted(name for names in called for name in names), exported


# What a flow logged at polar's own loopback servers looks like: a streamed answer parked at the relay, a Responses
# WebSocket handed to polar's WebSocket server (only calls polar answers go there).
POLAR_LOOPBACK = re.compile(r"http://127\.0\.0\.1:\d+/_polar/")
# A flow and the first line of its answer, as flow_detail=1 logs them.
FLOW_LINE = re.compile(r"^\S+: (GET|POST|PUT|PATCH|DELETE|HEAD|OPTIONS|CONNECT) (\S+)\n\s*<< (\S+)", re.MULTILINE)
REFUSED_CONNECT = re.compile(r"polar: refused CONNECT (\S+) \(polar_block_other\)")
# The requests a harness makes that are no model call, each refused by the proxy (polar_block_other: 403), never
# forwarded: (method, path) -> who sends it.
REFUSED_PROBES = {
    ("GET", "/polar-boundary-probe"): "polar rollout's check that the proxy blocks other traffic",
    ("HEAD", "/"): "Claude Code's reachability check of its base URL",
    # A CONNECT is known by its host: the probe's throwaway listener takes any free port.
    ("CONNECT", "127.0.0.1"): "polar rollout's boundary probe, by CONNECT",
}


def assert_only_polar_flows(proxy: SharedProxy) -> None:
    """Nothing but what polar answers reached the proxy, for every harness it served so far: each flow in its log
    is a provider route of polar's gateway (a model call, or an account call polar answers locally), a flow parked
    at polar's loopback servers, polar's control channel, or one of the known probes, refused (403). A harness's
    HTTPS_PROXY is the forward listener and its sandbox reaches nothing else, so a price list, telemetry or update
    check would be here."""
    from urllib.parse import urlsplit

    from polar_addon.providers import all_providers

    providers = all_providers()

    def polar_answers(method: str, url: str) -> bool:
        parts = urlsplit(url)
        path = parts.path + (f"?{parts.query}" if parts.query else "")
        return any(p.route(method, path) is not None for p in providers)

    logs = proxy.logs()
    flows = FLOW_LINE.findall(logs) + [("CONNECT", target, "403") for target in REFUSED_CONNECT.findall(logs)]
    assert any(polar_answers(m, u) or POLAR_LOOPBACK.match(u) for m, u, _ in flows), logs[-3000:]
    others = [
        (m, u, status)
        for m, u, status in flows
        if not polar_answers(m, u) and not POLAR_LOOPBACK.match(u) and not u.startswith("http://polar.local/")
    ]

    def probe_key(method: str, url: str) -> tuple[str, str]:
        return (method, url.rsplit(":", 1)[0]) if method == "CONNECT" else (method, urlsplit(url).path)

    unknown = [(m, u, status) for m, u, status in others if probe_key(m, u) not in REFUSED_PROBES]
    assert unknown == [], unknown
    assert {status for _, _, status in others} <= {"403"}, others  # refused, never forwarded


@pytest.mark.harness
@pytest.mark.parametrize("harness", HARNESSES)
def test_polar_rollout_in_bwrap_proxy_only(harness: str, proxy: SharedProxy, tmp_path: Path) -> None:
    """The same fix end to end: `polar rollout` on the JSONL task set, the harness in a proxy-only bwrap sandbox
    (it reaches the proxy and nothing else), verified by the runner in a fresh sandbox, rewarded through the
    proxy's control channel, every call stored under the session, group (the task) and sample."""
    if shutil.which("bwrap") is None:
        missing("bubblewrap missing (make sandbox)")
    task_id = script(harness)["task"]
    tasks = tmp_path / "tasks.jsonl"
    task = dict(jsonl_tasks()[task_id], workspace=str(SWE_MINI / jsonl_tasks()[task_id]["workspace"]))
    tasks.write_text(json.dumps(task) + "\n")
    # Distinct seeds: session ids come from the seed and the task, and two harnesses share each task here.
    session, _ = rollout_through(proxy, tasks, harness, "bwrap", HARNESSES.index(harness), tmp_path / "report")
    turns = script(harness)["turns"][1:] if harness == "qwen-code" else script(harness)["turns"]
    assert_scripted_calls_stored(proxy, session, task_id, turns)


# Where an offline user pre-loads the base image that swe_mini's Dockerfiles name (`FROM python:3.11-slim`):
# podman resolves that short name to this full one, and pulls only when it is missing.
PYTHON_BASE = "docker.io/library/python:3.11-slim"


@pytest.mark.harness
def test_polar_rollout_codex_on_oci_harbor_task(proxy: SharedProxy, tmp_path: Path) -> None:
    """Codex, unmodified, in a podman container of a Harbor task whose unchanged Dockerfile says `FROM
    python:3.11-slim`, that name pre-loaded offline with an image built from the host's binaries (bash, Python,
    node; the harness install bound read-only): the harness runs the scripted fix inside the container (proxy-only
    network), the verifier's `tests/test.sh` gives 1.0 in a fresh container of the task, every call is stored under
    the session, group and sample."""
    if shutil.which("podman") is None or shutil.which("runc") is None:
        missing("podman or runc missing (make sandbox)")
    from tests.support.oci_image import build_harness_image

    image = build_harness_image()
    subprocess.run(["podman", "tag", image, PYTHON_BASE], check=True, capture_output=True)
    harness = "codex"
    task_id = script(harness)["task"]
    session, logs = rollout_through(proxy, SWE_MINI / "harbor" / task_id, harness, "oci", 100, tmp_path / "report")
    assert "OK" in logs  # the verifier's unittest run, inside the container
    assert_scripted_calls_stored(proxy, session, task_id, script(harness)["turns"])
