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
        "[core]\n\tfsmonitor = \"" + hook + "\"\n\tpager = \"" + hook + "\"\n\thooksPath = /nonexistent\n"
        "[diff \"evil\"]\n\ttextconv = \"" + hook + "\"\n\tcommand = \"" + hook + "\"\n"
        "[filter \"evil\"]\n\tclean = \"" + hook + "\"\n\tsmudge = \"" + hook + "\"\n")
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
        f.stat().st_size < 1024 * 1024 for f in (git_dir / "objects").glob("??/*")), "git read the huge file"
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


@pytest.mark.skipif(not (shutil.which("bwrap") and shutil.which("socat")), reason="bubblewrap/socat missing (make sandbox)")
def test_a_rollout_scores_a_huge_patch_zero_and_never_reads_it(tiny_model_dir: Path, tmp_path: Path) -> None:
    """Through the runner: a 3 GB (sparse) file in the workspace is `failed` with reward 0, stored as the policy's
    failure (trainable), its sibling that wrote a small answer is rewarded; the runner never hashed the big file."""
    from polar_cli.rollout.runner import RolloutConfig, run_rollout
    from polar_cli.rollout.tasks import load_tasks

    (tmp_path / "tasks.jsonl").write_text(json.dumps({"id": "t", "instruction": "x", "verify": "test -e answer"}) + "\n")
    script = tmp_path / "script.json"
    script.write_bytes(orjson.dumps({"model_dir": str(tiny_model_dir), "cycle": True, "turns": [{"content": "hi"}]}))
    agent = 'if [ "$POLAR_SAMPLE" = 0 ]; then truncate -s 3G big.bin; fi; echo done > answer; echo answered'
    config = RolloutConfig(tasks=load_tasks(tmp_path / "tasks.jsonl"), harness=f"cmd:{agent}", samples=2,
                           engine=f"scripted:{script}", out=str(tmp_path / "store"), runtime="bwrap", seed=1,
                           confdir=tmp_path / "conf", max_patch_bytes=1024 * 1024, stop_on_signals=False)
    result = asyncio.run(run_rollout(config))
    by_sample = {s.sample: s for s in result.sessions}
    assert by_sample[0].status == "failed" and by_sample[0].reward == 0.0, by_sample[0]
    assert "grew by" in (by_sample[0].reason or "")
    assert by_sample[1].status == "completed" and by_sample[1].reward == 1.0, by_sample[1]
