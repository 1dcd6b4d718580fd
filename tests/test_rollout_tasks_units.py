"""The task loaders' decisions one by one (polar_cli.rollout.tasks): what a JSONL line or a Harbor directory becomes,
what is refused and with which message (the message names the file and line a person fixes), what a Harbor
Dockerfile puts in an image-free workspace (never anything outside its build context), and what the task-set hash
covers. Plain functions on planted files."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

import pytest

from polar_cli.rollout.tasks import (
    Task,
    TaskFileError,
    _hash_tree,
    dockerfile_workdir,
    image_free_copies,
    load_tasks,
    strip_canary,
    task_set_hash,
)

_BASE = {"id": "a", "instruction": "fix it", "verify": "true"}


def _jsonl(tmp: Path, *entries: object) -> Path:
    path = tmp / "tasks.jsonl"
    path.write_text("".join((e if isinstance(e, str) else json.dumps(e)) + "\n" for e in entries))
    return path


def _refused(path: Path, **kwargs: Any) -> str:
    with pytest.raises(TaskFileError) as info:
        load_tasks(path, **kwargs)
    return str(info.value)


# --- JSONL -----------------------------------------------------------------------------------------------------


def test_a_full_jsonl_task_keeps_every_field(tmp_path: Path) -> None:
    (tmp_path / "repo").mkdir()
    (tmp_path / "checks").mkdir()
    entry = {
        **_BASE,
        "instruction": "Fix add().",
        "workspace": "repo",
        "setup": "pip install -e .",
        "verify": "pytest -q",
        "reward_file": "out/reward.json",
        "tests_dir": "checks",
        "image": "python:3.11",
        "workdir": "/src",
        "metadata": {"level": 2},
        "timeouts": {"agent": 0.5, "setup": 9999999.5},
    }
    [task] = load_tasks(_jsonl(tmp_path, entry))
    assert task == Task(
        id="a",
        instruction="Fix add().",
        workspace=tmp_path / "repo",
        setup="pip install -e .",
        verify="pytest -q",
        reward_file="out/reward.json",
        tests_dir=tmp_path / "checks",
        agent_timeout_s=0.5,
        setup_timeout_s=9999999.5,
        image="python:3.11",
        workdir="/src",
        metadata={"level": 2},
        format="jsonl",
        source=f"{tmp_path / 'tasks.jsonl'}:1",
    )
    [bare] = load_tasks(_jsonl(tmp_path, _BASE))
    assert (bare.tests_dir, bare.setup, bare.image, bare.workdir, bare.reward_file) == (None, None, None, None, None)
    assert (bare.workspace, bare.repo, bare.format, bare.metadata) == (None, None, "jsonl", {})


def test_paths_resolve_against_the_task_file_unless_absolute_or_urls(tmp_path: Path) -> None:
    (tmp_path / "abs").mkdir()
    sub = tmp_path / "sub"
    sub.mkdir()
    (sub / "repo").mkdir()
    path = sub / "tasks.jsonl"
    lines = [
        {**_BASE, "id": "ws", "workspace": str(tmp_path / "abs")},
        {**_BASE, "id": "local", "repo": "repo", "revision": "v1"},
        {**_BASE, "id": "https", "repo": "https://github.com/o/r.git"},
        {**_BASE, "id": "ssh", "repo": "git@github.com:o/r.git"},
        {**_BASE, "id": "plus", "repo": "git+ssh://host/r"},
    ]
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    tasks = {t.id: t for t in load_tasks(path)}
    assert tasks["ws"].workspace == tmp_path / "abs"
    assert (tasks["local"].repo, tasks["local"].revision) == (str(sub / "repo"), "v1")
    assert tasks["https"].repo == "https://github.com/o/r.git"
    assert tasks["ssh"].repo == "git@github.com:o/r.git"
    assert tasks["plus"].repo == "git+ssh://host/r"


def test_an_empty_path_is_refused_not_read_as_the_task_files_directory(tmp_path: Path) -> None:
    """``"workspace": ""`` used to be the JSONL's own directory (its other tasks' tests and answers in the agent's
    workspace); an empty ``repo`` cloned that directory."""
    for key in ("workspace", "repo", "tests_dir"):
        path = _jsonl(tmp_path, {**_BASE, key: ""})
        assert _refused(path) == f"{path}:1: {key!r} must be a non-empty string"


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        ({"id": True}, "'id' must be a printable string of 1-256 characters"),
        ({"id": None}, "'id' must be a printable string of 1-256 characters"),
        ({"id": 1.5}, "'id' must be a printable string of 1-256 characters"),
        ({"id": ["a"]}, "'id' must be a printable string of 1-256 characters"),
        ({"id": "   "}, "'id' must be a printable string of 1-256 characters"),
        ({"id": "a\nb"}, "'id' must be a printable string of 1-256 characters"),
        ({"id": "x" * 257}, "'id' must be a printable string of 1-256 characters"),
        ({"workspace": 3}, "'workspace' must be a non-empty string"),
        ({"repo": ["r"]}, "'repo' must be a non-empty string"),
        ({"repo": "r", "revision": 1}, "'revision' must be a non-empty string"),
        ({"revision": "v1"}, "'revision' needs 'repo'"),
        ({"setup": 1}, "'setup' must be a non-empty string"),
        ({"image": {}}, "'image' must be a non-empty string"),
        ({"workdir": 0}, "'workdir' must be a non-empty string"),
        ({"reward_file": 2}, "'reward_file' must be a non-empty string"),
        ({"tests_dir": 2}, "'tests_dir' must be a non-empty string"),
        ({"tests_dir": "nowhere"}, "tests_dir {tmp}/nowhere is not a directory"),
        ({"workspace": ".", "repo": "https://h/r"}, "give 'workspace' or 'repo', not both"),
        ({"timeouts": [300]}, """'timeouts' must be an object like {"agent": 600, "verify": 300}"""),
        ({"timeouts": {"agnet": 5, "zz": 1}},
         "unknown timeout(s) ['agnet', 'zz']; known: ['agent', 'setup', 'verify']"),
        ({"timeouts": {"agent": True}}, "timeouts.agent must be a positive number of seconds"),
        ({"timeouts": {"agent": 0}}, "timeouts.agent must be a positive number of seconds"),
        ({"timeouts": {"verify": 1e7}}, "timeouts.verify must be a positive number of seconds"),
        ({"timeouts": {"setup": "60"}}, "timeouts.setup must be a positive number of seconds"),
        ({"setup_timeout_s": -1}, "setup_timeout_s must be a positive number of seconds"),
        ({"metadata": ["x"]}, "'metadata' must be an object"),
        ({"reward_file": "/etc/passwd"}, "'reward_file' must be a path relative to the workspace, without '..' "
                                         "(got '/etc/passwd')"),
        ({"reward_file": "a/../../r"}, "'reward_file' must be a path relative to the workspace, without '..' "
                                       "(got 'a/../../r')"),
        ({"reward_file": ".."}, "'reward_file' must be a path relative to the workspace, without '..' (got '..')"),
        ({"reward_file": "  "}, "'reward_file' must be a path relative to the workspace, without '..' (got '  ')"),
    ],
)  # fmt: skip
def test_a_bad_jsonl_field_is_refused_with_its_file_and_line(
    tmp_path: Path, extra: dict[str, Any], message: str
) -> None:
    path = _jsonl(tmp_path, "# first line: a comment", {**_BASE, **extra})
    assert _refused(path) == f"{path}:2: {message.replace('{tmp}', str(tmp_path))}"


def test_id_and_timeout_limits_hold_exactly(tmp_path: Path) -> None:
    longest = "x" * 256
    [task] = load_tasks(_jsonl(tmp_path, {**_BASE, "id": longest, "timeouts": {"agent": 9999999.9, "verify": 1e-3}}))
    assert (task.id, task.agent_timeout_s, task.verify_timeout_s) == (longest, 9999999.9, 1e-3)
    [task] = load_tasks(_jsonl(tmp_path, {**_BASE, "id": 12}))
    assert task.id == "12"
    [task] = load_tasks(_jsonl(tmp_path, {**_BASE, "reward_file": "sub/x..y/r.txt"}))
    assert task.reward_file == "sub/x..y/r.txt"  # '..' only as a whole component is a way out


def test_jsonl_lines_that_are_no_tasks(tmp_path: Path) -> None:
    path = _jsonl(tmp_path, "   # an indented comment", "", '["a"]')
    assert _refused(path) == f"{path}:3: a task line must be a JSON object, got list"
    path.write_bytes(b'{"id": "a", "instruction": "caf\xe9"}\n')
    assert _refused(path) == f"{path}: not UTF-8 text (invalid continuation byte)"
    path.write_text("# only a comment\n\n")
    assert _refused(path) == f"{path}: the task set is empty"


def test_the_task_set_refusals_name_the_path(tmp_path: Path) -> None:
    assert _refused(tmp_path / "none") == f"{tmp_path / 'none'}: no such file or directory"
    empty = tmp_path / "empty"
    empty.mkdir()
    assert _refused(empty) == (
        f"{empty}: no tasks: expected a .jsonl file, a directory of .jsonl files, a Harbor task directory "
        "(task.toml, instruction.md, tests/test.sh) or a directory of them"
    )
    _jsonl(tmp_path, _BASE)
    _harbor(tmp_path, "h")
    assert _refused(tmp_path) == (
        f"{tmp_path}: holds both *.jsonl files and Harbor task directories; point at one kind"
    )
    path = _jsonl(tmp_path, _BASE, {**_BASE, "instruction": "again"})
    assert _refused(path) == f"{path}:2: task id 'a' already used at {path}:1"
    one = _jsonl(tmp_path, _BASE)
    with pytest.raises(ValueError, match=r"^the task limit must be at least 1$"):
        load_tasks(one, limit=0)


# --- Harbor ----------------------------------------------------------------------------------------------------


def _harbor(root: Path, name: str = "task", toml: str = "", dockerfile: str | None = "FROM x\nWORKDIR /app\n") -> Path:
    task = root / name
    (task / "tests").mkdir(parents=True)
    (task / "task.toml").write_text(toml)
    (task / "instruction.md").write_text("Do it.\n")
    (task / "tests" / "test.sh").write_text("#!/bin/bash\necho 1 > /logs/verifier/reward.txt\n")
    if dockerfile is not None:
        (task / "environment").mkdir()
        (task / "environment" / "Dockerfile").write_text(dockerfile)
    return task


def test_a_minimal_harbor_task_takes_harbors_defaults(tmp_path: Path) -> None:
    task_dir = _harbor(tmp_path, dockerfile=None)
    [task] = load_tasks(task_dir)
    assert task == Task(
        id="task",
        instruction="Do it.\n",
        verify="bash /tests/test.sh > /logs/verifier/test-stdout.txt 2>&1",
        tests_dir=task_dir / "tests",
        agent_timeout_s=600.0,
        verify_timeout_s=600.0,
        format="harbor",
        source=str(task_dir),
    )
    assert task.allow_internet is True and task.reward_json is False and task.dockerfile is None


def test_harbor_environment_fields(tmp_path: Path) -> None:
    toml = (
        '[environment]\ndocker_image = "ghcr.io/o/img:1"\nworkdir = "/given"\ncpus = 0.5\nmemory_mb = 1\n'
        "[metadata]\ncreated = 2024-05-01\n"
    )
    task_dir = _harbor(tmp_path, toml=toml, dockerfile="FROM x\nWORKDIR /from-dockerfile\n")
    [task] = load_tasks(task_dir)
    assert (task.image, task.workdir, task.cpus, task.memory_mb) == ("ghcr.io/o/img:1", "/given", 0.5, 1)
    assert task.dockerfile == task_dir / "environment" / "Dockerfile"
    # A TOML date in the metadata still hashes (json has no dates).
    assert len(task_set_hash([task])) == 64
    # Without [environment] workdir: the Dockerfile's, read even with bytes that are not UTF-8.
    (task_dir / "task.toml").write_text("")
    (task_dir / "environment" / "Dockerfile").write_bytes(b"FROM x\n# caf\xe9\nWORKDIR /srv\n")
    [task] = load_tasks(task_dir)
    assert task.workdir == "/srv"


def test_a_task_whose_tests_write_reward_json_may_score_by_it(tmp_path: Path) -> None:
    task_dir = _harbor(tmp_path)
    (task_dir / "tests" / "lib").mkdir()
    (task_dir / "tests" / "lib" / "score.py").write_text("open('/logs/verifier/reward.json', 'w')\n")
    [task] = load_tasks(task_dir)
    assert task.reward_json is True


def test_a_link_in_the_tests_does_not_make_reward_json_theirs(tmp_path: Path) -> None:
    """Only the task's own files count: a link could point at a file anyone can write (the agent's workspace)."""
    elsewhere = tmp_path / "elsewhere.py"
    elsewhere.write_text("reward.json\n")
    task_dir = _harbor(tmp_path)
    (task_dir / "tests" / "helper.py").symlink_to(elsewhere)
    (task_dir / "tests" / "dangling").symlink_to(tmp_path / "missing")
    [task] = load_tasks(task_dir)
    assert task.reward_json is False


@pytest.mark.parametrize(
    ("toml", "message"),
    [
        ("agent = 5\n", "[agent] must be a table"),
        ("verifier = []\n", "[verifier] must be a table"),
        ('environment = "x"\n', "[environment] must be a table"),
        ("metadata = 1\n", "[metadata] must be a table"),
        ("[agent]\ntimeout_sec = 0\n", "[agent] timeout_sec must be a positive number"),
        ("[verifier]\ntimeout_sec = -1\n", "[verifier] timeout_sec must be a positive number"),
        ("[environment]\ncpus = 0\n", "[environment] cpus must be a positive number"),
        ("[environment]\nmemory_mb = true\n", "[environment] memory_mb must be a positive number"),
        ("[task]\nname = 5\n", "[task] name must be a non-empty string"),
        ('[task]\nname = "  "\n', "[task] name must be a non-empty string"),
        ('[verifier]\nenv = "A=1"\n', "[verifier] env must be a table of strings"),
        ("[verifier]\nenv = {A = 1}\n", "[verifier] env must be a table of strings"),
        ("[environment]\ndocker_image = 3\n", "[environment] docker_image must be a string"),
        ('[environment]\nallow_internet = "no"\n', "[environment] allow_internet must be true or false"),
        ("[environment]\nworkdir = 1\n", "[environment] workdir must be a string"),
    ],
)
def test_a_bad_task_toml_is_refused_naming_the_file(tmp_path: Path, toml: str, message: str) -> None:
    task_dir = _harbor(tmp_path, toml=toml)
    assert _refused(task_dir) == f"{task_dir / 'task.toml'}: {message}"


def test_broken_harbor_files_say_which(tmp_path: Path) -> None:
    task_dir = _harbor(tmp_path, toml="[agent]\ntimeout_sec =")
    message = _refused(task_dir)  # no line in tomllib's message at the end of the document: the file alone
    assert message.startswith(f"{task_dir / 'task.toml'}: invalid TOML: ") and "end of document" in message
    (task_dir / "task.toml").write_text("")
    (task_dir / "instruction.md").write_text("<!-- harbor-canary GUID 1 -->\n\n  \n")
    assert _refused(task_dir) == f"{task_dir / 'instruction.md'}: empty instruction"
    (task_dir / "instruction.md").unlink()
    assert _refused(task_dir) == f"{task_dir}: Harbor task without instruction.md"


def test_strip_canary_drops_only_the_leading_canary_lines() -> None:
    assert strip_canary("Fix the bug.\n") == "Fix the bug.\n"
    assert strip_canary("<!-- BENCHMARK DATA. canary GUID x -->\nFix it.\n") == "Fix it.\n"
    assert strip_canary("# terminal-bench-canary GUID y\n<!-- Canary 2 -->\n\n\nFix.\n# canary kept\n") == (
        "Fix.\n# canary kept\n"
    )
    assert strip_canary("<!-- canary -->") == ""
    assert strip_canary("\n\n") == ""
    assert strip_canary("<!-- a comment -->\nFix.") == "<!-- a comment -->\nFix."


# --- Dockerfiles -----------------------------------------------------------------------------------------------


def test_dockerfile_workdir_follows_relative_workdirs() -> None:
    assert dockerfile_workdir("FROM x\nRUN true\n") is None
    assert dockerfile_workdir("FROM x\nWORKDIR /a\nWORKDIR b\nWORKDIR c/\n") == "/a/b/c/"
    assert dockerfile_workdir("WORKDIR /a/\nWORKDIR b") == "/a/b"
    assert dockerfile_workdir("WORKDIR /opt/BOX\nWORKDIR b") == "/opt/BOX/b"  # only slashes are trimmed
    assert dockerfile_workdir("WORKDIR rel\nWORKDIR more") == "rel/more"  # no absolute one before: as written
    assert dockerfile_workdir("WORKDIR /a\nWORKDIR /b\n") == "/b"
    assert dockerfile_workdir('workdir ["/json"]\nWORKDIR\n') == "/json"
    # A comment (an apostrophe in it included) and a continued line are no instructions of their own.
    assert dockerfile_workdir("# don't WORKDIR /no\nWORKDIR \\\n  /yes\n# WORKDIR /no\n") == "/yes"
    assert dockerfile_workdir("WORKDIR [not json\n") == "[not"


def _context(tmp: Path, dockerfile: str, files: dict[str, str], workdir: str | None = "/app") -> Task:
    context = tmp / "environment"
    context.mkdir(parents=True, exist_ok=True)
    for rel, text in files.items():
        (context / rel).parent.mkdir(parents=True, exist_ok=True)
        (context / rel).write_text(text)
    (context / "Dockerfile").write_text(dockerfile)
    return Task(id="h", instruction="x", dockerfile=context / "Dockerfile", workdir=workdir)


def _copies(task: Task) -> list[tuple[str, str]]:
    assert task.dockerfile is not None
    return [(str(src.relative_to(task.dockerfile.parent)), rel) for src, rel in image_free_copies(task)]


def test_image_free_copies_follow_docker_copy_rules(tmp_path: Path) -> None:
    files = {"a.txt": "a", "b.txt": "b", "m1.py": "1", "m2.py": "2", "my file.txt": "q", "src/x.py": "x"}
    dockerfile = (
        "FROM x\n"
        "COPY --from=build /out /app/\n"  # another stage's files: not in the context
        "COPY a.txt /app/renamed.txt\n"  # one file to a name
        "COPY a.txt b.txt /app/lib\n"  # several: each keeps its name
        "COPY b.txt /elsewhere/\n"  # outside the workdir: not in the workspace
        "ADD https://example.com/t.tgz /app/\n"  # a URL: nothing local
        "ADD --chown=1000:1000 *.py /app/py/\n"  # a glob, a flag
        'COPY "my file.txt" /app/q/\n'
        'COPY ["src/x.py", "/app/j.py"]\n'
        "WORKDIR /app/sub\n"
        "COPY a.txt \\\n   rel/\n"  # relative to the current WORKDIR, continued
    )
    task = _context(tmp_path, dockerfile, files)
    assert _copies(task) == [
        ("a.txt", "renamed.txt"),
        ("a.txt", "lib/a.txt"),
        ("b.txt", "lib/b.txt"),
        ("m1.py", "py/m1.py"),
        ("m2.py", "py/m2.py"),
        ("my file.txt", "q/my file.txt"),
        ("src/x.py", "j.py"),
        ("a.txt", "sub/rel/a.txt"),
    ]


def test_copies_under_relative_workdirs_and_the_root(tmp_path: Path) -> None:
    files = {"a.txt": "a"}
    relative = "FROM x\nWORKDIR /srv/BOX\nWORKDIR app\nCOPY a.txt ./\nCOPY a.txt \\\n  rel/\n"
    assert _copies(_context(tmp_path / "1", relative, files, workdir="/srv/BOX/app")) == [
        ("a.txt", "a.txt"),
        ("a.txt", "rel/a.txt"),
    ]
    # A relative WORKDIR before any absolute one is under /; so is a relative destination before any WORKDIR.
    first = "FROM x\nCOPY a.txt opt/\nWORKDIR app\nCOPY a.txt ./\nWORKDIR /abs\nWORKDIR /app\nCOPY a.txt x/\n"
    assert _copies(_context(tmp_path / "2", first, files, workdir=None)) == [
        ("a.txt", "opt/a.txt"),
        ("a.txt", "app/a.txt"),
        ("a.txt", "app/x/a.txt"),
    ]
    assert _copies(_context(tmp_path / "3", "COPY a.txt /opt/a.txt\n", files, workdir="/")) == [("a.txt", "opt/a.txt")]
    assert _copies(_context(tmp_path / "5", "COPY a.txt /opt/BOX/\n", files, workdir="/opt/BOX/")) == [
        ("a.txt", "a.txt")
    ]
    boxed = "WORKDIR /opt/BOX\nCOPY a.txt rel/\n"
    assert _copies(_context(tmp_path / "6", boxed, files, workdir="/opt/BOX")) == [("a.txt", "rel/a.txt")]
    # A URL among an ADD's sources is skipped; the local ones after it are still copied.
    mixed = "ADD https://example.com/t.tgz a.txt /app/\n"
    assert _copies(_context(tmp_path / "7", mixed, files)) == [("a.txt", "a.txt")]
    # A Dockerfile with bytes that are not UTF-8 (a Latin-1 comment) is still read.
    task = _context(tmp_path / "4", "", files)
    assert task.dockerfile is not None
    task.dockerfile.write_bytes(b"FROM x\n# caf\xe9\nCOPY a.txt /app/\n")
    assert _copies(task) == [("a.txt", "a.txt")]
    assert image_free_copies(Task(id="j", instruction="x")) == []  # no Dockerfile: nothing


@pytest.mark.parametrize("source", ["EXTRA.txt", "../outside.txt", "out-link", "out-dir", "lnk*"])
def test_a_copy_source_missing_or_outside_the_build_context_is_refused(tmp_path: Path, source: str) -> None:
    """A task's Dockerfile never makes the runner copy a host file (its link target, a ``..`` path) into the
    agent's workspace."""
    (tmp_path / "outside.txt").write_text("host secret")
    (tmp_path / "outside-dir").mkdir()
    task = _context(tmp_path, f"FROM x\nCOPY {source} /app/\n", {"inside.txt": "i"})
    assert task.dockerfile is not None
    context = task.dockerfile.parent
    (context / "out-link").symlink_to(tmp_path / "outside.txt")
    (context / "lnk-out").symlink_to(tmp_path / "outside.txt")
    (context / "out-dir").symlink_to(tmp_path / "outside-dir")
    with pytest.raises(TaskFileError) as info:
        image_free_copies(task)
    assert str(info.value) == f"{task.dockerfile}: COPY source {source!r} is not in the build context"


def test_a_link_inside_the_build_context_is_copied(tmp_path: Path) -> None:
    task = _context(tmp_path, "FROM x\nCOPY in-link /app/\n", {"inside.txt": "i"})
    assert task.dockerfile is not None
    (task.dockerfile.parent / "in-link").symlink_to("inside.txt")
    assert _copies(task) == [("inside.txt", "inside.txt")]


# --- the task-set hash -----------------------------------------------------------------------------------------


def _tree(root: Path) -> Path:
    (root / "sub" / ".git").mkdir(parents=True)
    (root / ".git").mkdir()
    (root / "a.txt").write_bytes(b"A")
    (root / "sub" / "b.bin").write_bytes(b"\x00B")
    (root / "link").symlink_to("a.txt")
    (root / ".git" / "HEAD").write_text("ref: refs/heads/main\n")
    (root / "sub" / ".git" / "x").write_text("x")
    return root


def test_the_tree_hash_is_fixed_and_covers_names_bytes_and_links_not_git(tmp_path: Path) -> None:
    """Pinned: a loop resumes only on the same task-set hash (rollout/loop.py), so it must not change between polar
    versions for the same files."""

    def tree_hash(root: Path) -> str:
        digest = hashlib.sha256()
        _hash_tree(digest, root)
        return digest.hexdigest()

    root = _tree(tmp_path / "t")
    assert tree_hash(root) == "3a7d945c80527e4528bedad5740cf0e6071e2a636676225e2ae6e4fa39908e16"
    (root / ".git" / "HEAD").write_text("changed")
    (root / "sub" / ".git" / "x").write_text("changed")
    assert tree_hash(root) == "3a7d945c80527e4528bedad5740cf0e6071e2a636676225e2ae6e4fa39908e16"
    (root / "link").unlink()
    (root / "link").symlink_to("sub/b.bin")
    assert tree_hash(root) != "3a7d945c80527e4528bedad5740cf0e6071e2a636676225e2ae6e4fa39908e16"


def test_the_task_set_hash_is_fixed_and_covers_the_definition_not_its_source(tmp_path: Path) -> None:
    task = Task(id="a", instruction="x", verify="true", source="f:1", metadata={"k": [1, None]},
                verify_env={"A": "1"})  # fmt: skip
    # Pinned, as the tree hash above: a change makes every loop refuse to resume on its own task set.
    assert task_set_hash([task]) == "191fab6aa4db958aae74881e6d4fa427d370b71617de8827e2f18241915e9bf6"
    moved = Task(id="a", instruction="x", verify="true", source="g:9", metadata={"k": [1, None]},
                 verify_env={"A": "1"})  # fmt: skip
    assert (
        task_set_hash([moved]) == "191fab6aa4db958aae74881e6d4fa427d370b71617de8827e2f18241915e9bf6"
    )  # the same task read from another line
    assert task_set_hash([Task(id="a", instruction="x", verify="true", setup="None")]) != task_set_hash(
        [Task(id="a", instruction="x", verify="true")]
    )
    # Key order is no part of a definition.
    reordered = Task(id="a", instruction="x", verify="true", metadata={"b": 2, "a": 1}, verify_env={"B": "", "A": ""})
    ordered = Task(id="a", instruction="x", verify="true", metadata={"a": 1, "b": 2}, verify_env={"A": "", "B": ""})
    assert task_set_hash([reordered]) == task_set_hash([ordered])
    assert task_set_hash([ordered, task]) != task_set_hash([task, ordered])
    # The same files at another path are another definition; their bytes are hashed too.
    one, two = _tree(tmp_path / "one"), _tree(tmp_path / "two")
    hashes = {task_set_hash([Task(id="a", instruction="x", workspace=ws)]) for ws in (one, two)}
    assert len(hashes) == 2


def test_the_task_set_hash_covers_the_dockerfiles_context(tmp_path: Path) -> None:
    task = _context(tmp_path, "FROM x\nCOPY a.txt /app/\n", {"a.txt": "a"})
    before = task_set_hash([task])
    assert task.dockerfile is not None
    (task.dockerfile.parent / "a.txt").write_text("b")
    assert task_set_hash([task]) != before
