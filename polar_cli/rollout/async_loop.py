"""The asynchronous loop (``polar loop --async``): rollouts keep running while the trainer trains on finished groups.

Two coroutines share one event loop:

- the rollout side runs batch after batch (every task x ``samples``, as one ``polar rollout`` into
  ``OUT/batch-NNN/shards``), each on the newest policy pushed when it starts. Before a batch on a new version the
  engine is pushed the checkpoint (``loop._Engine``): the local engine lives in the proxy, so a push is a new proxy on
  it (``local:CKPT?weight_version=V``); vLLM loads it in place or is restarted on it (``polar engine reload``,
  ``--vllm-push``; each batch's proxy then tags its calls ``vllm:URL?weight_version=V``, vLLM reporting none);
  SGLang loads it in place with ``update_weights_from_disk`` and ``weight_version`` V, which it reports in every
  later answer. Either way every call records the ``weight_version`` that sampled it. At most ``AHEAD`` finished
  batches wait for the trainer; past that the rollout side waits (a bounded window, as Polar's figure 5: rollout
  stalls when the trainer is the bottleneck). Nor does it sample a batch no training step would take: once every
  remaining step has its batch, it waits for the last training and then measures that policy.
- the trainer takes the oldest finished batch (one per step: ``polar train`` reads one trace store), keeps the
  groups whose calls were all sampled within ``max_staleness`` versions of the policy it trains
  (:func:`select_groups`; staler groups are dropped and counted), runs ``polar train`` on them (TIS against the
  captured logprobs is always on in ``polar train``: it is what keeps stale-but-bounded traces correct;
  ``--current-weight-version``/``--max-staleness`` make it refuse anything past the bound), and pushes the
  checkpoint as version V+1.

Drain when new weights are pushed: new sessions wait (the next batch starts only once the engine serves the new
version), and ``wait``: the batch in flight finishes on the old weights (its groups stay usable within the bound),
then the push happens; ``cut``: the batch in flight is interrupted, its running sessions cancelled and posted as
``error`` (masked; what it finished before the cut is kept), then the push happens. With ``wait`` and ``cut`` no push
ever happens under a running batch, which is what makes a vLLM restart safe and its static tag true. ``keep`` (vLLM
started with ``--push in-place``, untied embeddings): the checkpoint is pushed as soon as it is made, under the
running batch, and its requests survive it (``serving.reload_vllm_in_place`` with ``keep``: paused, reloaded, their KV
recomputed on the new weights, resumed); every call is sampled on vLLM's scale-out endpoints (``versions=spans``),
which label each token with the version that sampled it (``weight_versions_json``), and its ``weight_version`` is its
oldest token's, which the staleness rule reads. Each batch records how much of it was sampled across a push
(``versions``: calls, calls with more than one version, tokens, tokens sampled after the call's first version).
``loop.json``'s ``pushes`` records each push's drain: from the checkpoint's publication to the engine serving it
(``drain_s``), of which the reload itself (``reload_s``), and with ``keep`` the batch it landed in (``during_batch``).

``iterations`` counts as in the synchronous loop: ``iterations - 1`` trainings, then a batch on the last policy
measures it. ``OUT/loop.json`` records every batch and training step with wall-clock times, and per step (and for
the run) the fraction of wall time the rollout side and the trainer were busy.

Resumable: loop.json is rewritten after every finished batch and step. Run again with the same ``--out`` (after
Ctrl-C, SIGTERM or a kill), the loop continues from the last finished step: the policy is its checkpoint and the
version the number of finished trainings; finished batches a finished step took stay taken (never trained twice);
finished batches no finished step took (the interrupted step's, or ones not taken yet) wait for the trainer again;
the batch that was in flight is redone whole under its index, in a new directory (``batch-NNN-attemptK``: the
killed run's proxy may still write into the old one), so shards never mix. An
engine a killed run left running (recorded in ``OUT/.engines``) is stopped first. Utilisation is over the time the
runs ran (``runs`` in loop.json), not the time between them.
"""

from __future__ import annotations

import asyncio
import shutil
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any, Literal

from polar_addon.store.status import REWARDED
from polar_cli.rollout.cpus import pinned
from polar_cli.rollout.loop import (
    EXIT_NOTHING_TO_TRAIN,
    LoopConfig,
    _check_same_run,
    _Engine,
    backfill_counts,
    backfill_short,
    backfill_tasks,
    engine_kind,
    load_state,
    mean_se,
    rollout_config,
    save_state,
    stop_stale_engines,
    tracked_train_args,
    train_command,
    train_preexec,
    train_start,
)
from polar_cli.rollout.progress_file import progress_config
from polar_cli.rollout.redact import control_tokens, write_json
from polar_cli.rollout.runner import RolloutInterrupted, RolloutResult, run_rollout
from polar_cli.rollout.tasks import task_set_hash

Drain = Literal["wait", "cut", "keep"]
DRAINS: tuple[str, ...] = ("wait", "cut", "keep")
AHEAD = 1  # finished batches that may wait for the trainer before the rollout side pauses


@dataclass
class GroupSelection:
    kept: list[str]
    stale: dict[str, int]  # dropped group -> versions behind (its oldest call)
    untagged: list[str]  # dropped: a call without a weight version cannot be bounded


def oldest_version(tags: Sequence[str | None]) -> int | None:
    """The oldest of some calls' ``weight_version`` tags, or None when there are none or one is not a number (such
    calls' staleness cannot be bounded)."""
    if not tags or any(t is None or not str(t).lstrip("-").isdigit() for t in tags):
        return None
    return min(int(t) for t in tags)  # type: ignore[arg-type]


def select_groups(versions: Mapping[str, Sequence[str | None]], current: int, max_staleness: int) -> GroupSelection:
    """Which groups the trainer of version ``current`` may learn from: a group is kept only if every one of its calls
    was sampled by a version in ``[current - max_staleness, current]``; groups are kept or dropped whole (GRPO's
    advantages are over the whole group)."""
    if max_staleness < 0:
        raise ValueError("max staleness must be 0 or more")
    kept, stale, untagged = [], {}, []
    for group, tags in sorted(versions.items()):
        oldest = oldest_version(tags)
        if oldest is None:
            untagged.append(group)
            continue
        behind = current - oldest
        if behind < 0:
            raise ValueError(f"group {group!r} was sampled by version {current - behind}, newer than {current}")
        if behind > max_staleness:
            stale[group] = behind
        else:
            kept.append(group)
    return GroupSelection(kept, stale, untagged)


def busy_fraction(intervals: Sequence[tuple[float, float]], start: float, end: float) -> float:
    """The fraction of ``[start, end]`` covered by the union of ``intervals`` (overlaps counted once)."""
    if end <= start:
        return 0.0
    clipped = sorted((max(a, start), min(b, end)) for a, b in intervals if min(b, end) > max(a, start))
    covered, reach = 0.0, start
    for a, b in clipped:
        if b > reach:
            covered += b - max(a, reach)
            reach = b
    return covered / (end - start)


def version_mix(spans_json: Sequence[str | None]) -> dict[str, int]:
    """How much of a batch was sampled across a push, from its calls' ``weight_versions_json``: calls, calls sampled
    by more than one version, the tokens the spans cover, and those sampled after each call's first version (a
    call without spans counts as a call only)."""
    import orjson

    mix = {"calls": len(spans_json), "calls_mixed": 0, "tokens": 0, "tokens_after_push": 0}
    for text in spans_json:
        spans = orjson.loads(text) if text else []
        if spans:
            mix["tokens"] += spans[-1]["end"]
            mix["tokens_after_push"] += spans[-1]["end"] - spans[0]["end"]
            mix["calls_mixed"] += len(spans) > 1
    return mix


def group_versions(store: str) -> dict[str, list[str | None]]:
    """Every group's calls' ``weight_version`` tags, from the trace store."""
    from polar_addon.store.reader import read_table

    table = read_table(store, columns=["group_id", "weight_version"])
    out: dict[str, list[str | None]] = {}
    for group, version in zip(table.column("group_id").to_pylist(), table.column("weight_version").to_pylist()):
        if group is not None:
            out.setdefault(group, []).append(version)
    return out


@dataclass
class Batch:
    index: int
    version: int
    policy: str
    shards: str
    started_at: float  # wall clock (time.time)
    ended_at: float
    sessions: int
    statuses: dict[str, int]
    rewarded: int
    reward_mean: float | None
    reward_se: float | None
    cut: bool = False  # interrupted by a push with drain "cut"
    final: bool = False  # the batch that measures the last policy: the run is complete once it is recorded
    step: int | None = None  # the training step that took it
    dropped_groups: dict[str, int] = field(default_factory=dict)  # group -> versions behind, when dropped
    groups: dict[str, int] | None = None  # with min_groups: sampled, informative, dropped, backfilled, rounds
    versions: dict[str, int] | None = None  # drain "keep": version_mix of its calls


@dataclass
class Step:
    step: int
    version: int  # the policy trained (its groups' staleness is measured against it)
    batches: list[int]
    groups_kept: int
    groups_dropped: int
    started_at: float
    ended_at: float
    status: str  # trained | nothing_to_train
    checkpoint: str | None
    log: str
    rollout_util: float = 0.0  # busy fraction of the wall time since the previous step ended
    trainer_util: float = 0.0


class _Shared:
    """What the two sides share (one event loop: no locks)."""

    def __init__(self, model: Path, version: int, training_done: bool, waiting: list[Batch], untaken: int) -> None:
        self.version, self.policy = version, model
        self.waiting = waiting
        # Trainings still to run whose step has no batch yet: a batch beyond them would be trained by nobody (the
        # last policy is measured by a batch of its own), so the rollout side waits instead of sampling it.
        self.untaken = untaken
        self.changed = asyncio.Condition()
        self.training_done = training_done
        self.in_flight: asyncio.Event | None = None  # the running batch's stop (drain "cut")
        self.batch: int | None = None  # the running batch's index
        self.engine = asyncio.Lock()  # one push or spec at a time: the trainer pushes under a batch with "keep"
        self.published: dict[int, float] = {}  # version -> when its checkpoint was made (this run's pushes)


def keep_refusal(kind: str, push: str, model: Path) -> None:
    """Refuse ``--drain keep`` where running requests cannot survive a push, saying why."""
    if kind != "vllm":
        raise ValueError(
            f"--drain keep needs --engine vllm (its pause/resume and per-token versions); {kind} has neither here"
        )
    if push == "adapter":
        raise ValueError(
            "--drain keep needs --vllm-push in-place: requests running on a LoRA adapter cannot go on with another "
            "(vLLM 0.32 reloads a replaced adapter from its old path at every step)"
        )
    if push != "in-place":
        raise ValueError("--drain keep needs --vllm-push in-place: a restart drops every running request")
    from polar_cli.serving import in_place_refusal

    refusal = in_place_refusal(model)
    if refusal is not None:
        raise ValueError(f"--drain keep: {model} cannot be loaded in place ({refusal})")


def run_async_loop(
    config: LoopConfig,
    max_staleness: int = 1,
    drain: Drain = "wait",
    on_event: Callable[[dict[str, Any]], None] | None = None,
    progress: Callable[[str], None] | None = None,
) -> dict[str, Any]:
    """Run the async loop to ``config.iterations - 1`` trainings and a last measuring batch; returns loop.json."""
    if config.iterations < 1:
        raise ValueError("iterations must be at least 1")
    if max_staleness < 0:
        raise ValueError("--max-staleness must be 0 or more")
    if drain not in DRAINS:
        raise ValueError(f"--drain must be one of {', '.join(DRAINS)}")
    kind = engine_kind(config.engine)
    if drain == "keep":
        keep_refusal(kind, config.vllm_push, config.model)
    if not (config.model / "config.json").is_file():
        raise ValueError(f"{config.model} is not a model directory (no config.json)")
    config.out.mkdir(parents=True, exist_ok=True)
    loop = _AsyncLoop(config, max_staleness, drain, on_event, progress)
    if loop.complete():
        if not (loop.state.get("summary") or {}).get("complete"):
            # Killed between recording its measuring batch and its final save: loop.json holds no summary, or an
            # earlier run's. Nothing to redo; the summary is made now.
            loop._save(final=True)
        return loop.state
    with pinned(config.rollout_cpus):  # what the loop starts (vLLM, proxies, harnesses) inherits the set
        return asyncio.run(loop.run())


class _AsyncLoop:
    def __init__(
        self,
        config: LoopConfig,
        max_staleness: int,
        drain: Drain,
        on_event: Callable[[dict[str, Any]], None] | None,
        progress: Callable[[str], None] | None,
    ) -> None:
        self.config, self.max_staleness, self.drain = config, max_staleness, drain
        self.on_event = on_event or (lambda _e: None)
        self.say = progress or (lambda _line: None)
        self.engine = _Engine(config, config.out / ".engines", keep=drain == "keep")
        self.started_at = time.time()
        identity = {
            "tasks": task_set_hash(list(config.tasks)),
            "harness": config.harness,
            "model": str(config.model.resolve()),
            "samples": config.samples,
        }
        old = load_state(config.out)
        if old.get("iterations"):
            raise ValueError(f"{config.out} holds a synchronous loop (polar loop without --async): use another --out")
        _check_same_run(old, identity)
        self.state: dict[str, Any] = {
            **old, "mode": "async", "max_staleness": max_staleness, "drain": drain, "identity": identity,
            "engine": config.engine,
        }  # fmt: skip
        self.state.pop("iterations", None)
        self.runs: list[dict[str, float]] = [
            *old.get("runs", []),
            {"started_at": self.started_at, "ended_at": self.started_at},
        ]
        self.pushes: list[dict[str, Any]] = list(old.get("pushes", []))
        # Resume: every recorded step finished; a recorded batch is finished, and taken for good only by a finished
        # step (one taken by the step that was interrupted waits for the trainer again).
        self.steps = [Step(**s) for s in old.get("steps", [])]
        self.batches = [Batch(**b) for b in old.get("batches", [])]
        for b in self.batches:
            if b.step is None or b.step >= len(self.steps):
                b.step, b.dropped_groups = None, {}
        trained = [s for s in self.steps if s.status == "trained"]
        for s in trained:
            if not (Path(s.checkpoint or "") / "config.json").is_file():
                raise ValueError(
                    f"step {s.step}'s checkpoint {s.checkpoint} is gone: the loop in {config.out} "
                    "cannot resume; use another --out"
                )
        self.resumed = bool(self.steps or self.batches)
        self.first_version = len(trained)
        self.first_policy = Path(trained[-1].checkpoint) if trained else config.model  # type: ignore[arg-type]

    def complete(self) -> bool:
        """A finished run (its measuring batch recorded): nothing to do again."""
        return any(b.final for b in self.batches) and len(self.steps) >= self.config.iterations - 1

    async def run(self) -> dict[str, Any]:
        trainings = self.config.iterations - 1
        waiting = [b for b in self.batches if b.step is None and not b.final]
        shared = _Shared(
            self.first_policy, self.first_version, len(self.steps) >= trainings, waiting, trainings - len(self.steps)
        )
        if self.resumed:
            self.say(
                f"resuming {self.config.out}: {len(self.steps)} step(s) and {len(self.batches)} batch(es) done, "
                f"version {shared.version}, batches {[b.index for b in waiting]} waiting for the trainer"
            )
        await asyncio.to_thread(stop_stale_engines, self.engine.state_dir)
        rollouts = asyncio.create_task(self._rollouts(shared))
        trainer = asyncio.create_task(self._trainer(shared))
        try:
            # The first failure (a rollout with no usable session, a training that fails) stops both sides.
            done, _ = await asyncio.wait({rollouts, trainer}, return_when=asyncio.FIRST_EXCEPTION)
            for task in done:
                task.result()
            await asyncio.gather(rollouts, trainer)
        finally:
            for task in (rollouts, trainer):
                task.cancel()
            await asyncio.gather(rollouts, trainer, return_exceptions=True)
            await asyncio.to_thread(self.engine.close)
            self._save(final=True)
        return self.state

    # -- the rollout side ---------------------------------------------------------------------------------------

    async def _rollouts(self, shared: _Shared) -> None:
        index = len(self.batches)
        while True:
            async with shared.changed:
                await shared.changed.wait_for(
                    lambda: shared.training_done or len(shared.waiting) < min(AHEAD, shared.untaken)
                )
            last = shared.training_done  # the policy is final: this batch measures it
            # The drain: no batch runs now (the one in flight finished or was cut), so new sessions wait here while
            # the engine loads the new version (with "keep" the trainer has pushed it already).
            version, policy, spec = await self._serve(shared)
            stop = asyncio.Event()
            shared.in_flight, shared.batch = stop, index
            batch = await self._batch(index, version, policy, spec, stop)
            shared.in_flight = shared.batch = None
            batch.final = last
            self.batches.append(batch)
            self._save()
            self.on_event({"kind": "batch", "batch": batch})
            if last:
                return
            async with shared.changed:
                if not shared.training_done:
                    shared.waiting.append(batch)
                shared.changed.notify_all()
            index += 1

    async def _serve(self, shared: _Shared) -> tuple[int, Path, str]:
        """Make the engine serve the newest policy (a push when it serves an older one); its version, checkpoint and
        the spec a rollout's proxy uses. Read under the lock, so a push never goes back to an older version."""
        async with shared.engine:
            version, policy = shared.version, shared.policy
            loading = time.time()
            spec = await asyncio.to_thread(self.engine.spec, policy, self.say, version)
            if version in shared.published:
                loaded = time.time()
                push = {"version": version, "checkpoint": str(policy), "published_at": shared.published[version],
                        "loaded_at": loaded, "drain_s": loaded - shared.published[version],
                        "reload_s": loaded - loading, "engine": self.engine.kind}  # fmt: skip
                if self.drain == "keep":
                    push["during_batch"] = shared.batch
                del shared.published[version]
                self.pushes.append(push)
                where = "" if shared.batch is None else f" under batch {shared.batch}"
                self.say(
                    f"pushed version {version}{where}: drain {push['drain_s']:.1f} s (reload {push['reload_s']:.1f} s)"
                )
            return version, policy, spec

    async def _batch(self, index: int, version: int, policy: Path, spec: str, stop: asyncio.Event) -> Batch:
        config = self.config
        bdir = config.out / f"batch-{index:03d}"
        attempt = 1
        while bdir.exists():
            # An interrupted attempt at this batch (a killed run): never reused, as the killed run's proxy, in its
            # own session, may still be writing there; its shards are never read.
            attempt += 1
            bdir = config.out / f"batch-{index:03d}-attempt{attempt}"
        bdir.mkdir(parents=True)
        self.say(f"batch {index}: {len(config.tasks)} tasks x {config.samples} samples on version {version} ({policy})")
        started = time.time()
        first = result = await self._round(bdir, index, spec, stop)
        rounds: list[RolloutResult] = []
        groups = None
        if config.min_groups is not None:
            # Dynamic sampling with backfill, as the synchronous loop does it: more groups into the same shards until
            # enough are informative; a push that cuts the batch ends it.
            while (
                not any(r.interrupted for r in (first, *rounds))
                and (short := backfill_short(config, first, rounds)) is not None
            ):
                k = len(rounds) + 1
                self.say(f"batch {index}: {short} informative groups < {config.min_groups}: backfill round {k}")
                rounds.append(await self._round(bdir, index, spec, stop, k))
            result, groups = backfill_counts(config.min_groups, first, rounds)
        cut_by = next((r.interrupted for r in (first, *rounds) if r.interrupted), None)
        batch = _batch_of(index, version, policy, bdir / "shards", started, time.time(), result, cut_by == "stop")
        batch.groups = groups
        if self.drain == "keep":
            from polar_addon.store.reader import read_table

            spans = read_table(str(bdir / "shards"), columns=["weight_versions_json"]).column(0).to_pylist()
            batch.versions = version_mix(spans)
        return batch

    async def _round(self, bdir: Path, index: int, spec: str, stop: asyncio.Event, backfill: int = 0) -> RolloutResult:
        """One rollout of the batch into ``bdir/shards``: the batch's own, or backfill round ``backfill``'s."""
        config = self.config
        part = f"bf{backfill}" if backfill else ""
        seed = config.seed + index + 100_000 * backfill
        rollout = rollout_config(config, bdir, spec, seed, f"b{index:03d}{part}", stop)
        if backfill:
            rollout = replace(rollout, tasks=backfill_tasks(config, backfill))
        try:
            with progress_config(bdir, rollout, lambda: control_tokens(rollout.out, rollout.confdir, None)) as rollout:
                result = await run_rollout(rollout)
        finally:
            shutil.rmtree(bdir / "work", ignore_errors=True)
        summary = bdir / (f"rollout-summary-{part}.json" if part else "rollout-summary.json")
        write_json(summary, result.summary(), control_tokens(rollout.out, rollout.confdir, None))
        cut = result.interrupted == "stop"
        if result.interrupted and not cut:
            raise RolloutInterrupted(
                f"batch {index}: interrupted by {result.interrupted} (summary in {bdir})", result.interrupted
            )
        if result.all_failed and not cut and not backfill:
            raise RuntimeError(f"batch {index}: no session was usable (logs in {bdir / 'logs'})")
        return result

    # -- the trainer ----------------------------------------------------------------------------------------------

    async def _trainer(self, shared: _Shared) -> None:
        for step in range(len(self.steps), self.config.iterations - 1):
            taken: list[Batch] = []
            kept: list[Batch] = []
            while not kept:  # every group too stale: wait for batches on newer weights
                # One batch per step, the oldest first: polar train reads one trace store (one batch's shards).
                # More than one waits only after a resume (the interrupted step's batch and the next).
                async with shared.changed:
                    await shared.changed.wait_for(lambda: bool(shared.waiting))
                    batch = shared.waiting.pop(0)
                    shared.changed.notify_all()
                taken.append(batch)
                if self._select(batch, shared.version, step):
                    kept.append(batch)
            async with shared.changed:
                shared.untaken -= 1  # this step has its batch
                shared.changed.notify_all()
            self._save()  # loop.json shows what the running step trains (a resumed run gives it back to the trainer)
            started = time.time()
            idir = self.config.out / f"train-{step:03d}"
            idir.mkdir(parents=True, exist_ok=True)
            self.say(f"step {step}: polar train on version {shared.version} with batches {[b.index for b in kept]}")
            status = await self._train([Path(b.shards) for b in kept], shared.policy, shared.version, idir)
            ended = time.time()
            record = Step(
                step=step, version=shared.version, batches=[b.index for b in kept],
                groups_kept=sum(len(_kept_groups(b)) for b in kept),
                groups_dropped=sum(len(b.dropped_groups) for b in taken), started_at=started, ended_at=ended,
                status=status, checkpoint=str(idir / "checkpoint") if status == "trained" else None,
                log=str(idir / "train.log"),
            )  # fmt: skip
            self.steps.append(record)
            async with shared.changed:
                if status == "trained":
                    shared.version, shared.policy = shared.version + 1, idir / "checkpoint"
                    shared.published[shared.version] = ended
                    if self.drain == "cut" and shared.in_flight is not None:
                        shared.in_flight.set()
                if step == self.config.iterations - 2:
                    shared.training_done = True
                shared.changed.notify_all()
            if status == "trained" and self.drain == "keep":
                await self._serve(shared)  # now, under the batch in flight: its requests go on on the new weights
            self._save()
            self.on_event({"kind": "step", "step": record})

    def _select(self, batch: Batch, version: int, step: int) -> bool:
        """Mark ``batch`` taken by ``step``; False when none of its groups is within the bound."""
        batch.step = step
        chosen = select_groups(group_versions(batch.shards), version, self.max_staleness)
        if chosen.untagged:
            # Every batch after it would be untagged too: dropping them would spin the loop forever.
            raise RuntimeError(
                f"batch {batch.index}: calls of group(s) {chosen.untagged[:3]} carry no numeric "
                f"weight_version (engine {self.config.engine}): their staleness cannot be bounded"
            )
        batch.dropped_groups = dict(chosen.stale)
        if chosen.stale:
            self.say(
                f"step {step}: batch {batch.index} (version {batch.version}): dropped "
                f"{len(batch.dropped_groups)} group(s) beyond --max-staleness {self.max_staleness}"
            )
        # A batch is one store sampled by one version, so its groups share their staleness; one dropped group leaves
        # the batch out whole (polar train, told the bound, would refuse the store anyway).
        return bool(chosen.kept) and not batch.dropped_groups

    async def _train(self, shards: list[Path], policy: Path, version: int, idir: Path) -> str:
        """``polar train`` in its own process (killed when the loop is cancelled)."""
        output, log = idir / "checkpoint", idir / "train.log"
        shutil.rmtree(output, ignore_errors=True)
        model, start_args = train_start(self.config, policy)
        command = train_command(shards, model, output, [
            *start_args, *tracked_train_args(self.config, idir), "--current-weight-version", str(version),
            "--max-staleness", str(self.max_staleness)])  # fmt: skip
        with log.open("w") as f:
            # train_preexec: a killed loop leaves no training running into the directory its resumed run trains in.
            proc = await asyncio.create_subprocess_exec(
                *command, stdout=f, stderr=asyncio.subprocess.STDOUT, preexec_fn=train_preexec(self.config.train_cpus)
            )
            try:
                code = await proc.wait()
            except asyncio.CancelledError:
                proc.kill()
                await proc.wait()
                raise
        if code == EXIT_NOTHING_TO_TRAIN:
            shutil.rmtree(output, ignore_errors=True)
            return "nothing_to_train"
        if code != 0:
            raise RuntimeError(f"polar train exited {code} (log {log}):\n{log.read_text(errors='replace')[-3000:]}")
        return "trained"

    # -- loop.json ------------------------------------------------------------------------------------------------

    def _save(self, final: bool = False) -> None:
        now = time.time()
        self.runs[-1]["ended_at"] = now
        windows = [(r["started_at"], r["ended_at"]) for r in self.runs]
        rollout = [(b.started_at, b.ended_at) for b in self.batches]
        trainer = [(s.started_at, s.ended_at) for s in self.steps]
        previous = self.runs[0]["started_at"]
        for s in self.steps:
            s.rollout_util = busy_within(rollout, windows, previous, s.ended_at)
            s.trainer_util = busy_within(trainer, windows, previous, s.ended_at)
            previous = s.ended_at
        self.state["runs"] = self.runs
        self.state["pushes"] = self.pushes
        self.state["batches"] = [asdict(b) for b in self.batches]
        self.state["steps"] = [asdict(s) for s in self.steps]
        if final:
            start = self.runs[0]["started_at"]
            end = max([now, *(b for _, b in rollout), *(b for _, b in trainer)])
            version = len([s for s in self.steps if s.status == "trained"])
            measured = [b for b in self.batches if b.version == version]
            self.state["summary"] = {
                "wall_s": sum(b - a for a, b in windows),
                "rollout_util": busy_within(rollout, windows, start, end),
                "trainer_util": busy_within(trainer, windows, start, end),
                "batches": len(self.batches), "batches_cut": sum(b.cut for b in self.batches),
                "groups_dropped": sum(len(b.dropped_groups) for b in self.batches),
                "final_version": version, "complete": self.complete(), "runs": len(self.runs),
                "final_reward_mean": measured[-1].reward_mean if measured else None,
                "final_reward_se": measured[-1].reward_se if measured else None,
                "drain_s": [p["drain_s"] for p in self.pushes],
            }  # fmt: skip
            if self.drain == "keep":
                mixes = [b.versions for b in self.batches if b.versions]
                self.state["summary"]["versions"] = {k: sum(m[k] for m in mixes) for k in version_mix([])}
        save_state(self.config.out, self.state)


def busy_within(
    intervals: Sequence[tuple[float, float]], windows: Sequence[tuple[float, float]], start: float, end: float
) -> float:
    """The busy fraction of ``[start, end]`` counting only the time inside ``windows`` (the runs of a resumed loop:
    the time between two runs is nobody's idle time)."""
    spans = [(max(a, start), min(b, end)) for a, b in windows if min(b, end) > max(a, start)]
    total = sum(b - a for a, b in spans)
    if total <= 0:
        return 0.0
    return sum(busy_fraction(intervals, a, b) * (b - a) for a, b in spans) / total


def _kept_groups(batch: Batch) -> list[str]:
    return [g for g in group_versions(batch.shards) if g not in batch.dropped_groups]


def _batch_of(
    index: int, version: int, policy: Path, shards: Path, started: float, ended: float, result: RolloutResult, cut: bool
) -> Batch:
    rewards = [s.reward for s in result.sessions if s.status in REWARDED and s.reward is not None]
    mean, se = mean_se(rewards)
    return Batch(index=index, version=version, policy=str(policy), shards=str(shards), started_at=started,
                 ended_at=ended, sessions=len(result.sessions), statuses=result.counts(), rewarded=len(rewards),
                 reward_mean=mean, reward_se=se, cut=cut)  # fmt: skip
