"""Small container images built from the host's own binaries (no registry is reachable), imported with
``podman import``; each is built once per machine (named by a digest of what goes in).

- :func:`build_test_image`: a shell, coreutils, tar and curl with their shared libraries.
- :func:`build_harness_image`: that plus bash, the host's Python 3 (binary, standard library, the libraries of its
  extension modules) and node, so a harness installed on the host (``.harness``, bound read-only at its own path)
  and the swe_mini verifiers (``python3 -m unittest``) run inside. Its libraries are the host's glibc ones, which is
  what lets the host's node and Python run.
"""

from __future__ import annotations

import hashlib
import io
import shutil
import subprocess
import tarfile
from pathlib import Path

TOOLS = [
    "sh",
    "dash",
    "cat",
    "ls",
    "id",
    "sleep",
    "mkdir",
    "rm",
    "touch",
    "tar",
    "find",
    "sort",
    "head",
    "tail",
    "grep",
    "nproc",
    "env",
    "echo",
    "printf",
    "mount",
    "curl",
    "setsid",
    "tr",
    "wc",
    "ln",
    "true",
]
HARNESS_TOOLS = [
    "bash",
    "sed",
    "cp",
    "mv",
    "cut",
    "diff",
    "dirname",
    "basename",
    "pwd",
    "uname",
    "chmod",
    "stat",
    "xargs",
    "which",
    "readlink",
    "ps",
    "kill",
    "node",
    "/usr/bin/python3",
]
# The host Python's standard library, less what no session needs (the static libpython alone is 25 MB).
PYTHON_SKIP = {"__pycache__", "test", "idlelib", "tkinter", "turtledemo", "ensurepip", "lib2to3", "pydoc_data"}
MERGED_USR = {"bin": "usr/bin", "lib": "usr/lib", "lib64": "usr/lib64", "sbin": "usr/sbin"}
TOP_DIRS = ("usr", "usr/bin", "usr/lib", "usr/lib64", "usr/sbin")


def _with_libraries(binary: Path, files: set[Path]) -> None:
    files.add(binary)
    files.add(binary.resolve())
    ldd = subprocess.run(["ldd", str(binary.resolve())], capture_output=True, text=True).stdout
    for line in ldd.splitlines():
        for word in line.split():
            if word.startswith("/"):
                files.add(Path(word))
                files.add(Path(word).resolve())


def _python_stdlib(files: set[Path]) -> None:
    version = subprocess.run(
        ["/usr/bin/python3", "-c", "import sys; print('%d.%d' % sys.version_info[:2])"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    stdlib = Path(f"/usr/lib/python{version}")
    for path in stdlib.rglob("*"):
        parts = path.relative_to(stdlib).parts
        if any(p in PYTHON_SKIP or p.startswith("config-") for p in parts) or path.is_dir():
            continue
        if path.suffix == ".so":
            _with_libraries(path, files)
        else:
            files.add(path)


def _files(tools: list[str], python: bool) -> list[Path]:
    files: set[Path] = set()
    for tool in tools:
        path = shutil.which(tool)
        if path is None:
            raise RuntimeError(f"the test image needs {tool} on the host")
        _with_libraries(Path(path), files)
    if python:
        _python_stdlib(files)
    return sorted(files)


def _canonical(path: Path) -> str:
    """The path inside the image's merged-/usr layout (/bin/x -> usr/bin/x)."""
    rel = str(path).lstrip("/")
    head, _, rest = rel.partition("/")
    return f"{MERGED_USR[head]}/{rest}" if head in MERGED_USR else rel


def _write_tar(files: list[Path], texts: dict[str, str], out: io.BufferedIOBase) -> None:
    with tarfile.open(fileobj=out, mode="w|") as tar:

        def add_dir(name: str, mode: int = 0o755) -> None:
            info = tarfile.TarInfo(name)
            info.type, info.mode = tarfile.DIRTYPE, mode
            tar.addfile(info)

        for d in (*TOP_DIRS, "etc", "root", "home", "workspace", "run", "proc", "sys", "dev", "var"):
            add_dir(d)
        add_dir("tmp", 0o1777)
        for link, target in MERGED_USR.items():
            info = tarfile.TarInfo(link)
            info.type, info.linkname = tarfile.SYMTYPE, target
            tar.addfile(info)
        made = set()
        for path in files:
            name = _canonical(path)
            if name in made:
                continue
            parts = name.split("/")
            for i in range(1, len(parts)):
                parent = "/".join(parts[:i])
                if parent not in made and parent not in TOP_DIRS:
                    add_dir(parent)
                    made.add(parent)
            made.add(name)
            if path.is_symlink():
                info = tarfile.TarInfo(name)
                info.type, info.linkname = tarfile.SYMTYPE, str(path.readlink())
                tar.addfile(info)
            else:
                tar.add(str(path), arcname=name)
        for name, text in texts.items():
            data = text.encode()
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))


def _digest(files: list[Path], texts: dict[str, str]) -> str:
    """What decides the image's content, without reading it: each file's path, size and mtime, and the texts."""
    digest = hashlib.sha256(Path(__file__).read_bytes())
    for path in files:
        st = path.lstat()
        digest.update(f"{path}\0{st.st_size}\0{st.st_mtime_ns}\0".encode())
    for name, text in sorted(texts.items()):
        digest.update(f"{name}\0{text}\0".encode())
    return digest.hexdigest()[:12]


def _build(repository: str, tools: list[str], python: bool, shell: str, podman: str) -> str:
    files = _files(tools, python)
    texts = {"etc/passwd": f"root:x:0:0:root:/root:{shell}\n", "etc/group": "root:x:0:\n"}
    name = f"localhost/{repository}:{_digest(files, texts)}"
    if subprocess.run([podman, "image", "exists", name]).returncode != 0:
        proc = subprocess.Popen(
            [podman, "import", "-", name], stdin=subprocess.PIPE, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE
        )
        assert proc.stdin is not None
        _write_tar(files, texts, proc.stdin)  # streamed: the harness image is ~130 MB
        proc.stdin.close()
        err = proc.stderr.read() if proc.stderr else b""
        if proc.wait() != 0:
            raise RuntimeError(f"podman import {name} failed: {err.decode(errors='replace')}")
    return name


def build_test_image(podman: str = "podman") -> str:
    """The small image's name, importing it when this machine does not have it yet."""
    return _build("polar-test-mini", TOOLS, python=False, shell="/bin/sh", podman=podman)


def build_harness_image(podman: str = "podman") -> str:
    """The image a node harness and a Python verifier run in, importing it when this machine does not have it yet."""
    return _build("polar-test-harness", TOOLS + HARNESS_TOOLS, python=True, shell="/bin/bash", podman=podman)
