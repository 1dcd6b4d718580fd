"""The starting tree every session of a task copies (polar_cli.rollout.workspace.prepare_template): the task's
directory as is, a clone at its revision made once per cache, or what a Harbor Dockerfile copies, on tiny local
repositories and planted task directories; and an empty start made a repository (``ensure_repo``)."""

from __future__ import annotations

import asyncio
import os
import subprocess
from pathlib import Path
from typing import Any

import pytest

from polar_cli.rollout import workspace as ws
from polar_cli.rollout.tasks import Task, TaskFileError


def _run(coro: Any) -> Any:
    return asyncio.run(coro)


def _git(cwd: Path, *args: str) -> str:
    env = {**os.environ, **ws._GIT_ENV, "GIT_CONFIG_GLOBAL": "/dev/null"}
    return subprocess.run(
        ["git", "-c", "init.defaultBranch=main", *args], cwd=cwd, env=env, check=True, capture_output=True, text=True
    ).stdout.strip()


def _origin(tmp: Path) -> tuple[Path, str]:
    """A repository with two commits; returns it and the first commit's id."""
    origin = tmp / "origin"
    origin.mkdir()
    _git(origin, "init", "-q")
    (origin / "calc.py").write_text("v1\n")
    _git(origin, "add", "-A")
    _git(origin, "commit", "-qm", "one")
    first = _git(origin, "rev-parse", "HEAD")
    (origin / "calc.py").write_text("v2\n")
    _git(origin, "commit", "-qam", "two")
    return origin, first


def test_a_task_directory_is_the_template_itself(tmp_path: Path) -> None:
    task = Task(id="t", instruction="x", workspace=tmp_path / "ws", repo=str(tmp_path / "ignored"))
    assert _run(ws.prepare_template(task, tmp_path / "cache")) == tmp_path / "ws"
    assert not (tmp_path / "cache").exists()  # nothing copied or cloned


def test_a_task_without_workspace_repo_or_copies_starts_empty(tmp_path: Path) -> None:
    assert _run(ws.prepare_template(Task(id="t", instruction="x"), tmp_path / "cache")) is None
    assert not (tmp_path / "cache").exists()


def test_a_repository_is_cloned_once_at_its_revision(tmp_path: Path) -> None:
    origin, first = _origin(tmp_path)
    cache = tmp_path / "cache" / "task-1"  # its parents are made
    task = Task(id="t", instruction="x", repo=str(origin), revision=first)
    template = _run(ws.prepare_template(task, cache))
    assert template == cache / "clone"
    assert (template / "calc.py").read_text() == "v1\n"
    assert _git(template, "rev-parse", "HEAD") == first
    assert sorted(p.name for p in cache.iterdir()) == ["clone"]  # the temporary clone was renamed, not left
    # The second session reuses the clone: a newer origin is not fetched, nothing is cloned again.
    (origin / "calc.py").write_text("v3\n")
    _git(origin, "commit", "-qam", "three")
    (template / "marker").write_text("kept")
    assert _run(ws.prepare_template(task, cache)) == template
    assert (template / "marker").read_text() == "kept" and (template / "calc.py").read_text() == "v1\n"


def test_a_branch_revision_is_checked_out_detached(tmp_path: Path) -> None:
    """The clone is the revision's commit, not a branch that a later ``git pull`` in the workspace would move."""
    origin, first = _origin(tmp_path)
    _git(origin, "branch", "polar-test-start", first)  # a name no repository running these tests has
    task = Task(id="t", instruction="x", repo=str(origin), revision="polar-test-start")
    template = _run(ws.prepare_template(task, tmp_path / "cache"))
    assert _git(template, "rev-parse", "HEAD") == first
    detached = subprocess.run(["git", "symbolic-ref", "-q", "HEAD"], cwd=template, capture_output=True, check=False)
    assert detached.returncode == 1


def test_without_a_revision_the_clone_is_the_default_branchs_head(tmp_path: Path) -> None:
    origin, _ = _origin(tmp_path)
    for revision in (None, ""):
        cache = tmp_path / f"cache-{revision}"
        template = _run(ws.prepare_template(Task(id="t", instruction="x", repo=str(origin), revision=revision), cache))
        assert (template / "calc.py").read_text() == "v2\n"
        assert _git(template, "symbolic-ref", "HEAD") == "refs/heads/main"  # a branch, not a detached head


def test_an_interrupted_clone_is_cleared_and_a_failed_one_leaves_no_template(tmp_path: Path) -> None:
    origin, first = _origin(tmp_path)
    cache = tmp_path / "cache"
    (cache / "clone.tmp").mkdir(parents=True)
    (cache / "clone.tmp" / "half-written").write_text("x")  # an earlier run killed mid-clone
    # A clone without .git (an earlier run's leftover) is not taken for a finished one.
    (cache / "clone").mkdir()
    with pytest.raises(ws.WorkspaceError, match="^revision 'no-such-rev' is not in the task's repository$"):
        _run(ws.prepare_template(Task(id="t", instruction="x", repo=str(origin), revision="no-such-rev"), cache))
    assert not (cache / "clone" / ".git").exists()
    with pytest.raises(ws.WorkspaceError, match="git clone --quiet"):
        _run(ws.prepare_template(Task(id="t", instruction="x", repo=str(tmp_path / "nowhere")), tmp_path / "c2"))
    assert not (tmp_path / "c2" / "clone").exists()
    (cache / "clone").rmdir()
    template = _run(ws.prepare_template(Task(id="t", instruction="x", repo=str(origin), revision=first), cache))
    assert not (template / "half-written").exists() and (template / "calc.py").read_text() == "v1\n"
    assert sorted(p.name for p in cache.iterdir()) == ["clone"]  # the failed clone's leftovers are gone


def test_the_clone_reads_the_users_git_config(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A task repository's clone is the one git call that may use the user's ~/.gitconfig (credentials, insteadOf)."""
    origin, first = _origin(tmp_path)
    home = tmp_path / "home"
    home.mkdir()
    (home / ".gitconfig").write_text(f'[url "{origin}"]\n\tinsteadOf = mirror:calc\n')
    monkeypatch.setenv("HOME", str(home))
    task = Task(id="t", instruction="x", repo="mirror:calc", revision=first)
    template = _run(ws.prepare_template(task, tmp_path / "cache"))
    assert _git(template, "rev-parse", "HEAD") == first


def _harbor(tmp: Path, dockerfile: str, files: dict[str, str], workdir: str | None = None) -> Task:
    context = tmp / "task" / "environment"
    context.mkdir(parents=True)
    for rel, text in files.items():
        (context / rel).parent.mkdir(parents=True, exist_ok=True)
        (context / rel).write_text(text)
    (context / "Dockerfile").write_text(dockerfile)
    return Task(id="h", instruction="x", dockerfile=context / "Dockerfile", workdir=workdir or "/app", format="harbor")


def test_a_harbor_template_is_what_the_dockerfile_copies_under_its_workdir(tmp_path: Path) -> None:
    task = _harbor(
        tmp_path,
        "FROM python:3.11\nWORKDIR /app\nCOPY src/ /app/\nCOPY lib/ /app/\nCOPY run.sh tools/bin/\n"
        "COPY secret.txt /root/\n",
        {"src/calc.py": "add\n", "src/pkg/m.py": "m\n", "lib/util.py": "u\n", "run.sh": "#!/bin/sh\n",
         "secret.txt": "not under /app\n"},
    )  # fmt: skip
    (task.dockerfile.parent / "run.sh").chmod(0o755)
    (task.dockerfile.parent / "src" / "link").symlink_to("/etc/hostname")
    cache = tmp_path / "cache" / "h"
    template = _run(ws.prepare_template(task, cache))
    assert template == cache / "context"
    files = sorted(str(p.relative_to(template)) for p in template.rglob("*"))
    # Two directories copied into the same place merge; a file into a new directory makes its parents.
    assert files == ["calc.py", "link", "pkg", "pkg/m.py", "tools", "tools/bin", "tools/bin/run.sh", "util.py"]
    assert (template / "pkg" / "m.py").read_text() == "m\n"
    assert os.readlink(template / "link") == "/etc/hostname"  # a link in the context stays a link
    assert os.stat(template / "tools" / "bin" / "run.sh").st_mode & 0o777 == 0o755  # its mode kept
    assert sorted(p.name for p in cache.iterdir()) == ["context"]
    # Built once: a later session reuses it as it is.
    (task.dockerfile.parent / "src" / "calc.py").write_text("changed\n")
    assert _run(ws.prepare_template(task, cache)) == template
    assert (template / "calc.py").read_text() == "add\n"


def test_a_harbor_template_replaces_an_interrupted_build(tmp_path: Path) -> None:
    task = _harbor(tmp_path, "FROM x\nWORKDIR /app\nCOPY a.txt ./\n", {"a.txt": "a\n"})
    cache = tmp_path / "cache"
    (cache / "context.tmp" / "stale").mkdir(parents=True)
    template = _run(ws.prepare_template(task, cache))
    assert sorted(p.name for p in template.iterdir()) == ["a.txt"]
    assert not (cache / "context.tmp").exists()


def test_a_harbor_copy_from_outside_its_build_context_is_refused(tmp_path: Path) -> None:
    outside = tmp_path / "host-secret"
    outside.write_text("s3cret")
    task = _harbor(tmp_path, "FROM x\nWORKDIR /app\nCOPY leak.txt ./\n", {})
    (task.dockerfile.parent / "leak.txt").symlink_to(outside)
    with pytest.raises(TaskFileError, match="COPY source 'leak.txt' is not in the build context"):
        _run(ws.prepare_template(task, tmp_path / "cache"))
    assert not (tmp_path / "cache" / "context").exists()


@pytest.mark.parametrize(
    "second", ["COPY a.txt /app/out/", "COPY a.txt /app/out", "COPY lib/ /app/", "COPY etc/ /app/etc/"]
)
def test_a_harbor_copy_never_writes_through_a_link_an_earlier_copy_made(tmp_path: Path, second: str) -> None:
    """``COPY src/ /app/`` brings ``out -> /somewhere/on/the/host`` into the tree; a later COPY onto ``out`` would have
    the host follow it and write there (a task set from the internet writing into the runner's home)."""
    victim = tmp_path / "victim"
    victim.mkdir()
    (victim / "bashrc").write_text("mine\n")
    files = {"a.txt": "x", "lib/out/b": "y", "etc/bashrc": "planted\n"}
    task = _harbor(tmp_path, f"FROM x\nWORKDIR /app\nCOPY src/ /app/\n{second}\n", files)
    assert task.dockerfile is not None
    (task.dockerfile.parent / "src" / "etc").mkdir(parents=True)
    (task.dockerfile.parent / "src" / "out").symlink_to(victim)
    (task.dockerfile.parent / "src" / "etc" / "bashrc").symlink_to(victim / "bashrc")  # a link to a host file
    with pytest.raises(TaskFileError, match="would leave the workspace through a link$"):
        _run(ws.prepare_template(task, tmp_path / "cache"))
    assert [p.name for p in victim.iterdir()] == ["bashrc"] and (victim / "bashrc").read_text() == "mine\n"
    assert not (tmp_path / "cache" / "context").exists()


def test_a_harbor_copy_through_a_link_inside_the_tree_is_kept(tmp_path: Path) -> None:
    task = _harbor(tmp_path, "FROM x\nWORKDIR /app\nCOPY src/ /app/\nCOPY a.txt /app/alias/\n", {"a.txt": "x"})
    assert task.dockerfile is not None
    (task.dockerfile.parent / "src" / "pkg").mkdir(parents=True)
    (task.dockerfile.parent / "src" / "alias").symlink_to("pkg")
    template = _run(ws.prepare_template(task, tmp_path / "cache"))
    assert (template / "pkg" / "a.txt").read_text() == "x" and os.readlink(template / "alias") == "pkg"


def test_an_empty_start_is_committed_as_the_task_start(tmp_path: Path) -> None:
    """A task that starts from nothing still gets a repository with a commit (--allow-empty): harnesses run
    ``git diff HEAD`` and Codex refuses to start outside a repository."""
    work = tmp_path / "w"
    work.mkdir()
    _run(ws.ensure_repo(work))
    assert _run(ws.git("log", "--format=%s", cwd=work)).strip() == b"task start"
    assert _run(ws.git("ls-tree", "HEAD", cwd=work)) == b""
