"""The harness presets without their CLIs: what each writes (environment, config files, argv) is what the real
harness reads, so a wrong variable name or key means the harness bypasses polar or runs the wrong model. Also what
the agent can see: only its own session's credential, never in argv (any process lists it), never more.

Covers the shared parts (``base``, ``_files``, ``_install``, ``_venv``, ``_bundled``, ``get_preset``) and the five
npm CLIs' presets (Claude Code, Codex, Qwen Code, Pi, Gemini CLI). Where a CLI is looked up, ``POLAR_HARNESS_DIR``
points at a temporary install and PATH at an empty directory, so the answers do not depend on this checkout."""

from __future__ import annotations

import dataclasses
import json
import tomllib
from pathlib import Path

import pytest

import polar_cli
from polar_cli.rollout.harnesses import _install, available_presets, get_preset, preset_names
from polar_cli.rollout.harnesses._bundled import SCRIPTS, BundledAgent
from polar_cli.rollout.harnesses._files import no_arg, write_json
from polar_cli.rollout.harnesses._install import InstalledHarness, executable, harness_dir
from polar_cli.rollout.harnesses._venv import VenvHarness, venv_dir, venv_python, venv_version
from polar_cli.rollout.harnesses.base import HarnessPreset, SessionContext
from polar_cli.rollout.harnesses.claude_code import ClaudeCode
from polar_cli.rollout.harnesses.codex import Codex
from polar_cli.rollout.harnesses.command import CommandPreset
from polar_cli.rollout.harnesses.gemini_cli import GeminiCli
from polar_cli.rollout.harnesses.pi import Pi
from polar_cli.rollout.harnesses.qwen_code import QwenCode

SECRET = "psk-s3/cr@t:1"  # a slash, an @ and a colon: each must be escaped in a proxy URL
KEY = "polar:" + SECRET
PROXY_WITH_SECRET = "http://polar:psk-s3%2Fcr%40t%3A1@127.0.0.1:8080"
ALL_PRESETS = ["aider", "claude-code", "cline", "codex", "continue-cli", "gemini-cli", "gptme", "kilocode", "kimi-cli",
               "mini-swe-agent", "openai-agents", "opencode", "openhands", "pi", "qwen-code", "smolagents"]  # fmt: skip


def context(window: int | None = None, max_output: int | None = None, **changes: object) -> SessionContext:
    fields: dict = dict(session_id="sess-1", task_id="task-1", group_id="grp-1", sample=2, model="org/model-1",
                        proxy_url="http://127.0.0.1:8080", reverse_url="http://127.0.0.1:8081", ca_path="/ca/ca.pem",
                        home="/home/polar", workspace="/workspace", secret=SECRET, context_window=window,
                        max_output_tokens=max_output)  # fmt: skip
    return SessionContext(**{**fields, **changes})


@pytest.fixture
def install(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """An empty ``.harness`` install of this test's own, and a PATH that finds nothing."""
    root = tmp_path / "install"
    root.mkdir()
    monkeypatch.setenv("POLAR_HARNESS_DIR", str(root))
    (tmp_path / "empty-path").mkdir()
    monkeypatch.setenv("PATH", str(tmp_path / "empty-path"))
    return root


def files_under(home: Path) -> dict[str, str]:
    return {str(p.relative_to(home)): p.read_text() for p in sorted(home.rglob("*")) if p.is_file()}


# --- the session context ----------------------------------------------------------------------------------------


def test_the_session_credential_as_an_api_key_and_as_proxy_credentials() -> None:
    ctx = context()
    assert ctx.api_key() == KEY
    assert ctx.forward_proxy_url() == PROXY_WITH_SECRET
    # The scheme and the host are kept as given.
    assert (
        context(proxy_url="https://10.0.0.1:3128").forward_proxy_url()
        == "https://polar:psk-s3%2Fcr%40t%3A1@10.0.0.1:3128"
    )
    assert context(secret="plain").forward_proxy_url() == "http://polar:plain@127.0.0.1:8080"


def test_a_printed_context_shows_no_credential() -> None:
    ctx = context()
    assert repr(ctx) == "SessionContext(session_id='sess-1', task_id='task-1', sample=2)"
    assert SECRET not in str(ctx) and SECRET not in f"{ctx!r}"


def test_a_context_is_fixed_and_has_no_window_unless_given() -> None:
    ctx = SessionContext("s", "t", "g", 0, "m", "http://p:1", "http://r:2", "/ca", "/h", "/w", "x")
    assert (ctx.context_window, ctx.max_output_tokens) == (None, None)
    with pytest.raises(dataclasses.FrozenInstanceError):
        ctx.secret = "y"  # type: ignore[misc]


def test_a_preset_must_implement_all_three_steps_and_knows_no_version_by_default() -> None:
    class Partial(HarnessPreset):
        name = "partial"

        def configure(self, home: Path, ctx: SessionContext) -> None: ...

        def env(self, ctx: SessionContext) -> dict[str, str]:
            return {}

    with pytest.raises(TypeError, match="command"):
        Partial()  # type: ignore[abstract]

    class Whole(Partial):
        def command(self, instruction: str, ctx: SessionContext) -> list[str]:
            return [instruction]

    whole = Whole()
    assert (whole.version(), whole.binaries, whole.read_only) == (None, (), ())


# --- writing config files, refusing arguments ------------------------------------------------------------------


def test_write_json_makes_the_folders_and_writes_indented_json_with_a_newline(tmp_path: Path) -> None:
    path = tmp_path / "a" / "b" / "settings.json"
    write_json(path, {"k": [1, {"x": True}]})
    assert path.read_text() == '{\n  "k": [\n    1,\n    {\n      "x": true\n    }\n  ]\n}\n'
    write_json(path, {"k": 2})  # a second write replaces the first; an existing folder is fine
    assert path.read_text() == '{\n  "k": 2\n}\n'


def test_a_preset_without_variants_refuses_an_argument_by_name() -> None:
    no_arg("aider", None)
    no_arg("aider", "")
    with pytest.raises(ValueError) as refused:
        no_arg("aider", "x")
    assert str(refused.value) == "harness 'aider' takes no argument (got 'x')"


# --- where the CLIs are ----------------------------------------------------------------------------------------


def test_the_install_is_the_checkouts_dot_harness_unless_the_environment_says(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("POLAR_HARNESS_DIR", raising=False)
    assert harness_dir() == Path(polar_cli.__file__).resolve().parents[1] / ".harness"
    monkeypatch.setenv("POLAR_HARNESS_DIR", "")
    assert harness_dir() == Path(polar_cli.__file__).resolve().parents[1] / ".harness"
    monkeypatch.setenv("POLAR_HARNESS_DIR", str(tmp_path / "h"))
    assert harness_dir() == tmp_path / "h"
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("POLAR_HARNESS_DIR", "rel/h")
    assert harness_dir() == tmp_path / "rel" / "h"  # absolute: the sandbox mounts it at that path


def test_a_cli_is_the_installs_link_unresolved_else_on_path_else_its_name(install: Path, tmp_path: Path) -> None:
    assert executable("claude") == "claude"
    on_path = tmp_path / "empty-path" / "claude"
    on_path.write_text("#!/bin/sh\n")
    on_path.chmod(0o755)
    assert executable("claude") == str(on_path)
    bin_dir = install / "node_modules" / ".bin"
    bin_dir.mkdir(parents=True)
    (install / "node_modules" / "cli.js").write_text("")
    (bin_dir / "claude").symlink_to("../cli.js")
    assert executable("claude") == str(bin_dir / "claude")  # the link, whose relative target resolves inside too
    assert executable("codex") == "codex"


def test_an_installed_harness_shows_the_install_only_when_there_is_one(
    install: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    assert ClaudeCode().read_only == (install,)
    monkeypatch.setenv("POLAR_HARNESS_DIR", str(install / "missing"))
    assert ClaudeCode().read_only == ()
    assert isinstance(ClaudeCode(), InstalledHarness) and _install.REPO == Path(polar_cli.__file__).parents[1]


# --- Python harnesses in venvs, and the bundled agents -----------------------------------------------------------


def _dist(site: Path, folder: str, name: str | None, version: str) -> None:
    info = site / folder
    info.mkdir(parents=True)
    (info / "METADATA").write_text((f"Name: {name}\n" if name else "") + f"Version: {version}\n")


def test_a_venvs_paths_and_the_version_installed_in_it(install: Path) -> None:
    assert venv_dir("aider") == install / "py" / "aider"
    assert venv_python("aider") == f"{install}/py/aider/bin/python"
    assert venv_version("aider", "aider-chat") is None  # no venv
    site = install / "py" / "aider" / "lib" / "python3.12" / "site-packages"
    _dist(site, "other-1.0.dist-info", "other", "1.0")
    _dist(site, "nameless-1.0.dist-info", None, "9.9")
    assert venv_version("aider", "aider-chat") is None
    _dist(site, "Aider_Chat-0.86.2.dist-info", "Aider_Chat", "0.86.2")  # PyPI's spelling varies in case and _/-
    assert venv_version("aider", "aider-chat") == "0.86.2"
    assert venv_version("gptme", "aider-chat") is None  # another venv's


class _Agent(BundledAgent):
    name = "bundled-test"
    venv = "agents"
    distribution = "openai-agents"
    script = "openai_agents_coder.py"
    extra_env = {"EXTRA": "1", "HTTPS_PROXY": "overridden"}


def test_a_venv_harness_shows_the_install_and_the_python_it_was_made_from(install: Path, tmp_path: Path) -> None:
    preset = _Agent()
    assert preset.python() == f"{install}/py/agents/bin/python"
    venv = install / "py" / "agents"
    (venv / "bin").mkdir(parents=True)
    (venv / "bin" / "python").write_text("")
    (venv / "pyvenv.cfg").write_text(f"home = {tmp_path}/base/3.12/bin\n")
    # The venv is inside the install (shown with it); its base installation is outside.
    assert preset.read_only == (install, tmp_path / "base" / "3.12")
    (venv / "pyvenv.cfg").write_text(f"home = {install}/python/bin\n")
    assert preset.read_only == (install,)
    site = venv / "lib" / "python3.12" / "site-packages"
    _dist(site, "openai_agents-0.24.0.dist-info", "openai-agents", "0.24.0")
    assert preset.version() == "0.24.0"


def test_a_venv_harness_without_an_install_needs_nothing_shown(install: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("POLAR_HARNESS_DIR", str(install / "missing"))
    assert _Agent().read_only == ()


def test_a_bundled_agent_is_copied_into_home_and_run_with_the_venvs_python(install: Path, tmp_path: Path) -> None:
    preset = _Agent()
    assert preset.in_home == ".polar/openai_agents_coder.py"
    preset.configure(tmp_path / "home", context())
    assert files_under(tmp_path / "home") == {
        ".polar/openai_agents_coder.py": (SCRIPTS / "openai_agents_coder.py").read_text()
    }
    preset.configure(tmp_path / "home", context())  # again, into a HOME that has it: replaced, no error
    assert len(files_under(tmp_path / "home")) == 1
    python = f"{install}/py/agents/bin/python"
    agent = "/home/polar/.polar/openai_agents_coder.py"
    assert preset.command("fix it", context(max_output=512)) == [
        python, "-P", agent, "--model", "org/model-1", "--max-tokens", "512", "fix it",
    ]  # fmt: skip
    assert preset.command("fix it", context()) == [python, "-P", agent, "--model", "org/model-1", "fix it"]
    assert preset.command("fix it", context(max_output=0))[-2:] == ["org/model-1", "fix it"]


def test_a_bundled_agent_reaches_the_reverse_proxy_and_sends_anything_else_to_the_forward_one() -> None:
    assert _Agent().env(context()) == {
        "OPENAI_API_KEY": KEY,
        "OPENAI_BASE_URL": "http://127.0.0.1:8081/v1",
        "EXTRA": "1",
        # The proxy settings come last: a preset's own variables cannot send traffic around polar.
        "HTTPS_PROXY": PROXY_WITH_SECRET,
        "https_proxy": PROXY_WITH_SECRET,
        "NO_PROXY": "127.0.0.1,localhost",
        "no_proxy": "127.0.0.1,localhost",
    }
    assert VenvHarness.forward_only_env(context(secret="k")) == {
        "HTTPS_PROXY": "http://polar:k@127.0.0.1:8080", "https_proxy": "http://polar:k@127.0.0.1:8080",
        "NO_PROXY": "127.0.0.1,localhost", "no_proxy": "127.0.0.1,localhost",
    }  # fmt: skip


# --- naming a preset -------------------------------------------------------------------------------------------


def test_the_preset_names_are_the_modules_with_a_make() -> None:
    assert preset_names() == ALL_PRESETS
    assert available_presets() == ALL_PRESETS


def test_a_spec_names_a_preset_and_its_argument() -> None:
    assert type(get_preset("claude-code")) is ClaudeCode
    assert type(get_preset("  qwen-code \n")) is QwenCode
    pi = get_preset("pi:anthropic-messages")
    assert type(pi) is Pi and pi.api == "anthropic-messages"
    assert get_preset("pi").api == get_preset("pi:").api == "openai-completions"  # an empty argument is none
    assert get_preset("codex:http").custom_provider is True and get_preset("codex").custom_provider is False
    with pytest.raises(ValueError, match="takes no argument"):
        get_preset("gemini-cli:x")


def test_cmd_takes_the_rest_of_the_spec_as_it_is() -> None:
    preset = get_preset(" cmd:python a.py {instruction} --pi:x")
    assert type(preset) is CommandPreset and preset.template == "python a.py {instruction} --pi:x"
    with pytest.raises(ValueError, match="needs a command"):
        get_preset("cmd:")


@pytest.mark.parametrize("spec", ["nope", "base", "claude_code.x", "a b", "", "nope:x"])
def test_an_unknown_preset_is_refused_with_the_available_names(spec: str) -> None:
    with pytest.raises(ValueError) as refused:
        get_preset(spec)
    name = spec.partition(":")[0]
    assert str(refused.value) == (
        f"unknown harness {name!r}; available: {', '.join(ALL_PRESETS)}, or cmd:'COMMAND {{instruction}}'"
    )


def test_a_module_that_is_not_a_preset_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    import sys
    import types

    fake = types.ModuleType("polar_cli.rollout.harnesses.fake_preset")
    monkeypatch.setitem(sys.modules, fake.__name__, fake)
    with pytest.raises(ValueError) as refused:
        get_preset("fake-preset")
    assert (
        str(refused.value) == "polar_cli.rollout.harnesses.fake_preset has no make(arg) function: not a harness preset"
    )
    fake.make = lambda arg=None: {"arg": arg}  # type: ignore[attr-defined]
    with pytest.raises(TypeError) as wrong:
        get_preset("fake-preset:x")
    assert str(wrong.value) == "polar_cli.rollout.harnesses.fake_preset.make returned dict, not a HarnessPreset"


# --- what the agent sees ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("spec", ["claude-code", "codex", "codex:http", "qwen-code", "pi", "gemini-cli"])
def test_the_secret_is_never_in_argv_and_only_the_sessions_own(spec: str, install: Path, tmp_path: Path) -> None:
    preset = get_preset(spec)
    ctx = context(131072, 4096, home=str(tmp_path))
    preset.configure(tmp_path, ctx)
    argv = preset.command("fix it", ctx)
    assert not any(SECRET in word or "psk-s3%2F" in word for word in argv)
    env = preset.env(ctx)
    seen = json.dumps(env) + json.dumps(files_under(tmp_path))
    # Nothing of the runner's own (control token, other sessions, the host's paths) reaches the harness.
    assert "POLAR_CONTROL" not in seen and "control" not in seen.lower() and str(Path.home()) + "/" not in seen
    # The secret is there as this session's key or proxy credentials, in no other form.
    assert SECRET in seen or "psk-s3%2F" in seen
    assert "psk-s3" not in seen.replace(KEY, "").replace(PROXY_WITH_SECRET, "")


# --- Claude Code ----------------------------------------------------------------------------------------------


def test_claude_code_sends_every_model_alias_to_the_reverse_proxy(install: Path) -> None:
    assert ClaudeCode().env(context()) == {
        "ANTHROPIC_MODEL": "org/model-1",
        "ANTHROPIC_DEFAULT_HAIKU_MODEL": "org/model-1",
        "ANTHROPIC_DEFAULT_SONNET_MODEL": "org/model-1",
        "ANTHROPIC_DEFAULT_OPUS_MODEL": "org/model-1",
        "CLAUDE_CODE_SUBAGENT_MODEL": "org/model-1",
        "ANTHROPIC_BASE_URL": "http://127.0.0.1:8081",
        "ANTHROPIC_API_KEY": KEY,
        "NODE_EXTRA_CA_CERTS": "/ca/ca.pem",
        "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1",
        "DISABLE_AUTOUPDATER": "1",
        "DISABLE_TELEMETRY": "1",
        "IS_SANDBOX": "1",
    }
    assert ClaudeCode().command("fix it", context()) == [
        "claude", "-p", "fix it", "--permission-mode", "bypassPermissions", "--output-format", "json",
    ]  # fmt: skip
    assert (ClaudeCode.name, ClaudeCode.binaries) == ("claude-code", ("claude",))


@pytest.mark.parametrize(
    ("window", "cap", "expected"),
    [
        (32_768, None, ("32768", "32768", "4096")),  # an eighth of the window
        (131_072, 4096, ("131072", "131072", "4096")),  # a given cap wins
        (None, 4096, (None, None, "4096")),
        (16, None, ("16", "16", "2")),
        (15, None, ("15", "15", "1")),  # rounded down
        (7, None, ("7", "7", "1")),  # never 0: Claude Code would take that as no cap
        (None, None, (None, None, None)),
    ],
)
def test_claude_code_window_and_output_cap(window: int | None, cap: int | None, expected: tuple) -> None:
    env = ClaudeCode().env(context(window, cap))
    names = ("CLAUDE_CODE_MAX_CONTEXT_TOKENS", "CLAUDE_CODE_AUTO_COMPACT_WINDOW", "CLAUDE_CODE_MAX_OUTPUT_TOKENS")
    assert tuple(env.get(name) for name in names) == expected


def test_claude_code_settings_skip_every_prompt(tmp_path: Path) -> None:
    ClaudeCode().configure(tmp_path, context())
    assert {name: json.loads(text) for name, text in files_under(tmp_path).items()} == {
        ".claude/settings.json": {"permissions": {"defaultMode": "bypassPermissions"}, "includeCoAuthoredBy": False},
        ".claude.json": {"hasCompletedOnboarding": True, "bypassPermissionsModeAccepted": True},
    }


def test_claude_code_qwen_and_gemini_take_no_argument() -> None:
    from polar_cli.rollout.harnesses import claude_code, gemini_cli, qwen_code

    for module, name in ((claude_code, "claude-code"), (qwen_code, "qwen-code"), (gemini_cli, "gemini-cli")):
        assert isinstance(module.make(None), HarnessPreset) and isinstance(module.make(""), HarnessPreset)
        with pytest.raises(ValueError) as refused:
            module.make("x")
        assert str(refused.value) == f"harness {name!r} takes no argument (got 'x')"


# --- Codex -----------------------------------------------------------------------------------------------------


def _codex_config(home: Path, custom: bool, window: int | None = None) -> tuple[str, dict]:
    Codex(custom_provider=custom).configure(home, context(window, home=str(home)))
    text = (home / ".codex" / "config.toml").read_text()
    return text, tomllib.loads(text)


COMMON_TABLES = {"analytics": {"enabled": False}, "feedback": {"enabled": False},
                 "features": {"plugins": False, "remote_plugin": False}}  # fmt: skip


def test_codex_default_provider_config_and_env(tmp_path: Path, install: Path) -> None:
    text, config = _codex_config(tmp_path, custom=False)
    assert config == {
        "model": "org/model-1", "approval_policy": "never", "sandbox_mode": "danger-full-access",
        "check_for_update_on_startup": False, **COMMON_TABLES,
    }  # fmt: skip
    assert text.endswith("remote_plugin = false\n") and SECRET not in text
    assert Codex().env(context(home="/home/polar")) == {
        "CODEX_HOME": "/home/polar/.codex",
        "RUST_LOG": "warn",
        "HTTPS_PROXY": PROXY_WITH_SECRET,
        "CODEX_CA_CERTIFICATE": "/ca/ca.pem",
        "SSL_CERT_FILE": "/ca/ca.pem",
        "OPENAI_API_KEY": "sk-polar-forward-proxy",  # not a credential: the session rides on the proxy's
    }
    assert Codex().command("fix it", context()) == [
        "codex", "exec", "--skip-git-repo-check", "--dangerously-bypass-approvals-and-sandbox", "--color", "never",
        "fix it",
    ]  # fmt: skip


def test_codex_custom_provider_config_and_env(tmp_path: Path) -> None:
    text, config = _codex_config(tmp_path, custom=True, window=131_072)
    assert config == {
        "model": "org/model-1", "model_provider": "polar", "approval_policy": "never",
        "sandbox_mode": "danger-full-access", "check_for_update_on_startup": False,
        "model_context_window": 131_072, "model_auto_compact_token_limit": 104_857, **COMMON_TABLES,
        "model_providers": {"polar": {
            "name": "polar", "base_url": "http://127.0.0.1:8081/v1", "env_key": "POLAR_API_KEY",
            "wire_api": "responses", "supports_websockets": False, "request_max_retries": 0, "stream_max_retries": 0,
        }},
    }  # fmt: skip
    assert SECRET not in text  # the key is in the environment only
    assert Codex(custom_provider=True).env(context(home="/h")) == {
        "CODEX_HOME": "/h/.codex", "RUST_LOG": "warn", "POLAR_API_KEY": KEY,
    }  # fmt: skip


def test_codex_config_goes_into_a_home_not_made_yet(tmp_path: Path) -> None:
    """As every preset's files do (write_json): the runner need not have made HOME first."""
    _, config = _codex_config(tmp_path / "new" / "home", custom=False)
    assert config["model"] == "org/model-1"


def test_codex_compacts_at_four_fifths_of_the_window(tmp_path: Path) -> None:
    _, config = _codex_config(tmp_path, custom=False, window=10)
    assert (config["model_context_window"], config["model_auto_compact_token_limit"]) == (10, 8)
    _, config = _codex_config(tmp_path, custom=False, window=9)
    assert config["model_auto_compact_token_limit"] == 7  # rounded down
    _, config = _codex_config(tmp_path, custom=False)
    assert "model_context_window" not in config and "model_auto_compact_token_limit" not in config


def test_codex_config_values_are_toml_strings(tmp_path: Path) -> None:
    """A model name with quotes and backslashes is one TOML string, not broken syntax or an extra key."""
    model = 'a"b\\c\nd = 1'
    Codex(custom_provider=True).configure(tmp_path, context(model=model, reverse_url='http://x"y'))
    config = tomllib.loads((tmp_path / ".codex" / "config.toml").read_text())
    assert config["model"] == model and "d" not in config
    assert config["model_providers"]["polar"]["base_url"] == 'http://x"y/v1'


def test_codex_takes_http_or_nothing() -> None:
    from polar_cli.rollout.harnesses import codex

    assert [codex.make(arg).custom_provider for arg in (None, "", "http")] == [False, False, True]
    with pytest.raises(ValueError) as refused:
        codex.make("ws")
    assert str(refused.value) == (
        "harness 'codex' takes no argument or 'http' (a custom provider at the reverse proxy), got 'ws'"
    )


# --- Qwen Code -------------------------------------------------------------------------------------------------


def test_qwen_code_settings_env_and_argv(tmp_path: Path, install: Path) -> None:
    QwenCode().configure(tmp_path, context(131_072, 4096))
    expected = {
        "security": {"auth": {"selectedType": "openai"}},
        "model": {"name": "org/model-1", "generationConfig": {"contextWindowSize": 131_072}},
        "tools": {"approvalMode": "yolo"},
        "general": {"enableAutoUpdate": False},
        "privacy": {"usageStatisticsEnabled": False},
        "telemetry": {"enabled": False},
    }
    assert {k: json.loads(v) for k, v in files_under(tmp_path).items()} == {".qwen/settings.json": expected}
    QwenCode().configure(tmp_path, context())
    assert json.loads((tmp_path / ".qwen" / "settings.json").read_text())["model"] == {"name": "org/model-1"}
    base = {"OPENAI_BASE_URL": "http://127.0.0.1:8081/v1", "OPENAI_API_KEY": KEY, "OPENAI_MODEL": "org/model-1",
            "NODE_EXTRA_CA_CERTS": "/ca/ca.pem"}  # fmt: skip
    assert QwenCode().env(context(131_072, 4096)) == {**base, "QWEN_CODE_MAX_OUTPUT_TOKENS": "4096"}
    assert QwenCode().env(context(131_072)) == base
    assert QwenCode().command("fix it", context()) == ["qwen", "--auth-type", "openai", "--yolo", "-p", "fix it"]


# --- Pi --------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("api", "path", "openai"),
    [
        ("openai-completions", "/v1", True),
        ("openai-responses", "/v1", True),
        ("anthropic-messages", "", False),
        ("google-generative-ai", "/v1beta", False),
    ],
)
def test_pi_provider_for_each_api(api: str, path: str, openai: bool, tmp_path: Path) -> None:
    from polar_cli.rollout.harnesses import pi

    preset = pi.make(api)
    preset.configure(tmp_path, context(131_072, 4096))
    provider = {
        "baseUrl": "http://127.0.0.1:8081" + path,
        "api": api,
        "apiKey": KEY,
        "models": [{"id": "org/model-1", "contextWindow": 131_072, "maxTokens": 4096}],
    }
    if openai:
        provider["compat"] = {"supportsDeveloperRole": False, "supportsReasoningEffort": False}
    assert {k: json.loads(v) for k, v in files_under(tmp_path).items()} == {
        ".pi/agent/models.json": {"providers": {"polar": provider}}
    }


def test_pi_window_cap_env_argv_and_arguments(tmp_path: Path, install: Path) -> None:
    from polar_cli.rollout.harnesses import pi

    def models(window: int | None, cap: int | None) -> list:
        Pi().configure(tmp_path, context(window, cap))
        return json.loads((tmp_path / ".pi" / "agent" / "models.json").read_text())["providers"]["polar"]["models"]

    assert models(None, None) == [{"id": "org/model-1"}]
    assert models(8192, None) == [{"id": "org/model-1", "contextWindow": 8192}]
    assert models(None, 512) == [{"id": "org/model-1", "maxTokens": 512}]
    assert Pi().env(context()) == {"PI_OFFLINE": "1", "NODE_EXTRA_CA_CERTS": "/ca/ca.pem"}
    assert Pi().command("fix it", context()) == [
        "pi", "-p", "--provider", "polar", "--model", "org/model-1", "--no-session", "fix it",
    ]  # fmt: skip
    assert pi.make(None).api == pi.make("").api == "openai-completions"
    with pytest.raises(ValueError) as refused:
        pi.make("openai")
    assert str(refused.value) == (
        "harness 'pi': unknown API 'openai'; use one of openai-completions, openai-responses, anthropic-messages, "
        "google-generative-ai"
    )


# --- Gemini CLI ------------------------------------------------------------------------------------------------


def test_gemini_cli_settings_env_and_argv(tmp_path: Path, install: Path) -> None:
    GeminiCli().configure(tmp_path, context(131_072, 4096))
    assert {k: json.loads(v) for k, v in files_under(tmp_path).items()} == {
        ".gemini/settings.json": {
            "security": {"auth": {"selectedType": "gemini-api-key"}},
            "general": {"enableAutoUpdate": False, "enableAutoUpdateNotification": False},
            "privacy": {"usageStatisticsEnabled": False},
            "telemetry": {"enabled": False},
            # The CLI takes an unknown model for 1,048,576 tokens: half the served window, as its share of that.
            "model": {"compressionThreshold": 0.0625},
            "modelConfigs": {"overrides": [{
                "match": {"model": "org/model-1"},
                "modelConfig": {"generateContentConfig": {"maxOutputTokens": 4096}},
            }]},
        }
    }  # fmt: skip
    GeminiCli().configure(tmp_path, context())
    settings = json.loads((tmp_path / ".gemini" / "settings.json").read_text())
    assert "model" not in settings and "modelConfigs" not in settings
    GeminiCli().configure(tmp_path, context(32_768))
    settings = json.loads((tmp_path / ".gemini" / "settings.json").read_text())
    assert settings["model"] == {"compressionThreshold": 0.015625} and "modelConfigs" not in settings
    assert GeminiCli().env(context()) == {
        "GOOGLE_GEMINI_BASE_URL": "http://127.0.0.1:8081", "GEMINI_API_KEY": KEY, "NODE_EXTRA_CA_CERTS": "/ca/ca.pem",
    }  # fmt: skip
    assert GeminiCli().command("fix it", context()) == [
        "gemini", "-p", "fix it", "-m", "org/model-1", "--yolo", "--skip-trust",
    ]  # fmt: skip


def test_each_npm_preset_names_its_cli() -> None:
    presets = (ClaudeCode(), Codex(), QwenCode(), Pi(), GeminiCli())
    assert [(p.name, p.binaries) for p in presets] == [
        ("claude-code", ("claude",)), ("codex", ("codex",)), ("qwen-code", ("qwen",)), ("pi", ("pi",)),
        ("gemini-cli", ("gemini",)),
    ]  # fmt: skip
