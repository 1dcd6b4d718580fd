"""The cmd: preset shows a sandbox what its command names on the host (found running a venv's python in bwrap:
`/work/.venv/bin/python: not found`)."""

from __future__ import annotations

from pathlib import Path

from polar_cli.rollout.harnesses import get_preset
from polar_cli.rollout.harnesses.command import named_host_paths


def _venv(root: Path, home: str) -> Path:
    venv = root / "venv"
    (venv / "bin").mkdir(parents=True)
    (venv / "bin" / "python").write_text("")
    (venv / "pyvenv.cfg").write_text(f"home = {home}\ninclude-system-site-packages = false\n")
    return venv


def test_a_venv_is_shown_whole_with_the_installation_it_was_made_from(tmp_path: Path) -> None:
    venv = _venv(tmp_path, str(tmp_path / "pyenv" / "3.11" / "bin"))
    agent = tmp_path / "agent.py"
    agent.write_text("")
    template = f"{venv}/bin/python {agent} --out relative/path {tmp_path}/missing {{instruction}}"
    assert named_host_paths(template) == (venv, tmp_path / "pyenv" / "3.11", agent)
    assert get_preset(f"cmd:{template}").read_only == (venv, tmp_path / "pyenv" / "3.11", agent)


def test_a_venv_made_from_the_system_python_adds_nothing_under_usr(tmp_path: Path) -> None:
    venv = _venv(tmp_path, "/usr/bin")
    assert named_host_paths(f"{venv}/bin/python -c 'print(1)'") == (venv,)
    assert named_host_paths("python agent.py {instruction}") == ()
