"""One rollout's settings: what `polar rollout`, `polar loop`, the Ray backend and the async loop hand the runner."""

from __future__ import annotations

import asyncio
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from polar_cli.rollout import workspace as ws
from polar_cli.rollout.harnesses import preset_names
from polar_cli.set_option import runtime_options, set_options
from polar_cli.settings import SettingsError, option

if TYPE_CHECKING:  # annotations only: `polar --help` imports this module and should stay fast
    from polar_cli.rollout.harnesses.base import HarnessPreset
    from polar_cli.rollout.proxy import ExternalProxy
    from polar_cli.rollout.runner import RolloutProgress
    from polar_cli.rollout.runtimes.base import NetworkMode, Runtime
    from polar_cli.rollout.tasks import Task


@dataclass
class RolloutConfig:
    """One rollout. Give ``engine`` (and ``out``) to start a proxy, or ``proxy`` to use a running one."""

    tasks: Sequence[Task]
    harness: str | HarnessPreset  # a --harness spec (``codex``, ``cmd:python agent.py {instruction}``) or a preset
    samples: int = 1  # sessions per task: one group
    out: str | None = None  # the trace store of the proxy this runner starts (a directory or s3://...)
    engine: str | None = None  # the proxy's engine spec (vllm:URL, local:DIR, scripted:SCRIPT.json, ...)
    proxy: ExternalProxy | None = None  # a running polar proxy instead
    # bwrap unless asked (as `polar rollout`); where it cannot start, the run fails saying why. "local" runs the agent
    # unsandboxed (it can read the control token and set its own reward) and needs trust_agent, as --trust-agent.
    runtime: str | Runtime = "bwrap"
    trust_agent: bool = False
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

    def __post_init__(self) -> None:
        if self.runtime == "local" and not self.trust_agent:
            raise ValueError(
                "runtime local does not isolate the agent: it could read the proxy's control token and set its own "
                "reward; set trust_agent=True (--trust-agent) if you trust it, or use runtime bwrap or oci"
            )


def make_run_id(seed: int | None) -> str:
    """A rollout's id, the prefix of its session ids: ``r{seed}`` (the same seed, the same ids), else random."""
    import secrets

    return f"r{seed}" if seed is not None else f"r{secrets.token_hex(4)}"


@dataclass
class RolloutSettings:
    """`polar rollout`'s command line, declared once: each field is an option (type, default, help) and a manifest
    key; :meth:`to_config` makes the runner's :class:`RolloutConfig` of it."""

    tasks: Path = option(
        argument=True,
        help="The task set: a JSONL file (or a directory of *.jsonl), a Harbor task "
        "directory (task.toml, instruction.md, tests/test.sh), or a directory of them.",
    )
    harness: str = option(
        flags=("--harness", "-H"),
        help=f"A preset ({', '.join(preset_names())}), or "
        "cmd:'ANY COMMAND {instruction}' ({instruction} becomes one shell-quoted word).",
    )
    samples: int = option(1, flags=("--samples", "-n"), help="Sessions per task (one GRPO group per task).")
    out: str | None = option(
        None,
        flags=("--out", "-o"),
        help="The trace store the started proxy writes (a "
        "directory or s3://...). With --proxy: the running proxy's store, for the report.",
    )
    engine: str | None = option(
        None,
        flags=("--engine", "-e"),
        help="Start a proxy with this engine: vllm:URL, sglang:URL, local:MODEL_DIR, scripted:SCRIPT.json.",
    )
    proxy: str | None = option(
        None,
        flags=("--proxy",),
        help="Use a running `polar proxy` instead: its forward URL "
        "http://127.0.0.1:PORT (needs its control token). Probed first: a proxy that "
        "relays non-model traffic (to a loopback listener, by absolute URL, CONNECT "
        "or a reverse Host: header) is refused before any session.",
    )
    reverse_url: str | None = option(None, help="With --proxy: its reverse listener (default: PORT + 1).")
    control_token: str | None = option(
        None,
        envvar="POLAR_CONTROL_TOKEN",
        secret=True,
        help="With --proxy: the proxy's control token (to register sessions and post rewards).",
    )
    trust_claimed_sessions: bool = option(
        False,
        flags=("--trust-claimed-sessions",),
        help="With --proxy: use it even if it runs polar_sessions="
        "claimed (the default of `polar proxy`), where an agent can write "
        "calls into another session and relabel task, group and sample; "
        "only for trusted agents. Without it such a proxy is refused: start "
        "it with --set polar_sessions=registered.",
    )
    runtime: str | None = option(
        None,
        help="Where sessions run: bwrap (bubblewrap, the default where it "
        "works here; network proxy-only), oci (podman/docker, for tasks with an "
        "image), local (a subprocess with its own HOME and workspace copy; NO "
        "isolation: needs --trust-agent). Where bwrap does not work the command "
        "says why and asks for an explicit choice.",
    )
    trust_agent: bool = option(
        False,
        flags=("--trust-agent",),
        help="Allow --runtime local: the agent then runs as you, unsandboxed, "
        "and can read the proxy's control token and the store (and so set its own "
        "reward) and reach any address. Only for agents you trust.",
    )
    runtime_option: list[str] = option(
        default_factory=list,
        flags=("--runtime-option",),
        help="A runtime option KEY=VALUE (repeatable; values read as JSON numbers/true/false, else text): "
        "disk_mb and disk_files (bwrap, local: the bound on workspace + HOME, default 4096 MiB / 200000 entries), "
        "tmp_mb (bwrap: its /tmp tmpfs), trust_root=true (oci: accept a docker daemon that runs containers as host "
        "root, which is refused otherwise).",
    )
    network: str | None = option(
        None,
        help="host, or proxy-only (the agent reaches the model API and "
        "nothing else; bwrap/oci). Default: the runtime's (local: host).",
    )
    concurrency: int = option(4, flags=("--concurrency", "-c"), help="Harness runs at once (RUN slots).")
    ready: int | None = option(
        None,
        help="Sessions prepared ahead (started sandbox, setup done, harness "
        "configured) so a free RUN slot starts at once. Default: --concurrency; 0: off.",
    )
    timeout_s: float | None = option(
        None,
        flags=("--timeout",),
        help="Seconds per harness run (default: each task's agent "
        "timeout). A timed-out session keeps its traces, status timeout.",
    )
    early_stop: int | None = option(
        None,
        help="Once M sessions of a group are usable (completed, failed "
        "or timeout), cancel its stragglers (masked); with --ray, on every "
        "node.",
    )
    tasks_limit: int | None = option(None, help="Only the first K tasks.")
    seed: int | None = option(None, help="Fixes session ids and task order (same seed, same ids).")
    model: str = option("policy", help="The model name harnesses ask for.")
    context_window: int | None = option(
        None,
        min=1,
        help="The context window each harness is told (its "
        "compaction and token budgets). Default: what --engine serves (local: "
        "the model's max_position_embeddings, or ?max_len=N; vllm/sglang: "
        "max_model_len on /v1/models); with --proxy: the harness's own.",
    )
    max_output_tokens: int | None = option(
        None,
        min=1,
        help="The output cap each harness is told. Default: "
        "--set polar_max_tokens=N when given, else the harness's own.",
    )
    confdir: Path = option(Path("~/.mitmproxy"), help="mitmproxy's configuration directory (its CA).")
    proxy_set: list[str] = option(
        default_factory=list,
        flags=("--set",),
        help="Extra mitmdump option KEY=VALUE for the started proxy (repeatable), e.g. --set polar_max_tokens=512.",
    )
    report_dir: Path | None = option(
        None,
        help="Where rollout-summary.json, rollout-manifest.json and "
        "per-session logs go (default: STORE/rollouts/RUN_ID for a local store; "
        "./polar-rollouts/RUN_ID otherwise).",
    )
    work_dir: Path | None = option(
        None, help="Scratch for session workspaces and homes (default: a temporary directory)."
    )
    keep_sessions: bool = option(False, help="Keep each session's workspace and home (debugging).")
    init_attempts: int = option(3, help="Tries of a session's INIT (sandbox, workspace, setup).")
    max_patch_mb: int = option(
        ws.MAX_PATCH_BYTES // (1024 * 1024),
        min=1,
        help="Largest agent patch (and workspace growth) in MiB; past it the "
        "session is failed, reward 0, and the runner never reads the patch.",
    )
    read_only: list[Path] = option(
        default_factory=list,
        flags=("--read-only",),
        help="A host path the sandboxes see read-only at the "
        "same path (repeatable), e.g. a virtualenv a cmd: agent runs from.",
    )
    progress: bool = option(True, flags=("--progress/--no-progress",), help="Live progress display.")
    ray: str | None = option(
        None,
        flags=("--ray",),
        help="Run the sessions on a Ray cluster (its address, "
        "e.g. 127.0.0.1:6379, or auto): one worker per node, each with its own "
        "proxy writing to --out, which every node must see (a shared directory "
        "or s3://...). --concurrency and --ready are then per node. Needs "
        "Ray (the pip extra fleet). Refused with --proxy (every node starts "
        "its own proxy: give --engine). --early-stop counts a group's usable "
        "sessions over every node and cancels its stragglers on all of them. With s3://, each node writes "
        "with its own credentials (the environment `ray start` ran with, "
        "~/.aws, an instance role): the driver's AWS_* are not shipped. "
        "Ctrl-C stops the run on every node.",
    )
    ray_resource: str | None = option(
        None,
        help="With --ray: only the nodes offering this custom resource "
        "(ray start --resources); default: every node with a CPU.",
    )

    def validate(self) -> None:
        """The refusals that need no file, no proxy and no sandbox (the command checks these before anything)."""
        if (self.engine is None) == (self.proxy is None):
            raise SettingsError("give --engine (start a proxy) or --proxy (use a running one)", "engine")
        if self.engine is not None and not self.out:
            raise SettingsError("--engine needs --out (the trace store)", "out")
        if self.ray is not None and self.engine is None:
            raise SettingsError("--ray starts a proxy on every node: give --engine (not --proxy)", "ray")
        if self.proxy is not None and not self.control_token:
            raise SettingsError(
                "--proxy needs the proxy's control token (--control-token or POLAR_CONTROL_TOKEN): "
                "rewards are posted with it",
                "control_token",
            )
        check_network(self.network)
        check_set_options(self.proxy_set)
        check_set_options(self.runtime_option, "runtime_option")

    def proxy_options(self) -> dict[str, str]:
        """``--set KEY=VALUE`` as a mapping."""
        return set_options(self.proxy_set)

    def to_config(
        self, tasks: Sequence[Task], harness: HarnessPreset, proxy: ExternalProxy | None, **more: Any
    ) -> RolloutConfig:
        """The runner's config: these settings with the loaded ``tasks``, the resolved ``harness`` preset and the
        probed ``proxy``; ``more`` sets the fields the command decides (run_id, logs_dir, progress)."""
        assert self.runtime is not None, "choose the runtime first"
        return RolloutConfig(
            tasks=tasks, harness=harness, samples=self.samples, out=self.out, engine=self.engine, proxy=proxy,
            runtime=self.runtime, trust_agent=self.trust_agent, network=self.network,  # type: ignore[arg-type]
            runtime_options=runtime_options(self.runtime_option),
            concurrency=self.concurrency, ready=self.ready, timeout_s=self.timeout_s, early_stop=self.early_stop,
            seed=self.seed, model=self.model, context_window=self.context_window,
            max_output_tokens=self.max_output_tokens, init_attempts=self.init_attempts,
            max_patch_bytes=self.max_patch_mb * 1024 * 1024, work_dir=self.work_dir,
            keep_sessions=self.keep_sessions, read_only=[p.resolve() for p in self.read_only], confdir=self.confdir,
            proxy_options=self.proxy_options(), **more,
        )  # fmt: skip


NETWORKS = ("host", "proxy-only")


def check_network(network: str | None) -> None:
    if network not in (None, *NETWORKS):
        raise SettingsError("host or proxy-only", "network")


def check_set_options(items: Sequence[str], name: str = "proxy_set") -> None:
    """Each ``--set`` (or ``--runtime-option``) item is KEY=VALUE."""
    try:
        set_options(items)
    except ValueError as exc:
        raise SettingsError(str(exc), name) from exc
