"""TRL's ``RolloutWorkerProtocol`` over ``polar rollout``: any harness, runtime, task set and engine that ``polar loop``
takes, feeding TRL's own ``AsyncGRPOTrainer``.

A thread runs batch after batch, each one ``polar rollout`` of every task x ``samples`` into ``OUT/batch-NNNN/`` (its
shards, logs, summary and live ``rollout-progress.json``), exactly as ``polar loop --async`` runs its batches, on
the newest weights TRL has pushed (:class:`~polar_cli.trl_async.weights.PolarWeightTransfer`). A finished batch is
built with ``polar train``'s own code (``load_traces`` + ``prepare_rows``: prefix merging, polar's leave-one-out
group advantages, zero-advantage groups dropped, length clipping, the sampling temperature checked against the
trainer's) and every row goes to ``rollout_buffer`` as a TRL sample whose tokens, mask and behaviour logprobs are the
captured ones (:mod:`polar_cli.trl_async.samples`).

The push is the engine's load at the start of the next batch, through ``polar loop``'s engine machinery: the embedded
engine gets a new proxy on the checkpoint, vLLM is restarted on it, SGLang loads it in place. Every call records the
version that sampled it (the spec's ``?weight_version=V``), and each sample's ``model_version`` is read back from its
calls, so TRL's ``max_staleness`` bound is applied to what was served.

Interplay with the trainer: ``pause`` (TRL's sync begins) holds the next batch; ``update_model_version(V)`` binds
the just-written checkpoint to version V and releases it. ``rollout_buffer`` is bounded: a full buffer stalls the
rollout side (TRL's backpressure). ``check_health`` raises the thread's error, or a hang: no session finished, no
batch began and no sample was queued for ``stale_after_s`` (so it must exceed a session's timeout).
"""

from __future__ import annotations

import asyncio
import queue
import shutil
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from polar_cli.rollout.loop import LoopConfig, _Engine, _ray_rollout, rollout_config
from polar_cli.rollout.progress_file import progress_config
from polar_cli.rollout.redact import control_tokens, write_json
from polar_cli.rollout.runner import RolloutResult, run_rollout
from polar_cli.trl_async.samples import rows_to_samples
from polar_cli.trl_async.weights import PolarWeightTransfer

PUT_POLL_S = 0.5


@dataclass
class PolarWorkerConfig:
    """How a batch becomes samples (``polar train``'s options of the same names)."""

    max_length: int = 4096  # prompt + completion; longer completions are cut (never the prompt)
    temperature: float | None = None  # the trainer's (AsyncGRPOConfig.temperature); None: whatever was sampled
    strategy: str = "prefix_merging"
    scale_rewards: str = "group"
    build_options: Mapping[str, Any] = field(default_factory=dict)  # load_traces': eot_token_id, roles, ...
    queue_maxsize: int = 1024
    max_batches: int | None = None  # None: until stopped


class PolarRolloutWorker:
    """``rollout_buffer`` and ``metrics_queue`` for the trainer; ``start``/``stop``/``update_model_version``/
    ``check_health`` as TRL calls them. ``loop`` holds what ``polar loop`` would be given (its ``iterations`` is not
    read: the trainer's ``max_steps`` ends the run)."""

    def __init__(self, loop: LoopConfig, options: PolarWorkerConfig | None = None, keep_checkpoints: int = 3) -> None:
        self.loop, self.options = loop, options or PolarWorkerConfig()
        self.rollout_buffer: queue.Queue = queue.Queue(maxsize=self.options.queue_maxsize)
        self.metrics_queue: queue.Queue = queue.Queue()
        self.transfer = PolarWeightTransfer(loop.model, loop.out, keep=keep_checkpoints)
        self.model_version = 0
        self.policy: tuple[Path, int] | None = None  # (checkpoint, version) the next batch is served from
        self.batches: list[dict[str, Any]] = []  # one record per finished batch (also in OUT/worker.json)
        self.error: BaseException | None = None
        self._group_ids: dict[str, int] = {}
        self._stopping = threading.Event()
        self._released = threading.Condition()
        self._thread: threading.Thread | None = None
        self._rollout_loop: asyncio.AbstractEventLoop | None = None
        self._rollout_stop: asyncio.Event | None = None
        self._heartbeat = time.time()
        self._progress: Any = None
        self._progress_seen = -1
        self._decode: Any = None

    def train_dataset(self) -> Any:
        """The task set as TRL's prompt dataset (``train_dataset=``), one row per task. TRL only counts it: with
        ``max_steps`` unset, ``num_train_epochs`` passes over it end the run, and one batch trains each task's group
        once."""
        from datasets import Dataset

        return Dataset.from_dict(
            {"prompt": [[{"role": "user", "content": t.instruction}] for t in self.loop.tasks],
             "task_id": [t.id for t in self.loop.tasks]}
        )  # fmt: skip

    def weight_transfer(self) -> PolarWeightTransfer:
        """The ``WeightTransferProtocol`` half: give it to the trainer as ``weight_transfer=``."""
        return self.transfer

    # -- RolloutWorkerProtocol ---------------------------------------------------------------------------------
    def start(self) -> None:
        if self._thread is not None:
            return
        self.loop.out.mkdir(parents=True, exist_ok=True)
        self._heartbeat = time.time()
        self._thread = threading.Thread(target=self._run, name="polar-rollouts", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """Ends the run: the batch in flight is cut (its running sessions are posted as ``error``, what finished is
        kept in its shards), the engine polar started is stopped."""
        self._stopping.set()
        with self._released:
            self._released.notify_all()
        if self._rollout_loop is not None and self._rollout_stop is not None:
            try:
                self._rollout_loop.call_soon_threadsafe(self._rollout_stop.set)
            except RuntimeError:  # that batch's event loop has just ended
                pass
        if self._thread is not None:
            self._thread.join()

    def update_model_version(self, model_version: int) -> None:
        pending = self.transfer.take_pending()
        with self._released:
            self.model_version = model_version
            if pending is not None:
                self.policy = (pending, model_version)
            self.transfer.syncing.clear()
            self._released.notify_all()

    def check_health(self, stale_after_s: float) -> None:
        if self.error is not None:
            raise RuntimeError(
                f"polar rollout worker failed: {type(self.error).__name__}: {self.error}"
            ) from self.error
        if self._thread is not None and not self._thread.is_alive() and not self._stopping.is_set():
            raise RuntimeError("polar rollout worker ended: its max_batches are done and the trainer wants more")
        progress = self._progress
        if progress is not None and progress.ran != self._progress_seen:
            self._progress_seen = progress.ran
            self._beat()
        age = time.time() - self._heartbeat
        if age > stale_after_s:
            raise RuntimeError(
                f"polar rollout worker: nothing finished for {age:.0f} s > {stale_after_s:.0f} s (logs in "
                f"{self.loop.out}); raise heartbeat_stale_after_s above the sessions' timeout"
            )

    # -- the rollout thread ------------------------------------------------------------------------------------
    def _beat(self) -> None:
        self._heartbeat = time.time()

    def _run(self) -> None:
        engine = _Engine(self.loop, self.loop.out)
        try:
            index = 0
            while not self._stopping.is_set():
                if self.options.max_batches is not None and index >= self.options.max_batches:
                    return
                served = self._next_policy()
                if served is None:
                    return
                self._batch(index, engine, *served)
                index += 1
        except BaseException as exc:  # noqa: BLE001 (handed to the trainer's thread by check_health)
            self.error = exc
        finally:
            engine.close()

    def _next_policy(self) -> tuple[Path, int] | None:
        """Wait until no sync is under way and a checkpoint has a version; None once stopping."""
        with self._released:
            while not self._stopping.is_set() and (self.transfer.syncing.is_set() or self.policy is None):
                self._released.wait(timeout=PUT_POLL_S)
                self._beat()  # waiting on the trainer is not a hang of ours
            return None if self._stopping.is_set() else self.policy

    def _batch(self, index: int, engine: _Engine, policy: Path, version: int) -> None:
        bdir = self.loop.out / f"batch-{index:04d}"
        shutil.rmtree(bdir, ignore_errors=True)
        bdir.mkdir(parents=True)
        self.transfer.in_use = {policy}
        self._beat()
        push_started = time.monotonic()
        spec = engine.spec(policy, lambda message: None, version)
        push_s = time.monotonic() - push_started
        self._beat()
        rollout = replace(
            rollout_config(self.loop, bdir, spec, self.loop.seed + index, f"b{index:04d}"), stop_on_signals=False
        )
        started = time.monotonic()
        try:
            with progress_config(bdir, rollout, lambda: control_tokens(rollout.out, rollout.confdir, None)) as rollout:
                self._progress = rollout.progress
                result = asyncio.run(self._rollout(rollout))
        finally:
            self._progress = None
            shutil.rmtree(bdir / "work", ignore_errors=True)
        rollout_s = time.monotonic() - started
        write_json(bdir / "rollout-summary.json", result.summary(), control_tokens(rollout.out, rollout.confdir, None))
        if result.interrupted:
            return  # stopping: a cut batch trains nothing
        record = self._emit(bdir, policy, version, result)
        record.update(batch=index, version=version, policy=str(policy), push_s=push_s, rollout_s=rollout_s)
        self.batches.append(record)
        write_json(self.loop.out / "worker.json", {"batches": self.batches}, ())
        self.metrics_queue.put({f"polar/{k}": float(v) for k, v in record.items() if isinstance(v, int | float)})

    async def _rollout(self, rollout: Any) -> RolloutResult:
        self._rollout_loop = asyncio.get_running_loop()
        self._rollout_stop = asyncio.Event()
        if self._stopping.is_set():
            self._rollout_stop.set()
        rollout = replace(rollout, stop=self._rollout_stop)
        return await (run_rollout(rollout) if self.loop.ray is None else _ray_rollout(rollout, self.loop))

    def _emit(self, bdir: Path, policy: Path, version: int, result: RolloutResult) -> dict[str, Any]:
        from polar_cli.train.dataset import load_traces, prepare_rows

        options = self.options
        traces = load_traces([bdir / "shards"], options.strategy, tokenizer=policy, **dict(options.build_options))
        data = prepare_rows(
            traces,
            max_length=options.max_length,
            scale_rewards=options.scale_rewards,
            drop_zero_advantage=True,
            temperature=options.temperature,
        )
        if self._decode is None:
            self._decode = _decoder(self.loop.model)  # the tokenizer never changes, only the weights
        samples = rows_to_samples(data.rows, {t.trace_id: t for t in traces}, self._group_ids, decode=self._decode)
        for sample in samples:
            self._put(sample)
        rewards = [r for group in result.group_rewards().values() for r in group]
        counts = result.counts()
        return {
            "sessions": len(result.sessions),
            "rewarded": len(rewards),
            "reward_mean": sum(rewards) / len(rewards) if rewards else float("nan"),
            "samples": len(samples),
            "groups": len(result.group_rewards()),
            "groups_trained": data.stats.get("groups", 0),
            "zero_advantage_traces": data.stats.get("zero_advantage", 0),
            "clipped": data.stats.get("clipped", 0),
            "statuses": counts,
        }

    def _put(self, sample: Any) -> None:
        while not self._stopping.is_set():
            try:
                self.rollout_buffer.put(sample, timeout=PUT_POLL_S)
                self._beat()
                return
            except queue.Full:
                self._beat()  # the trainer is the bottleneck: backpressure, not a hang


def _decoder(policy: Path) -> Any:
    try:
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(str(policy))
    except (OSError, ValueError):
        return None
    return lambda ids: tok.decode(list(ids))
