"""polar_cli.rollout.config: `polar rollout`'s refusals before anything runs (their words and the flag each names),
and every setting reaching the runner's RolloutConfig (pure: no proxy, no sandbox)."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from polar_cli.rollout import workspace as ws
from polar_cli.rollout.config import (
    NETWORKS,
    RolloutConfig,
    RolloutSettings,
    check_network,
    check_set_options,
    make_run_id,
)
from polar_cli.rollout.tasks import Task
from polar_cli.settings import SettingsError

LOCAL_REFUSAL = (
    "runtime local does not isolate the agent: it could read the proxy's control token and set its own "
    "reward; set trust_agent=True (--trust-agent) if you trust it, or use runtime bwrap or oci"
)

TOKEN_REFUSAL = (
    "--proxy needs the proxy's control token (--control-token or POLAR_CONTROL_TOKEN): rewards are posted with it"
)


def _settings(**fields: Any) -> RolloutSettings:
    base: dict[str, Any] = {"tasks": Path("tasks.jsonl"), "harness": "cmd:true", "engine": "scripted:x", "out": "s"}
    return RolloutSettings(**(base | fields))


def _refusal(settings: RolloutSettings) -> tuple[str, str | None]:
    with pytest.raises(SettingsError) as caught:
        settings.validate()
    return str(caught.value), caught.value.field


def test_runtime_local_without_trust_is_refused_in_full_words() -> None:
    with pytest.raises(ValueError) as caught:
        RolloutConfig(tasks=[], harness="cmd:true", runtime="local")
    assert str(caught.value) == LOCAL_REFUSAL
    # Trust lifts it; other runtimes never need it.
    RolloutConfig(tasks=[], harness="cmd:true", runtime="local", trust_agent=True)
    RolloutConfig(tasks=[], harness="cmd:true", runtime="oci")


def test_run_ids() -> None:
    assert make_run_id(0) == "r0"  # seed 0 is a seed, not "none"
    assert make_run_id(-3) == "r-3"


@pytest.mark.parametrize(
    ("fields", "message", "field"),
    [
        ({"engine": None}, "give --engine (start a proxy) or --proxy (use a running one)", "engine"),
        (
            {"proxy": "http://127.0.0.1:1", "control_token": "t"},
            "give --engine (start a proxy) or --proxy (use a running one)",
            "engine",
        ),
        ({"out": None}, "--engine needs --out (the trace store)", "out"),
        ({"out": ""}, "--engine needs --out (the trace store)", "out"),
        (
            {"engine": None, "proxy": "http://127.0.0.1:1", "ray": "auto", "control_token": "t"},
            "--ray starts a proxy on every node: give --engine (not --proxy)",
            "ray",
        ),
        (
            {"engine": None, "proxy": "http://127.0.0.1:1"},
            TOKEN_REFUSAL,
            "control_token",
        ),
        (
            {"engine": None, "proxy": "http://127.0.0.1:1", "control_token": ""},
            TOKEN_REFUSAL,
            "control_token",
        ),
        ({"network": "lan"}, "host or proxy-only", "network"),
        ({"network": ""}, "host or proxy-only", "network"),
        ({"proxy_set": ["a=1", "novalue"]}, "'novalue' is not KEY=VALUE", "proxy_set"),
        ({"proxy_set": ["=1"]}, "'=1' is not KEY=VALUE", "proxy_set"),
        ({"runtime_option": ["disk_mb=1", "bad"]}, "'bad' is not KEY=VALUE", "runtime_option"),
    ],
)
def test_each_refusal_says_why_and_names_its_field(fields: dict[str, Any], message: str, field: str) -> None:
    assert _refusal(_settings(**fields)) == (message, field)


def test_accepted_settings_pass() -> None:
    _settings().validate()
    _settings(ray="auto").validate()  # --ray with --engine
    _settings(engine=None, out=None, proxy="http://127.0.0.1:1", control_token="t").validate()  # --proxy, no store
    for network in (None, *NETWORKS):
        _settings(network=network).validate()
    _settings(proxy_set=["polar_max_tokens=512", "k="], runtime_option=["disk_mb=64", "x=a=b"]).validate()


def test_the_checks_on_their_own() -> None:
    assert NETWORKS == ("host", "proxy-only")
    check_network(None)
    check_network("host")
    with pytest.raises(SettingsError) as caught:
        check_network("HOST")
    assert (str(caught.value), caught.value.field) == ("host or proxy-only", "network")
    check_set_options([])
    with pytest.raises(SettingsError) as caught:
        check_set_options(["x"])
    assert (str(caught.value), caught.value.field) == ("'x' is not KEY=VALUE", "proxy_set")
    with pytest.raises(SettingsError) as caught:
        check_set_options(["x"], "runtime_option")
    assert caught.value.field == "runtime_option"
    assert isinstance(caught.value.__cause__, ValueError)


def test_every_setting_reaches_the_runners_config(tmp_path: Path) -> None:
    task = Task(id="t", instruction="x")
    settings = _settings(
        samples=3,
        out="store",
        engine="local:m",
        runtime="local",
        trust_agent=True,
        network="host",
        runtime_option=["disk_mb=64", "trust_root=true", "x=a=b"],
        concurrency=5,
        ready=2,
        timeout_s=9.5,
        early_stop=2,
        seed=7,
        model="m1",
        context_window=4096,
        max_output_tokens=512,
        init_attempts=4,
        max_patch_mb=3,
        work_dir=tmp_path / "work",
        keep_sessions=True,
        read_only=[Path("rel/ro")],
        confdir=tmp_path / "ca",
        proxy_set=["polar_max_tokens=512", "a=b=c"],
    )
    probed = SimpleNamespace(url="http://127.0.0.1:1")  # the probed proxy is handed on as it is
    config = settings.to_config([task], "cmd:true", probed, run_id="r7", logs_dir=tmp_path / "logs")  # type: ignore[arg-type]
    assert isinstance(config, RolloutConfig)
    got = {
        name: getattr(config, name)
        for name in (
            "tasks",
            "harness",
            "samples",
            "out",
            "engine",
            "proxy",
            "runtime",
            "trust_agent",
            "network",
            "runtime_options",
            "concurrency",
            "ready",
            "timeout_s",
            "early_stop",
            "seed",
            "model",
            "context_window",
            "max_output_tokens",
            "init_attempts",
            "max_patch_bytes",
            "work_dir",
            "keep_sessions",
            "read_only",
            "confdir",
            "proxy_options",
            "run_id",
            "logs_dir",
        )
    }
    assert got == {
        "tasks": [task],
        "harness": "cmd:true",
        "samples": 3,
        "out": "store",
        "engine": "local:m",
        "proxy": probed,
        "runtime": "local",
        "trust_agent": True,
        "network": "host",
        "runtime_options": {"disk_mb": 64, "trust_root": True, "x": "a=b"},
        "concurrency": 5,
        "ready": 2,
        "timeout_s": 9.5,
        "early_stop": 2,
        "seed": 7,
        "model": "m1",
        "context_window": 4096,
        "max_output_tokens": 512,
        "init_attempts": 4,
        "max_patch_bytes": 3 * 1024 * 1024,
        "work_dir": tmp_path / "work",
        "keep_sessions": True,
        "read_only": [Path("rel/ro").resolve()],
        "confdir": tmp_path / "ca",
        "proxy_options": {"polar_max_tokens": "512", "a": "b=c"},
        "run_id": "r7",
        "logs_dir": tmp_path / "logs",
    }
    assert config.read_only[0].is_absolute()
    assert settings.proxy_options() == {"polar_max_tokens": "512", "a": "b=c"}


def test_defaults_reach_the_runners_config_unchanged() -> None:
    config = _settings(runtime="bwrap").to_config([], "cmd:true", None)  # type: ignore[arg-type]
    defaults = RolloutConfig(tasks=[], harness="cmd:true")
    for name in (
        "samples",
        "concurrency",
        "ready",
        "timeout_s",
        "early_stop",
        "seed",
        "model",
        "init_attempts",
        "keep_sessions",
        "confdir",
        "trust_agent",
        "network",
        "context_window",
        "max_output_tokens",
    ):
        assert getattr(config, name) == getattr(defaults, name), name
    assert config.max_patch_bytes == ws.MAX_PATCH_BYTES == defaults.max_patch_bytes
    assert (config.runtime_options, config.proxy_options, config.read_only) == ({}, {}, [])


def test_a_config_needs_its_runtime_chosen_first() -> None:
    with pytest.raises(AssertionError) as caught:
        _settings().to_config([], "cmd:true", None)  # type: ignore[arg-type]
    assert str(caught.value) == "choose the runtime first"
