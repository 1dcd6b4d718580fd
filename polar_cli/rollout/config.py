"""One rollout's settings: what `polar rollout`, `polar loop`, the Ray backend and the async loop hand the runner."""

from __future__ import annotations

import asyncio
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from polar_cli.rollout import workspace as ws
from polar_cli.rollout.harnesses.base import HarnessPreset
from polar_cli.rollout.proxy import ExternalProxy
from polar_cli.rollout.runtimes.base import NetworkMode, Runtime
from polar_cli.rollout.tasks import Task

if TYPE_CHECKING:
    from polar_cli.rollout.runner import RolloutProgress


@dataclass
class RolloutConfig:
    """One rollout. Give ``engine`` (and ``out``) to start a proxy, or ``proxy`` to use a running one."""

    tasks: Sequence[Task]
    harness: str | HarnessPreset  # a --harness spec (``codex``, ``cmd:python agent.py {instruction}``) or a preset
    samples: int = 1  # sessions per task: one group
    out: str | None = None  # the trace store of the proxy this runner starts (a directory or s3://...)
    engine: str | None = None  # the proxy's engine spec (vllm:URL, local:DIR, scripted:SCRIPT.json, ...)
    proxy: ExternalProxy | None = None  # a running polar proxy instead
    runtime: str | Runtime = "local"
    runtime_options: Mapping[str, Any] = field(default_factory=dict)
    network: NetworkMode | None = None  # None: the runtime's default (local: host; bwrap: proxy-only)
    concurrency: int = 4  # RUN slots
    ready: int | None = None  # sessions prepared ahead (INIT + READY); None: as many as ``concurrency``; 0: none
    init_concurrency: int | None = None  # INIT workers; None: min(ready, concurrency)
    postrun_concurrency: int | None = None  # verifications at once; None: ``concurrency``
    timeout_s: float | None = None  # the harness's deadline; None: each task's agent timeout
    early_stop: int | None = None  # cancel a group's stragglers once this many of its sessions are usable
    seed: int | None = None  # fixes session ids and task order
    model: str = "policy"  # the model name harnesses ask for (the proxy's engine answers whatever it is)
    # The window and output cap each harness budgets by (compaction, max tokens). None: the window the started
    # proxy's engine serves (polar_cli.rollout.window), the cap of ``--set polar_max_tokens``; else the harness's own.
    context_window: int | None = None
    max_output_tokens: int | None = None
    init_attempts: int = 3  # tries of INIT per session (infrastructure failures)
    max_patch_bytes: int = ws.MAX_PATCH_BYTES  # the agent's patch; larger is the policy's failure (reward 0)
    verify_attempts: int = 2  # tries of starting the verifier's sandbox
    work_dir: Path | None = None  # scratch for session homes and workspaces; None: a temporary directory
    keep_sessions: bool = False  # keep each session's directories (debugging)
    logs_dir: Path | None = None  # per-session harness/verifier output and patch, and mitmdump's log
    confdir: Path = Path("~/.mitmproxy")  # mitmproxy's CA (for a started proxy)
    proxy_options: Mapping[str, str] = field(default_factory=dict)  # extra mitmdump --set KEY=VALUE
    env: Mapping[str, str] = field(default_factory=dict)  # extra environment for the harness
    read_only: Sequence[Path] = ()  # host paths visible read-only in sandboxes (harness installs)
    run_id: str | None = None  # prefix of session ids; None: from the seed, else random
    progress: RolloutProgress | None = None  # live counters for a display (mutated in place)
    # SIGINT/SIGTERM interrupt the rollout (see run_rollout); False leaves the process's signal handling alone.
    stop_on_signals: bool = True
    # Set, it interrupts the rollout as a signal would (reason "stop"): the async loop's drain "cut".
    stop: asyncio.Event | None = None
    status_metadata: Mapping[str, Any] = field(default_factory=dict)  # merged into every posted status's metadata
