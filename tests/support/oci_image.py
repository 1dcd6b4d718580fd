"""A small container image built from the host's own binaries (no registry is reachable): a shell, coreutils,
tar and curl with their shared libraries, imported with ``podman import``. Built once per machine (content-named)."""

from __future__ import annotations

import hashlib
import io
import shutil
import subprocess
import tarfile
from pathlib import Path

TOOLS = ["sh", "dash", "cat", "ls", "id", "sleep", "mkdir", "rm", "touch", "tar", "find", "sort", "head", "tail",
         "grep", "nproc", "env", "echo", "printf", "mount", "curl", "setsid", "tr", "wc", "ln", "true"]
MERGED_USR = {"bin": "usr/bin", "lib": "usr/lib", "lib64": "usr/lib64", "sbin": "usr/sbin"}


def _files() -> list[Path]:
    files: set[Path] = set()
    for tool in TOOLS:
        path = shutil.which(tool)
        if path is None:
            raise RuntimeError(f"the test image needs {tool} on the host")
        files.add(Path(path))
        files.add(Path(path).resolve())
        ldd = subprocess.run(["ldd", str(Path(path).resolve())], capture_output=True, text=True).stdout
        for line in ldd.splitlines():
            for word in line.split():
                if word.startswith("/"):
                    files.add(Path(word))
                    files.add(Path(word).resolve())
    return sorted(files)


def _canonical(path: Path) -> str:
    """The path inside the image's merged-/usr layout (/bin/x -> usr/bin/x)."""
    rel = str(path).lstrip("/")
    head, _, rest = rel.partition("/")
    return f"{MERGED_USR[head]}/{rest}" if head in MERGED_USR else rel


def rootfs_tar() -> bytes:
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w") as tar:
        def add_dir(name: str, mode: int = 0o755) -> None:
            info = tarfile.TarInfo(name)
            info.type, info.mode = tarfile.DIRTYPE, mode
            tar.addfile(info)

        for d in ("usr", "usr/bin", "usr/lib", "usr/lib64", "usr/sbin", "etc", "root", "home", "workspace", "run",
                  "proc", "sys", "dev", "var"):
            add_dir(d)
        add_dir("tmp", 0o1777)
        for link, target in MERGED_USR.items():
            info = tarfile.TarInfo(link)
            info.type, info.linkname = tarfile.SYMTYPE, target
            tar.addfile(info)
        made = set()
        for path in _files():
            name = _canonical(path)
            if name in made:
                continue
            parts = name.split("/")
            for i in range(1, len(parts)):
                parent = "/".join(parts[:i])
                if parent not in made and parent not in ("usr", "usr/bin", "usr/lib", "usr/lib64", "usr/sbin"):
                    add_dir(parent)
                    made.add(parent)
            made.add(name)
            if path.is_symlink():
                info = tarfile.TarInfo(name)
                info.type, info.linkname = tarfile.SYMTYPE, str(path.readlink())
                tar.addfile(info)
            else:
                tar.add(str(path), arcname=name)
        for name, text in (("etc/passwd", "root:x:0:0:root:/root:/bin/sh\n"), ("etc/group", "root:x:0:\n")):
            data = text.encode()
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return buffer.getvalue()


def build_test_image(podman: str = "podman") -> str:
    """The image's name, importing it when this machine does not have it yet."""
    data = rootfs_tar()
    name = f"localhost/polar-test-mini:{hashlib.sha256(data).hexdigest()[:12]}"
    if subprocess.run([podman, "image", "exists", name]).returncode != 0:
        subprocess.run([podman, "import", "-", name], input=data, check=True, capture_output=True)
    return name
