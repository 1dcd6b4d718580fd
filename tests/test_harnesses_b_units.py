"""Unit tests of the harness presets of group B (aider, gptme, kimi-cli, mini-swe-agent, openai-agents, smolagents,
openhands; opencode, kilocode, cline, continue-cli) and their shared helpers (``_bundled``, ``_venv``, ``_install``,
``_files``).

What a preset writes is what the harness reads: an env var or config key spelled wrong, or a URL without ``/v1``,
makes the harness bypass the proxy or use the wrong model, window or cap without a word. So each test compares the
whole argv, environment and config file with what the harness's own documentation asks for. The agent runs inside
the harness and reads all of it: the only credential anywhere is its own session's, never on the command line (which
every process can read).

No harness is run: ``POLAR_HARNESS_DIR`` points at a fake install (venvs with a dist-info, npm ``.bin`` files).
"""

from __future__ import annotations

import io
import json
import tomllib
from pathlib import Path

import pytest

import polar_cli
from polar_cli.rollout.harnesses import (
    _bundled,
    _files,
    _install,
    _venv,
    aider,
    cline,
    continue_cli,
    gptme,
    kilocode,
    kimi_cli,
    mini_swe_agent,
    openai_agents,
    opencode,
    openhands,
    smolagents,
)
from polar_cli.rollout.harnesses.base import SessionContext

REPO = Path(polar_cli.__file__).resolve().parents[1]
HOME = "/home/agent"
SECRET = "s3cr/t"  # a '/' shows the forward proxy URL quotes it
KEY = "polar:s3cr/t"
FORWARD = "http://polar:s3cr%2Ft@127.0.0.1:8080"
BASE = "http://127.0.0.1:8081/v1"
OFFLINE = {
    "HTTPS_PROXY": FORWARD,
    "https_proxy": FORWARD,
    "NO_PROXY": "127.0.0.1,localhost",
    "no_proxy": "127.0.0.1,localhost",
}
PYTHON_MODULES = [aider, gptme, kimi_cli, mini_swe_agent, openai_agents, smolagents, openhands]
NPM_MODULES = [opencode, kilocode, cline, continue_cli]


def ctx(window: int | None = 32768, output: int | None = 2048) -> SessionContext:
    return SessionContext(session_id="sess-1", task_id="task-1", group_id="grp-1", sample=3, model="qwen-7b",
                          proxy_url="http://127.0.0.1:8080", reverse_url="http://127.0.0.1:8081",
                          ca_path="/run/polar/ca.pem", home=HOME, workspace="/workspace/repo", secret=SECRET,
                          context_window=window, max_output_tokens=output)  # fmt: skip


def read_json(path: Path) -> object:
    return json.loads(path.read_text())


@pytest.fixture
def install(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """An empty harness install that POLAR_HARNESS_DIR names, and a PATH with no harness on it."""
    root = tmp_path / "harness"
    root.mkdir()
    empty = tmp_path / "empty-path"
    empty.mkdir()
    monkeypatch.setenv("POLAR_HARNESS_DIR", str(root))
    monkeypatch.setenv("PATH", str(empty))
    return root


def fake_venv(root: Path, venv: str, name: str, version: str, home: Path | None = None) -> Path:
    """A venv under the install: an interpreter file, pyvenv.cfg and one dist-info (``name``, ``version``)."""
    base = root / "py" / venv
    (base / "bin").mkdir(parents=True)
    (base / "bin" / "python").write_text("")
    (base / "pyvenv.cfg").write_text(f"home = {home or '/usr/bin'}\n")
    info = base / "lib" / "python3.13" / "site-packages" / f"{name.replace('-', '_')}-{version}.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n")
    return base


# --- shared helpers -------------------------------------------------------------------------------------------------


def test_write_json_makes_the_parents_and_writes_indented_json_with_a_newline(tmp_path: Path) -> None:
    path = tmp_path / "a" / "b" / "c.json"
    _files.write_json(path, {"k": [1, "v"]})
    assert path.read_text() == '{\n  "k": [\n    1,\n    "v"\n  ]\n}\n'


def test_a_preset_without_variants_refuses_an_argument() -> None:
    _files.no_arg("aider", None)
    _files.no_arg("aider", "")
    with pytest.raises(ValueError) as caught:
        _files.no_arg("aider", "x")
    assert str(caught.value) == "harness 'aider' takes no argument (got 'x')"


@pytest.mark.parametrize("module", [m for m in PYTHON_MODULES + NPM_MODULES if m is not mini_swe_agent])
def test_every_preset_without_variants_refuses_an_argument(module) -> None:
    name = module.make(None).name
    assert module.make("").name == name
    with pytest.raises(ValueError) as caught:
        module.make("x")
    assert str(caught.value) == f"harness {name!r} takes no argument (got 'x')"


def test_harness_dir_is_the_override_made_absolute_else_the_repositorys(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("POLAR_HARNESS_DIR", str(tmp_path / "h"))
    assert _install.harness_dir() == tmp_path / "h"
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("POLAR_HARNESS_DIR", "rel")
    assert _install.harness_dir() == tmp_path / "rel"
    for unset in ("", None):
        if unset is None:
            monkeypatch.delenv("POLAR_HARNESS_DIR")
        else:
            monkeypatch.setenv("POLAR_HARNESS_DIR", unset)
        assert _install.harness_dir() == REPO / ".harness"


def test_executable_is_the_install_s_link_unresolved_else_path_else_the_bare_name(
    install: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    assert _install.executable("opencode") == "opencode"
    on_path = tmp_path / "bin"
    on_path.mkdir()
    (on_path / "opencode").write_text("#!/bin/sh\n")
    (on_path / "opencode").chmod(0o755)
    monkeypatch.setenv("PATH", str(on_path))
    assert _install.executable("opencode") == str(on_path / "opencode")
    bin_dir = install / "node_modules" / ".bin"
    bin_dir.mkdir(parents=True)
    target = install / "node_modules" / "opencode-ai" / "bin" / "opencode"
    target.parent.mkdir(parents=True)
    target.write_text("")
    (bin_dir / "opencode").symlink_to("../opencode-ai/bin/opencode")
    # The link itself: the sandbox mounts the install at the same path, where the relative target resolves too.
    assert _install.executable("opencode") == str(bin_dir / "opencode")


def test_an_installed_harness_needs_the_install_read_only_only_when_there_is_one(
    install: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    assert opencode.make().read_only == (install,)
    monkeypatch.setenv("POLAR_HARNESS_DIR", str(install / "missing"))
    assert cline.make().read_only == ()


def test_venv_paths_and_version(install: Path) -> None:
    assert _venv.venv_dir("aider") == install / "py" / "aider"
    assert _venv.venv_python("aider") == f"{install}/py/aider/bin/python"
    assert _venv.venv_version("aider", "aider-chat") is None  # not installed
    fake_venv(install, "aider", "Aider_Chat", "0.86.2")  # the name as a dist-info may spell it
    assert _venv.venv_version("aider", "aider-chat") == "0.86.2"
    assert _venv.venv_version("aider", "aider") is None
    assert aider.make().version() == "0.86.2"
    assert gptme.make().version() is None


def test_venv_version_skips_a_dist_info_without_a_name(install: Path) -> None:
    base = fake_venv(install, "gptme", "gptme", "0.28.0")
    nameless = base / "lib" / "python3.13" / "site-packages" / "broken-1.0.dist-info"
    nameless.mkdir()
    (nameless / "METADATA").write_text("Metadata-Version: 2.1\nVersion: 1.0\n")
    assert _venv.venv_version("gptme", "gptme") == "0.28.0"


def test_a_venv_harness_needs_its_install_and_the_python_it_was_made_from(install: Path, tmp_path: Path) -> None:
    preset = aider.make()
    assert preset.read_only == (install,)  # no venv yet: nothing outside
    base_python = tmp_path / "pythons" / "3.13"
    fake_venv(install, "aider", "aider-chat", "0.86.2", home=base_python / "bin")
    assert preset.read_only == (install, base_python)
    # A venv of the system's own Python: /usr is in every sandbox already.
    fake_venv(install, "gptme", "gptme", "0.28.0", home=Path("/usr/bin"))
    assert gptme.make().read_only == (install,)


def test_a_venv_harness_without_an_install_needs_nothing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("POLAR_HARNESS_DIR", str(tmp_path / "none"))
    assert kimi_cli.make().read_only == ()


def test_the_offline_environment_sends_other_traffic_to_the_forward_proxy_with_the_session() -> None:
    assert _venv.VenvHarness.forward_only_env(ctx()) == OFFLINE


# --- Python harnesses ----------------------------------------------------------------------------------------------


def test_aider_files_env_and_argv(install: Path, tmp_path: Path) -> None:
    preset = aider.make()
    assert (preset.name, preset.venv, preset.distribution) == ("aider", "aider", "aider-chat")
    home = tmp_path / "home"
    preset.configure(home, ctx())
    info = {"litellm_provider": "openai", "mode": "chat", "max_input_tokens": 32768, "max_output_tokens": 2048}
    metadata = {"openai/qwen-7b": info, "qwen-7b": info}
    assert read_json(home / ".aider.model.metadata.json") == metadata
    assert read_json(home / ".aider" / "caches" / "model_prices_and_context_window.json") == metadata
    extra = {"extra_headers": {"User-Agent": "aider/unknown"}, "max_tokens": 2048}
    settings = [{"name": "openai/qwen-7b", "edit_format": "diff", "use_repo_map": True, "extra_params": extra}]
    assert read_json(home / ".aider.model.settings.yml") == settings
    assert {str(p.relative_to(home)) for p in home.rglob("*") if p.is_file()} == {
        ".aider.model.metadata.json",
        ".aider/caches/model_prices_and_context_window.json",
        ".aider.model.settings.yml",
    }
    assert preset.env(ctx()) == {
        "OPENAI_API_KEY": KEY,
        "OPENAI_API_BASE": BASE,
        "LITELLM_LOCAL_MODEL_COST_MAP": "True",
        **OFFLINE,
    }
    assert preset.command("fix it", ctx()) == [
        f"{install}/py/aider/bin/python", "-P", "-m", "aider", "--model", "openai/qwen-7b", "--message", "fix it",
        "--yes-always", "--no-auto-commits", "--no-dirty-commits", "--no-gitignore", "--no-check-update",
        "--no-show-release-notes", "--analytics-disable", "--no-show-model-warnings", "--no-detect-urls",
        "--no-pretty", "--no-fancy-input", "--encoding", "utf-8",
        "--chat-history-file", "/home/agent/.aider/chat.history.md",
        "--input-history-file", "/home/agent/.aider/input.history",
    ]  # fmt: skip


def test_aider_writes_each_limit_only_when_given_and_names_its_version(install: Path, tmp_path: Path) -> None:
    fake_venv(install, "aider", "aider-chat", "0.86.2")
    preset = aider.make()
    for window, output, info_extra, params_extra in (
        (None, None, {}, {}),
        (32768, None, {"max_input_tokens": 32768}, {}),
        (None, 2048, {"max_output_tokens": 2048}, {"max_tokens": 2048}),
    ):
        home = tmp_path / f"{window}-{output}"
        preset.configure(home, ctx(window, output))
        info = {"litellm_provider": "openai", "mode": "chat", **info_extra}
        assert read_json(home / ".aider.model.metadata.json") == {"openai/qwen-7b": info, "qwen-7b": info}
        (settings,) = read_json(home / ".aider.model.settings.yml")
        assert settings["extra_params"] == {"extra_headers": {"User-Agent": "aider/0.86.2"}, **params_extra}


def test_gptme_env_and_argv(install: Path, tmp_path: Path) -> None:
    preset = gptme.make()
    assert (preset.name, preset.venv, preset.distribution) == ("gptme", "gptme", "gptme")
    home = tmp_path / "home"
    preset.configure(home, ctx())
    assert (home / ".config" / "gptme").is_dir() and not [p for p in home.rglob("*") if p.is_file()]
    preset.configure(home, ctx())  # a second session on the same HOME
    common = {"OPENAI_API_KEY": KEY, "OPENAI_BASE_URL": BASE, "GPTME_TIKTOKEN_TIMEOUT": "0", **OFFLINE}
    assert preset.env(ctx()) == {**common, "GPTME_MAX_TOKENS": "2048"}
    assert preset.env(ctx(32768, None)) == common
    assert preset.command("fix it", ctx()) == [
        f"{install}/py/gptme/bin/python", "-P", "-m", "gptme", "--non-interactive", "--name", "polar-sess-1",
        "--model", "local/qwen-7b", "--tools", "shell,save,patch,read,complete", "--tool-format", "markdown",
        "-w", "/workspace/repo", "fix it",
    ]  # fmt: skip


@pytest.mark.parametrize(
    ("window", "output", "reserve"),
    [
        (None, None, None),  # kimi's own default
        (None, 999, 1000),  # raised to kimi's floor
        (None, 1000, 1000),
        (None, 1001, 1001),
        (None, 50000, 50000),
        (None, 50001, 50000),  # at most kimi's default
        (131072, 2048, 2048),  # the output cap first
        (3, None, 1000),  # a quarter rounds to 0: still the floor, not kimi's default
        (4006, None, 1001),  # a quarter, a whole number of tokens
        (200000, None, 50000),
        (200004, None, 50000),
        (199996, None, 49999),
    ],
)
def test_kimi_reserves_the_output_cap_else_a_quarter_of_the_window_within_its_bounds(
    window: int | None, output: int | None, reserve: int | None
) -> None:
    got = kimi_cli.reserved_context(window, output)
    assert got == reserve and type(got) is type(reserve)


def test_kimi_cli_config_env_and_argv(install: Path, tmp_path: Path) -> None:
    preset = kimi_cli.make()
    assert (preset.name, preset.venv, preset.distribution) == ("kimi-cli", "kimi-cli", "kimi-cli")
    home = tmp_path / "home"
    preset.configure(home, ctx())
    assert read_json(home / ".kimi" / "polar.json") == {
        "default_model": "polar",
        "providers": {"polar": {"type": "kimi", "base_url": BASE, "api_key": ""}},
        "models": {"polar": {"provider": "polar", "model": "qwen-7b", "max_context_size": 32768}},
        "telemetry": False,
        "loop_control": {"reserved_context_size": 2048},
    }
    wide = tmp_path / "wide"
    preset.configure(wide, ctx(32768, None))  # no cap: a quarter of the window is kept free
    assert read_json(wide / ".kimi" / "polar.json")["loop_control"] == {"reserved_context_size": 8192}
    bare = tmp_path / "bare"
    preset.configure(bare, ctx(None, None))
    config = read_json(bare / ".kimi" / "polar.json")
    assert config["models"]["polar"]["max_context_size"] == 100_000 and "loop_control" not in config
    common = {
        "KIMI_API_KEY": KEY,
        "KIMI_SHARE_DIR": "/home/agent/.kimi",
        "KIMI_DISABLE_TELEMETRY": "1",
        "KIMI_CLI_NO_AUTO_UPDATE": "1",
        **OFFLINE,
    }
    assert preset.env(ctx()) == {**common, "KIMI_MODEL_MAX_COMPLETION_TOKENS": "2048"}
    assert preset.env(ctx(32768, None)) == common
    assert preset.command("fix it", ctx()) == [
        f"{install}/py/kimi-cli/bin/python", "-P", "-m", "kimi_cli.cli",
        "--config-file", "/home/agent/.kimi/polar.json", "--work-dir", "/workspace/repo",
        "--print", "--yolo", "--prompt", "fix it",
    ]  # fmt: skip


@pytest.mark.parametrize(
    ("arg", "flavour", "builtin", "model_class"),
    [
        (None, "toolcall", "mini.yaml", "litellm"),
        ("", "toolcall", "mini.yaml", "litellm"),
        ("toolcall", "toolcall", "mini.yaml", "litellm"),
        ("textbased", "textbased", "mini_textbased.yaml", "litellm_textbased"),
    ],
)
def test_mini_swe_agent_config_env_and_argv(
    arg: str | None, flavour: str, builtin: str, model_class: str, install: Path, tmp_path: Path
) -> None:
    preset = mini_swe_agent.make(arg)
    assert (preset.name, preset.venv, preset.distribution) == ("mini-swe-agent",) * 3
    home = tmp_path / "home"
    preset.configure(home, ctx())
    kwargs = {
        "api_base": BASE,
        "drop_params": True,
        "extra_headers": {"User-Agent": f"mini-swe-agent/unknown ({flavour})"},
        "max_tokens": 2048,
    }
    assert read_json(home / ".config" / "polar" / "mini-swe-agent.yaml") == {
        "agent": {"mode": "yolo", "confirm_exit": False, "cost_limit": 0},
        "model": {
            "model_class": model_class,
            "model_name": "openai/qwen-7b",
            "cost_tracking": "ignore_errors",
            "model_kwargs": kwargs,
        },
    }
    assert preset.env(ctx()) == {
        "OPENAI_API_KEY": KEY,
        "MSWEA_CONFIGURED": "true",
        "MSWEA_SILENT_STARTUP": "1",
        "MSWEA_COST_TRACKING": "ignore_errors",
        "MSWEA_GLOBAL_CONFIG_DIR": "/home/agent/.config/mini-swe-agent",
        "LITELLM_OFFLINE_MODE": "true",
        "LITELLM_LOCAL_MODEL_COST_MAP": "True",
        **OFFLINE,
    }
    assert preset.command("fix it", ctx()) == [
        f"{install}/py/mini-swe-agent/bin/python", "-P", "-m", "minisweagent.run.mini", "-y", "--exit-immediately",
        "-c", builtin, "-c", "/home/agent/.config/polar/mini-swe-agent.yaml", "-t", "fix it",
        "-o", "/home/agent/.config/polar/mini-swe-agent.traj.json",
    ]  # fmt: skip


def test_mini_swe_agent_without_a_cap_and_with_its_version(install: Path, tmp_path: Path) -> None:
    fake_venv(install, "mini-swe-agent", "mini-swe-agent", "2.4.6")
    assert mini_swe_agent.MiniSweAgent().flavour == "toolcall"
    preset = mini_swe_agent.make("textbased")
    preset.configure(tmp_path, ctx(32768, None))
    kwargs = read_json(tmp_path / ".config" / "polar" / "mini-swe-agent.yaml")["model"]["model_kwargs"]
    assert kwargs == {
        "api_base": BASE,
        "drop_params": True,
        "extra_headers": {"User-Agent": "mini-swe-agent/2.4.6 (textbased)"},
    }


def test_mini_swe_agent_refuses_an_unknown_flavour() -> None:
    with pytest.raises(ValueError) as caught:
        mini_swe_agent.make("xml")
    assert str(caught.value) == "harness 'mini-swe-agent': unknown flavour 'xml'; use one of toolcall, textbased"


@pytest.mark.parametrize(
    ("module", "script", "extra"),
    [
        (openai_agents, "openai_agents_coder.py", {"OPENAI_AGENTS_DISABLE_TRACING": "1"}),
        (smolagents, "smolagents_coder.py", {}),
    ],
)
def test_a_bundled_agent_is_copied_into_home_and_run_on_the_session(
    module, script: str, extra: dict[str, str], install: Path, tmp_path: Path
) -> None:
    preset = module.make()
    venv = preset.name
    assert (preset.venv, preset.distribution, preset.script, preset.in_home) == (
        venv,
        venv,
        script,
        f".polar/{script}",
    )
    home = tmp_path / "home"
    preset.configure(home, ctx())
    assert (home / ".polar" / script).read_bytes() == (_bundled.SCRIPTS / script).read_bytes()
    preset.configure(home, ctx())  # a second session on the same HOME overwrites it
    assert preset.env(ctx()) == {"OPENAI_API_KEY": KEY, "OPENAI_BASE_URL": BASE, **extra, **OFFLINE}
    python = f"{install}/py/{venv}/bin/python"
    run = [python, "-P", f"/home/agent/.polar/{script}", "--model", "qwen-7b"]
    assert preset.command("fix it", ctx()) == [*run, "--max-tokens", "2048", "fix it"]
    assert preset.command("fix it", ctx(32768, None)) == [*run, "fix it"]


def test_openhands_config_file_is_exact_toml(install: Path, tmp_path: Path) -> None:
    preset = openhands.make()
    assert (preset.name, preset.venv, preset.distribution) == ("openhands", "openhands", "openhands-ai")
    home = tmp_path / "home"
    preset.configure(home, ctx())
    text = (home / ".openhands" / "polar.toml").read_text()
    assert text == (
        "[core]\n"
        'runtime = "cli"\n'
        'workspace_base = "/workspace/repo"\n'
        'file_store = "local"\n'
        'file_store_path = "/home/agent/.openhands/file_store"\n'
        "\n"
        "[llm]\n"
        'model = "openai/qwen-7b"\n'
        'base_url = "http://127.0.0.1:8081/v1"\n'
        "native_tool_calling = true\n"
        "max_input_tokens = 32768\n"
        "max_output_tokens = 2048\n"
        "\n"
        "[agent]\n"
        "enable_browsing = false\n"
        "enable_jupyter = false\n"
        "enable_mcp = false\n"
    )
    assert tomllib.loads(text)["llm"]["max_input_tokens"] == 32768
    preset.configure(home, ctx(None, None))  # a second session on the same HOME rewrites it
    assert "max_input_tokens" not in (home / ".openhands" / "polar.toml").read_text()
    for window, output, limits in (
        (None, None, {}),
        (32768, None, {"max_input_tokens": 32768}),
        (None, 2048, {"max_output_tokens": 2048}),
    ):
        assert preset.settings(ctx(window, output))["llm"] == {
            "model": "openai/qwen-7b",
            "base_url": BASE,
            "native_tool_calling": True,
            **limits,
        }


def test_openhands_toml_holds_any_string_a_path_or_model_may_hold(tmp_path: Path) -> None:
    """A character past U+FFFF (JSON's surrogate pair escape is not TOML: OpenHands' toml 0.10 refuses the file and the
    session fails) and DEL (TOML wants it escaped) reach OpenHands as they are, as do quotes and backslashes."""
    workspace = 'C:\\w "x" \U0001f600 \x7f \u00e9'
    odd = SessionContext(**{**ctx().__dict__, "workspace": workspace, "model": "m\U0001f600"})
    openhands.make().configure(tmp_path, odd)
    text = (tmp_path / ".openhands" / "polar.toml").read_bytes().decode("utf-8")
    config = tomllib.loads(text)
    assert config["core"]["workspace_base"] == workspace and config["llm"]["model"] == "openai/m\U0001f600"
    assert 'workspace_base = "C:\\\\w \\"x\\" \U0001f600 \\u007f \u00e9"\n' in text


def test_openhands_writes_its_config_as_utf8_under_an_ascii_locale(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """OpenHands reads its config as UTF-8: polar run under an ASCII locale still writes it so."""
    # What an ASCII locale without UTF-8 mode makes the default encoding of a text file (a subprocess with LC_ALL=C
    # would do, but mutation runs name the mutant in a non-ASCII environment variable such a child cannot decode).
    default = io.text_encoding
    monkeypatch.setattr(io, "text_encoding", lambda encoding, *a: "ascii" if encoding is None else default(encoding))
    with pytest.raises(UnicodeEncodeError):
        (tmp_path / "probe").write_text("\U0001f600")
    openhands.make().configure(tmp_path, SessionContext(**{**ctx().__dict__, "workspace": "/w/\U0001f600"}))
    text = (tmp_path / ".openhands" / "polar.toml").read_bytes().decode("utf-8")
    assert tomllib.loads(text)["core"]["workspace_base"] == "/w/\U0001f600"


def test_openhands_env_and_argv(install: Path) -> None:
    preset = openhands.make()
    assert preset.env(ctx()) == {"LLM_API_KEY": KEY, "LITELLM_LOCAL_MODEL_COST_MAP": "True", **OFFLINE}
    assert preset.command("fix it", ctx()) == [
        f"{install}/py/openhands/bin/python", "-P", "-m", "openhands.core.main",
        "--config-file", "/home/agent/.openhands/polar.toml", "-t", "fix it",
    ]  # fmt: skip


# --- npm harnesses -------------------------------------------------------------------------------------------------


def opencode_config(limit: dict[str, int] | None) -> dict[str, object]:
    model: dict[str, object] = {"name": "qwen-7b", "tool_call": True}
    if limit is not None:
        model["limit"] = limit
    return {
        "provider": {
            "polar": {
                "npm": "@ai-sdk/openai-compatible",
                "name": "polar",
                "options": {"baseURL": BASE, "apiKey": KEY},
                "models": {"qwen-7b": model},
            }
        },
        "model": "polar/qwen-7b",
        "small_model": "polar/qwen-7b",
        "enabled_providers": ["polar"],
        "autoupdate": False,
        "share": "disabled",
        "lsp": False,
        "formatter": False,
        "permission": {"edit": "allow", "bash": "allow", "webfetch": "deny", "external_directory": "allow"},
    }


@pytest.mark.parametrize(
    ("window", "output", "limit"),
    [
        (32768, 2048, {"context": 32768, "output": 2048}),
        (32776, None, {"context": 32776, "output": 4097}),  # an eighth of the window, whole tokens
        (None, 2048, {"context": 0, "output": 2048}),
        (None, None, None),
    ],
)
def test_opencode_provider_config(window: int | None, output: int | None, limit: dict[str, int] | None) -> None:
    config = opencode.provider_config(ctx(window, output))
    assert config == opencode_config(limit)
    if limit:
        assert all(type(v) is int for v in config["provider"]["polar"]["models"]["qwen-7b"]["limit"].values())


SWITCHES = [
    "DISABLE_MODELS_FETCH",
    "DISABLE_AUTOUPDATE",
    "DISABLE_DEFAULT_PLUGINS",
    "DISABLE_LSP_DOWNLOAD",
    "DISABLE_SHARE",
    "DISABLE_CLAUDE_CODE",
    "DISABLE_EXTERNAL_SKILLS",
]


def test_opencode_files_env_and_argv(install: Path, tmp_path: Path) -> None:
    preset = opencode.make()
    assert (preset.name, preset.binaries) == ("opencode", ("opencode",))
    home = tmp_path / "home"
    preset.configure(home, ctx())
    assert [p.relative_to(home) for p in home.rglob("*") if p.is_file()] == [Path(".config/opencode/opencode.json")]
    assert read_json(home / ".config" / "opencode" / "opencode.json") == opencode_config(
        {"context": 32768, "output": 2048}
    )
    assert preset.env(ctx()) == {
        **{f"OPENCODE_{s}": "1" for s in SWITCHES},
        "NODE_EXTRA_CA_CERTS": "/run/polar/ca.pem",
    }
    assert preset.command("fix it", ctx()) == [
        "opencode", "run", "--pure", "--model", "polar/qwen-7b", "--title", "sess-1", "fix it",
    ]  # fmt: skip


def test_kilocode_is_opencode_under_kilo_s_names(install: Path, tmp_path: Path) -> None:
    preset = kilocode.make()
    assert (preset.name, preset.binaries) == ("kilocode", ("kilo",))
    home = tmp_path / "home"
    preset.configure(home, ctx())
    assert [p.relative_to(home) for p in home.rglob("*") if p.is_file()] == [Path(".config/kilo/kilo.json")]
    assert read_json(home / ".config" / "kilo" / "kilo.json") == opencode_config({"context": 32768, "output": 2048})
    assert preset.env(ctx()) == {
        **{f"KILO_{s}": "1" for s in SWITCHES},
        "NODE_EXTRA_CA_CERTS": "/run/polar/ca.pem",
        "KILO_TELEMETRY_LEVEL": "off",
        "KILO_DISABLE_PRESENCE": "1",
        "KILO_DISABLE_SESSION_INGEST": "1",
        "KILO_DISABLE_CODEBASE_INDEXING": "1",
    }
    bin_dir = install / "node_modules" / ".bin"
    bin_dir.mkdir(parents=True)
    (bin_dir / "kilo").write_text("")
    assert preset.command("fix it", ctx()) == [
        f"{bin_dir}/kilo", "run", "--pure", "--model", "polar/qwen-7b", "--title", "sess-1", "fix it",
    ]  # fmt: skip


def test_cline_files_env_and_argv(install: Path, tmp_path: Path) -> None:
    preset = cline.make()
    assert (preset.name, preset.binaries) == ("cline", ("cline",))
    home = tmp_path / "home"
    preset.configure(home, ctx())
    settings = home / ".cline" / "data" / "settings"
    assert read_json(settings / "providers.json") == {
        "version": 1,
        "lastUsedProvider": "openai-compatible",
        "modes": {},
        "providers": {
            "openai-compatible": {
                "settings": {"provider": "openai-compatible", "apiKey": KEY, "model": "qwen-7b", "baseUrl": BASE},
                "updatedAt": "2026-01-01T00:00:00.000Z",
                "tokenSource": "manual",
            }
        },
    }
    assert read_json(settings / "global-settings.json") == {"telemetryOptOut": True, "autoUpdateEnabled": False}
    assert len([p for p in home.rglob("*") if p.is_file()]) == 2
    assert preset.env(ctx()) == {
        "CLINE_SESSION_BACKEND_MODE": "local",
        "CLINE_NO_AUTO_UPDATE": "1",
        "NODE_EXTRA_CA_CERTS": "/run/polar/ca.pem",
    }
    assert preset.command("fix it", ctx()) == [
        "cline", "--json", "--auto-approve", "true", "-c", "/workspace/repo", "-P", "openai-compatible",
        "-m", "qwen-7b", "fix it",
    ]  # fmt: skip


@pytest.mark.parametrize(
    ("window", "output", "options"),
    [
        (32768, 2048, {"contextLength": 32768, "maxTokens": 2048}),
        (32768, None, {"contextLength": 32768}),
        (None, 2048, {"maxTokens": 2048}),
        (None, None, None),
    ],
)
def test_continue_cli_config(window: int | None, output: int | None, options: dict | None, tmp_path: Path) -> None:
    continue_cli.make().configure(tmp_path, ctx(window, output))
    model = {
        "name": "qwen-7b",
        "provider": "openai",
        "model": "qwen-7b",
        "apiBase": BASE,
        "apiKey": KEY,
        "roles": ["chat", "edit", "apply"],
        "capabilities": ["tool_use"],
    }
    if options is not None:
        model["defaultCompletionOptions"] = options
    assert read_json(tmp_path / ".continue" / "config.yaml") == {
        "name": "polar",
        "version": "0.0.1",
        "schema": "v1",
        "models": [model],
    }


def test_continue_cli_env_and_argv(install: Path) -> None:
    preset = continue_cli.make()
    assert (preset.name, preset.binaries) == ("continue-cli", ("cn",))
    assert preset.env(ctx()) == {
        "CONTINUE_CLI_ENABLE_TELEMETRY": "0",
        "CONTINUE_METRICS_ENABLED": "0",
        "NODE_EXTRA_CA_CERTS": "/run/polar/ca.pem",
    }
    assert preset.command("fix it", ctx()) == [
        "cn", "-p", "--auto", "--config", "/home/agent/.continue/config.yaml", "fix it",
    ]  # fmt: skip


# --- what the agent can read ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("module", PYTHON_MODULES + NPM_MODULES, ids=lambda m: m.__name__.rsplit(".", 1)[-1])
def test_the_agent_sees_its_own_session_credential_only_and_never_on_the_command_line(
    module, install: Path, tmp_path: Path
) -> None:
    """Anything a preset writes the agent can read: the secret may only appear as the session's API key or the forward
    proxy's password, no other session field is a credential, and argv (in every process's /proc) never holds it."""
    preset = module.make()
    home = tmp_path / "home"
    context = ctx()
    preset.configure(home, context)
    written = [p.read_text() for p in home.rglob("*") if p.is_file() and p.parent.name != ".polar"]
    env = preset.env(context)
    for text in [*written, *env.values()]:
        rest = text.replace(KEY, "").replace(FORWARD, "")
        assert SECRET not in rest and "s3cr%2Ft" not in rest
    assert not any(SECRET in word or "s3cr%2Ft" in word for word in preset.command("fix it", context))
    # No variable overrides what the runner gives every session, and none is for the control plane.
    assert not {"HOME", "PATH", "SSL_CERT_FILE"} & set(env)
    assert not [name for name in env if name.startswith("POLAR_")]
