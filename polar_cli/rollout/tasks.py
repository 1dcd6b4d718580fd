"""A task set: JSONL task lines or Harbor (Terminal-Bench) task directories, one :class:`Task` each.

:func:`load_tasks` reads either format (auto-detected) and says ``file:line`` for a bad entry; :func:`task_set_hash`
names the exact task set (definitions and the files they point at) in a run manifest.

JSONL, one task per line (``#`` lines and blank lines are skipped)::

    {"id": "fix-add", "instruction": "Fix add() so the tests pass.", "workspace": "repos/calc",
     "setup": "pip install -e .", "verify": "python -m pytest -q", "timeouts": {"agent": 300, "verify": 60},
     "metadata": {"difficulty": "easy"}}

``workspace`` is a directory relative to the JSONL file (or absolute); instead, ``repo`` (a git URL or path) with an
optional ``revision`` is cloned. ``verify`` exits 0 for reward 1.0, else 0.0, unless it writes ``reward_file``
(a path relative to the verifier's workspace, without ``..``: a float, or a flat JSON object name -> number).
``verify`` reads the harness's stdout (its final answer in print mode) from the file ``$POLAR_AGENT_OUTPUT`` names
(the runner's copy, outside the workspace; Harbor tasks: ``/logs/agent/stdout.txt``).

Harbor task directories (``task.toml``, ``instruction.md``, ``environment/Dockerfile``, ``tests/test.sh``), the format
of the ``harbor`` package 0.25 (read from its ``models/task`` and ``verifier`` sources; not a dependency): TASKS is
one such directory or a directory of them. ``tests/`` is bound at ``/tests`` for the verifier only, which runs
``bash /tests/test.sh`` and writes ``/logs/verifier/reward.json`` (flat name -> number) or ``reward.txt`` (a float);
``reward.json`` counts only when the task's tests mention it (``Task.reward_json``).
An image runtime builds ``environment/Dockerfile`` (or pulls ``[environment] docker_image``); runtimes without
images get as workspace what the Dockerfile's ``COPY``/``ADD`` lines put under its ``WORKDIR``.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shlex
import tomllib
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any


@dataclass(frozen=True)
class Task:
    """One verifiable task. Paths are absolute on the host.

    ``workspace``: the directory the agent starts in (copied per session), or None with ``repo`` (+ ``revision``)
    to clone. ``setup``/``verify`` are shell commands run inside the session's sandbox, in the workspace;
    ``verify`` exits 0 for reward 1.0, else 0.0, unless it writes a reward file (``reward_file``: a float, or
    a flat JSON object name -> number whose ``reward`` entry, else mean, is the reward). ``tests_dir`` (Harbor)
    is uploaded to ``/tests`` for the verifier only, never shown to the agent.
    """

    id: str
    instruction: str
    workspace: Path | None = None
    repo: str | None = None
    revision: str | None = None
    setup: str | None = None
    verify: str | None = None
    reward_file: str | None = None
    tests_dir: Path | None = None
    agent_timeout_s: float = 600.0
    verify_timeout_s: float = 300.0
    setup_timeout_s: float = 300.0
    image: str | None = None  # an OCI image name, for the oci runtime
    dockerfile: Path | None = None  # environment/Dockerfile (Harbor), built by the oci runtime
    workdir: str | None = None  # where the workspace is inside an image (Harbor [environment] workdir)
    metadata: dict[str, Any] = field(default_factory=dict)
    format: str = "jsonl"  # "jsonl" | "harbor"
    # Added with the loaders (defaults keep older constructors valid):
    cpus: float | None = None  # Harbor [environment] cpus, when the task says
    memory_mb: int | None = None  # Harbor [environment] memory_mb, when the task says
    allow_internet: bool = True  # Harbor [environment] allow_internet
    verify_env: Mapping[str, str] = field(default_factory=dict)  # Harbor [verifier] env
    source: str | None = None  # "FILE:LINE" or the task directory, for messages
    # Harbor: the task's own tests mention reward.json, so a reward.json is theirs to write (else only the code
    # under test could have written it, and only reward.txt is read: polar_cli.rollout.verify).
    reward_json: bool = False


class TaskFileError(ValueError):
    """A task file that cannot be read as a task; the message starts with ``FILE:LINE:`` (or the directory)."""


_TIMEOUT_KEYS = {"agent": "agent_timeout_s", "verify": "verify_timeout_s", "setup": "setup_timeout_s"}
# Task's own field names for the timeouts are accepted at the top level too (``"agent_timeout_s": 300``).
_JSONL_FIELDS = {
    "id",
    "instruction",
    "workspace",
    "repo",
    "revision",
    "setup",
    "verify",
    "reward_file",
    "timeouts",
    "metadata",
    "image",
    "workdir",
    "tests_dir",
    *_TIMEOUT_KEYS.values(),
}
# Harbor strips provenance canaries (HTML or hash comments naming a canary) from the top of instruction.md.
_CANARY = re.compile(r"^(<!--.*canary.*-->|#.*canary.*)$", re.IGNORECASE)


def load_tasks(path: str | os.PathLike[str], limit: int | None = None) -> list[Task]:
    """The tasks at ``path``: a JSONL file, a directory of ``*.jsonl`` files, a Harbor task directory, or a directory
    of Harbor task directories. ``limit`` keeps the first K (in file order, Harbor directories by name)."""
    root = Path(path).expanduser()
    if not root.exists():
        raise TaskFileError(f"{root}: no such file or directory")
    if root.is_file():
        tasks = _load_jsonl(root)
    elif (root / "task.toml").is_file():
        tasks = [_load_harbor(root)]
    else:
        jsonl = sorted(root.glob("*.jsonl"))
        harbor = sorted(d for d in root.iterdir() if d.is_dir() and (d / "task.toml").is_file())
        if jsonl and harbor:
            raise TaskFileError(f"{root}: holds both *.jsonl files and Harbor task directories; point at one kind")
        if jsonl:
            tasks = [t for f in jsonl for t in _load_jsonl(f)]
        elif harbor:
            tasks = [_load_harbor(d) for d in harbor]
        else:
            raise TaskFileError(
                f"{root}: no tasks: expected a .jsonl file, a directory of .jsonl files, a Harbor task "
                "directory (task.toml, instruction.md, tests/test.sh) or a directory of them"
            )
    seen: dict[str, str] = {}
    for task in tasks:
        if task.id in seen:
            raise TaskFileError(f"{task.source}: task id {task.id!r} already used at {seen[task.id]}")
        seen[task.id] = task.source or ""
    if limit is not None:
        if limit < 1:
            raise ValueError("the task limit must be at least 1")
        tasks = tasks[:limit]
    if not tasks:
        raise TaskFileError(f"{root}: the task set is empty")
    return tasks


def _load_jsonl(path: Path) -> list[Task]:
    tasks = []
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except UnicodeDecodeError as exc:
        raise TaskFileError(f"{path}: not UTF-8 text ({exc.reason})") from None
    for lineno, line in enumerate(lines, 1):
        if not line.strip() or line.lstrip().startswith("#"):
            continue
        where = f"{path}:{lineno}"
        try:
            entry = json.loads(line)
        except json.JSONDecodeError as exc:
            raise TaskFileError(f"{where}: not valid JSON ({exc.msg} at column {exc.colno})") from None
        if not isinstance(entry, dict):
            raise TaskFileError(f"{where}: a task line must be a JSON object, got {type(entry).__name__}")
        tasks.append(_jsonl_task(entry, path.parent, where))
    return tasks


def _text(entry: dict[str, Any], key: str, where: str, required: bool = False) -> str | None:
    value = entry.get(key)
    if value is None:
        if required:
            raise TaskFileError(f"{where}: missing {key!r}")
        return None
    if not isinstance(value, str) or (required and not value.strip()):
        raise TaskFileError(f"{where}: {key!r} must be a non-empty string")
    return value


def _jsonl_task(entry: dict[str, Any], base: Path, where: str) -> Task:
    unknown = set(entry) - _JSONL_FIELDS
    if unknown:
        raise TaskFileError(f"{where}: unknown field(s) {sorted(unknown)}; known: {sorted(_JSONL_FIELDS)}")
    task_id = entry.get("id")
    if isinstance(task_id, int) and not isinstance(task_id, bool):
        task_id = str(task_id)
    if not isinstance(task_id, str) or not task_id.strip() or len(task_id) > 256 or not task_id.isprintable():
        raise TaskFileError(f"{where}: 'id' must be a printable string of 1-256 characters")
    instruction = _text(entry, "instruction", where, required=True)
    workspace = repo = None
    # An empty path is refused, not read as the task file's own directory (its other tasks' tests, their answers).
    if entry.get("workspace") is not None:
        ws = Path(_text(entry, "workspace", where, required=True) or "").expanduser()
        workspace = (ws if ws.is_absolute() else base / ws).resolve()
        if not workspace.is_dir():
            raise TaskFileError(f"{where}: workspace {workspace} is not a directory")
    repo = _text(entry, "repo", where, required=entry.get("repo") is not None)
    if workspace is not None and repo is not None:
        raise TaskFileError(f"{where}: give 'workspace' or 'repo', not both")
    if repo is not None and not re.match(r"^[a-z][a-z0-9+.-]*://|^git@", repo):
        local = Path(repo).expanduser()
        repo = str((local if local.is_absolute() else base / local).resolve())
    revision = _text(entry, "revision", where)
    if revision is not None and repo is None:
        raise TaskFileError(f"{where}: 'revision' needs 'repo'")
    verify = _text(entry, "verify", where, required=True)
    timeouts = entry.get("timeouts") or {}
    if not isinstance(timeouts, dict):
        raise TaskFileError(f'{where}: \'timeouts\' must be an object like {{"agent": 600, "verify": 300}}')
    unknown_timeouts = set(timeouts) - set(_TIMEOUT_KEYS)
    if unknown_timeouts:
        raise TaskFileError(f"{where}: unknown timeout(s) {sorted(unknown_timeouts)}; known: {sorted(_TIMEOUT_KEYS)}")
    given = {f"timeouts.{k}": (_TIMEOUT_KEYS[k], v) for k, v in timeouts.items()}
    for name in _TIMEOUT_KEYS.values():
        if name in entry:
            if any(field == name for field, _ in given.values()):
                raise TaskFileError(f"{where}: {name} given twice (top level and in 'timeouts')")
            given[name] = (name, entry[name])
    limits: dict[str, float] = {}
    for label, (name, value) in given.items():
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < 1e7:
            raise TaskFileError(f"{where}: {label} must be a positive number of seconds")
        limits[name] = float(value)
    metadata = entry.get("metadata") or {}
    if not isinstance(metadata, dict):
        raise TaskFileError(f"{where}: 'metadata' must be an object")
    tests_dir = None
    if entry.get("tests_dir") is not None:
        tests_dir = (base / (_text(entry, "tests_dir", where, required=True) or "")).resolve()
        if not tests_dir.is_dir():
            raise TaskFileError(f"{where}: tests_dir {tests_dir} is not a directory")
    reward_file = _text(entry, "reward_file", where)
    if reward_file is not None and (
        not reward_file.strip() or reward_file.startswith("/") or ".." in reward_file.split("/")
    ):
        raise TaskFileError(
            f"{where}: 'reward_file' must be a path relative to the workspace, without '..' (got {reward_file!r})"
        )
    return Task(id=task_id, instruction=instruction or "", workspace=workspace, repo=repo, revision=revision,
                setup=_text(entry, "setup", where), verify=verify, reward_file=reward_file,
                tests_dir=tests_dir, image=_text(entry, "image", where), workdir=_text(entry, "workdir", where),
                metadata=metadata, format="jsonl", source=where, **limits)  # fmt: skip


def strip_canary(text: str) -> str:
    """instruction.md without its leading canary comment lines (and the blank lines after them), as Harbor shows it."""
    lines = text.split("\n")
    i = 0
    while i < len(lines) and _CANARY.match(lines[i].strip()):
        i += 1
    while i < len(lines) and not lines[i].strip():
        i += 1
    return "\n".join(lines[i:])


def _section(config: dict[str, Any], name: str, where: str) -> dict[str, Any]:
    value = config.get(name, {})
    if not isinstance(value, dict):
        raise TaskFileError(f"{where}: [{name}] must be a table")
    return value


def _number(table: dict[str, Any], key: str, where: str, section: str) -> float | None:
    value = table.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
        raise TaskFileError(f"{where}: [{section}] {key} must be a positive number")
    return float(value)


def _load_harbor(task_dir: Path) -> Task:
    task_dir = task_dir.resolve()
    toml_path = task_dir / "task.toml"
    try:
        config = tomllib.loads(toml_path.read_text(encoding="utf-8"))
    except tomllib.TOMLDecodeError as exc:
        # tomllib says "(at line L, column C)": keep it, in file:line form.
        match = re.search(r"\(at line (\d+), column (\d+)\)", str(exc))
        where = f"{toml_path}:{match.group(1)}" if match else str(toml_path)
        raise TaskFileError(f"{where}: invalid TOML: {exc}") from None
    where = str(toml_path)
    instruction_path = task_dir / "instruction.md"
    if not instruction_path.is_file():
        raise TaskFileError(f"{task_dir}: Harbor task without instruction.md")
    instruction = strip_canary(instruction_path.read_text(encoding="utf-8"))
    if not instruction.strip():
        raise TaskFileError(f"{instruction_path}: empty instruction")
    tests_dir = task_dir / "tests"
    if not (tests_dir / "test.sh").is_file():
        raise TaskFileError(f"{task_dir}: Harbor task without tests/test.sh (its verifier)")
    agent = _section(config, "agent", where)
    verifier = _section(config, "verifier", where)
    env = _section(config, "environment", where)
    meta = _section(config, "metadata", where)
    package = config.get("task")
    name = package.get("name") if isinstance(package, dict) else None
    if name is not None and (not isinstance(name, str) or not name.strip()):
        raise TaskFileError(f"{where}: [task] name must be a non-empty string")
    verify_env = verifier.get("env", {})
    if not isinstance(verify_env, dict) or not all(isinstance(v, str) for v in verify_env.values()):
        raise TaskFileError(f"{where}: [verifier] env must be a table of strings")
    image = env.get("docker_image")
    if image is not None and not isinstance(image, str):
        raise TaskFileError(f"{where}: [environment] docker_image must be a string")
    allow_internet = env.get("allow_internet", True)
    if not isinstance(allow_internet, bool):
        raise TaskFileError(f"{where}: [environment] allow_internet must be true or false")
    memory = _number(env, "memory_mb", where, "environment")
    dockerfile = task_dir / "environment" / "Dockerfile"
    workdir = env.get("workdir")
    if workdir is not None and not isinstance(workdir, str):
        raise TaskFileError(f"{where}: [environment] workdir must be a string")
    if workdir is None and dockerfile.is_file():
        workdir = dockerfile_workdir(dockerfile.read_text(encoding="utf-8", errors="replace"))
    return Task(
        id=name or task_dir.name,
        instruction=instruction,
        workspace=None,  # built per runtime: the image's WORKDIR, or image_free_workspace() without an image
        verify="bash /tests/test.sh > /logs/verifier/test-stdout.txt 2>&1",
        tests_dir=tests_dir,
        agent_timeout_s=_number(agent, "timeout_sec", where, "agent") or 600.0,
        verify_timeout_s=_number(verifier, "timeout_sec", where, "verifier") or 600.0,
        image=image,
        dockerfile=dockerfile if dockerfile.is_file() else None,
        workdir=workdir,
        metadata=dict(meta),
        format="harbor",
        cpus=_number(env, "cpus", where, "environment"),
        memory_mb=int(memory) if memory else None,
        allow_internet=allow_internet,
        verify_env=dict(verify_env),
        source=str(task_dir),
        reward_json=_mentions(tests_dir, b"reward.json"),
    )


def _mentions(directory: Path, needle: bytes) -> bool:
    """Whether a file under ``directory`` (the task's own, trusted) holds ``needle``; links are not followed."""
    for dirpath, _, filenames in os.walk(directory):
        for name in filenames:
            path = Path(dirpath) / name
            if path.is_file() and not path.is_symlink() and needle in path.read_bytes():
                return True
    return False


def dockerfile_workdir(text: str) -> str | None:
    """The last ``WORKDIR`` of a Dockerfile (where Harbor's agent and test.sh start), or None."""
    workdir = None
    for instruction, args in _dockerfile_instructions(text):
        if instruction == "WORKDIR" and args:
            path = args[0]
            workdir = path if path.startswith("/") or workdir is None else f"{workdir.rstrip('/')}/{path}"
    return workdir


def _dockerfile_instructions(text: str) -> list[tuple[str, list[str]]]:
    joined = re.sub(r"\\\n", " ", text)
    out = []
    for line in joined.splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        word, _, rest = line.partition(" ")
        rest = rest.strip()
        if rest.startswith("["):
            try:
                args = [str(a) for a in json.loads(rest)]
            except json.JSONDecodeError:
                args = shlex.split(rest)
        else:
            args = shlex.split(rest, posix=True) if rest else []
        out.append((word.upper(), args))
    return out


def image_free_copies(task: Task) -> list[tuple[Path, str]]:
    """For a Harbor task run without an image: (host source, path relative to the workspace) for each ``COPY``/``ADD``
    of the Dockerfile's build context whose destination lies under the final ``WORKDIR``. ``RUN`` lines are not
    replayed: a task that needs them needs an image runtime."""
    if task.dockerfile is None:
        return []
    context = task.dockerfile.parent
    workdir = (task.workdir or "/").rstrip("/") or "/"
    current = "/"
    copies: list[tuple[Path, str]] = []
    for instruction, args in _dockerfile_instructions(task.dockerfile.read_text(encoding="utf-8", errors="replace")):
        if instruction == "WORKDIR" and args:
            current = args[0] if args[0].startswith("/") else f"{current.rstrip('/')}/{args[0]}"
        if instruction not in ("COPY", "ADD"):
            continue
        paths = [a for a in args if not a.startswith("--")]
        if any(a.startswith("--from") for a in args) or len(paths) < 2:
            continue
        *sources, dest = paths
        absolute = dest if dest.startswith("/") else f"{current.rstrip('/')}/{dest}"
        rel = os.path.relpath(absolute, workdir)
        if rel.startswith(".."):
            continue
        for source in sources:
            if re.match(r"^[a-z]+://", source):
                continue
            for match in sorted(context.glob(source)) if any(c in source for c in "*?[") else [context / source]:
                resolved = match.resolve()
                if not resolved.exists() or context.resolve() not in (resolved, *resolved.parents):
                    raise TaskFileError(f"{task.dockerfile}: COPY source {source!r} is not in the build context")
                # COPY dir/ dest copies the directory's contents; a file into a dest ending in / keeps its name.
                target = rel
                if resolved.is_file() and (dest.endswith("/") or len(sources) > 1):
                    target = os.path.normpath(os.path.join(rel, resolved.name))
                copies.append((resolved, os.path.normpath(target)))
    return copies


def _hash_tree(digest: hashlib._Hash, root: Path) -> None:
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d != ".git")
        for name in sorted(filenames):
            path = Path(dirpath) / name
            digest.update(path.relative_to(root).as_posix().encode() + b"\0")
            if path.is_symlink():
                digest.update(b"L" + os.readlink(path).encode())
            elif path.is_file():
                digest.update(hashlib.sha256(path.read_bytes()).digest())


def task_set_hash(tasks: list[Task]) -> str:
    """sha256 over every task's definition and the bytes of the files it points at (workspace, tests, Dockerfile
    context), in task order: the same hash means the same task set."""
    digest = hashlib.sha256()
    for task in tasks:
        fields = {k: (str(v) if isinstance(v, Path) else v) for k, v in asdict(task).items() if k != "source"}
        fields["verify_env"] = dict(task.verify_env)
        digest.update(json.dumps(fields, sort_keys=True, default=str).encode() + b"\n")
        for directory in (task.workspace, task.tests_dir, task.dockerfile.parent if task.dockerfile else None):
            if directory is not None and directory.is_dir():
                _hash_tree(digest, directory)
    return digest.hexdigest()
