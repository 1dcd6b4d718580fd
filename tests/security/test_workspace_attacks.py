"""Attacks on what the runner does with the agent's workspace on the HOST after the agent ran (polar's own design:
issue 23 asks for attacks beyond the nine it found). The agent controls every byte of its workspace; the runner then
runs git on the host over it (the patch) and reads the result into memory.

Each test plants what a policy could leave behind and runs the runner's own workspace functions on it."""

from __future__ import annotations

import asyncio
import json
import os
import shutil
from pathlib import Path

import orjson
import pytest

from polar_cli.rollout import workspace as ws


def _start(tmp: Path) -> tuple[Path, Path, str]:
    work, git_dir = tmp / "workspace", tmp / "base.git"
    work.mkdir()
    (work / "main.py").write_text("print('hello')\n")

    async def go() -> str:
        await ws.ensure_repo(work)
        return await ws.snapshot(work, git_dir)

    return work, git_dir, asyncio.run(go())


def test_a_planted_git_config_never_runs_on_the_host(tmp_path: Path) -> None:
    """The workspace's own .git/config (core.fsmonitor, a diff textconv, a pager) is code the host's git would run as
    polar's user, outside every sandbox; the runner's git uses its own git dir, so none of it runs."""
    work, git_dir, base = _start(tmp_path)
    marker = tmp_path / "pwned"
    hook = f"touch {marker}; echo"
    (work / ".git" / "config").write_text(
        '[core]\n\tfsmonitor = "' + hook + '"\n\tpager = "' + hook + '"\n\thooksPath = /nonexistent\n'
        '[diff "evil"]\n\ttextconv = "' + hook + '"\n\tcommand = "' + hook + '"\n'
        '[filter "evil"]\n\tclean = "' + hook + '"\n\tsmudge = "' + hook + '"\n'
    )
    (work / ".gitattributes").write_text("* diff=evil filter=evil\n")
    (work / "main.py").write_text("print('changed')\n")
    patch = asyncio.run(ws.diff(work, git_dir, base))
    assert b"changed" in patch
    assert not marker.exists(), "the agent's git config ran a command on the host"
    # Control: the same config does run when git is pointed at the agent's repository, so the probe can fire.
    os.system(f"cd {work} && git -c safe.directory='*' status >/dev/null 2>&1")
    assert marker.exists()


def test_a_fifo_or_a_device_node_in_the_workspace_does_not_hang_the_patch(tmp_path: Path) -> None:
    work, git_dir, base = _start(tmp_path)
    os.mkfifo(work / "blocker")
    (work / "new.txt").write_text("x\n")

    async def bounded() -> bytes:
        return await asyncio.wait_for(ws.diff(work, git_dir, base), timeout=60)

    patch = asyncio.run(bounded())
    assert b"new.txt" in patch and b"blocker" not in patch


def test_a_huge_workspace_is_refused_before_git_reads_it(tmp_path: Path) -> None:
    """A multi-GB file would be hashed into the host's git dir and read whole into the runner; past the bound it is
    the policy's failure, found by size before git touches it."""
    work, git_dir, base = _start(tmp_path)
    with open(work / "big.bin", "wb") as fh:
        fh.truncate(3 * 1024 * 1024)  # sparse: cheap to make, full size to anyone who reads it
    with pytest.raises(ws.PatchTooLarge, match="grew by"):
        asyncio.run(ws.diff(work, git_dir, base, max_bytes=1024 * 1024))
    assert not any((git_dir / "objects").glob("??/*")) or all(
        f.stat().st_size < 1024 * 1024 for f in (git_dir / "objects").glob("??/*")
    ), "git read the huge file"
    # Under the bound the same change is a patch.
    assert b"big.bin" in asyncio.run(ws.diff(work, git_dir, base, max_bytes=8 * 1024 * 1024))


def test_a_patch_that_only_git_finds_large_is_cut_while_git_prints_it(tmp_path: Path) -> None:
    """Replacing files keeps the workspace's size but not the patch's: the output cap catches what the size test
    cannot (a patch holds the old and the new content)."""
    work, git_dir, _ = _start(tmp_path)
    (work / "data.bin").write_bytes(os.urandom(600 * 1024))
    base = asyncio.run(ws.snapshot(work, git_dir))
    (work / "data.bin").write_bytes(os.urandom(600 * 1024))  # same size, new bytes: a ~1.6 MB binary patch
    with pytest.raises(ws.PatchTooLarge, match="patch exceeds"):
        asyncio.run(ws.diff(work, git_dir, base, max_bytes=1024 * 1024))


@pytest.mark.skipif(
    not (shutil.which("bwrap") and shutil.which("socat")), reason="bubblewrap/socat missing (make sandbox)"
)
def test_a_rollout_scores_a_huge_patch_zero_and_never_reads_it(tiny_model_dir: Path, tmp_path: Path) -> None:
    """Through the runner: a 3 GB (sparse) file in the workspace is `failed` with reward 0, stored as the policy's
    failure (trainable), its sibling that wrote a small answer is rewarded; the runner never hashed the big file."""
    from polar_cli.rollout.runner import RolloutConfig, run_rollout
    from polar_cli.rollout.tasks import load_tasks

    (tmp_path / "tasks.jsonl").write_text(
        json.dumps({"id": "t", "instruction": "x", "verify": "test -e answer"}) + "\n"
    )
    script = tmp_path / "script.json"
    script.write_bytes(orjson.dumps({"model_dir": str(tiny_model_dir), "cycle": True, "turns": [{"content": "hi"}]}))
    agent = 'if [ "$POLAR_SAMPLE" = 0 ]; then truncate -s 3G big.bin; fi; echo done > answer; echo answered'
    config = RolloutConfig(
        tasks=load_tasks(tmp_path / "tasks.jsonl"),
        harness=f"cmd:{agent}",
        samples=2,
        engine=f"scripted:{script}",
        out=str(tmp_path / "store"),
        runtime="bwrap",
        seed=1,
        confdir=tmp_path / "conf",
        max_patch_bytes=1024 * 1024,
        stop_on_signals=False,
    )
    result = asyncio.run(run_rollout(config))
    by_sample = {s.sample: s for s in result.sessions}
    assert by_sample[0].status == "failed" and by_sample[0].reward == 0.0, by_sample[0]
    assert "grew by" in (by_sample[0].reason or "")
    assert by_sample[1].status == "completed" and by_sample[1].reward == 1.0, by_sample[1]


# ---- the host-side git itself, pure (tiny temp repos): what the patch and the bound mean exactly --------------------


def _run(coro):
    return asyncio.run(coro)


def test_a_failing_git_names_its_first_three_arguments_and_ends_with_its_stderr(tmp_path: Path) -> None:
    with pytest.raises(ws.WorkspaceError) as info:
        _run(ws.git("rev-parse", "--verify", "--quiet", "nosuchref", cwd=tmp_path))
    assert str(info.value).startswith("git rev-parse --verify --quiet failed (")
    _run(ws.git("init", "--quiet", cwd=tmp_path))
    long = "x" * 3000
    with pytest.raises(ws.WorkspaceError) as info:
        _run(ws.git("show", long, cwd=tmp_path))
    message = str(info.value)
    assert message.startswith("git show " + long[:20])
    head, _, stderr = message.partition("): ")
    assert head.endswith("failed (128") and len(stderr) == 2000 and "x" * 1000 in stderr
    assert _run(ws.git("rev-parse", "--verify", "nosuchref", cwd=tmp_path, check=False)) == b""


def test_git_runs_from_the_runners_path_even_without_a_home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    real = shutil.which("git")
    assert real
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    log = tmp_path / "calls"
    wrapper = bin_dir / "git"
    wrapper.write_text(f'#!/bin/sh\necho "$HOME" >> {log}\nexec {real} "$@"\n')
    wrapper.chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}:{os.environ['PATH']}")
    monkeypatch.delenv("HOME", raising=False)
    assert _run(ws.git("--version")).startswith(b"git version")
    assert log.read_text() == "/\n"


def test_the_hosts_git_environment_never_reaches_the_workspace_git(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    decoy = tmp_path / "decoy.git"
    monkeypatch.setenv("GIT_DIR", str(decoy))
    monkeypatch.setenv("GIT_WORK_TREE", str(tmp_path))
    work, git_dir, tree = _start(tmp_path)
    assert not decoy.exists()
    # ensure_repo committed the start on branch main (init.defaultBranch from polar's own flags, not the host's).
    assert _run(ws.git("symbolic-ref", "HEAD", cwd=work)).strip() == b"refs/heads/main"
    assert _run(ws.git("ls-tree", "--name-only", "HEAD", cwd=work)).split() == [b"main.py"]
    assert _run(ws.git("log", "--format=%s|%an|%ad", "--date=unix", cwd=work)).strip() == b"task start|polar|946684800"


def test_a_workspace_that_is_already_a_repository_is_left_as_it_is(tmp_path: Path) -> None:
    work = tmp_path / "w"
    work.mkdir()
    (work / "a").write_text("1")
    _run(ws.ensure_repo(work))
    head = _run(ws.git("rev-parse", "HEAD", cwd=work))
    (work / "b").write_text("2")
    _run(ws.ensure_repo(work))
    assert _run(ws.git("rev-parse", "HEAD", cwd=work)) == head
    assert _run(ws.git("rev-list", "--count", "HEAD", cwd=work)).strip() == b"1"


def test_tree_bytes_counts_regular_files_only_and_skips_the_top_git(tmp_path: Path) -> None:
    (tmp_path / "a").write_bytes(b"x" * 10)
    (tmp_path / "sub" / ".git").mkdir(parents=True)
    (tmp_path / "sub" / "b").write_bytes(b"x" * 100)
    (tmp_path / "sub" / ".git" / "c").write_bytes(b"x" * 1000)  # a nested repository's files are the agent's
    (tmp_path / ".git").mkdir()
    (tmp_path / ".git" / "d").write_bytes(b"x" * 10000)
    (tmp_path / ".GIT").mkdir()
    (tmp_path / ".GIT" / "e").write_bytes(b"x" * 3)
    (tmp_path / "link").symlink_to(tmp_path / ".git" / "d")
    os.mkfifo(tmp_path / "pipe")
    assert ws.tree_bytes(tmp_path) == 10 + 100 + 1000 + 3
    assert ws.tree_bytes(tmp_path / "sub" / ".git") == 1000
    empty = tmp_path / "empty"
    empty.mkdir()
    assert ws.tree_bytes(empty) == 0


def test_the_growth_bound_counts_growth_only_and_holds_exactly(tmp_path: Path) -> None:
    work, git_dir, tree = _start(tmp_path)
    (work / "base.bin").write_bytes(b"b" * 5000)  # after the start: growth, not base
    assert int((git_dir / "polar-base-bytes").read_text()) == len("print('hello')\n")
    assert _run(ws.snapshot(work, git_dir, max_growth=5000))
    with pytest.raises(ws.PatchTooLarge) as info:
        _run(ws.snapshot(work, git_dir, max_growth=4999))
    assert str(info.value) == "the agent's workspace grew by 5000 bytes, over the patch bound of 4999"


def test_the_patch_bound_holds_exactly_and_an_unchanged_workspace_has_no_patch(tmp_path: Path) -> None:
    work, git_dir, tree = _start(tmp_path)
    assert _run(ws.diff(work, git_dir, tree)) == b""
    (work / "main.py").write_text("print('bye')\n")
    patch = _run(ws.diff(work, git_dir, tree))
    assert _run(ws.diff(work, git_dir, tree, max_bytes=len(patch))) == patch
    with pytest.raises(ws.PatchTooLarge) as info:
        _run(ws.diff(work, git_dir, tree, max_bytes=len(patch) - 1))
    assert str(info.value) == f"the agent's patch exceeds {len(patch) - 1} bytes"


def test_a_large_binary_patch_applies_to_a_fresh_copy(tmp_path: Path) -> None:
    work, git_dir, tree = _start(tmp_path)
    template = tmp_path / "template"
    shutil.copytree(work, template, ignore=shutil.ignore_patterns(".git"))
    text = "".join(f"line {i} {i * i}\n" for i in range(20000))  # a patch of several read chunks
    blob = bytes(range(256)) * 64
    (work / "main.py").write_text(text)
    (work / "data.bin").write_bytes(blob)
    patch = _run(ws.diff(work, git_dir, tree))
    assert len(patch) > 3 * (1 << 16)
    assert b"GIT binary patch" in patch
    index_lines = [line for line in patch.splitlines() if line.startswith(b"index ")]
    assert index_lines and all(len(line.split()[1].split(b"..")[1]) == 40 for line in index_lines)
    fresh = tmp_path / "fresh"
    _run(ws.copy_template(template, fresh))
    _run(ws.apply(fresh, tmp_path / "fresh.git", patch))
    assert (fresh / "main.py").read_text() == text and (fresh / "data.bin").read_bytes() == blob
    _run(ws.apply(fresh, tmp_path / "fresh.git", b""))  # no patch: nothing to do
    assert (fresh / "main.py").read_text() == text


def test_the_runners_own_git_config_does_not_change_the_patch(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    home = tmp_path / "home"
    home.mkdir()
    (home / ".gitconfig").write_text("[diff]\n\tnoprefix = true\n\texternal = /bin/false\n")
    monkeypatch.setenv("HOME", str(home))
    work, git_dir, tree = _start(tmp_path)
    template = tmp_path / "template"
    shutil.copytree(work, template, ignore=shutil.ignore_patterns(".git"))
    (work / "main.py").write_text("print('bye')\n")
    patch = _run(ws.diff(work, git_dir, tree))
    assert patch.startswith(b"diff --git a/main.py b/main.py\n")
    _run(ws.apply(template, tmp_path / "t.git", patch))
    assert (template / "main.py").read_text() == "print('bye')\n"


def test_a_sessions_copy_keeps_links_as_links_and_an_empty_one_makes_its_parents(tmp_path: Path) -> None:
    secret = tmp_path / "host-secret"
    secret.write_text("s3cret")
    template = tmp_path / "template"
    template.mkdir()
    (template / "link").symlink_to(secret)
    copy = tmp_path / "sessions" / "1" / "workspace"
    _run(ws.copy_template(template, copy))
    assert (copy / "link").is_symlink() and os.readlink(copy / "link") == str(secret)
    empty = tmp_path / "sessions" / "2" / "workspace"
    _run(ws.copy_template(None, empty))
    assert empty.is_dir() and not any(empty.iterdir())
