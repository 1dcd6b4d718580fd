"""polar_cli.settings: a settings dataclass is a Typer command's options (types, defaults, help, flags), its
validation and its manifest; every `polar` command is declared that way (pure, no run)."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import pytest
import typer
from typer.testing import CliRunner

from polar_cli import settings
from polar_cli.app import TinyModelSettings
from polar_cli.build_cmd import BuildSettings, StatsSettings, ViewSettings
from polar_cli.dashboard_cmd import DashboardSettings
from polar_cli.engine_cmd import EngineReloadSettings, EngineServeSettings, EngineStopSettings
from polar_cli.eval_cmd import EvalSettings
from polar_cli.export_cmd import ExportSettings
from polar_cli.loop_cmd import LoopSettings
from polar_cli.model_cmd import ModelImportGgufSettings
from polar_cli.proxy_cmd import ProxySettings
from polar_cli.rollout.config import RolloutConfig, RolloutSettings, make_run_id
from polar_cli.rollout.redact import REDACTED
from polar_cli.settings import SettingsError, option, reuse
from polar_cli.shards_cmd import RewardSettings, ShardsInspectSettings, ShardsValidateSettings
from polar_cli.train.config import TrainConfig


@dataclasses.dataclass
class Toy:
    source: Path = option(argument=True, help="Where from.")
    name: str = option(flags=("--name", "-N"), help="Who.")
    count: int = option(3, min=1, help="How many.")
    ratio: float | None = option(None, help="A fraction.")
    loud: bool = option(False, flags=("--loud",), help="Shout.")
    tags: list[str] = option(default_factory=list, flags=("--tag",), help="A tag (repeatable).")
    token: str | None = option(None, envvar="TOY_TOKEN", secret=True, help="A credential.")
    library_only: int = 7  # no option(): not on the command line

    def validate(self) -> None:
        if self.ratio is not None and not 0 <= self.ratio <= 1:
            raise SettingsError("a ratio is between 0 and 1", "ratio")


@dataclasses.dataclass
class Toy2:
    name: str = reuse(Toy, "name", help="Who, again.")
    count: int = reuse(Toy, "count", default=5)


def _app(seen: list) -> typer.Typer:
    @settings.command
    def toy(config: Toy, extra: bool = typer.Option(False, "--extra", help="A command-only flag.")) -> None:
        """The toy command."""
        config.validate()
        seen.append((config, extra))

    app = typer.Typer(add_completion=False)
    app.command()(toy)
    return app


def _help(app: typer.Typer, *args: str) -> str:
    """``--help`` as a wide terminal shows it: one row per option, nothing wrapped."""
    done = CliRunner().invoke(app, [*args, "--help"], env={"COLUMNS": "1000", "TERMINAL_WIDTH": "1000"})
    assert done.exit_code == 0, done.output
    return done.output


def _option_rows(text: str) -> list[str]:
    """The long flags each option row of the help declares (``--a/--no-a`` counts as ``--a``)."""
    flags = []
    for line in text.splitlines():
        row = re.match(r"^│\s+(?:\*\s+)?((?:--?[\w-]+(?:,\s*)?\s*)+)", line)
        if row:
            flags += [f for f in re.findall(r"--[\w-]+", row.group(1))]
    return flags


def test_a_settings_dataclass_round_trips_through_its_command(monkeypatch: pytest.MonkeyPatch) -> None:
    seen: list = []
    runner = CliRunner()
    monkeypatch.delenv("TOY_TOKEN", raising=False)
    done = runner.invoke(_app(seen), ["src", "-N", "ann"])
    assert done.exit_code == 0, done.output
    ((config, extra),) = seen
    assert config == Toy(source=Path("src"), name="ann") and extra is False
    assert (config.count, config.ratio, config.loud, config.tags, config.token, config.library_only) == (
        3, None, False, [], None, 7
    )  # fmt: skip

    seen.clear()
    monkeypatch.setenv("TOY_TOKEN", "s3cret")
    args = ["src", "--name", "bo", "--count", "2", "--ratio", "0.5", "--loud", "--tag", "a", "--tag", "b", "--extra"]
    done = runner.invoke(_app(seen), args)
    assert done.exit_code == 0, done.output
    ((config, extra),) = seen
    assert extra is True and isinstance(config.count, int) and isinstance(config.ratio, float)
    assert (config.count, config.ratio, config.loud, config.tags, config.token) == (2, 0.5, True, ["a", "b"], "s3cret")

    manifest = settings.manifest(config)
    assert manifest["token"] == REDACTED and "s3cret" not in repr(manifest)
    assert manifest["source"] == "src" and manifest["tags"] == ["a", "b"] and manifest["library_only"] == 7
    assert settings.manifest(Toy(source=Path("x"), name="n"))["token"] is None  # unset: nothing to hide


def test_types_bounds_and_validate_are_usage_errors_naming_the_flag() -> None:
    seen: list = []
    runner = CliRunner()
    for args, said in (
        (["src", "--name", "a", "--count", "zero"], "Invalid value for '--count'"),
        (["src", "--name", "a", "--count", "0"], "greater than or equal to 1"),
        (["src"], "Missing option '--name'"),
        (["src", "--name", "a", "--ratio", "2"], "Invalid value for --ratio: a ratio is between 0 and 1"),
    ):
        done = runner.invoke(_app(seen), args)
        assert done.exit_code == 2 and said in " ".join(done.output.replace("│", " ").split()), (args, done.output)
    assert not seen


def test_help_shows_each_option_once_with_its_default_and_help() -> None:
    text = _help(_app([]))
    assert "The toy command." in text
    for expected in ("--name", "-N", "Who.", "--count", "x>=1", "[default: 3]", "--loud", "Shout.", "--tag",
                     "A tag (repeatable).", "env var: TOY_TOKEN", "--extra", "source"):  # fmt: skip
        assert expected in text, (expected, text)
    assert "library-only" not in text and "library_only" not in text
    assert sorted(_option_rows(text)) == sorted(
        ["--name", "--count", "--ratio", "--loud", "--tag", "--token", "--extra", "--help"]
    ), text


def test_a_reused_field_keeps_flags_and_help_unless_changed() -> None:
    name, count = dataclasses.fields(Toy2)
    assert count.default == 5 and settings.spec(count).help == "How many." and settings.spec(count).min == 1
    assert name.default is dataclasses.MISSING and settings.spec(name).flags == ("--name", "-N")
    assert settings.spec(name).help == "Who, again."
    assert settings.flag(Toy2, "name") == "--name" and settings.flag(Toy, "source") == "SOURCE"


SETTINGS_OF_COMMANDS = [
    ("rollout", RolloutSettings),
    ("eval", EvalSettings),
    ("train", TrainConfig),
    ("loop", LoopSettings),
    ("build", BuildSettings),
    ("stats", StatsSettings),
    ("view", ViewSettings),
    ("proxy", ProxySettings),
    ("engine serve", EngineServeSettings),
    ("engine reload", EngineReloadSettings),
    ("engine stop", EngineStopSettings),
    ("shards inspect", ShardsInspectSettings),
    ("shards validate", ShardsValidateSettings),
    ("reward", RewardSettings),
    ("tiny-model", TinyModelSettings),
    ("model import-gguf", ModelImportGgufSettings),
    ("export", ExportSettings),
    ("dashboard", DashboardSettings),
]


@pytest.mark.parametrize(("name", "cls"), SETTINGS_OF_COMMANDS)
def test_every_cli_field_is_in_help_exactly_once(name: str, cls: type) -> None:
    from polar_cli.app import app

    command = typer.main.get_command(app)
    for word in name.split():
        command = command.commands[word]  # type: ignore[attr-defined]
    by_name = {p.name: p for p in command.params}
    text = _help(app, *name.split())
    usage = next(line for line in text.splitlines() if "Usage:" in line).lower()
    rows = _option_rows(text)
    for field in settings.cli_fields(cls):
        param = by_name[field.name]
        if settings.spec(field).argument:
            assert param.param_type_name == "argument" and field.name in usage, (field.name, usage)
            continue
        long = next(o for o in [*param.opts, *param.secondary_opts] if o.startswith("--"))
        assert rows.count(long) == 1, (field.name, long, rows)
    assert len(rows) == len(set(rows)), rows  # no flag declared twice
    own = {"train": {"verbose", "overwrite"}}.get(name, set())  # the command's own flags, beside its settings
    assert set(by_name) == {f.name for f in settings.cli_fields(cls)} | own, sorted(by_name)


def test_every_command_takes_its_options_from_a_settings_class() -> None:
    """No command of `polar` declares a Typer option in its signature any more, but for a few command-only flags."""
    from polar_cli.app import app

    def leaves(group: object, path: tuple[str, ...] = ()) -> list[str]:
        subs = getattr(group, "commands", None)
        if subs is None:
            return [" ".join(path)]
        return [leaf for word, sub in subs.items() for leaf in leaves(sub, (*path, word))]

    assert sorted(leaves(typer.main.get_command(app))) == sorted(name for name, _ in SETTINGS_OF_COMMANDS)


@pytest.mark.parametrize(
    ("args", "said"),
    [
        (["build", "{store}", "-o", "{tmp}/out", "--strategy", "x"], "Invalid value for --strategy: use one of"),
        (["build", "{store}", "-o", "{tmp}/full"], "Invalid value for --out:"),
        (["build", "{store}", "-o", "{tmp}/out", "--tool-call-reward", "nan"], "--tool-call-reward must be a finite"),
        (["build", "{store}", "-o", "{tmp}/out", "--tool-call-reward", "-0.5"], "finite number >= 0, not -0.5"),
        (["stats", "{store}", "--retokenized", "x"], "Invalid value for --retokenized: use one of merge, break"),
        (["view", "{store}", "--session", "s", "--retokenized", "x"], "Invalid value for --retokenized: use one"),
        (["view", "{tmp}/nothing", "--session", "s"], "Invalid value for 'shards': no trace store at"),
        (["proxy", "-e", "scripted:x", "-o", "{tmp}/o", "--port", "9", "--reverse-port", "9"], "--reverse-port"),
        (["reward", "{store}", "--session", "s"], "give --session with --value and/or --status"),
        (["reward", "{store}", "--file", "f", "--value", "1"], "give either --file or --session with --value"),
        (["reward", "{store}", "--session", "s", "--status", "x"], "Invalid value for --status: use one of"),
    ],
)
def test_each_command_refuses_bad_settings_as_a_usage_error(args: list[str], said: str, tmp_path: Path) -> None:
    from polar_cli.app import app

    store = tmp_path / "store"
    (store / "sessions").mkdir(parents=True)
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "x").write_text("kept")
    done = CliRunner().invoke(app, [a.format(store=store, tmp=tmp_path) for a in args])
    assert done.exit_code == 2 and said in " ".join(done.output.replace("│", " ").split()), done.output
    assert (tmp_path / "full" / "x").read_text() == "kept" and not (tmp_path / "out").exists()


def test_polar_train_flags_are_the_same_as_before() -> None:
    """The short flags and the renamed ones (--lr, --keep-zero-advantage that clears drop_zero_advantage)."""
    from polar_cli.train_cmd import train

    app = typer.Typer()
    app.command()(train)
    command = typer.main.get_command(app)
    ctx = command.make_context("t", ["S", "-m", "M", "-o", "O", "--lr", "0.5", "-v", "--keep-zero-advantage"])
    assert ctx.params["drop_zero_advantage"] is False and ctx.params["learning_rate"] == 0.5
    assert ctx.params["verbose"] is True and ctx.params["inputs"] == [Path("S")]
    ctx = command.make_context("t", ["S", "-m", "M", "-o", "O"])
    assert ctx.params["drop_zero_advantage"] is True
    assert {
        f.name: ctx.params[f.name] for f in settings.cli_fields(TrainConfig) if f.default is not dataclasses.MISSING
    } == {f.name: f.default for f in settings.cli_fields(TrainConfig) if f.default is not dataclasses.MISSING}


def test_polar_loop_forwards_rollout_options_to_each_rollout(tmp_path: Path) -> None:
    """--max-patch-mb (missing before), --trust-agent and --runtime-option reach every rollout's RolloutConfig."""
    from polar_cli.loop_cmd import loop
    from polar_cli.rollout.loop import rollout_config
    from polar_cli.rollout.tasks import Task

    app = typer.Typer()
    app.command()(loop)
    command = typer.main.get_command(app)
    args = ["T", "-H", "cmd:true", "-m", "M", "-k", "2", "-o", str(tmp_path), "--max-patch-mb", "3", "-c", "2"]
    args += ["--runtime-option", "disk_mb=64", "--runtime-option", "trust_root=true", "--runtime-option", "x=a=b"]
    params = command.make_context("loop", args).params
    loop_settings = LoopSettings(**{f.name: params[f.name] for f in settings.cli_fields(LoopSettings)})
    assert loop_settings.samples == 8 and loop_settings.served_model_name == "policy"
    loop_settings.runtime, loop_settings.trust_agent = "local", True
    task = Task(id="t", instruction="x")
    config = loop_settings.to_config([task], ["--lr", "1"])
    rollout = rollout_config(config, tmp_path / "iter-000", "local:M", 0, "it000")
    assert rollout.max_patch_bytes == 3 * 1024 * 1024 and rollout.concurrency == 2
    assert (rollout.runtime, rollout.trust_agent) == ("local", True)
    # --runtime-option values are typed as the runtimes take them: numbers and booleans from JSON, else text
    assert rollout.runtime_options == {"disk_mb": 64, "trust_root": True, "x": "a=b"}


def test_the_library_default_runtime_is_bwrap_and_local_needs_trust() -> None:
    assert RolloutConfig(tasks=[], harness="cmd:true").runtime == "bwrap"
    with pytest.raises(ValueError, match="trust_agent"):
        RolloutConfig(tasks=[], harness="cmd:true", runtime="local")
    assert RolloutConfig(tasks=[], harness="cmd:true", runtime="local", trust_agent=True).runtime == "local"


def test_run_ids_come_from_the_seed_or_are_random() -> None:
    assert make_run_id(5) == "r5"
    a, b = make_run_id(None), make_run_id(None)
    assert a != b and re.fullmatch(r"r[0-9a-f]{8}", a)


@pytest.mark.parametrize(
    ("args", "said"),
    [
        ([], "give --engine (start a proxy) or --proxy"),
        (["--engine", "scripted:x"], "--engine needs --out"),
        (["--proxy", "http://127.0.0.1:1", "--ray", "auto"], "give --engine (not --proxy)"),
        (["--proxy", "http://127.0.0.1:1"], "--proxy needs the proxy's control token"),
        (["--engine", "scripted:x", "-o", "s", "--network", "lan"], "host or proxy-only"),
        (["--engine", "scripted:x", "-o", "s", "--set", "novalue"], "'novalue' is not KEY=VALUE"),
    ],
)
def test_polar_rollout_refuses_bad_settings_before_anything(
    args: list[str], said: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from polar_cli.app import app

    monkeypatch.delenv("POLAR_CONTROL_TOKEN", raising=False)
    monkeypatch.chdir(tmp_path)
    done = CliRunner().invoke(app, ["rollout", "missing.jsonl", "--harness", "cmd:true", *args])
    assert done.exit_code == 2 and said in " ".join(done.output.replace("│", " ").split()), done.output
    assert not any(tmp_path.iterdir())  # no report directory, no store
