"""The one interface every sandbox runtime implements (local subprocess, bubblewrap, podman/docker, and later
remote sandboxes such as Modal, E2B or Daytona).

A runtime starts a :class:`Sandbox` for one session from a :class:`SandboxSpec`. Inside, the agent sees its
workspace at ``sandbox.workspace`` and its HOME at ``sandbox.home``; it reaches polar's proxy at
``sandbox.proxy_url`` (forward) / ``sandbox.reverse_url`` (reverse, base URLs) and trusts ``sandbox.ca_path``.
Nothing else of the host is reachable where the runtime can prevent it (``network="proxy-only"``).
"""

from __future__ import annotations

import abc
import asyncio
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

NetworkMode = Literal["host", "proxy-only", "none"]
# Where an isolated sandbox (bwrap, oci) puts HOME and mitmproxy's CA certificate (only that file of its confdir).
ISOLATED_HOME = "/home/polar"
ISOLATED_RUN_DIR = "/run/polar"
ISOLATED_CA = f"{ISOLATED_RUN_DIR}/mitmproxy-ca-cert.pem"
# polar's own commands for verifiers (``polar-untrusted``: :mod:`untrusted.polar_untrusted`), bound read-only there in
# every isolated sandbox and first on its PATH.
TOOLS_HOST = Path(__file__).parent / "untrusted"
TOOLS_DIR = "/opt/polar/bin"


@dataclass(frozen=True)
class ProxyEndpoints:
    """polar's proxy as the host sees it (both listeners on 127.0.0.1) and its CA certificate file."""

    forward_port: int
    reverse_port: int
    ca: Path


@dataclass(frozen=True)
class SandboxSpec:
    """What one session's sandbox needs. ``workspace`` and ``home`` are host directories the runtime makes
    the sandbox's own (bound or copied in); ``image``/``dockerfile`` only matter to image runtimes."""

    name: str  # unique per session (the session id); names containers, sockets, scratch dirs
    workspace: Path
    home: Path
    proxy: ProxyEndpoints
    network: NetworkMode = "proxy-only"
    image: str | None = None
    dockerfile: Path | None = None
    workdir: str | None = None
    cpus: float | None = None
    memory_mb: int | None = None
    pids: int | None = 4096
    # Host paths made visible read-only inside at the same path (the harness CLIs' install, node).
    read_only: Sequence[Path] = ()
    # Inside path -> host directory, writable (Harbor's /tests and /logs/verifier for the verifier). A runtime
    # that cannot place a directory at an absolute path (local) raises RuntimeUnavailable naming the runtimes
    # that can.
    binds: Mapping[str, Path] = field(default_factory=dict)
    # Inside path -> host directory, read-only inside (Harbor's /tests: the code under test must not rewrite the
    # tests that score it). Refused by a runtime that cannot place directories, as ``binds``.
    read_only_binds: Mapping[str, Path] = field(default_factory=dict)
    env: Mapping[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class ExecResult:
    exit_code: int  # -1 when killed by the timeout or a cancel
    stdout: str
    stderr: str
    timed_out: bool = False
    cancelled: bool = False
    # The runtime's memory limit killed a process of this exec (the cgroup's OOM killer; oci: the engine says so).
    # Still the policy's failure (it controls its own memory), reported so that the runner can say why.
    oom_killed: bool = False
    # A limit of the runtime's own that ended the exec (its processes killed): "disk" (the disk bound of the
    # sandbox's writable directories). None otherwise.
    limit: str | None = None


class Sandbox(abc.ABC):
    """One running sandbox. All methods are safe to call from several tasks of one event loop."""

    workspace: str  # the workspace path inside
    home: str  # HOME inside
    proxy_url: str  # forward proxy URL as seen inside, e.g. http://127.0.0.1:8080
    reverse_url: str  # reverse proxy base URL as seen inside, e.g. http://127.0.0.1:8081
    ca_path: str  # mitmproxy's CA certificate path inside
    # The host directory that IS the workspace (bound or used in place, so the runner reads the agent's changes
    # there), or None when the workspace lives only inside (the runner then downloads it).
    host_workspace: Path | None = None

    @abc.abstractmethod
    async def exec(
        self,
        command: Sequence[str] | str,
        *,
        env: Mapping[str, str] | None = None,
        cwd: str | None = None,
        timeout_s: float | None = None,
        stdin: bytes | None = None,
    ) -> ExecResult:
        """Run ``command`` (argv, or a shell string run by ``sh -c``) inside; never raises on a non-zero exit."""

    @abc.abstractmethod
    async def upload(self, local: Path, remote: str) -> None:
        """Copy a host file or directory to ``remote`` inside."""

    @abc.abstractmethod
    async def download(self, remote: str, local: Path) -> None:
        """Copy a file or directory from inside to the host (raises FileNotFoundError when absent)."""

    @abc.abstractmethod
    async def cancel(self) -> None:
        """Kill every process running inside now (running ``exec`` calls return ``cancelled=True``)."""

    @abc.abstractmethod
    async def stop(self) -> None:
        """Tear everything down (idempotent)."""


class IsolatedSandbox(Sandbox):
    """A sandbox with its own filesystem and loopback (bwrap, oci): HOME at ``/home/polar``, the CA at
    ``/run/polar``, the proxy at the host's ports on the sandbox's own loopback; and the process bookkeeping their
    ``cancel``/``stop`` share."""

    def __init__(self, spec: SandboxSpec) -> None:
        self.spec = spec
        self.home = ISOLATED_HOME
        self.proxy_url = f"http://127.0.0.1:{spec.proxy.forward_port}"
        self.reverse_url = f"http://127.0.0.1:{spec.proxy.reverse_port}"
        self.ca_path = ISOLATED_CA
        self.running: set[asyncio.subprocess.Process] = set()
        self.cancels = 0  # cancel() calls so far: an exec that began before one is killed even if not yet spawned
        self.stopped = False


class Runtime(abc.ABC):
    """A kind of sandbox. ``name`` is what ``--runtime`` selects."""

    name: str
    # The network a spec gets when the user names none: what this runtime can enforce.
    default_network: NetworkMode = "proxy-only"
    # Whether it can place a directory at an absolute path inside (``SandboxSpec.binds``): Harbor tasks need it, and
    # are refused before any session runs where it cannot.
    places_directories: bool = True

    @abc.abstractmethod
    async def start(self, spec: SandboxSpec) -> Sandbox:
        """Start a sandbox; raises :class:`RuntimeUnavailable` (an infrastructure failure, retried at INIT)."""

    async def close(self) -> None:  # noqa: B027 (optional: most runtimes hold nothing across sandboxes)
        """Release what the runtime holds across sandboxes (daemons, built images)."""


class RuntimeUnavailable(RuntimeError):
    """The runtime could not start a sandbox (missing binary, daemon down, image build failed)."""
