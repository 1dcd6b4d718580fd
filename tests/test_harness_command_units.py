"""``cmd:``'s preset on its own: the shell line it builds from the template, the environment that points any client
at polar with the session's own credential, and the host paths a sandbox must show for the command to run."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from polar_cli.rollout.harnesses import command
from polar_cli.rollout.harnesses.base import SessionContext
from polar_cli.rollout.harnesses.command import CommandPreset, named_host_paths


def context(**changes: object) -> SessionContext:
    fields: dict = dict(session_id="sess-1", task_id="task-1", group_id="grp-1", sample=3, model="org/m-1",
                        proxy_url="http://127.0.0.1:8080", reverse_url="http://127.0.0.1:8081", ca_path="/ca/ca.pem",
                        home="/home/polar", workspace="/workspace", secret="psk-s/1")  # fmt: skip
    return SessionContext(**{**fields, **changes})


def shell_words(argv: list[str]) -> list[str]:
    """What the command's words are once ``sh`` has parsed the line (each printed between bars)."""
    assert argv[:2] == ["sh", "-c"] and len(argv) == 3
    line = argv[2].replace("echo-words", "printf '%s|'", 1)
    return subprocess.run(["sh", "-c", line], capture_output=True, text=True, check=True).stdout.split("|")[:-1]


def test_an_empty_or_blank_command_is_refused_with_an_example() -> None:
    for template in ("", "  \t\n"):
        with pytest.raises(ValueError) as refused:
            CommandPreset(template)
        assert str(refused.value) == "cmd: needs a command, e.g. cmd:'python agent.py {instruction}'"
    with pytest.raises(ValueError, match="needs a command"):
        command.make(None)
    assert command.make("x {instruction}").template == "x {instruction}"
    assert CommandPreset(" a ").template == " a "  # kept as written: sh reads it


def test_every_placeholder_becomes_one_shell_word_of_its_value() -> None:
    preset = CommandPreset("echo-words {instruction} {model} {session} {task} {sample} {workspace} {instruction}")
    ctx = context(workspace="/my work", model="a model")
    argv = preset.command("fix it; rm -rf / 'q' \"$HOME\" `id`", ctx)
    assert argv[2] == (
        "echo-words 'fix it; rm -rf / '\"'\"'q'\"'\"' \"$HOME\" `id`' 'a model' sess-1 task-1 3 '/my work' "
        "'fix it; rm -rf / '\"'\"'q'\"'\"' \"$HOME\" `id`'"
    )
    assert shell_words(argv) == [
        "fix it; rm -rf / 'q' \"$HOME\" `id`", "a model", "sess-1", "task-1", "3", "/my work",
        "fix it; rm -rf / 'q' \"$HOME\" `id`",
    ]  # fmt: skip


def test_an_instruction_that_names_a_placeholder_arrives_unchanged() -> None:
    """Found by reading the substitution (fixed): each value was searched again for the placeholders after it, so
    an instruction saying ``{workspace}`` had the workspace put into it, and a workspace with a space split the
    instruction into two words."""
    preset = CommandPreset("echo-words {instruction}")
    instruction = "Fill in {workspace}, {model}, {session}, {task} and {sample}; keep {instruction} and {other}"
    assert shell_words(preset.command(instruction, context(workspace="/my ws"))) == [instruction]
    # Nor does a value that looks like a placeholder pick up another value.
    words = shell_words(CommandPreset("echo-words {model} {instruction}").command("go", context(model="{instruction}")))
    assert words == ["{instruction}", "go"]


def test_text_that_only_looks_like_a_placeholder_is_left_to_the_shell() -> None:
    preset = CommandPreset("echo-words {Model} { model } {models} $x {instruction}")
    assert preset.command("hi", context())[2] == "echo-words {Model} { model } {models} $x hi"


def test_the_environment_points_every_client_at_polar_with_the_session_alone() -> None:
    ctx = context()
    key = "polar:psk-s/1"
    proxy = "http://polar:psk-s%2F1@127.0.0.1:8080"
    assert CommandPreset("x").env(ctx) == {
        "OPENAI_API_KEY": key, "ANTHROPIC_API_KEY": key, "GEMINI_API_KEY": key, "GOOGLE_API_KEY": key,
        "OPENAI_BASE_URL": "http://127.0.0.1:8081/v1", "ANTHROPIC_BASE_URL": "http://127.0.0.1:8081",
        "GOOGLE_GEMINI_BASE_URL": "http://127.0.0.1:8081",
        "OPENAI_MODEL": "org/m-1", "ANTHROPIC_MODEL": "org/m-1",
        "HTTPS_PROXY": proxy, "https_proxy": proxy,
        "NO_PROXY": "127.0.0.1,localhost", "no_proxy": "127.0.0.1,localhost",
        "SSL_CERT_FILE": "/ca/ca.pem", "NODE_EXTRA_CA_CERTS": "/ca/ca.pem", "REQUESTS_CA_BUNDLE": "/ca/ca.pem",
        "CURL_CA_BUNDLE": "/ca/ca.pem",
        "POLAR_SESSION": "sess-1", "POLAR_TASK": "task-1", "POLAR_GROUP": "grp-1", "POLAR_SAMPLE": "3",
        "POLAR_MODEL": "org/m-1",
    }  # fmt: skip


def test_configure_writes_nothing(tmp_path: Path) -> None:
    CommandPreset("x {instruction}").configure(tmp_path, context(home=str(tmp_path)))
    assert list(tmp_path.iterdir()) == []


def _venv(root: Path, cfg: str) -> Path:
    venv = root / "venv"
    (venv / "bin").mkdir(parents=True)
    (venv / "bin" / "python").write_text("")
    (venv / "pyvenv.cfg").write_text(cfg)
    return venv


@pytest.mark.parametrize(
    ("cfg", "base"),
    [
        ("version = 3.11\nhome=/opt/py/3.11/bin\n", Path("/opt/py/3.11")),  # found past other keys, no spaces
        ("  home   =   /opt/py/bin  \n", Path("/opt/py")),
        ("pythonhome = /opt/a/bin\nhome = /opt/b/bin\n", Path("/opt/b")),  # the key itself, not a suffix of one
        ("home = /opt/a/bin\nhome = /opt/b/bin\n", Path("/opt/a")),  # the first
        ("home =\nhome = /opt/b/bin\n", Path("/opt/b")),  # an empty value is not a home
        ("version = 3.11\n", None),
        ("home = /usr/bin\n", None),  # the system's own: every sandbox shows /usr
        ("home = /usr/local/bin\n", None),
        ("home = /usrx/bin\n", Path("/usrx")),
        ("home = /opt/a=b/bin\n", Path("/opt/a=b")),  # a path may hold "="
    ],
)
def test_a_venv_is_shown_with_the_installation_its_pyvenv_cfg_names(tmp_path: Path, cfg: str, base: Path) -> None:
    venv = _venv(tmp_path, cfg)
    assert named_host_paths(f"{venv}/bin/python agent.py") == ((venv, base) if base else (venv,))


def test_a_pyvenv_cfg_that_is_not_utf8_is_still_read(tmp_path: Path) -> None:
    venv = _venv(tmp_path, "")
    (venv / "pyvenv.cfg").write_bytes(b"prompt = caf\xe9\nhome = /opt/py/bin\n")  # latin-1, as some tools write
    assert named_host_paths(f"{venv}/bin/python") == (venv, Path("/opt/py"))


def test_a_venvs_home_is_taken_through_links(tmp_path: Path) -> None:
    (tmp_path / "real" / "bin").mkdir(parents=True)
    (tmp_path / "link").symlink_to(tmp_path / "real")
    venv = _venv(tmp_path, f"home = {tmp_path}/link/bin\n")
    assert named_host_paths(f"{venv}/bin/python") == (venv, tmp_path / "real")


def test_named_paths_are_absolute_existing_and_listed_once(tmp_path: Path) -> None:
    venv = _venv(tmp_path, "home = /usr/bin\n")
    (tmp_path / "lib.py").write_text("")
    (tmp_path / "d").mkdir()
    (tmp_path / "d" / "pyvenv.cfg").mkdir()  # a directory of that name makes no venv
    (tmp_path / "d" / "run").write_text("")
    template = (
        f"{venv}/bin/python {venv}/bin/python -m x {tmp_path}/lib.py lib.py ./lib.py {tmp_path}/gone "
        f"--out={tmp_path}/lib.py {tmp_path}/d/run {tmp_path}/lib.py {venv}"
    )
    assert named_host_paths(template) == (venv, tmp_path / "lib.py", tmp_path / "d" / "run")
    assert CommandPreset(template).read_only == (venv, tmp_path / "lib.py", tmp_path / "d" / "run")


def test_a_template_sh_cannot_split_is_read_word_by_word(tmp_path: Path) -> None:
    (tmp_path / "a b").mkdir()
    (tmp_path / "agent").write_text("")
    # Quoted, a path with a space is one word; with an unclosed quote the words are split at spaces.
    assert named_host_paths(f"'{tmp_path}/a b' {{instruction}}") == (tmp_path / "a b",)
    assert named_host_paths(f"{tmp_path}/agent it's {tmp_path}/a b") == (tmp_path / "agent",)
    assert named_host_paths(f"{tmp_path}/agent it's") == (tmp_path / "agent",)
