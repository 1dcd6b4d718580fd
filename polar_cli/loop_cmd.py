"""`polar loop`: a thin Typer shell over :func:`polar_cli.rollout.loop.run_loop` (options -> LoopConfig, a rich table
of reward per iteration, the exit code)."""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import typer

from polar_cli.eval_cmd import EvalSettings
from polar_cli.rollout.config import RolloutSettings, check_network, check_set_options
from polar_cli.set_option import runtime_options, set_options
from polar_cli.settings import SettingsError, command, option, reuse
from polar_cli.train.config import TrainConfig

if TYPE_CHECKING:
    from polar_cli.rollout.loop import LoopConfig
    from polar_cli.rollout.tasks import Task

LOOP_HELP = (
    "Close the loop: rollout -> polar train -> engine reload -> rollout, ITERATIONS times.\n"
    "\n"
    "Each iteration runs SAMPLES sessions of every task (as `polar rollout`) into OUT/iter-NNN/shards, "
    "then trains the policy that sampled them on exactly those shards (`polar train`), and the checkpoint"
    " becomes the policy of the next rollout. The last iteration only rolls out: it measures the last "
    'training. Iterations where every reward is equal ("nothing to train") keep the policy.\n'
    "\n"
    "--eval HELDOUT: the held-out tasks are run on the base policy and on every --eval-every-th iteration's "
    "policy (and the last), --eval-samples sessions each, sampled as the rollouts are, into OUT/eval/iter-NNN "
    "(never trained on); loop.json's evals hold pass@1 ± SE, pass@k and the causes (`polar eval`'s scoring), "
    "OUT/loop-curves.png draws them next to the train reward.\n"
    "\n"
    "Every option polar loop does not know is passed to `polar train` as given (e.g. --lr 1e-2 --epochs 2"
    " --groups-per-step 1); they are checked before the first rollout.\n"
    "\n"
    "Resumable: OUT/loop.json records each finished rollout and training; run the same command again "
    "after an interruption and it continues at the first unfinished phase (a half-done rollout is redone "
    "from scratch, so shards of two attempts never mix). Even a SIGKILLed loop leaves nothing running "
    "that could write into it: its proxy, harnesses, containers, training and vLLM die with it, and the "
    "redo refuses an iteration directory whose proxy is still alive.\n"
    "\n"
    "--ray ADDRESS: each rollout runs on a Ray cluster as `polar rollout --ray` does (a worker with its "
    "own proxy per node, all writing OUT/iter-NNN/shards); OUT, --model and the checkpoints must be at "
    "the same path on every node; `polar train` runs on this machine.\n"
    "\n"
    "--async: rollouts keep running while the trainer trains on finished batches (any --engine). A "
    "batch's groups are trained only if every call's weight_version is within --max-staleness versions of"
    " the policy being trained (staler ones are dropped and counted). Each new checkpoint is pushed as "
    "the next version V with a drain: new sessions wait until the engine serves V, and the batch in "
    "flight either finishes on the old weights first (--drain wait) or is cancelled, its running sessions"
    " masked as error (--drain cut), or goes on across the push (--drain keep: vllm with --vllm-push "
    "in-place only; the push lands as soon as the checkpoint is made: vLLM pauses, reloads, recomputes the"
    " running requests on the new weights and resumes, and labels every sampled token with its version, "
    "recorded per call in weight_versions_json; loop.json reports per batch the calls and tokens sampled "
    "across a push). The push: local: a new proxy on the checkpoint; vllm: `polar engine "
    "reload` restarts vLLM on it (each batch's proxy tags its calls vllm:URL?weight_version=V, as vLLM "
    "reports no version); sglang:URL: update_weights_from_disk with weight_version V, which SGLang "
    "reports in every answer. polar train's truncated importance sampling against the captured logprobs "
    "corrects the bounded staleness. loop.json records batches, steps, each push's drain time and the "
    "rollout/trainer utilisation (fraction of wall time busy). Resumable: run the same command again "
    "after Ctrl-C or a kill and it continues from the last finished step (its checkpoint and version; no "
    "batch is trained twice; the batch in flight is redone).\n"
    "\n"
    "Example (the toy task of examples/toy_task):\n"
    "\n"
    'polar loop examples/toy_task/tasks.jsonl --harness "cmd:$PWD/.venv/bin/python '
    '$PWD/examples/toy_task/agent.py {instruction}" --model models/tiny --iterations 4 --out runs/toy '
    "--lr 1e-2 --epochs 2 --groups-per-step 1\n"
    "\n"
    "Sessions run in bwrap (network proxy-only) by default, which shows a cmd: harness every absolute "
    "path it names (a venv whole) read-only; --runtime local runs them unsandboxed and needs "
    "--trust-agent.\n"
)


@dataclass
class LoopSettings:
    """`polar loop`'s command line: its own options, and `polar rollout`'s it passes to every rollout (reused, not
    repeated: the same flags, defaults, help and checks). Unknown options go to `polar train` (checked up front)."""

    tasks: Path = reuse(
        RolloutSettings,
        "tasks",
        help="The task set (as `polar rollout`): a JSONL file, a Harbor task directory, or a directory of either.",
    )
    harness: str = reuse(RolloutSettings, "harness")
    model: Path = option(flags=("--model", "-m"), help="The starting policy (a model directory).")
    iterations: int = option(flags=("--iterations", "-k"), help="Rollouts; a training between each two.")
    out: Path = option(
        flags=("--out", "-o"),
        help="The loop's directory: iter-NNN/{shards,logs,checkpoint}, "
        "loop.json. Re-running with the same OUT resumes.",
    )
    samples: int = reuse(
        RolloutSettings, "samples", default=8, help="Sessions per task per iteration (the GRPO group)."
    )
    engine: str = option(
        "local",
        help="local: the model runs in the proxy (restarted on each checkpoint); "
        "vllm: a vLLM server (.venv-vllm) started by the loop and restarted on each checkpoint; "
        "sglang:URL: a running SGLang server, given each checkpoint with "
        "update_weights_from_disk (it must see the loop's --out at the same path).",
    )
    runtime: str | None = reuse(RolloutSettings, "runtime")
    trust_agent: bool = reuse(RolloutSettings, "trust_agent")
    runtime_option: list[str] = reuse(RolloutSettings, "runtime_option")
    network: str | None = reuse(RolloutSettings, "network")
    concurrency: int = reuse(RolloutSettings, "concurrency")
    timeout_s: float | None = reuse(RolloutSettings, "timeout_s")
    seed: int = option(0, help="Iteration i's rollout seed is SEED + i (session ids and task order).")
    served_model_name: str = reuse(RolloutSettings, "model", flags=("--served-model",))
    context_window: int | None = reuse(
        RolloutSettings,
        "context_window",
        help="The context window each harness is told. Default: what the engine serves (the model's "
        "max_position_embeddings; vLLM's --max-model-len).",
    )
    max_output_tokens: int | None = reuse(RolloutSettings, "max_output_tokens")
    max_patch_mb: int = reuse(RolloutSettings, "max_patch_mb")
    proxy_set: list[str] = reuse(
        RolloutSettings, "proxy_set", help="Extra proxy option KEY=VALUE (repeatable), e.g. --set polar_max_tokens=64."
    )
    vllm_arg: list[str] = option(
        default_factory=list, flags=("--vllm-arg",), help="Extra vLLM flag with --engine vllm (repeatable)."
    )
    progress: bool = reuse(RolloutSettings, "progress", help="Status lines while a phase runs.")
    asynchronous: bool = option(
        False,
        flags=("--async",),
        help="Rollouts keep running while the trainer trains (see above); resumable with the same --out.",
    )
    max_staleness: int | None = option(
        None,
        flags=("--max-staleness",),
        min=0,
        help="--async: train a group only if its calls were sampled at most this many weight versions before the "
        "policy being trained (default 1). Without --async it is passed to polar train.",
    )
    drain: str = option(
        "wait",
        flags=("--drain",),
        help="--async, when new weights are pushed (new sessions wait until "
        "the engine serves them): wait (the batch in flight finishes on the old weights first) "
        "or cut (its running sessions are cancelled and masked as error) "
        "or keep (vllm in place: the running requests go on on the new weights, each token labelled with the "
        "version that sampled it).",
    )
    ray: str | None = reuse(
        RolloutSettings,
        "ray",
        help="Run each rollout on this Ray cluster (as polar "
        "rollout --ray: a worker and proxy per node, --concurrency per node). "
        "OUT, --model and the checkpoints must be at the same path on every "
        "node (a shared directory); training runs here. Needs the pip extra "
        "fleet.",
    )
    ray_resource: str | None = reuse(RolloutSettings, "ray_resource")
    eval_tasks: Path | None = option(
        None,
        flags=("--eval",),
        help="A held-out task set (as TASKS) evaluated on the policy before the first iteration (the base), after "
        "every --eval-every-th iteration's weight push, and at the last iteration: pass@1 ± SE, pass@k, causes per "
        "evaluated iteration in loop.json (evals) and loop-curves.png, as `polar eval` scores them. Its sessions "
        "go to OUT/eval/iter-NNN, never into a training. Sampled exactly as the rollouts (the same harness, "
        "engine and --set options, so the training temperature, as the paper evaluates) unless --eval-set says "
        "otherwise. Not with --async.",
    )
    eval_every: int = option(1, min=1, help="--eval: evaluate every N-th iteration's policy (and the base, the last).")
    eval_samples: int | None = option(
        None,
        min=1,
        help="--eval: sessions per held-out task (default --samples); pass@k is reported for k = 1 and this.",
    )
    eval_set: list[str] = option(
        default_factory=list,
        flags=("--eval-set",),
        help="--eval: a proxy option KEY=VALUE for the held-out sessions only, over --set (repeatable), e.g. "
        "--eval-set polar_temperature=0 --eval-set polar_sampling=fixed for greedy evaluation.",
    )
    eval_pass_threshold: float = reuse(
        EvalSettings,
        "pass_threshold",
        flags=("--eval-pass-threshold",),
        help="--eval: a held-out session passes when its reward is at least this.",
    )
    report_to: list[str] = reuse(
        TrainConfig,
        "report_to",
        help="Experiment trackers (tensorboard, wandb, trackio, none; repeatable or a comma list): one point per "
        "iteration (--async: per training step) of the train reward mean and SE, held-out pass@1 (--eval), "
        "staleness, push latency and the rollout/trainer busy fractions, the iteration as the step, in run RUN_NAME; "
        "each training logs its own TRL metrics to the same trackers as run RUN_NAME-iter-NNN. Needs the pip extra "
        "trackers.",
    )
    run_name: str | None = reuse(
        TrainConfig, "run_name", help="--report-to: the loop's run name (default: OUT's name)."
    )
    logging_dir: Path | None = reuse(
        TrainConfig,
        "logging_dir",
        help="--report-to: where the trackers write (as polar train --logging-dir). Default: OUT/runs.",
    )
    project: str = reuse(TrainConfig, "project")
    min_groups: int | None = option(
        None,
        help="Dynamic sampling with backfill (DAPO's): when an iteration's rollout leaves fewer than N informative "
        "groups (rewards not all equal; the training drops the others), every task is rolled again as new groups "
        "into the same shards, up to --max-backfill more rounds. loop.json records per iteration (--async: per "
        "batch) the groups sampled, informative, dropped and backfilled.",
    )
    max_backfill: int = option(2, help="--min-groups: at most this many extra rounds per iteration.")
    vllm_push: str = option(
        "in-place",
        help="How --engine vllm gets each checkpoint: in-place (vLLM's reload_weights through its development "
        "endpoints on 127.0.0.1, a restart if that fails), restart (a new server on it, ~30-50 s on CPU) or "
        "adapter (with polar train's --lora-r: vLLM serves the starting model for good plus one LoRA adapter, "
        "trained across iterations and pushed alone, megabytes instead of the whole model; any embeddings).",
    )
    rollout_cpus: str | None = option(
        None,
        help="Run the loop and everything it starts (vLLM, proxies, harnesses) on these CPUs (a Linux CPU list: "
        "0-7,16); with --train-cpus, rollouts and training get their own cores, which --async needs to overlap "
        "them on one machine.",
    )
    train_cpus: str | None = option(None, help="Run each polar train on these CPUs (a Linux CPU list: 8-15).")

    def validate(self) -> None:
        from polar_cli.rollout.loop import engine_kind
        from polar_cli.trackers import TrackerError, check_installed, parse_report_to

        try:
            check_installed(parse_report_to(self.report_to))
        except TrackerError as exc:
            raise SettingsError(str(exc), "report_to") from exc

        try:
            engine_kind(self.engine)
        except ValueError as exc:
            raise SettingsError("local, vllm or sglang:URL", "engine") from exc
        check_network(self.network)
        if self.drain not in ("wait", "cut", "keep"):
            raise SettingsError("wait, cut or keep", "drain")
        if self.vllm_push not in ("in-place", "restart", "adapter"):
            raise SettingsError("in-place, restart or adapter", "vllm_push")
        for name in ("rollout_cpus", "train_cpus"):
            self._cpus(name)
        if self.min_groups is not None and self.min_groups < 1:
            raise SettingsError("1 or more", "min_groups")
        if self.max_backfill < 0:
            raise SettingsError("0 or more", "max_backfill")
        if self.ray is not None and self.asynchronous:
            raise SettingsError("--ray runs the synchronous loop's rollouts; --async runs locally", "ray")
        if self.ray is not None and self.engine != "local":
            raise SettingsError(
                "--ray needs --engine local (each node's proxy loads the policy; the loop's vLLM "
                "server listens on this machine's loopback only)",
                "engine",
            )
        if self.ray_resource is not None and self.ray is None:
            raise SettingsError("--ray-resource needs --ray", "ray_resource")
        check_set_options(self.proxy_set)
        check_set_options(self.runtime_option, "runtime_option")
        check_set_options(self.eval_set, "eval_set")
        if self.eval_tasks is None:
            for name, default in (("eval_every", 1), ("eval_samples", None), ("eval_set", [])):
                if getattr(self, name) != default:
                    raise SettingsError("needs --eval (the held-out task set)", name)
        elif self.asynchronous:
            # The async loop pushes weights under running batches; an eval there would need its own drain.
            raise SettingsError(
                "--eval runs with the synchronous loop only: --async does not evaluate held-out tasks "
                "(run `polar eval` on its checkpoints, OUT/train-NNN/checkpoint)",
                "eval_tasks",
            )

    def _cpus(self, name: str) -> frozenset[int] | None:
        from polar_cli.rollout.cpus import check_cpus, parse_cpus

        text = getattr(self, name)
        if text is None:
            return None
        try:
            cpus = parse_cpus(text)
            check_cpus(cpus, "CPUs")
        except ValueError as exc:
            raise SettingsError(str(exc), name) from exc
        return cpus

    def to_config(
        self, tasks: Sequence[Task], train_args: Sequence[str], eval_tasks: Sequence[Task] = ()
    ) -> LoopConfig:
        """The loop's config (the runtime chosen first)."""
        from polar_cli.rollout.loop import LoopConfig

        assert self.runtime is not None, "choose the runtime first"
        return LoopConfig(
            tasks=tasks, harness=self.harness, model=self.model, iterations=self.iterations, out=self.out,
            samples=self.samples, engine=self.engine, runtime=self.runtime, trust_agent=self.trust_agent,
            runtime_options=runtime_options(self.runtime_option),
            network=self.network, concurrency=self.concurrency, timeout_s=self.timeout_s, seed=self.seed,
            proxy_options=set_options(self.proxy_set), train_args=train_args,
            served_model_name=self.served_model_name, vllm_args=self.vllm_arg, vllm_push=self.vllm_push,
            context_window=self.context_window,
            max_output_tokens=self.max_output_tokens, max_patch_bytes=self.max_patch_mb * 1024 * 1024, ray=self.ray,
            ray_resource=self.ray_resource, eval_tasks=eval_tasks, eval_every=self.eval_every,
            eval_samples=self.eval_samples, eval_proxy_options=set_options(self.eval_set),
            eval_pass_threshold=self.eval_pass_threshold, min_groups=self.min_groups, max_backfill=self.max_backfill,
            trackers_run=self.tracker_run_name if self.trackers else None,
            rollout_cpus=self._cpus("rollout_cpus"), train_cpus=self._cpus("train_cpus"),
        )  # fmt: skip

    @property
    def trackers(self) -> list[str]:
        from polar_cli.trackers import parse_report_to

        return parse_report_to(self.report_to)

    @property
    def tracker_run_name(self) -> str:
        return self.run_name or self.out.resolve().name

    @property
    def tracker_dir(self) -> Path:
        return self.logging_dir if self.logging_dir is not None else self.out / "runs"

    def tracker_train_args(self) -> list[str]:
        """What each training is told, so its TRL metrics go to the same trackers, directory and project."""
        if not self.trackers:
            return []
        return ["--report-to", ",".join(self.trackers), "--logging-dir", str(self.tracker_dir), "--project",
                self.project]  # fmt: skip


@command
def loop(ctx: typer.Context, settings: LoopSettings) -> None:
    from rich.console import Console

    from polar_cli.rollout.harnesses import get_preset
    from polar_cli.rollout.loop import load_state, rise, run_loop
    from polar_cli.rollout.tasks import TaskFileError, load_tasks
    from polar_cli.rollout_cmd import choose_runtime

    s = settings
    s.validate()
    s.runtime = choose_runtime(s.runtime, s.trust_agent)
    train_args = list(ctx.args)
    if s.max_staleness is not None and not s.asynchronous:
        train_args += ["--max-staleness", str(s.max_staleness)]
    _check_train_args(train_args, s.asynchronous)
    if s.engine == "vllm" and s.vllm_push == "adapter":
        from polar_cli.rollout.loop import lora_rank

        if lora_rank(train_args) <= 0:
            raise typer.BadParameter(
                "--vllm-push adapter pushes a LoRA adapter: pass polar train's --lora-r N after --",
                param_hint="--vllm-push",
            )
    train_args += s.tracker_train_args()
    try:
        get_preset(s.harness)
    except ValueError as exc:
        raise typer.BadParameter(str(exc), param_hint="--harness") from exc
    try:
        task_list = load_tasks(s.tasks)
        eval_list = load_tasks(s.eval_tasks) if s.eval_tasks is not None else []
    except (TaskFileError, ValueError) as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(2) from exc
    shared = sorted({t.id for t in task_list} & {t.id for t in eval_list})
    if shared:
        typer.echo(f"warning: --eval shares task ids with TASKS ({', '.join(shared[:5])}): not held out?", err=True)
    console = Console()
    status_console = Console(stderr=True)
    config = s.to_config(task_list, train_args, eval_list)
    shown: set[tuple[int, bool]] = set()

    def on_iteration(stats: list[Any]) -> None:
        key = (len(stats), stats[-1].train is not None)
        if key not in shown:
            shown.add(key)
            console.print(_table(stats))

    def say(line: str) -> None:
        if s.progress:
            status_console.print(f"[dim]{line}[/]")

    with _tracked(s) as track:
        if s.asynchronous:
            _run_async(config, 1 if s.max_staleness is None else s.max_staleness, s.drain, console, say, track)
            return

        def on_iteration_tracked(stats: list[Any]) -> None:
            on_iteration(stats)
            track()

        with _exit_codes("; run the same command to resume"):
            stats = run_loop(
                config, on_iteration=on_iteration_tracked, progress=say, on_eval=lambda e: console.print(_eval_line(e))
            )
    console.print(_table(stats))
    evals = sorted(load_state(s.out).get("evals", []), key=lambda e: e["iteration"])
    if len(evals) > 1 and evals[0]["pass@1"] is not None and evals[-1]["pass@1"] is not None:
        first, last = evals[0], evals[-1]
        se = math.hypot(first["pass@1_se"] or 0.0, last["pass@1_se"] or 0.0)
        diff = last["pass@1"] - first["pass@1"]
        rise_se = f", {diff / se:.1f} standard errors" if se > 0 else ""
        console.print(
            f"held-out pass@1 {first['pass@1']:.3f} (iteration {first['iteration']}) -> {last['pass@1']:.3f} "
            f"(iteration {last['iteration']}): {diff:+.3f}{rise_se}"
        )
    change = rise(stats[0], stats[-1])
    if change is not None and len(stats) > 1:
        diff, z = change
        console.print(
            f"reward {stats[0].reward_mean:.3f} -> {stats[-1].reward_mean:.3f}: {diff:+.3f}, "
            f"{z:.1f} standard errors; loop.json in {s.out}"
        )
    else:
        console.print(f"loop.json in {s.out}")


@contextmanager
def _tracked(s: LoopSettings) -> Iterator[Any]:
    """The loop's tracker writers while it runs; yields ``track()``, which logs the points loop.json holds now."""
    from polar_cli.rollout.loop import load_state
    from polar_cli.trackers import LoopTracker, open_writers

    if not s.trackers:
        yield lambda: None
        return
    config = {k: str(v) if isinstance(v, Path) else v for k, v in vars(s).items() if k != "report_to"}
    tracker = LoopTracker(
        open_writers(s.trackers, s.tracker_dir, s.tracker_run_name, s.project, config), load_state(s.out), s.iterations
    )
    try:
        yield lambda: tracker.update(load_state(s.out))
    finally:
        tracker.close(load_state(s.out))


@contextmanager
def _exit_codes(resume_hint: str) -> Iterator[None]:
    """A loop's errors as exit codes: 2 for bad input, 130/143 for a signal (with how to go on), 1 otherwise."""
    from polar_cli.rollout.runner import RolloutInterrupted
    from polar_cli.rollout_cmd import interrupted_exit_code

    try:
        yield
    except ValueError as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(2) from exc
    except RolloutInterrupted as exc:
        typer.echo(f"error: {exc}{resume_hint}", err=True)
        raise typer.Exit(interrupted_exit_code(exc.signal_name)) from exc
    except RuntimeError as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(1) from exc


def _run_async(config: Any, max_staleness: int, drain: str, console: Any, say: Any, track: Any) -> None:
    from polar_cli.rollout.async_loop import run_async_loop

    def on_event(event: dict[str, Any]) -> None:
        if event["kind"] == "batch":
            b = event["batch"]
            reward = "-" if b.reward_mean is None else f"{b.reward_mean:.3f} ± {b.reward_se:.3f}"
            console.print(
                f"batch {b.index}: version {b.version}, reward {reward} (n {b.rewarded}), "
                f"{b.ended_at - b.started_at:.0f} s{', cut' if b.cut else ''}"
            )
        else:
            s = event["step"]
            console.print(
                f"step {s.step}: {s.status.replace('_', ' ')} on version {s.version} from batches "
                f"{s.batches} ({s.groups_kept} groups, {s.groups_dropped} dropped as stale), "
                f"{s.ended_at - s.started_at:.0f} s"
            )
        track()

    with _exit_codes("; run the same command to resume from the last finished step"):
        state = run_async_loop(config, max_staleness, drain, on_event=on_event, progress=say)  # type: ignore[arg-type]
    console.print(_async_table(state))
    s = state["summary"]
    final = "-" if s["final_reward_mean"] is None else f"{s['final_reward_mean']:.3f} ± {s['final_reward_se']:.3f}"
    console.print(
        f"{s['wall_s']:.0f} s: rollout busy {s['rollout_util']:.0%}, trainer busy {s['trainer_util']:.0%}; "
        f"{s['batches']} batches ({s['batches_cut']} cut), {s['groups_dropped']} groups dropped as stale; "
        f"version {s['final_version']} reward {final}; loop.json in {config.out}"
    )
    for push in state.get("pushes", []):
        where = "" if push.get("during_batch") is None else f" under batch {push['during_batch']}"
        console.print(
            f"push of version {push['version']} to {push['engine']}{where}: drain {push['drain_s']:.1f} s "
            f"(checkpoint made -> engine serving it), of which reload {push['reload_s']:.1f} s"
        )
    mix = s.get("versions")
    if mix:
        console.print(
            f"sampled across a push: {mix['calls_mixed']} of {mix['calls']} calls, {mix['tokens_after_push']} of "
            f"{mix['tokens']} tokens after their call's first version"
        )


def _async_table(state: dict[str, Any]) -> Any:
    from rich.table import Table

    table = Table(title="polar loop --async", title_justify="left")
    for name in ("step", "version", "batches", "groups", "dropped", "train s", "rollout busy", "trainer busy"):
        table.add_column(name, justify="right")
    for s in state["steps"]:
        table.add_row(str(s["step"]), str(s["version"]), ",".join(map(str, s["batches"])), str(s["groups_kept"]),
                      str(s["groups_dropped"]), f"{s['ended_at'] - s['started_at']:.0f}", f"{s['rollout_util']:.0%}",
                      f"{s['trainer_util']:.0%}")  # fmt: skip
    return table


def _check_train_args(args: list[str], asynchronous: bool = False) -> None:
    """Parse the forwarded options with `polar train`'s own parser now, not after the first rollout."""
    import click

    from polar_cli.train_cmd import train

    command = typer.main.get_command(_train_app(train))
    try:
        command.make_context("polar train", ["SHARDS", "--model", "M", "--output", "O", *args])
    except click.UsageError as exc:
        raise typer.BadParameter(f"{' '.join(args)}: {exc.format_message()}", param_hint="polar train options") from exc
    loop_sets = ("--model", "--output", "--resume", "--lora-init")
    for flag in (*loop_sets, *(("--current-weight-version",) if asynchronous else ())):
        if any(a == flag or a.startswith(flag + "=") for a in args):
            raise typer.BadParameter(f"polar loop sets {flag} of each training itself", param_hint=flag)


def _train_app(train: Any) -> typer.Typer:
    app = typer.Typer()
    app.command()(train)
    return app


def _eval_line(entry: dict[str, Any]) -> str:
    """One held-out evaluation as a line: pass@k ± SE, tasks and sessions scored, the causes."""
    figures = []
    for name, e in entry["overall"].items():
        if e["mean"] is None:
            figures.append(f"{name} -")
        else:
            figures.append(f"{name} {e['mean']:.3f}" + (f" ± {e['se']:.3f}" if e["se"] is not None else ""))
    causes = ", ".join(f"{c} {n}" for c, n in entry["causes"].items() if n)
    return (
        f"held-out eval, iteration {entry['iteration']} (version {entry['version']}): {', '.join(figures)} "
        f"({entry['scored_tasks']} tasks, {entry['scored_sessions']} of {entry['sessions']} sessions scored; "
        f"{causes}; {entry['seconds']:.0f} s)"
    )


def _table(stats: list[Any]) -> Any:
    from rich.table import Table

    table = Table(title="polar loop", title_justify="left")
    for name in ("iter", "reward", "± se", "n", "statuses", "tool calls", "rollout s", "train", "train s"):
        table.add_column(name, justify="right" if name not in ("statuses", "train") else "left")
    for s in stats:
        train = s.train or {}
        statuses = " ".join(f"{k} {v}" for k, v in s.statuses.items() if v)
        table.add_row(
            str(s.iteration), "-" if s.reward_mean is None else f"{s.reward_mean:.3f}",
            "-" if s.reward_se is None else f"{s.reward_se:.3f}", str(s.rewarded), statuses,
            f"{s.calls['tool_call_calls']} of {s.calls['answered_calls']}" if s.calls else "-", f"{s.rollout_s:.0f}",
            {"trained": "trained", "nothing_to_train": "nothing to train"}.get(train.get("status"), "-"),
            f"{train['seconds']:.0f}" if "seconds" in train else "-",
        )  # fmt: skip
    return table


def register(app: typer.Typer) -> None:
    app.command("loop", help=LOOP_HELP, context_settings={"allow_extra_args": True, "ignore_unknown_options": True})(
        loop
    )
