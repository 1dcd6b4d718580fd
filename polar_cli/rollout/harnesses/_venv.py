"""Python harnesses, each in a venv of its own under ``.harness/py/NAME`` (``make pyharnesses``, pinned by
``harness-py/NAME.txt``): their pins (LiteLLM, openai, pydantic) clash with polar's and with each other's.

A preset runs ``VENV/bin/python -m MODULE`` rather than the venv's console script: the script's shebang names the
path the venv was built at, while a sandbox shows ``.harness`` at the path this checkout sees it (a worktree's
symlink), so only the interpreter path is the same on both sides. The interpreter is a link into the Python
installation the venv was made from, which the sandbox then needs too (read-only, as ``cmd:`` does for a venv)."""

from __future__ import annotations

from importlib import metadata
from pathlib import Path

from polar_cli.rollout.harnesses._install import harness_dir
from polar_cli.rollout.harnesses.base import HarnessPreset, SessionContext
from polar_cli.rollout.harnesses.command import named_host_paths


def venv_dir(name: str) -> Path:
    return harness_dir() / "py" / name


def venv_python(name: str) -> str:
    return str(venv_dir(name) / "bin" / "python")


def venv_version(name: str, distribution: str) -> str | None:
    """``distribution``'s version as installed in the venv (None: not installed)."""
    site = [str(p) for p in venv_dir(name).glob("lib/python*/site-packages")]
    matches = [
        d.version
        for d in metadata.distributions(path=site)
        if (d.metadata["Name"] or "").lower().replace("_", "-") == distribution
    ]
    return matches[0] if matches else None


class VenvHarness(HarnessPreset):
    """A preset whose harness lives in ``.harness/py/<venv>``."""

    venv: str
    distribution: str  # its PyPI name, for the version

    @property
    def read_only(self) -> tuple[Path, ...]:
        if not harness_dir().exists():
            return ()
        # The venv itself is under .harness; what it links to outside is its base installation.
        outside = [p for p in named_host_paths(venv_python(self.venv)) if harness_dir() not in (p, *p.parents)]
        return (harness_dir(), *outside)

    @staticmethod
    def forward_only_env(ctx: SessionContext) -> dict[str, str]:
        """Anything the harness or a library fetches besides its model calls goes to the forward proxy, which refuses
        (and logs) it, rather than failing unseen in the sandbox's empty network; the reverse proxy, on loopback, is
        reached directly."""
        return {
            "HTTPS_PROXY": ctx.forward_proxy_url(),
            "https_proxy": ctx.forward_proxy_url(),
            "NO_PROXY": "127.0.0.1,localhost",
            "no_proxy": "127.0.0.1,localhost",
        }

    def python(self) -> str:
        return venv_python(self.venv)

    def version(self) -> str | None:
        return venv_version(self.venv, self.distribution)
