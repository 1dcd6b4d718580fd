"""Python harness presets (each in its own venv under ``.harness/py``, ``make pyharnesses``) drive the real
agents through a swe_mini bug fix.

As tests/test_rollout_presets.py does for the npm CLIs: ``polar rollout --runtime bwrap --network proxy-only`` runs
the real harness on a swe_mini task against one shared mitmdump whose scripted engine replays that harness's own fix
(``examples/swe_mini/scripts/HARNESS.json``: its own action format). The harness must exit 0, the runner's verifier
must give 1.0, every call must be stored under the session, task, group and sample, each scripted action must have
run (its output is in the next request), and the proxy must have seen nothing but those model calls.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest

from polar_addon.store.validate import validate_store
from polar_cli.build import build_traces
from polar_cli.rollout.harnesses import get_preset
from polar_cli.rollout.harnesses._venv import venv_python
from polar_cli.rollout.harnesses.base import SessionContext
from tests.support.prereq import missing
from tests.support.proxy import SharedProxy
from tests.support.shards import session_records
from tests.test_rollout_presets import (
    SWE_MINI,
    assert_exports_to_atif,
    assert_only_polar_flows,
    jsonl_tasks,
    preset_proxy,
    rollout_through,
)

SCRIPTS = SWE_MINI / "scripts"
# harness spec -> (its script, the venv it needs, the User-Agent it sends)
HARNESSES = {
    "mini-swe-agent:toolcall": ("mini-swe-agent-toolcall", "mini-swe-agent", "mini-swe-agent/2.4.6 (toolcall)"),
    "mini-swe-agent:textbased": ("mini-swe-agent-textbased", "mini-swe-agent", "mini-swe-agent/2.4.6 (textbased)"),
    "aider": ("aider", "aider", "aider/0.86.2"),
    "openai-agents": ("openai-agents", "openai-agents", "Agents/Python 0.24.0"),
    "smolagents": ("smolagents", "smolagents", "smolagents/1.26.0"),
    "gptme": ("gptme", "gptme", "gptme (OpenAI/Python 2.54.0)"),
    "kimi-cli": ("kimi-cli", "kimi-cli", "KimiCLI/1.52.0"),
    "openhands": ("openhands", "openhands", "openhands (OpenAI/Python 1.99.9)"),
}
# The calls each harness makes besides its loop (role_reason of each, sorted).
SIDE_JOBS = {"gptme": ["gptme title"]}
# The harnesses whose agent calls merge into one trace (gptme sends each tool's output as a system message: it stays
# in place, not folded into the leading system prompt, which would change every call's prompt; Kimi CLI and OpenHands
# only append).
ONE_CHAIN = {"gptme", "kimi-cli", "openhands"}
# Kimi CLI 1.52.0's default agent, as it declares it (SearchWeb needs Moonshot's search service, not configured;
# ReadMediaFile a model that takes images).
KIMI_TOOLS = ["Agent", "AskUserQuestion", "SetTodoList", "Shell", "TaskList", "TaskOutput", "TaskStop", "ReadFile",
              "Glob", "Grep", "WriteFile", "StrReplaceFile", "FetchURL", "ExitPlanMode", "EnterPlanMode"]  # fmt: skip
# The harnesses that call tools (the others write their actions as text), and the tools each declares.
TOOL_CALLING = {
    "mini-swe-agent:toolcall": ["bash"],
    "openai-agents": ["bash"],
    "kimi-cli": KIMI_TOOLS,
    "openhands": ["execute_bash", "think", "finish", "task_tracker", "str_replace_editor"],
}
# What each scripted action prints, seen in the request after it (None: nothing to see): the action ran in the
# workspace. Aider's one reply is its edit, which the verifier sees.
SEEN_AFTER = {
    "mini-swe-agent:toolcall": ["def add(a, b):", None, "Ran 2 tests"],
    "mini-swe-agent:textbased": ["def shout(text):", None, "Ran 2 tests"],
    "aider": [],
    "openai-agents": ["def shout(text):", "Ran 2 tests"],
    "smolagents": ["def mean(values):", "Ran 2 tests"],
    "gptme": ["def add(a, b):", "Ran 2 tests"],
    "kimi-cli": ["def mean(values):", None, "Ran 2 tests"],
    "openhands": ["def add(a, b):", None, "Ran 2 tests"],
}


def script(harness: str) -> dict:
    return json.loads((SCRIPTS / f"{HARNESSES[harness][0]}.json").read_text())


def model_name(harness: str) -> str:
    return f"swe-{harness}"  # as rollout_through names it


def context(home: Path, **window: int | None) -> SessionContext:
    return SessionContext(session_id="s", task_id="t", group_id="g", sample=0, model="m",
                          proxy_url="http://127.0.0.1:1", reverse_url="http://127.0.0.1:2", ca_path="/ca.pem",
                          home=str(home), workspace="/workspace", secret="psk-test", **window)  # fmt: skip


@pytest.fixture(scope="module")
def proxy(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[SharedProxy]:
    """One mitmdump for every Python harness."""
    scripts = {model_name(h): script(h) for h in HARNESSES}
    with preset_proxy(tiny_model_dir, tmp_path_factory.mktemp("pypresets-proxy"), scripts) as started:
        yield started


def test_mini_swe_agent_config(tmp_path: Path) -> None:
    """The flavour picks mini's bundled config and model class; the output cap is LiteLLM's ``max_tokens``; the
    session rides on the key (never in a file mini writes its trajectory from); first-run wizard and LiteLLM's
    downloads are off."""
    for flavour, builtin, model_class in (
        ("toolcall", "mini.yaml", "litellm"),
        ("textbased", "mini_textbased.yaml", "litellm_textbased"),
    ):
        preset = get_preset(f"mini-swe-agent:{flavour}")
        home = tmp_path / flavour
        ctx = context(Path("/home/polar"), context_window=8192, max_output_tokens=512)
        preset.configure(home, ctx)
        config = json.loads((home / ".config" / "polar" / "mini-swe-agent.yaml").read_text())
        assert config["model"]["model_class"] == model_class and config["model"]["model_name"] == "openai/m"
        assert config["model"]["model_kwargs"]["api_base"] == "http://127.0.0.1:2/v1"
        assert config["model"]["model_kwargs"]["max_tokens"] == 512
        assert config["agent"] == {"mode": "yolo", "confirm_exit": False, "cost_limit": 0}
        assert "psk-test" not in json.dumps(config)
        env = preset.env(ctx)
        assert env["OPENAI_API_KEY"] == "polar:psk-test" and env["MSWEA_CONFIGURED"] == "true"
        assert env["LITELLM_OFFLINE_MODE"] == "true" and env["MSWEA_COST_TRACKING"] == "ignore_errors"
        argv = preset.command("fix it", ctx)
        assert argv[argv.index("-c") + 1] == builtin and "/home/polar/.config/polar/mini-swe-agent.yaml" in argv
        assert argv[argv.index("-t") + 1] == "fix it" and {"-y", "--exit-immediately"} <= set(argv)
    bare = tmp_path / "bare"
    get_preset("mini-swe-agent").configure(bare, context(bare))
    assert "max_tokens" not in (bare / ".config" / "polar" / "mini-swe-agent.yaml").read_text()
    with pytest.raises(ValueError, match="unknown flavour"):
        get_preset("mini-swe-agent:xml")


def test_aider_config(tmp_path: Path) -> None:
    """Aider gets the served window and output cap in its model metadata and settings, a fresh non-empty price-list
    cache (else it downloads one), history files in HOME, and no commit, .gitignore edit, update check or
    analytics."""
    preset = get_preset("aider")
    ctx = context(Path("/home/polar"), context_window=8192, max_output_tokens=512)
    preset.configure(tmp_path, ctx)
    metadata = json.loads((tmp_path / ".aider.model.metadata.json").read_text())
    assert metadata["openai/m"]["max_input_tokens"] == 8192 and metadata["openai/m"]["max_output_tokens"] == 512
    assert json.loads((tmp_path / ".aider" / "caches" / "model_prices_and_context_window.json").read_text())
    (settings,) = json.loads((tmp_path / ".aider.model.settings.yml").read_text())
    assert settings["name"] == "openai/m" and settings["extra_params"]["max_tokens"] == 512
    env = preset.env(ctx)
    assert env["OPENAI_API_KEY"] == "polar:psk-test" and env["OPENAI_API_BASE"] == "http://127.0.0.1:2/v1"
    argv = preset.command("fix it", ctx)
    assert argv[argv.index("--message") + 1] == "fix it" and argv[argv.index("--model") + 1] == "openai/m"
    assert {"--yes-always", "--no-auto-commits", "--no-gitignore", "--no-check-update", "--analytics-disable"} <= set(
        argv
    )
    assert all(
        argv[argv.index(f) + 1].startswith("/home/polar/") for f in ("--chat-history-file", "--input-history-file")
    )
    bare = tmp_path / "bare"
    preset.configure(bare, context(bare))
    assert "8192" not in (bare / ".aider.model.metadata.json").read_text()
    assert "max_tokens" not in (bare / ".aider.model.settings.yml").read_text()
    with pytest.raises(ValueError, match="takes no argument"):
        get_preset("aider:x")


def test_openai_agents_config(tmp_path: Path) -> None:
    """The bundled Agents SDK script is copied into HOME (the sandbox needs nothing of the checkout), the SDK's tracing
    upload is off, and the served output cap reaches its model settings."""
    preset = get_preset("openai-agents")
    ctx = context(Path("/home/polar"), max_output_tokens=512)
    preset.configure(tmp_path, ctx)
    from polar_cli.rollout.harnesses._bundled import SCRIPTS

    assert (tmp_path / preset.in_home).read_text() == (SCRIPTS / "openai_agents_coder.py").read_text()
    env = preset.env(ctx)
    assert env["OPENAI_API_KEY"] == "polar:psk-test" and env["OPENAI_BASE_URL"] == "http://127.0.0.1:2/v1"
    assert env["OPENAI_AGENTS_DISABLE_TRACING"] == "1"
    argv = preset.command("fix it", ctx)
    assert argv[1:] == ["-P", f"/home/polar/{preset.in_home}", "--model", "m", "--max-tokens", "512", "fix it"]
    assert "--max-tokens" not in preset.command("fix it", context(Path("/home/polar")))
    with pytest.raises(ValueError, match="takes no argument"):
        get_preset("openai-agents:x")


def test_kimi_cli_config(tmp_path: Path) -> None:
    """Kimi CLI runs its Typer app (not the 1.52 console script, which only prints a notice or runs an installer) on
    a config file naming the reverse proxy and the served window, the key in the environment only; the output cap is
    its completion-token cap and bounds the reserve it compacts at; telemetry and auto-update are off."""
    preset = get_preset("kimi-cli")
    ctx = context(Path("/home/polar"), context_window=8192, max_output_tokens=512)
    preset.configure(tmp_path, ctx)
    config = json.loads((tmp_path / ".kimi" / "polar.json").read_text())
    assert config["providers"] == {"polar": {"type": "kimi", "base_url": "http://127.0.0.1:2/v1", "api_key": ""}}
    assert config["models"] == {"polar": {"provider": "polar", "model": "m", "max_context_size": 8192}}
    assert config["default_model"] == "polar" and config["telemetry"] is False
    assert config["loop_control"] == {"reserved_context_size": 1000}  # 512, raised to kimi's floor
    env = preset.env(ctx)
    assert env["KIMI_API_KEY"] == "polar:psk-test" and env["KIMI_MODEL_MAX_COMPLETION_TOKENS"] == "512"
    assert env["KIMI_SHARE_DIR"] == "/home/polar/.kimi" and env["KIMI_DISABLE_TELEMETRY"] == "1"
    argv = preset.command("fix it", ctx)
    assert argv[1:4] == ["-P", "-m", "kimi_cli.cli"] and argv[argv.index("--prompt") + 1] == "fix it"
    assert argv[argv.index("--config-file") + 1] == "/home/polar/.kimi/polar.json"
    assert argv[argv.index("--work-dir") + 1] == "/workspace" and {"--print", "--yolo"} <= set(argv)
    # A window alone: a quarter of it is kept free; none: kimi's own defaults, and no cap.
    wide = tmp_path / "wide"
    preset.configure(wide, context(wide, context_window=131072))
    assert json.loads((wide / ".kimi" / "polar.json").read_text())["loop_control"] == {"reserved_context_size": 32768}
    bare = tmp_path / "bare"
    preset.configure(bare, context(bare))
    config = json.loads((bare / ".kimi" / "polar.json").read_text())
    assert config["models"]["polar"]["max_context_size"] == 100_000 and "loop_control" not in config
    assert "KIMI_MODEL_MAX_COMPLETION_TOKENS" not in preset.env(context(bare))
    with pytest.raises(ValueError, match="takes no argument"):
        get_preset("kimi-cli:x")


def test_openhands_config(tmp_path: Path) -> None:
    """OpenHands runs headless on the cli runtime in the workspace, its model at the reverse proxy with native tool
    calls, the served window and output cap as its LLM limits, the key in the environment only; browsing, Jupyter and
    MCP (which would fetch and start servers) are off."""
    import tomllib

    preset = get_preset("openhands")
    ctx = context(Path("/home/polar"), context_window=8192, max_output_tokens=512)
    preset.configure(tmp_path, ctx)
    config = tomllib.loads((tmp_path / ".openhands" / "polar.toml").read_text())
    assert config["core"] == {"runtime": "cli", "workspace_base": "/workspace", "file_store": "local",
                              "file_store_path": "/home/polar/.openhands/file_store"}  # fmt: skip
    assert config["llm"] == {"model": "openai/m", "base_url": "http://127.0.0.1:2/v1", "native_tool_calling": True,
                             "max_input_tokens": 8192, "max_output_tokens": 512}  # fmt: skip
    assert config["agent"] == {"enable_browsing": False, "enable_jupyter": False, "enable_mcp": False}
    env = preset.env(ctx)
    assert env["LLM_API_KEY"] == "polar:psk-test" and env["LITELLM_LOCAL_MODEL_COST_MAP"] == "True"
    assert "psk-test" not in (tmp_path / ".openhands" / "polar.toml").read_text()
    argv = preset.command("fix it", ctx)
    assert argv[1:] == ["-P", "-m", "openhands.core.main", "--config-file", "/home/polar/.openhands/polar.toml",
                        "-t", "fix it"]  # fmt: skip
    bare = tmp_path / "bare"
    preset.configure(bare, context(bare))
    assert "max_" not in (bare / ".openhands" / "polar.toml").read_text()
    with pytest.raises(ValueError, match="takes no argument"):
        get_preset("openhands:x")


def request_text(record) -> str:
    return json.dumps(json.loads(record.messages_json))


@pytest.mark.harness
@pytest.mark.parametrize("harness", list(HARNESSES))
def test_polar_rollout_in_bwrap_proxy_only(harness: str, proxy: SharedProxy, tmp_path: Path) -> None:
    """The scripted fix end to end through the real harness in a proxy-only bwrap sandbox."""
    if shutil.which("bwrap") is None:
        missing("bubblewrap missing (make sandbox)")
    venv = HARNESSES[harness][1]
    if not Path(venv_python(venv)).exists():
        missing(f"{venv} venv missing (make pyharnesses)")
    turns = script(harness)["turns"][script(harness).get("first_requested", 0) :]
    task_id = script(harness)["task"]
    tasks = tmp_path / "tasks.jsonl"
    task = dict(jsonl_tasks()[task_id], workspace=str(SWE_MINI / jsonl_tasks()[task_id]["workspace"]))
    tasks.write_text(json.dumps(task) + "\n")
    seed = 200 + list(HARNESSES).index(harness)
    session, logs = rollout_through(proxy, tasks, harness, "bwrap", seed, tmp_path / "report")

    side_jobs = SIDE_JOBS.get(harness, [])
    stored = session_records(proxy.out, session["session_id"], at_least=len(turns) + len(side_jobs))
    stored = sorted(stored, key=lambda r: r.started_at)
    # The harness's own side jobs, tagged so by the proxy (they run beside the loop, in any order).
    assert sorted(r.role_reason for r in stored if r.role != "agent") == side_jobs
    assert all(r.role == "auxiliary" for r in stored if r.role != "agent")
    records = [r for r in stored if r.role == "agent"]
    # One agent call per scripted turn, no more: the last action ended the run.
    assert [r.status for r in records] == ["ok"] * len(turns), [r.error for r in records]
    assert {(r.task_id, r.group_id, r.sample_index) for r in records} == {(task_id, task_id, 0)}
    assert {r.requested_model for r in records} == {model_name(harness)}
    assert {r.harness for r in records} == {HARNESSES[harness][2]}
    if harness in TOOL_CALLING:
        declared = [[t["function"]["name"] for t in json.loads(r.tools_json)] for r in records]
        assert declared == [TOOL_CALLING[harness]] * len(records)
        called = [
            [(c["name"], json.loads(c["arguments"])) for c in r.response_message.get("tool_calls") or []]
            for r in records
        ]
        workspace = json.loads(json.dumps(turns).replace("{workspace}", "/workspace"))
        assert called == [
            [(c["function"]["name"], c["function"]["arguments"]) for c in t.get("tool_calls", [])] for t in workspace
        ]
    else:
        assert all(json.loads(r.tools_json) == [] for r in records)
        assert [r.response_message["content"] for r in records] == [t["content"] for t in turns]
    for record, seen in zip(records[1:], SEEN_AFTER[harness], strict=True):
        if seen is not None:
            assert seen in request_text(record), seen
    assert validate_store(str(proxy.out)) == []
    if harness in ONE_CHAIN:
        built = build_traces(records, {}, "prefix_merging")
        assert [t.calls_merged for t in built.traces] == [len(records)], built.report.total.breaks
    assert_exports_to_atif(
        proxy, session["session_id"], [[c["function"]["name"] for c in t.get("tool_calls", [])] for t in turns]
    )
    # A streamed answer the engine took longer than a keep-alive to start (Kimi CLI's 48 kB prompts, on the tiny
    # model) is parked at polar's loopback relay: assert_only_polar_flows counts it as polar's.
    assert_only_polar_flows(proxy)


def test_the_help_names_every_preset() -> None:
    """`--harness`'s help lists the preset modules without importing them: the same names `get_preset` takes."""
    from polar_cli.rollout.config import RolloutSettings
    from polar_cli.rollout.harnesses import available_presets, preset_names

    assert preset_names() == available_presets()
    assert {"gptme", "openai-agents", "smolagents"} <= set(preset_names())
    help_text = RolloutSettings.__dataclass_fields__["harness"].metadata
    assert all(name in str(help_text) for name in preset_names()), help_text
