"""The closed loop: rollout -> ``polar train`` -> engine reload -> rollout, resumable.

Each iteration ``i`` owns ``OUT/iter-NNN/``: ``shards/`` (this iteration's traces only), ``logs/`` (the rollout's
per-session logs), ``checkpoint/`` (what ``polar train`` made of those shards, starting from the policy that
produced them). ``OUT/loop.json`` records each finished phase (rollout stats, training outcome, timings); it is
rewritten atomically after every phase, so an interrupted loop, re-run with the same command, starts again at the
first unfinished phase: a half-done rollout is thrown away whole (its directory removed, so shards of two attempts
never mix) and a half-done training is redone from the finished rollout's shards.

The last iteration is a rollout only: it measures the policy the previous training made (a checkpoint trained on it
would never be evaluated). Raising ``iterations`` later trains it first.

Reload: the local engine lives in the proxy (``local:DIR``), so the next rollout's proxy simply starts on the new
checkpoint; a vLLM engine is started once by this loop (``polar engine serve`` machinery), loads each new checkpoint
in place (``polar engine reload``; ``vllm_push="restart"``, or a failed in-place load: restarted on it), and is
stopped at the end.
"""

from __future__ import annotations

import asyncio
import json
import math
import os
import shutil
import socket
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

from polar_addon.engines.spec import EngineSpec
from polar_addon.store.status import REWARDED, USABLE
from polar_cli.eval.report import read_call_stats, tool_call_counts
from polar_cli.rollout.cpus import pinned
from polar_cli.rollout.loop_eval import EVAL_REPORT, eval_dir, eval_due, loop_entry, score
from polar_cli.rollout.progress_file import progress_config
from polar_cli.rollout.proxy import wait_writer_gone
from polar_cli.rollout.redact import control_tokens, write_json
from polar_cli.rollout.runner import RolloutConfig, RolloutInterrupted, RolloutResult, run_rollout
from polar_cli.rollout.tasks import Task, task_set_hash
from polar_cli.rollout.workspace import MAX_PATCH_BYTES

EXIT_NOTHING_TO_TRAIN = 3  # polar train's exit status when every reward of every group is equal
STATE_FILE = "loop.json"
CURVES_FILE = "loop-curves.png"


@dataclass
class LoopConfig:
    tasks: Sequence[Task]
    harness: str  # a --harness spec (kept as a string: loop.json records it)
    model: Path  # the starting policy
    iterations: int
    out: Path
    samples: int = 8  # sessions per task (the GRPO group)
    engine: str = "local"  # local | vllm (started and restarted by the loop) | sglang:URL (reloaded in place)
    runtime: str = "bwrap"  # local only with trust_agent (`polar loop --trust-agent`)
    trust_agent: bool = False
    runtime_options: Mapping[str, Any] = field(default_factory=dict)  # --runtime-option KEY=VALUE
    network: str | None = None
    concurrency: int = 4
    timeout_s: float | None = None
    seed: int = 0  # iteration i's rollout uses seed + i (its session ids are it{i}-...)
    proxy_options: Mapping[str, str] = field(default_factory=dict)
    train_args: Sequence[str] = ()  # extra `polar train` options, forwarded as given
    served_model_name: str = "policy"  # what harnesses ask for
    context_window: int | None = None  # None: what the engine serves (RolloutConfig.context_window)
    max_output_tokens: int | None = None
    vllm_args: Sequence[str] = ()  # extra vLLM flags (--engine vllm)
    vllm_port: int | None = None  # None: a free port
    vllm_push: str = "in-place"  # in-place (reload_weights, restart on failure) | restart (serving.py)
    env: Mapping[str, str] = field(default_factory=dict)  # extra harness environment
    read_only: Sequence[Path] = ()
    max_patch_bytes: int = MAX_PATCH_BYTES  # each rollout's (RolloutConfig.max_patch_bytes)
    # Each rollout on this Ray cluster (``polar rollout --ray``): OUT, the model and every checkpoint must be at the
    # same path on every node (a shared directory); training stays on this machine.
    ray: str | None = None
    ray_resource: str | None = None
    # Held-out evaluation (``polar loop --eval``; loop_eval.py): none without eval tasks. Sampled as the rollouts are
    # (the same harness, engine and proxy options), with ``eval_proxy_options`` laid over those.
    eval_tasks: Sequence[Task] = ()
    eval_every: int = 1
    eval_samples: int | None = None  # None: ``samples``
    eval_proxy_options: Mapping[str, str] = field(default_factory=dict)
    eval_pass_threshold: float = 1.0
    # ``polar loop --report-to``: each training's tracker run is named RUN-iter-NNN (RUN-train-NNN with --async).
    trackers_run: str | None = None
    # Dynamic sampling with backfill (``--min-groups``, DAPO's): an iteration whose rollout left fewer than
    # ``min_groups`` informative groups (rewards not all equal) rolls every task again as new groups, up to
    # ``max_backfill`` more rounds, into the same shards; the training drops the uninformative ones as always.
    min_groups: int | None = None
    max_backfill: int = 2
    # CPU sets (rollout/cpus.py): the loop and what it starts on rollout_cpus, each `polar train` on train_cpus.
    rollout_cpus: frozenset[int] | None = None
    train_cpus: frozenset[int] | None = None


@dataclass
class IterationStats:
    iteration: int
    policy: str  # the model directory the rollout sampled from
    sessions: int
    usable: int  # completed, failed or timeout
    rewarded: int  # completed with a reward (the ones the mean is over)
    statuses: dict[str, int]
    reward_mean: float | None
    reward_se: float | None
    rollout_s: float
    train: dict[str, Any] | None = None  # {"status": "trained"|"nothing_to_train", "checkpoint", "seconds", ...}
    push_s: float | None = None  # the engine's load of this iteration's policy (vllm, sglang; local: none)
    groups: dict[str, int] | None = None  # with min_groups: sampled, informative, dropped, backfilled, rounds
    calls: dict[str, int] | None = None  # the captured calls: answered_calls, tool_call_calls (eval.report)


def mean_se(values: Sequence[float]) -> tuple[float | None, float | None]:
    """The mean and its standard error (sample std / sqrt(n)); (None, None) for no values, SE 0 for one."""
    if not values:
        return None, None
    mean = statistics.fmean(values)
    return mean, statistics.stdev(values) / math.sqrt(len(values)) if len(values) > 1 else 0.0


def rise(first: IterationStats, last: IterationStats) -> tuple[float, float] | None:
    """(last mean - first mean, that difference in standard errors of the difference), or None without rewards."""
    if first.reward_mean is None or last.reward_mean is None:
        return None
    diff = last.reward_mean - first.reward_mean
    se = math.hypot(first.reward_se or 0.0, last.reward_se or 0.0)
    return diff, diff / se if se > 0 else (math.inf if diff > 0 else 0.0)


def iteration_dir(out: Path, i: int) -> Path:
    return out / f"iter-{i:03d}"


# -- the state file --------------------------------------------------------------------------------------------------


def load_state(out: Path) -> dict[str, Any]:
    path = out / STATE_FILE
    if not path.is_file():
        return {"iterations": []}
    return json.loads(path.read_text())


def save_state(out: Path, state: dict[str, Any]) -> None:
    tmp = out / (STATE_FILE + ".tmp")
    tmp.write_text(json.dumps(state, indent=2) + "\n")
    os.replace(tmp, out / STATE_FILE)


def _check_same_run(state: dict[str, Any], identity: dict[str, Any]) -> None:
    """A resumed loop must be the same experiment: other tasks, harness or starting model would mix two runs."""
    old = state.get("identity")
    if old is None:
        return
    changed = [k for k in identity if old.get(k) != identity[k]]
    if changed:
        raise ValueError(
            f"{', '.join(changed)} differ from the loop already in this directory "
            f"({', '.join(f'{k}={old.get(k)!r}' for k in changed)}): use another --out"
        )


# -- one phase each ----------------------------------------------------------------------------------------------------


def stats_of(i: int, policy: Path, result: RolloutResult) -> IterationStats:
    rewards = [s.reward for s in result.sessions if s.status in REWARDED and s.reward is not None]
    mean, se = mean_se(rewards)
    counts = result.counts()
    return IterationStats(
        iteration=i, policy=str(policy), sessions=len(result.sessions),
        usable=sum(counts.get(s, 0) for s in USABLE), rewarded=len(rewards), statuses=counts,
        reward_mean=mean, reward_se=se, rollout_s=result.ended_at - result.started_at,
    )  # fmt: skip


def _calls(result: RolloutResult) -> dict[str, int] | None:
    if result.store is None:
        return None
    return tool_call_counts(read_call_stats(result.store, [s.session_id for s in result.sessions]).values())


def lora_rank(train_args: Sequence[str]) -> int:
    """The ``--lora-r`` among a loop's `polar train` options (0 when none)."""
    rank = 0
    for i, arg in enumerate(train_args):
        value = arg.split("=", 1)[1] if arg.startswith("--lora-r=") else None
        if arg == "--lora-r" and i + 1 < len(train_args):
            value = train_args[i + 1]
        if value is not None:
            try:
                rank = int(value)
            except ValueError:
                raise ValueError(f"--train-arg --lora-r must be a whole number, not {value!r}") from None
    return rank


def train_start(config: LoopConfig, policy: Path) -> tuple[Path, list[str]]:
    """The model a `polar train` starts from, and the options that say so. With --vllm-push adapter, one adapter is
    trained across iterations over the starting model (what the engine keeps serving): the policy's adapter goes on
    training; otherwise the policy itself is trained."""
    if config.engine != "vllm" or config.vllm_push != "adapter" or policy.resolve() == config.model.resolve():
        return policy, []
    from polar_cli.serving import ADAPTER_DIR

    return config.model, ["--lora-init", str(policy / ADAPTER_DIR)]


def train_command(shards: Sequence[Path], policy: Path, output: Path, train_args: Sequence[str]) -> list[str]:
    return [sys.executable, "-m", "polar_cli.app", "train", *map(str, shards), "--model", str(policy), "--output",
            str(output), "--no-progress", *train_args]  # fmt: skip


def train_preexec(cpus: frozenset[int] | None) -> Callable[[], None]:
    """The ``preexec_fn`` of a `polar train`: dies with the loop, runs on the train CPU set."""
    from polar_cli.rollout.cpus import pin_self

    def preexec() -> None:
        die_with_parent()
        pin_self(cpus)

    return preexec


def die_with_parent() -> None:
    """``preexec_fn`` of a child that must not outlive the loop (Linux: SIGKILL when the loop's process dies, also by
    SIGKILL): a resumed loop trains into the same directory a leftover training would still write."""
    import ctypes
    import signal

    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass  # not Linux: an interrupted loop's training may outlive it


def stop_stale_engines(state_dir: Path) -> list[str]:
    """Stop the engines a killed run of this loop left running (``polar engine serve``'s state files in ``state_dir``:
    pid plus its start time, so only that very process); the URLs stopped."""
    from polar_cli.serving import stop_engine

    stopped = []
    for path in sorted(state_dir.glob("engine-*.json")) if state_dir.is_dir() else []:
        try:
            port = int(path.stem.removeprefix("engine-"))
        except ValueError:
            continue
        server, running = stop_engine(f"http://127.0.0.1:{port}", state_dir=state_dir)
        if running:
            stopped.append(server.url)
    return stopped


def tracked_train_args(config: LoopConfig, directory: Path) -> list[str]:
    """The loop's train options, plus the tracker run name of the training in ``directory`` (with --report-to)."""
    if config.trackers_run is None:
        return list(config.train_args)
    return [*config.train_args, "--run-name", f"{config.trackers_run}-{directory.name}"]


def run_train(
    shards: Path,
    policy: Path,
    output: Path,
    train_args: Sequence[str],
    log: Path,
    cpus: frozenset[int] | None = None,
) -> dict[str, Any]:
    """``polar train`` in its own process (its memory is gone when it ends); the outcome for loop.json."""
    shutil.rmtree(output, ignore_errors=True)
    started = time.monotonic()
    with log.open("w") as f:
        done = subprocess.run(
            train_command([shards], policy, output, train_args),
            stdout=f,
            stderr=subprocess.STDOUT,
            preexec_fn=train_preexec(cpus),
        )
    ran = {"seconds": time.monotonic() - started, "log": str(log), "shards": [str(shards)]}
    if done.returncode == EXIT_NOTHING_TO_TRAIN:
        shutil.rmtree(output, ignore_errors=True)
        return {"status": "nothing_to_train", **ran}
    if done.returncode != 0:
        tail = log.read_text(errors="replace")[-3000:]
        raise RuntimeError(f"polar train exited {done.returncode} (log {log}):\n{tail}")
    return {"status": "trained", "checkpoint": str(output), **ran}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def served_root(url: str) -> str | None:
    """The model directory a vLLM/SGLang server says it serves (``root`` in ``GET /v1/models``); None if unknown."""
    import httpx

    try:
        data = httpx.get(f"{url.rstrip('/')}/v1/models", timeout=5.0).json()
        root = data["data"][0].get("root")
    except (httpx.HTTPError, ValueError, KeyError, IndexError, TypeError, AttributeError):
        return None
    return root if isinstance(root, str) else None


def engine_kind(engine: str) -> str:
    """``local``, ``vllm`` or ``sglang`` (from ``sglang:URL``); ValueError for anything else."""
    if engine in ("local", "vllm"):
        return engine
    try:
        spec = EngineSpec.parse(engine)
    except ValueError:
        spec = None
    if spec is not None and spec.kind == "sglang" and spec.target.startswith(("http://", "https://")):
        return spec.kind
    raise ValueError(f"--engine must be local, vllm or sglang:URL (a running SGLang server), not {engine!r}")


class _Engine:
    """The policy's engine across iterations: ``local:DIR`` per rollout, one vLLM server restarted on each push, or a
    running SGLang server that loads each push in place (``update_weights_from_disk``).

    ``spec(policy, version)`` makes the engine serve ``policy`` (a push when it serves something else) and returns the
    ``polar_engine`` spec a rollout's proxy uses; with a version, every call it serves is tagged ``weight_version``
    (the local engine and vLLM through the spec's ``?weight_version=V``; SGLang reports the version it was given in
    its own answers, and the same tag is in its spec for the calls of an older build that reports none)."""

    def __init__(self, config: LoopConfig, state_dir: Path, keep: bool = False) -> None:
        self.config, self.state_dir = config, state_dir
        self.kind = engine_kind(config.engine)
        # Pushes land under running requests (async loop, drain "keep"): vLLM keeps them across the reload and
        # labels every token with its version, so rollouts' proxies sample where it says (versions=spans).
        self.keep = keep
        self.server: Any = None
        self.serving: tuple[Path, int | None] | None = None
        self.pushes: list[dict[str, Any]] = []  # each load after the first: version, checkpoint, seconds

    def spec(self, policy: Path, progress: Callable[[str], None], version: int | None = None) -> str:
        tag = "" if version is None else f"?weight_version={version}"
        if self.kind == "local":
            self.serving = (policy, version)
            return f"local:{policy}{tag}"
        from polar_cli.serving import label_version, load_state, reload_engine, serve_vllm

        wanted = (policy, version)
        started = time.monotonic()
        if self.kind == "sglang":
            url = EngineSpec.parse(self.config.engine).target
            if self.serving != wanted:
                progress(f"loading {policy} into SGLang {url} (update_weights_from_disk) as version {version}")
                reload_engine(
                    f"sglang:{url}",
                    policy,
                    state_dir=self.state_dir,
                    weight_version=None if version is None else str(version),
                )
                self._pushed(policy, version, started)
            return f"sglang:{url}{tag}"
        if self.server is None:
            # Adapters: the server holds the starting model for good, and each policy is an adapter over it.
            adapter = self.config.vllm_push == "adapter"
            start = self.config.model if adapter else policy
            progress(f"starting vLLM on {start}")
            self.server = serve_vllm(
                str(start), port=self.config.vllm_port or _free_port(),
                served_model_name=self.config.served_model_name,
                state_dir=self.state_dir, extra_args=list(self.config.vllm_args), dtype="auto", tie=True,
                push=self.config.vllm_push, lora_rank=lora_rank(self.config.train_args) if adapter else 0,
            )  # fmt: skip
            if start.resolve() == policy.resolve():
                if self.keep and version is not None:
                    label_version(self.server.url, str(version))
                self.serving = wanted
        if self.serving != wanted:
            progress(f"reloading vLLM with {policy} as version {version}")
            reload_engine(
                self.server.spec,
                policy,
                state_dir=self.state_dir,
                tie=True,
                weight_version=None if version is None else str(version),
                keep=self.keep,
            )
            self._pushed(policy, version, started)
        # vLLM reports no version: the tag in the spec is only true if this server serves ``policy`` now. Loaded in
        # place, the server still names the model it started on; what it loaded since is in its state.
        if self.server.push == "restart":
            server, root = self.server, served_root(self.server.url)
        else:
            server = load_state(self.state_dir, self.server.port)
            root = server.model
        if root is not None and Path(root).resolve() != policy.resolve():
            raise RuntimeError(
                f"vLLM on {server.url} serves {root}, not {policy}: its calls cannot be tagged version {version}"
            )
        spec = EngineSpec.parse(server.spec).with_params(
            weight_version=None if version is None else str(version), versions="spans" if self.keep else None
        )
        return str(spec)

    def _pushed(self, policy: Path, version: int | None, started: float) -> None:
        if self.serving is not None:  # the first load of a run is not a push of new weights
            self.pushes.append({"version": version, "checkpoint": str(policy), "reload_s": time.monotonic() - started})
        self.serving = (policy, version)

    def close(self) -> None:
        if self.server is not None:
            from polar_cli.serving import stop_engine

            stop_engine(self.server.url, state_dir=self.state_dir)
            self.server = None


def run_loop(
    config: LoopConfig,
    on_iteration: Callable[[list[IterationStats]], None] | None = None,
    progress: Callable[[str], None] | None = None,
    on_eval: Callable[[dict[str, Any]], None] | None = None,
) -> list[IterationStats]:
    """Run (or continue) the loop to ``config.iterations`` rollouts; returns every iteration's stats. With eval
    tasks, the policy of each due iteration (:func:`eval_due`) is evaluated on them before its rollout, each entry
    in loop.json's ``evals`` (and given to ``on_eval``)."""
    with pinned(config.rollout_cpus):  # what the loop starts (vLLM, proxies, harnesses) inherits the set
        return _run_loop(config, on_iteration, progress, on_eval)


def _run_loop(
    config: LoopConfig,
    on_iteration: Callable[[list[IterationStats]], None] | None = None,
    progress: Callable[[str], None] | None = None,
    on_eval: Callable[[dict[str, Any]], None] | None = None,
) -> list[IterationStats]:
    if config.iterations < 1:
        raise ValueError("iterations must be at least 1")
    if not (config.model / "config.json").is_file():
        raise ValueError(f"{config.model} is not a model directory (no config.json)")
    say = progress or (lambda _line: None)
    out = config.out
    out.mkdir(parents=True, exist_ok=True)
    state = load_state(out)
    if state.get("mode") == "async":
        raise ValueError(f"{out} holds an async loop (polar loop --async): use another --out")
    identity = {
        "tasks": task_set_hash(list(config.tasks)),
        "harness": config.harness,
        "model": str(config.model.resolve()),
        "samples": config.samples,
    }
    if config.eval_tasks:
        # Another held-out set (or sample count) would make one curve of two measures; a resume without --eval
        # leaves the evaluations already made as they are.
        identity["eval"] = {
            "tasks": task_set_hash(list(config.eval_tasks)),
            "samples": config.eval_samples or config.samples,
        }
    _check_same_run(state, identity)
    state["identity"] = identity
    records: list[dict[str, Any]] = state["iterations"]
    policy = _policy(records, config.model)
    if policy != config.model and not (policy / "config.json").is_file():
        raise ValueError(
            f"the policy's checkpoint {policy} is gone: the loop in {out} cannot resume; use another --out"
        )
    evals: list[dict[str, Any]] = state.setdefault("evals", [])
    engine = _Engine(config, out / ".engines")
    stop_stale_engines(engine.state_dir)
    started = time.monotonic()
    try:
        for i in range(config.iterations):
            idir = iteration_dir(out, i)
            if i >= len(records):
                # An interrupted attempt: start the iteration over whole, once its proxy is gone (a SIGKILLed run's
                # lifeline kills it; a proxy still alive after that would write into the redone iteration).
                wait_writer_gone(idir / "logs")
                shutil.rmtree(idir, ignore_errors=True)
                policy = _policy(records, config.model)
                # The policy's version: the trainings that made it (its calls carry it as weight_version).
                version = sum((r.get("train") or {}).get("status") == "trained" for r in records)
                pushes = len(engine.pushes)
                evaluated = {e["iteration"] for e in evals}
                if config.eval_tasks and i not in evaluated and eval_due(i, config.iterations, config.eval_every):
                    evals.append(_evaluate(config, i, policy, engine, say, version))
                    save_state(out, state)
                    if on_eval:
                        on_eval(evals[-1])
                rollout = _rollout(config, i, policy, engine, say, version)
                groups = None
                if config.min_groups is not None:
                    rollout, groups = _backfill(config, i, policy, engine, say, version, rollout)
                records.append(asdict(replace(stats_of(i, policy, rollout), groups=groups, calls=_calls(rollout))))
                if len(engine.pushes) > pushes:  # the eval or the rollout loaded this policy into the engine
                    records[-1]["push_s"] = sum(p["reload_s"] for p in engine.pushes[pushes:])
                save_state(out, state)
                if on_iteration:
                    on_iteration([IterationStats(**r) for r in records])
            record = records[i]
            if i < config.iterations - 1 and record.get("train") is None:
                say(f"iteration {i}: polar train")
                model, start_args = train_start(config, Path(record["policy"]))
                record["train"] = run_train(
                    idir / "shards",
                    model,
                    idir / "checkpoint",
                    [*start_args, *tracked_train_args(config, idir)],
                    idir / "train.log",
                    config.train_cpus,
                )
                save_state(out, state)
                if on_iteration:
                    on_iteration([IterationStats(**r) for r in records])
    finally:
        engine.close()
    state["seconds_this_run"] = time.monotonic() - started
    from polar_cli.train.plots import plot_loop_curves

    state["curves"] = str(plot_loop_curves(records, evals, out / CURVES_FILE))
    save_state(out, state)
    return [IterationStats(**r) for r in records[: config.iterations]]


def _policy(records: list[dict[str, Any]], start: Path) -> Path:
    """The newest checkpoint a training made; iterations with nothing to train keep the policy before them."""
    for record in reversed(records):
        train = record.get("train") or {}
        if train.get("status") == "trained":
            return Path(train["checkpoint"])
    return start


def rollout_config(
    config: LoopConfig, directory: Path, engine: str, seed: int, run_id: str, stop: asyncio.Event | None = None
) -> RolloutConfig:
    """One rollout of the loop's tasks into ``directory`` (shards/, logs/, a work/ scratch dir)."""
    return RolloutConfig(
        tasks=config.tasks, harness=config.harness, samples=config.samples, out=str(directory / "shards"),
        engine=engine, runtime=config.runtime, network=config.network, concurrency=config.concurrency,  # type: ignore[arg-type]
        timeout_s=config.timeout_s, seed=seed, run_id=run_id, model=config.served_model_name,
        logs_dir=directory / "logs", proxy_options=dict(config.proxy_options), env=dict(config.env),
        read_only=tuple(config.read_only), work_dir=directory / "work", context_window=config.context_window,
        max_output_tokens=config.max_output_tokens, stop=stop, trust_agent=config.trust_agent,
        runtime_options=config.runtime_options,
        max_patch_bytes=config.max_patch_bytes,
    )  # fmt: skip


def _evaluate(
    config: LoopConfig, i: int, policy: Path, engine: _Engine, say: Callable[[str], None], version: int
) -> dict[str, Any]:
    """Iteration ``i``'s policy on the held-out tasks, into ``OUT/eval/iter-NNN`` (redone whole if a killed run left
    one half done); its loop.json entry."""
    edir = eval_dir(config.out, i)
    wait_writer_gone(edir / "logs")
    shutil.rmtree(edir, ignore_errors=True)
    edir.mkdir(parents=True)
    spec = engine.spec(policy, say, version)  # the push, when this iteration samples new weights
    samples = config.eval_samples or config.samples
    say(f"iteration {i}: held-out eval of {len(config.eval_tasks)} tasks x {samples} samples on {policy}")
    rollout = replace(
        rollout_config(config, edir, spec, config.seed + i, f"ev{i:03d}"),
        tasks=config.eval_tasks,
        samples=samples,
        proxy_options={**config.proxy_options, **config.eval_proxy_options},
    )
    started = time.monotonic()
    try:
        with progress_config(edir, rollout, lambda: control_tokens(rollout.out, rollout.confdir, None)) as rollout:
            result = asyncio.run(run_rollout(rollout) if config.ray is None else _ray_rollout(rollout, config))
    finally:
        shutil.rmtree(edir / "work", ignore_errors=True)
    summary = result.summary()
    tokens = control_tokens(rollout.out, rollout.confdir, None)
    write_json(edir / "rollout-summary.json", summary, tokens)
    if result.interrupted:
        raise RolloutInterrupted(
            f"iteration {i}: held-out eval interrupted by {result.interrupted} (summary in {edir})", result.interrupted
        )
    report = score(summary["session_results"], samples, config.eval_pass_threshold, Path(rollout.out))
    entry = loop_entry(report, i, str(policy), version, time.monotonic() - started)
    document = {
        **report.to_json(), "iteration": i, "policy": str(policy), "version": version,
        "task_set_hash": task_set_hash(list(config.eval_tasks)), "rollout_summary": str(edir / "rollout-summary.json"),
    }  # fmt: skip
    write_json(edir / EVAL_REPORT, document, tokens)
    return {**entry, "report": str(edir / EVAL_REPORT)}


async def _ray_rollout(rollout: RolloutConfig, config: LoopConfig) -> RolloutResult:
    from polar_cli.rollout.ray_backend import RayOptions, run_rollout_ray

    assert config.ray is not None
    return await run_rollout_ray(rollout, RayOptions(config.ray, config.ray_resource))


def informative_groups(result: RolloutResult) -> list[str]:
    """The groups a GRPO step can learn from: at least two rewarded sessions whose rewards are not all equal."""
    return sorted(
        g for g, rewards in result.group_rewards().items() if len(rewards) > 1 and min(rewards) < max(rewards)
    )


def merged(first: RolloutResult, later: Sequence[RolloutResult]) -> RolloutResult:
    """One iteration's rollouts as one result (its sessions, from the first start to the last end)."""
    if not later:
        return first
    sessions = [s for r in (first, *later) for s in r.sessions]
    return replace(first, sessions=sessions, ended_at=later[-1].ended_at)


def _backfill(
    config: LoopConfig, i: int, policy: Path, engine: _Engine, say: Callable[[str], None], version: int | None,
    first: RolloutResult,
) -> tuple[RolloutResult, dict[str, int]]:  # fmt: skip
    """More rounds of every task, as new groups (task id ``ID+bfK``), until ``min_groups`` groups are informative
    or ``max_backfill`` rounds are spent; the merged result and the counts loop.json records."""
    assert config.min_groups is not None
    rounds: list[RolloutResult] = []
    while (short := backfill_short(config, first, rounds)) is not None:
        k = len(rounds) + 1
        say(f"iteration {i}: {short} informative groups < {config.min_groups}: backfill round {k}")
        rounds.append(_rollout(config, i, policy, engine, say, version, tasks=backfill_tasks(config, k), backfill=k))
    result, groups = backfill_counts(config.min_groups, first, rounds)
    if groups["informative"] < config.min_groups:
        say(f"iteration {i}: {groups['informative']} informative groups after {len(rounds)} backfill rounds: short")
    return result, groups


def backfill_short(config: LoopConfig, first: RolloutResult, rounds: Sequence[RolloutResult]) -> int | None:
    """The informative groups so far when another backfill round is due (fewer than ``min_groups``, rounds left),
    else None."""
    assert config.min_groups is not None
    informative = len(informative_groups(merged(first, rounds)))
    return informative if informative < config.min_groups and len(rounds) < config.max_backfill else None


def backfill_tasks(config: LoopConfig, k: int) -> list[Task]:
    """Backfill round ``k``'s tasks: every task again as a new group (task id ``ID+bfK``)."""
    return [replace(t, id=f"{t.id}+bf{k}") for t in config.tasks]


def backfill_counts(
    target: int, first: RolloutResult, rounds: Sequence[RolloutResult]
) -> tuple[RolloutResult, dict[str, int]]:
    """The merged result of a rollout and its backfill rounds, and the counts loop.json records."""
    result = merged(first, rounds)
    informative = len(informative_groups(result))
    sampled = len(result.group_rewards())
    groups = {
        "target": target, "sampled": sampled, "informative": informative, "dropped": sampled - informative,
        "backfilled": informative - len(informative_groups(first)), "rounds": len(rounds),
    }  # fmt: skip
    return result, groups


def _rollout(
    config: LoopConfig,
    i: int,
    policy: Path,
    engine: _Engine,
    say: Callable[[str], None],
    version: int | None = None,
    *,
    tasks: Sequence[Task] | None = None,
    backfill: int = 0,
) -> RolloutResult:
    """Iteration ``i``'s rollout into ``OUT/iter-NNN/shards``; ``backfill`` K > 0: backfill round K into the same
    shards (its own run id, seed and summary file)."""
    part = f"bf{backfill}" if backfill else ""
    idir = iteration_dir(config.out, i)
    idir.mkdir(parents=True, exist_ok=bool(backfill))
    spec = engine.spec(policy, say, version)
    tasks = config.tasks if tasks is None else tasks
    what = f"rollout {part}" if part else "rollout"
    say(f"iteration {i}: {what} of {len(tasks)} tasks x {config.samples} samples on {policy}")
    seed = config.seed + i + 100_000 * backfill
    rollout = replace(rollout_config(config, idir, spec, seed, f"it{i:03d}{part}"), tasks=tasks)
    try:
        with progress_config(idir, rollout, lambda: control_tokens(rollout.out, rollout.confdir, None)) as rollout:
            result = asyncio.run(run_rollout(rollout) if config.ray is None else _ray_rollout(rollout, config))
    finally:
        shutil.rmtree(idir / "work", ignore_errors=True)
    summary = idir / (f"rollout-summary-{part}.json" if part else "rollout-summary.json")
    write_json(summary, result.summary(), control_tokens(rollout.out, rollout.confdir, None))
    if result.interrupted:
        # Not recorded: re-running the loop starts this iteration over.
        raise RolloutInterrupted(
            f"iteration {i}: interrupted by {result.interrupted} (summary in {idir})", result.interrupted
        )
    if result.all_failed:
        raise RuntimeError(f"iteration {i}: no session was usable (logs in {idir / 'logs'})")
    return result
