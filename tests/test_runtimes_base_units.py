"""Issue 29: what every isolated sandbox (bwrap, oci) shows the agent, whatever the runtime: HOME and the CA at fixed
paths, the proxy at the host's ports on its own loopback, and the process bookkeeping ``cancel``/``stop`` share;
and the defaults a spec starts from (proxy-only, a pids limit)."""

from __future__ import annotations

import asyncio
from pathlib import Path

from polar_cli.rollout.runtimes import base
from polar_cli.rollout.runtimes.base import IsolatedSandbox, ProxyEndpoints, Runtime, SandboxSpec


class _Sandbox(IsolatedSandbox):
    async def exec(self, command, *, env=None, cwd=None, timeout_s=None, stdin=None):  # type: ignore[no-untyped-def]
        raise NotImplementedError

    async def upload(self, local: Path, remote: str) -> None:
        raise NotImplementedError

    async def download(self, remote: str, local: Path) -> None:
        raise NotImplementedError

    async def cancel(self) -> None:
        raise NotImplementedError

    async def stop(self) -> None:
        raise NotImplementedError


def _spec(tmp_path: Path) -> SandboxSpec:
    return SandboxSpec("s", tmp_path / "ws", tmp_path / "home", ProxyEndpoints(18080, 18443, tmp_path / "ca.pem"))


def test_an_isolated_sandbox_shows_fixed_paths_and_the_hosts_ports(tmp_path: Path) -> None:
    spec = _spec(tmp_path)
    sandbox = _Sandbox(spec)
    assert sandbox.spec is spec
    assert (sandbox.home, sandbox.ca_path) == ("/home/polar", "/run/polar/mitmproxy-ca-cert.pem")
    assert (sandbox.proxy_url, sandbox.reverse_url) == ("http://127.0.0.1:18080", "http://127.0.0.1:18443")
    assert (sandbox.running, sandbox.cancels, sandbox.stopped) == (set(), 0, False)
    assert sandbox.host_workspace is None
    # Each sandbox its own bookkeeping.
    assert _Sandbox(spec).running is not sandbox.running


def test_a_spec_defaults_to_the_proxy_only_network_and_a_pids_limit(tmp_path: Path) -> None:
    spec = _spec(tmp_path)
    assert (spec.network, spec.pids, spec.cpus, spec.memory_mb) == ("proxy-only", 4096, None, None)
    assert (spec.read_only, dict(spec.binds), dict(spec.read_only_binds), dict(spec.env)) == ((), {}, {}, {})
    assert base.TOOLS_HOST.name == "untrusted" and (base.TOOLS_HOST / "polar_untrusted.py").is_file()


def test_a_runtime_holds_nothing_to_close_by_default() -> None:
    class _Runtime(Runtime):
        name = "test"

        async def start(self, spec: SandboxSpec) -> _Sandbox:
            return _Sandbox(spec)

    runtime = _Runtime()
    assert asyncio.run(runtime.close()) is None
    assert (runtime.default_network, runtime.places_directories) == ("proxy-only", True)
