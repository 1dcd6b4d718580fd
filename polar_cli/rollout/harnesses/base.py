"""The one interface every harness preset implements: write the harness's own config into the session's HOME,
give the session its credential, and say how to run it non-interactively on one instruction.

The credential is the session's secret alone (``polar:SECRET`` as an API key, ``http://polar:SECRET@...`` as the
forward proxy URL): the runner registered the session's task, group and sample with the proxy, which takes them
from the registration (``polar_addon.identity``), so nothing a harness sends can relabel them."""

from __future__ import annotations

import abc
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class SessionContext:
    """Everything a preset needs for one session. URLs and paths are as seen inside the sandbox."""

    session_id: str
    task_id: str
    group_id: str
    sample: int
    model: str
    proxy_url: str  # forward proxy, e.g. http://127.0.0.1:8080 (no credentials)
    reverse_url: str  # reverse proxy base, e.g. http://127.0.0.1:8081
    ca_path: str
    home: str  # HOME inside
    workspace: str  # the working directory inside
    secret: str  # the proxy's secret for this session (a credential: never logged or stored)
    context_window: int | None = None  # the served model's window, for harnesses that budget by tokens
    max_output_tokens: int | None = None

    def __repr__(self) -> str:
        # A context printed in a traceback or a log must not show the credential.
        return f"SessionContext(session_id={self.session_id!r}, task_id={self.task_id!r}, sample={self.sample})"

    def api_key(self) -> str:
        return "polar:" + self.secret

    def forward_proxy_url(self) -> str:
        """The forward proxy URL with the secret as its password (the user name is not read)."""
        from urllib.parse import quote

        scheme, _, host = self.proxy_url.partition("://")
        return f"{scheme}://polar:{quote(self.secret, safe='')}@{host}"


class HarnessPreset(abc.ABC):
    """How to run one harness. ``name`` is what ``--harness`` selects; ``binaries`` are the CLIs it needs
    (looked up in ``.harness/node_modules/.bin`` or on PATH)."""

    name: str
    binaries: tuple[str, ...] = ()
    # Host paths the harness needs inside a sandbox, read-only (its install, node): added to SandboxSpec.read_only.
    read_only: tuple[Path, ...] = ()

    def version(self) -> str | None:
        """The harness's version for the run manifest (None: unknown)."""
        return None

    @abc.abstractmethod
    def configure(self, home: Path, ctx: SessionContext) -> None:
        """Write the harness's config files under ``home`` (the host directory that is HOME inside)."""

    @abc.abstractmethod
    def env(self, ctx: SessionContext) -> dict[str, str]:
        """Environment variables for the harness process (credential, endpoints, CA, non-interactive switches)."""

    @abc.abstractmethod
    def command(self, instruction: str, ctx: SessionContext) -> list[str]:
        """argv that runs the harness once on ``instruction`` and exits."""
