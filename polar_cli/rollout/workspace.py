"""Session workspaces on the host: the task's starting tree (a directory, a clone at a revision, or what a Harbor
Dockerfile copies), per-session copies, and the agent's changes as one binary git patch.

The baseline lives in a git directory outside the workspace (the session's own, on the host), so nothing the agent
does to the workspace's ``.git`` can change what counts as its patch; ``.git`` itself is never part of it (nor its
config: git runs with an explicit ``--git-dir``, so a ``core.fsmonitor`` the agent plants there never runs on the host).

The patch is bounded (``max_patch_bytes``): the agent controls the workspace, and a multi-GB file would otherwise be
hashed into the host's git directory and read whole into the runner's memory. A workspace that grew past the bound
is refused before git reads it (:class:`PatchTooLarge`: the policy's failure, scored 0), and git's output is read
with the same cap.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import stat
from pathlib import Path

from polar_cli.rollout.tasks import Task, TaskFileError, image_free_copies

# Same commits on every host: no user config (the runner's own ~/.gitconfig could set diff.noprefix or
# diff.external, which change the patch; only a task's clone reads it, for the user's credentials), no signing, a
# fixed identity and clock.
_GIT_ENV = {
    "GIT_CONFIG_NOSYSTEM": "1",
    "GIT_AUTHOR_NAME": "polar",
    "GIT_AUTHOR_EMAIL": "polar@localhost",
    "GIT_COMMITTER_NAME": "polar",
    "GIT_COMMITTER_EMAIL": "polar@localhost",
    "GIT_AUTHOR_DATE": "2000-01-01T00:00:00Z",
    "GIT_COMMITTER_DATE": "2000-01-01T00:00:00Z",
}
_GIT_FLAGS = [
    "-c",
    "core.excludesFile=/dev/null",
    "-c",
    "safe.directory=*",
    "-c",
    "commit.gpgsign=false",
    "-c",
    "core.autocrlf=false",
    "-c",
    "init.defaultBranch=main",
]


MAX_PATCH_BYTES = 64 * 1024 * 1024
_BASE_BYTES = "polar-base-bytes"  # in the baseline's git dir: the workspace's size when its start was taken
_READ_CHUNK = 1 << 16


class WorkspaceError(RuntimeError):
    pass


class PatchTooLarge(WorkspaceError):
    """The agent's changes exceed the rollout's patch bound (the policy's failure, not infrastructure)."""


async def git(
    *args: str,
    cwd: Path | None = None,
    stdin: bytes | None = None,
    check: bool = True,
    max_output: int | None = None,
    user_config: bool = False,
) -> bytes:
    """git's stdout; with ``max_output``, git is killed and :class:`PatchTooLarge` raised once it printed more.
    ``user_config``: read the user's ~/.gitconfig (a task repository's clone: its credentials, insteadOf)."""
    env = {
        **{k: v for k, v in os.environ.items() if k in ("PATH", "LANG", "LC_ALL")},
        **_GIT_ENV,
        "HOME": os.environ.get("HOME", "/"),
    }
    if not user_config:
        env["GIT_CONFIG_GLOBAL"] = "/dev/null"
    proc = await asyncio.create_subprocess_exec(
        "git", *_GIT_FLAGS, *args, cwd=cwd, env=env, stdin=asyncio.subprocess.PIPE if stdin is not None else None,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)  # fmt: skip
    if max_output is None:
        out, err = await proc.communicate(stdin)
    else:
        assert stdin is None and proc.stdout is not None and proc.stderr is not None
        errors = asyncio.create_task(proc.stderr.read())
        chunks, size = [], 0
        while chunk := await proc.stdout.read(_READ_CHUNK):
            size += len(chunk)
            if size > max_output:
                proc.kill()
                await proc.wait()
                errors.cancel()
                raise PatchTooLarge(f"the agent's patch exceeds {max_output} bytes")
            chunks.append(chunk)
        out, err = b"".join(chunks), await errors
        await proc.wait()
    if check and proc.returncode != 0:
        raise WorkspaceError(
            f"git {' '.join(args[:3])} failed ({proc.returncode}): {err.decode(errors='replace')[-2000:]}"
        )
    return out


def tree_bytes(root: Path) -> int:
    """Bytes of the regular files under ``root`` (``.git`` skipped, links not followed)."""
    total = 0
    for directory, dirs, files in os.walk(root):
        if directory == str(root):
            dirs[:] = [d for d in dirs if d != ".git"]
        for name in files:
            try:
                st = os.lstat(os.path.join(directory, name))
            except OSError:
                continue
            if stat.S_ISREG(st.st_mode):
                total += st.st_size
    return total


async def prepare_template(task: Task, cache: Path) -> Path | None:
    """The directory each session of ``task`` copies: the task's workspace as is, a clone at the revision (made once
    into ``cache``), the Harbor Dockerfile's copies into an empty tree, or None (an empty workspace)."""
    if task.workspace is not None:
        return task.workspace
    if task.repo is not None:
        target = cache / "clone"
        if not (target / ".git").is_dir():
            tmp = cache / "clone.tmp"
            shutil.rmtree(tmp, ignore_errors=True)
            cache.mkdir(parents=True, exist_ok=True)
            await git("clone", "--quiet", task.repo, str(tmp), user_config=True)
            if task.revision:
                commit = await _commit_of(tmp, task.revision)
                await git("checkout", "--quiet", "--detach", commit, cwd=tmp, user_config=True)
            tmp.rename(target)
        return target
    copies = image_free_copies(task)
    if copies:
        target = cache / "context"
        if not target.is_dir():
            tmp = cache / "context.tmp"
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir(parents=True)
            for source, rel in copies:
                dest = (tmp / rel).resolve()
                if _escapes(tmp.resolve(), dest, source):
                    raise TaskFileError(f"{task.dockerfile}: COPY to {rel!r} would leave the workspace through a link")
                if source.is_dir():
                    shutil.copytree(source, dest, symlinks=True, dirs_exist_ok=True)
                else:
                    dest.parent.mkdir(parents=True, exist_ok=True)
                    shutil.copy2(source, dest)
            tmp.rename(target)
        return target
    return None


def _escapes(root: Path, dest: Path, source: Path) -> bool:
    """Whether copying ``source`` to ``dest`` writes outside ``root``: through a link an earlier COPY put in the tree
    (``COPY src/ .`` with ``src/out -> /home/user``, then ``COPY x out/``), which the host would follow."""
    targets = [dest]
    if source.is_dir():  # each directory and file it will write (a file onto a link to a host file included)
        targets += [
            dest / os.path.relpath(directory, source) / name
            for directory, dirs, files in os.walk(source)
            for name in (".", *dirs, *files)
        ]
    return any(not target.resolve().is_relative_to(root) for target in targets)


async def _commit_of(clone: Path, revision: str) -> str:
    """The commit ``revision`` names in a fresh clone. A branch other than the default one is only ``origin/NAME``
    there, and ``git checkout --detach NAME`` refuses it (git guesses a new local branch, which --detach forbids)."""
    for name in (revision, f"origin/{revision}"):
        found = await git("rev-parse", "--verify", "--quiet", f"{name}^{{commit}}", cwd=clone, check=False)
        if found.strip():
            return found.decode().strip()
    raise WorkspaceError(f"revision {revision!r} is not in the task's repository")


async def copy_template(template: Path | None, dest: Path) -> None:
    if template is None:
        dest.mkdir(parents=True)
    else:
        await asyncio.to_thread(shutil.copytree, template, dest, symlinks=True)


async def ensure_repo(workspace: Path) -> None:
    """Make a workspace that is no git repository one, with its start committed: harnesses such as Codex expect a
    repository, and ``git diff`` is how agents look at their own changes."""
    if (workspace / ".git").exists():
        return
    await git("init", "--quiet", cwd=workspace)
    await git("add", "-A", cwd=workspace)
    await git("commit", "--quiet", "--allow-empty", "--no-verify", "-m", "task start", cwd=workspace)


async def snapshot(workspace: Path, git_dir: Path, max_growth: int | None = None) -> str:
    """The tree id of ``workspace``'s files now (``.gitignore`` honoured, ``.git`` never included), kept in ``git_dir``.

    The first snapshot records the workspace's size; with ``max_growth``, a workspace that grew by more than that
    since is refused (:class:`PatchTooLarge`) before git reads a byte of it."""
    if not (git_dir / "HEAD").exists():
        await git("init", "--quiet", "--bare", str(git_dir))
        (git_dir / _BASE_BYTES).write_text(str(await asyncio.to_thread(tree_bytes, workspace)))
    elif max_growth is not None:
        base = int((git_dir / _BASE_BYTES).read_text())
        grown = await asyncio.to_thread(tree_bytes, workspace) - base
        if grown > max_growth:
            raise PatchTooLarge(f"the agent's workspace grew by {grown} bytes, over the patch bound of {max_growth}")
    tree_args = ["--git-dir", str(git_dir), "--work-tree", str(workspace)]
    await git(*tree_args, "add", "-A", cwd=workspace)
    return (await git(*tree_args, "write-tree", cwd=workspace)).decode().strip()


async def diff(workspace: Path, git_dir: Path, base_tree: str, max_bytes: int = MAX_PATCH_BYTES) -> bytes:
    """The agent's changes: a binary patch from ``base_tree`` to the workspace's files now (b"" when unchanged), at
    most ``max_bytes`` (else :class:`PatchTooLarge`)."""
    now = await snapshot(workspace, git_dir, max_growth=max_bytes)
    if now == base_tree:
        return b""
    return await git(
        "--git-dir", str(git_dir), "diff", "--binary", "--full-index", base_tree, now, max_output=max_bytes
    )


async def apply(workspace: Path, git_dir: Path, patch: bytes) -> None:
    """Apply a patch from :func:`diff` to a fresh copy of the task's workspace."""
    if not patch:
        return
    if not (git_dir / "HEAD").exists():
        await git("init", "--quiet", "--bare", str(git_dir))
    await git(
        "--git-dir",
        str(git_dir),
        "--work-tree",
        str(workspace),
        "apply",
        "--binary",
        "--whitespace=nowarn",
        "-",
        cwd=workspace,
        stdin=patch,
    )
