"""The TOML config files presets write (Codex's config.toml, OpenHands' polar.toml) hold any string a model name, a
path or a URL may hold: a character past U+FFFF (which ASCII JSON would write as a surrogate pair TOML refuses), DEL,
quotes and backslashes all read back as written, with the harness's own TOML reader (tomllib here) under any locale."""

from __future__ import annotations

import tomllib
from pathlib import Path

import pytest

from polar_cli.rollout.harnesses._files import toml_value
from polar_cli.rollout.harnesses.codex import Codex
from tests.test_harnesses_a_units import context

AWKWARD = 'org/m\U0001f600del-\x7f "q" \\ é'


@pytest.mark.parametrize("value", [AWKWARD, "plain", "", 'a"b', "tab\tnl\n", 3, 2.5, True, False])
def test_a_toml_value_reads_back_as_itself(value: object) -> None:
    assert tomllib.loads(f"k = {toml_value(value)}")["k"] == value


def test_toml_value_spelling() -> None:
    assert toml_value("\U0001f600") == '"\U0001f600"'  # not "\ud83d\ude00"
    assert toml_value("\x7f") == '"\\u007f"'
    assert (toml_value(True), toml_value(131072)) == ("true", "131072")


@pytest.mark.parametrize("custom", [False, True])
def test_codex_config_holds_a_model_name_any_string_may_hold(
    tmp_path: Path, custom: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("LC_ALL", "C")  # the file is UTF-8 whatever the runner's locale
    Codex(custom_provider=custom).configure(tmp_path, context(model=AWKWARD, home=str(tmp_path)))
    config = tomllib.loads((tmp_path / ".codex" / "config.toml").read_bytes().decode("utf-8"))
    assert config["model"] == AWKWARD
