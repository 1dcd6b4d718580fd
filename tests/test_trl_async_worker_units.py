"""TRL's rollout worker (trl_async/worker.py) on fake rollouts, no engine: the batch directory and what it sends the
trainer (samples, the batch record, the metrics), the hold while TRL syncs, the version each batch is served, the
health check's three failures, the buffer's backpressure and the stop that cuts a batch; and the CPU stand-in for TRL's
varlen attention kernel (trl_async/cpu_attention.py) against attention written out by hand."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import math
import queue
import threading
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from polar_addon.control import TOKEN_FILE
from polar_cli.rollout.loop import LoopConfig
from polar_cli.rollout.progress_file import PROGRESS_FILE
from polar_cli.rollout.runner import RolloutResult, SessionResult
from polar_cli.rollout.tasks import Task
from polar_cli.trl_async import worker as wmod
from polar_cli.trl_async.cpu_attention import flash_attn_varlen_func
from polar_cli.trl_async.worker import PolarRolloutWorker, PolarWorkerConfig


def make_worker(tmp_path: Path, keep: int = 3, **options: Any) -> PolarRolloutWorker:
    loop = LoopConfig(
        tasks=[Task(id="t1", instruction="fix the bug"), Task(id="t2", instruction="add a test")],
        harness="cmd:true",
        model=tmp_path / "base",
        iterations=99,
        out=tmp_path / "out",
        seed=7,
    )
    return PolarRolloutWorker(loop, PolarWorkerConfig(**options) if options else None, keep_checkpoints=keep)


class FakeClock:
    """``time.time`` and ``time.monotonic`` as the test sets them."""

    def __init__(self, now: float = 1000.0) -> None:
        self.now = now
        self.ticks: list[float] = []

    def time(self) -> float:
        return self.now

    def monotonic(self) -> float:
        return self.ticks.pop(0) if self.ticks else 0.0


class FakeEngine:
    def __init__(self) -> None:
        self.specs: list[tuple[Path, int]] = []
        self.closed = 0

    def spec(self, policy: Path, progress: Any, version: int) -> str:
        self.specs.append((policy, version))
        progress("ignored")
        return f"local:{policy}?weight_version={version}"

    def close(self) -> None:
        self.closed += 1


def session(sid: str, group: str, status: str, reward: float | None) -> SessionResult:
    return SessionResult(sid, group, group, 0, status, reward=reward)  # type: ignore[arg-type]


def result(*sessions: SessionResult, interrupted: str | None = None) -> RolloutResult:
    return RolloutResult("run", list(sessions), 0.0, 60.0, None, interrupted=interrupted)


# -- configuration and the trainer-facing halves ---------------------------------------------------------------------


def test_defaults_and_what_the_trainer_is_given(tmp_path: Path) -> None:
    options = PolarWorkerConfig()
    assert (options.max_length, options.temperature, options.strategy, options.scale_rewards) == (
        4096, None, "prefix_merging", "group"
    )  # fmt: skip
    assert (dict(options.build_options), options.queue_maxsize, options.max_batches) == ({}, 1024, None)
    w = make_worker(tmp_path)
    assert w.rollout_buffer.maxsize == 1024 and w.model_version == 0 and w.policy is None and w.batches == []
    assert w.error is None and w.metrics_queue.empty()
    assert w.weight_transfer() is w.transfer
    assert (w.transfer.base, w.transfer.dir, w.transfer.keep) == (tmp_path / "base", tmp_path / "out" / "weights", 3)
    assert PolarRolloutWorker(w.loop).transfer.keep == 3
    small = make_worker(tmp_path, keep=1, queue_maxsize=2)
    assert small.rollout_buffer.maxsize == 2 and small.transfer.keep == 1


def test_train_dataset_is_one_user_prompt_per_task(tmp_path: Path) -> None:
    data = make_worker(tmp_path).train_dataset()
    assert data.to_dict() == {
        "prompt": [[{"role": "user", "content": "fix the bug"}], [{"role": "user", "content": "add a test"}]],
        "task_id": ["t1", "t2"],
    }


def test_update_model_version_binds_the_pending_checkpoint_and_ends_the_sync(tmp_path: Path) -> None:
    w = make_worker(tmp_path)
    w.transfer.syncing.set()
    w.transfer.pending = tmp_path / "sync-0001"
    w.update_model_version(4)
    assert (w.model_version, w.policy, w.transfer.pending) == (4, (tmp_path / "sync-0001", 4), None)
    assert not w.transfer.syncing.is_set()
    # A version with nothing new written (TRL names it again): the served checkpoint stays.
    w.transfer.syncing.set()
    w.update_model_version(5)
    assert (w.model_version, w.policy) == (5, (tmp_path / "sync-0001", 4))
    assert not w.transfer.syncing.is_set()


# -- check_health ------------------------------------------------------------------------------------------------------


def test_check_health_hands_over_the_threads_error(tmp_path: Path) -> None:
    w = make_worker(tmp_path)
    w.error = ValueError("no shards")
    with pytest.raises(RuntimeError) as raised:
        w.check_health(1e9)
    assert str(raised.value) == "polar rollout worker failed: ValueError: no shards"
    assert raised.value.__cause__ is w.error


def test_check_health_refuses_a_worker_whose_batches_ran_out(tmp_path: Path) -> None:
    w = make_worker(tmp_path)
    w._thread = threading.Thread(target=lambda: None)
    w._thread.start()
    w._thread.join()
    with pytest.raises(RuntimeError, match=r"^polar rollout worker ended: its max_batches are done and the trainer"):
        w.check_health(1e9)
    w._stopping.set()  # stopped by the trainer: an ended thread is expected
    w.check_health(1e9)


def test_check_health_stale_after_exactly_the_bound(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    clock = FakeClock()
    monkeypatch.setattr(wmod, "time", clock)
    w = make_worker(tmp_path)
    w._heartbeat = 1000.0
    clock.now = 1030.0
    w.check_health(30.0)  # exactly the bound: not yet stale
    clock.now = 1031.0
    with pytest.raises(RuntimeError) as raised:
        w.check_health(30.0)
    assert str(raised.value) == (
        f"polar rollout worker: nothing finished for 31 s > 30 s (logs in {tmp_path / 'out'}); raise "
        "heartbeat_stale_after_s above the sessions' timeout"
    )


def test_a_session_finishing_is_a_heartbeat(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    clock = FakeClock()
    monkeypatch.setattr(wmod, "time", clock)
    w = make_worker(tmp_path)
    w._heartbeat = 1000.0
    w._progress = SimpleNamespace(ran=0)
    clock.now = 1100.0
    w.check_health(30.0)  # the first count seen (0 is not the initial -1): a beat now
    assert w._heartbeat == 1100.0 and w._progress_seen == 0
    clock.now = 1131.0
    with pytest.raises(RuntimeError, match="nothing finished for 31 s"):
        w.check_health(30.0)  # the same count: nothing finished since
    w._progress.ran = 1
    w.check_health(30.0)
    assert w._heartbeat == 1131.0 and w._progress_seen == 1
    # A first look that finds a session already finished is a beat too.
    fresh = make_worker(tmp_path)
    fresh._heartbeat, fresh._progress = 1000.0, SimpleNamespace(ran=1)
    fresh.check_health(30.0)
    assert fresh._heartbeat == 1131.0


# -- waiting for a versioned checkpoint ------------------------------------------------------------------------------


def test_next_policy_waits_for_a_versioned_checkpoint_and_the_end_of_the_sync(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(wmod, "PUT_POLL_S", 0.01)
    w = make_worker(tmp_path)
    w._heartbeat = 0.0
    got: list[Any] = []
    waiter = threading.Thread(target=lambda: got.append(w._next_policy()))
    waiter.start()
    time.sleep(0.1)
    assert got == [] and w._heartbeat > 0.0  # waiting on the trainer beats: it is not a hang
    w.transfer.syncing.set()
    w.policy = (tmp_path / "sync-0001", 1)  # a checkpoint, but TRL's sync is still under way
    time.sleep(0.1)
    assert got == []
    w.transfer.pending = tmp_path / "sync-0002"
    w.update_model_version(2)
    waiter.join(timeout=5)
    assert got == [(tmp_path / "sync-0002", 2)]


def test_next_policy_is_none_once_stopping(tmp_path: Path) -> None:
    w = make_worker(tmp_path)
    w.policy = (tmp_path / "sync-0001", 1)
    assert w._next_policy() == (tmp_path / "sync-0001", 1)
    got: list[Any] = []
    w.policy = None
    waiter = threading.Thread(target=lambda: got.append(w._next_policy()))
    waiter.start()
    time.sleep(0.05)
    w.stop()  # wakes the waiter at once, not after a poll
    waiter.join(timeout=0.3)
    assert got == [None]
    w.policy = (tmp_path / "sync-0001", 1)
    assert w._next_policy() is None


# -- the thread -------------------------------------------------------------------------------------------------------


def test_run_serves_each_batch_its_index_until_max_batches(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    engines: list[FakeEngine] = []

    def engine(loop: LoopConfig, out: Path) -> FakeEngine:
        assert isinstance(loop, LoopConfig) and loop.out == out == tmp_path / "out"
        engines.append(FakeEngine())
        return engines[-1]

    monkeypatch.setattr(wmod, "_Engine", engine)
    w = make_worker(tmp_path, max_batches=2)
    w.policy = (tmp_path / "sync-0001", 3)
    ran: list[tuple[Any, ...]] = []
    w._batch = lambda *args: ran.append(args)  # type: ignore[method-assign]
    w._run()
    assert ran == [(0, engines[0], tmp_path / "sync-0001", 3), (1, engines[0], tmp_path / "sync-0001", 3)]
    assert engines[0].closed == 1 and w.error is None
    once = make_worker(tmp_path, max_batches=1)
    once.policy = (tmp_path / "p", 0)
    once._batch = lambda *args: ran.append(args)  # type: ignore[method-assign]
    once._run()
    assert len(ran) == 3


def test_run_keeps_the_error_for_the_trainer_and_closes_the_engine(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    engine = FakeEngine()
    monkeypatch.setattr(wmod, "_Engine", lambda loop, out: engine)
    w = make_worker(tmp_path)
    w.policy = (tmp_path / "p", 0)
    boom = OSError("disk full")

    def fail(*args: Any) -> None:
        raise boom

    w._batch = fail  # type: ignore[method-assign]
    w._run()
    assert w.error is boom and engine.closed == 1
    stopped = make_worker(tmp_path)
    stopped._stopping.set()
    stopped._batch = fail  # type: ignore[method-assign]
    stopped._run()
    assert stopped.error is None and engine.closed == 2


def test_start_runs_one_thread_and_stop_ends_it(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(wmod, "_Engine", lambda loop, out: FakeEngine())
    monkeypatch.setattr(wmod, "PUT_POLL_S", 0.01)
    w = make_worker(tmp_path)
    w._heartbeat = 0.0
    w.start()
    thread = w._thread
    assert thread is not None and thread.name == "polar-rollouts" and thread.daemon and thread.is_alive()
    assert (tmp_path / "out").is_dir() and w._heartbeat > 0.0
    w.start()
    assert w._thread is thread
    w.stop()
    assert not thread.is_alive() and w.error is None
    # OUT two levels down, then OUT already there (a resumed run).
    for out in (tmp_path / "runs" / "deep", tmp_path / "runs" / "deep"):
        again = PolarRolloutWorker(dataclasses.replace(w.loop, out=out))
        again.start()
        again.stop()
        assert out.is_dir() and again.error is None


def test_stop_cuts_the_batch_in_flight(tmp_path: Path) -> None:
    w = make_worker(tmp_path)
    loop = asyncio.new_event_loop()
    event = asyncio.Event()
    w._rollout_loop, w._rollout_stop = loop, event
    w.stop()
    loop.run_until_complete(asyncio.wait_for(event.wait(), 1))
    assert w._stopping.is_set()
    loop.close()
    w.stop()  # that batch's loop has ended since: nothing to cut, no error


# -- one batch --------------------------------------------------------------------------------------------------------


@pytest.fixture
def batch_env(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> SimpleNamespace:
    """A worker whose rollouts are canned results and whose build (load_traces, prepare_rows, rows_to_samples) is
    recorded."""
    import polar_cli.train.dataset as dataset

    env = SimpleNamespace(
        rollouts=[],
        loads=[],
        prepares=[],
        to_samples=[],
        decoders=[],
        results=[],
        clock=FakeClock(),
        make_work=True,
        token=None,
    )
    monkeypatch.setattr(wmod, "time", env.clock)

    async def run_rollout(rollout: Any) -> RolloutResult:
        env.rollouts.append(rollout)
        if env.make_work:
            Path(rollout.work_dir).mkdir(parents=True, exist_ok=True)
            (Path(rollout.work_dir) / "scratch").write_text("x")
        if env.token:  # the proxy's control token beside its store, and an agent that printed it
            Path(rollout.out).mkdir(parents=True, exist_ok=True)
            (Path(rollout.out) / TOKEN_FILE).write_text(env.token)
            rollout.progress.errors.append(("s1", f"the agent printed {env.token}"))
        return env.results.pop(0)

    def load_traces(paths: list[Path], strategy: str, **kwargs: Any) -> list[Any]:
        env.loads.append((paths, strategy, kwargs))
        return [SimpleNamespace(trace_id="a"), SimpleNamespace(trace_id="b")]

    def prepare_rows(traces: list[Any], **kwargs: Any) -> Any:
        env.prepares.append((traces, kwargs))
        return SimpleNamespace(rows=["row-a", "row-b", "row-c"], stats={"groups": 2, "zero_advantage": 4, "clipped": 1})

    def rows_to_samples(rows: list[str], traces: dict[str, Any], group_ids: dict[str, int], decode: Any) -> list[str]:
        env.to_samples.append((rows, sorted(traces), group_ids, decode))
        return [f"sample-{r}" for r in rows]

    def decoder(model: Path) -> Any:
        env.decoders.append(model)
        return "decode"

    monkeypatch.setattr(wmod, "run_rollout", run_rollout)
    monkeypatch.setattr(dataset, "load_traces", load_traces)
    monkeypatch.setattr(dataset, "prepare_rows", prepare_rows)
    monkeypatch.setattr(wmod, "rows_to_samples", rows_to_samples)
    monkeypatch.setattr(wmod, "_decoder", decoder)
    env.worker = make_worker(
        tmp_path, max_length=64, temperature=0.7, strategy="per_request", scale_rewards="none",
        build_options={"eot_token_id": 9},
    )  # fmt: skip
    return env


def test_a_batch_is_rolled_out_on_the_served_version_and_sent_to_the_trainer(
    batch_env: SimpleNamespace, tmp_path: Path
) -> None:
    w, engine = batch_env.worker, FakeEngine()
    policy = tmp_path / "out" / "weights" / "sync-0002"
    bdir = tmp_path / "out" / "batch-0003"
    bdir.mkdir(parents=True)
    (bdir / "stale.txt").write_text("a killed run's batch")
    batch_env.results.append(
        result(
            session("s1", "g1", "completed", 1.0), session("s2", "g1", "failed", 0.0),
            session("s3", "g2", "error", None), session("s4", "g2", "completed", 0.5),
        )
    )  # fmt: skip
    batch_env.clock.ticks = [10.0, 12.5, 20.0, 80.0]  # push 2.5 s, rollout 60 s
    w._batch(3, engine, policy, 2)

    assert engine.specs == [(policy, 2)] and w.transfer.in_use == {policy}
    (rollout,) = batch_env.rollouts
    assert rollout.engine == f"local:{policy}?weight_version=2"
    assert (rollout.seed, rollout.run_id, rollout.out) == (10, "b0003", str(bdir / "shards"))
    assert rollout.stop_on_signals is False and rollout.stop is w._rollout_stop and rollout.progress is not None
    assert not (bdir / "stale.txt").exists() and not (bdir / "work").exists()
    assert json.loads((bdir / PROGRESS_FILE).read_text())["final"] is True
    summary = json.loads((bdir / "rollout-summary.json").read_text())
    assert summary["run_id"] == "run" and summary["sessions"] == 4

    assert batch_env.loads == [([bdir / "shards"], "per_request", {"tokenizer": policy, "eot_token_id": 9})]
    assert batch_env.prepares == [
        (
            [SimpleNamespace(trace_id="a"), SimpleNamespace(trace_id="b")],
            {"max_length": 64, "scale_rewards": "none", "drop_zero_advantage": True, "temperature": 0.7},
        )
    ]
    assert batch_env.to_samples == [(["row-a", "row-b", "row-c"], ["a", "b"], {}, "decode")]
    assert batch_env.to_samples[0][2] is w._group_ids  # one mapping across batches: group ids stay unique
    assert batch_env.decoders == [tmp_path / "base"]  # the tokenizer of the base model
    queued = [w.rollout_buffer.get_nowait() for _ in range(3)]
    assert queued == ["sample-row-a", "sample-row-b", "sample-row-c"] and w.rollout_buffer.empty()

    statuses = {"completed": 2, "failed": 1, "timeout": 0, "error": 1, "cancelled": 0}
    record = {
        "sessions": 4, "rewarded": 3, "reward_mean": 0.5, "samples": 3, "groups": 2, "groups_trained": 2,
        "zero_advantage_traces": 4, "clipped": 1, "statuses": statuses, "batch": 3, "version": 2,
        "policy": str(policy), "push_s": 2.5, "rollout_s": 60.0,
    }  # fmt: skip
    assert w.batches == [record]
    assert json.loads((tmp_path / "out" / "worker.json").read_text()) == {"batches": [record]}
    metrics = w.metrics_queue.get_nowait()
    assert metrics == {f"polar/{k}": float(v) for k, v in record.items() if k not in ("statuses", "policy")}
    assert all(type(v) is float for v in metrics.values())


def test_the_decoder_is_made_once_and_an_empty_batch_has_no_reward_mean(
    batch_env: SimpleNamespace, tmp_path: Path
) -> None:
    w = batch_env.worker
    batch_env.results += [result(session("s1", "g1", "error", None)), result()]
    w._batch(0, FakeEngine(), tmp_path / "p", 1)
    w._batch(1, FakeEngine(), tmp_path / "p", 1)
    assert batch_env.decoders == [tmp_path / "base"]
    first, second = w.batches
    assert first["rewarded"] == 0 and math.isnan(first["reward_mean"]) and first["groups"] == 1
    assert second["sessions"] == 0 and second["groups"] == 0
    assert [r["batch"] for r in json.loads((tmp_path / "out" / "worker.json").read_text())["batches"]] == [0, 1]


def test_stats_a_build_did_not_report_count_as_zero(
    batch_env: SimpleNamespace, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import polar_cli.train.dataset as dataset

    monkeypatch.setattr(dataset, "prepare_rows", lambda traces, **kwargs: SimpleNamespace(rows=[], stats={}))
    batch_env.results.append(result(session("s1", "g1", "completed", 1.0)))
    batch_env.worker._batch(0, FakeEngine(), tmp_path / "p", 0)
    (record,) = batch_env.worker.batches
    assert (record["groups_trained"], record["zero_advantage_traces"], record["clipped"]) == (0, 0, 0)
    assert record["reward_mean"] == 1.0 and record["samples"] == 0


def test_an_interrupted_batch_trains_nothing(batch_env: SimpleNamespace, tmp_path: Path) -> None:
    w = batch_env.worker
    batch_env.make_work = False  # cut before any session made its scratch directory
    batch_env.results.append(result(session("s1", "g1", "completed", 1.0), interrupted="stop"))
    w._batch(0, FakeEngine(), tmp_path / "p", 0)
    bdir = tmp_path / "out" / "batch-0000"
    assert json.loads((bdir / "rollout-summary.json").read_text())["interrupted"] == "stop"
    assert w.batches == [] and w.metrics_queue.empty() and w.rollout_buffer.empty()
    assert not (tmp_path / "out" / "worker.json").exists() and batch_env.loads == []


def test_the_control_token_never_reaches_the_batchs_files(batch_env: SimpleNamespace, tmp_path: Path) -> None:
    token = "polar-ctl-" + "k" * 32
    batch_env.token = token
    leaked = SessionResult("s1", "g1", "g1", 0, "error", reason=f"harness said {token}")  # type: ignore[arg-type]
    batch_env.results.append(result(leaked))
    batch_env.worker._batch(0, FakeEngine(), tmp_path / "p", 0)
    bdir = tmp_path / "out" / "batch-0000"
    progress, summary = (bdir / PROGRESS_FILE).read_text(), (bdir / "rollout-summary.json").read_text()
    assert token not in progress and "the agent printed" in progress
    assert token not in summary and "harness said" in summary


def test_a_failed_rollout_still_clears_its_scratch_and_progress(
    batch_env: SimpleNamespace, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    w = batch_env.worker
    seen: list[Any] = []

    async def crash(rollout: Any) -> RolloutResult:
        seen.append(w._progress)
        Path(rollout.work_dir).mkdir(parents=True)
        raise RuntimeError("proxy died")

    monkeypatch.setattr(wmod, "run_rollout", crash)
    with pytest.raises(RuntimeError, match="proxy died"):
        w._batch(0, FakeEngine(), tmp_path / "p", 0)
    assert seen[0] is not None and w._progress is None
    assert not (tmp_path / "out" / "batch-0000" / "work").exists()


def test_a_ray_loop_rolls_out_on_ray(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[tuple[str, Any]] = []

    async def local(rollout: Any) -> str:
        calls.append(("local", rollout))
        assert w._rollout_loop is asyncio.get_running_loop()  # where stop() cuts the batch
        return "local-result"

    async def ray(rollout: Any, loop: LoopConfig) -> str:
        calls.append(("ray", loop.ray))
        assert rollout.stop is w._rollout_stop
        return "ray-result"

    monkeypatch.setattr(wmod, "run_rollout", local)
    monkeypatch.setattr(wmod, "_ray_rollout", ray)
    w = make_worker(tmp_path)

    @dataclasses.dataclass
    class R:
        stop: Any = None

    assert asyncio.run(w._rollout(R())) == "local-result"
    assert calls[0][1].stop is w._rollout_stop and not w._rollout_stop.is_set()
    w.loop.ray = "ray://head:10001"
    assert asyncio.run(w._rollout(R())) == "ray-result" and calls[1] == ("ray", "ray://head:10001")
    w._stopping.set()  # stopped between batches: the next rollout is cut before it starts
    asyncio.run(w._rollout(R()))
    assert w._rollout_stop.is_set()


# -- the buffer ------------------------------------------------------------------------------------------------------


def test_a_full_buffer_stalls_the_worker_without_counting_as_a_hang(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(wmod, "PUT_POLL_S", 0.01)
    w = make_worker(tmp_path, queue_maxsize=1)
    w.rollout_buffer.put("first")
    w._heartbeat = 0.0
    putter = threading.Thread(target=w._put, args=("second",))
    putter.start()
    time.sleep(0.1)
    assert putter.is_alive() and w._heartbeat > 0.0
    w._heartbeat = 0.0
    assert w.rollout_buffer.get(timeout=1) == "first"
    putter.join(timeout=5)
    assert w.rollout_buffer.get_nowait() == "second" and w._heartbeat > 0.0


def test_a_stopping_worker_drops_what_the_full_buffer_cannot_take(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(wmod, "PUT_POLL_S", 0.01)
    w = make_worker(tmp_path, queue_maxsize=1)
    w.rollout_buffer.put("first")
    putter = threading.Thread(target=w._put, args=("second",))
    putter.start()
    time.sleep(0.05)
    w._stopping.set()
    putter.join(timeout=5)
    assert not putter.is_alive() and w.rollout_buffer.get_nowait() == "first"
    with pytest.raises(queue.Empty):
        w.rollout_buffer.get_nowait()
    w._put("third")  # already stopping: nothing is queued
    assert w.rollout_buffer.empty()


# -- the decoder -----------------------------------------------------------------------------------------------------


def test_decoder_decodes_with_the_models_tokenizer_or_is_none(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import transformers

    asked: list[Any] = []

    class Tok:
        def decode(self, ids: Any) -> str:
            asked.append(ids)
            return "text"

    def from_pretrained(path: Any) -> Tok:
        asked.append(path)
        if path == str(tmp_path / "none"):
            raise OSError("no tokenizer there")
        if path == str(tmp_path / "bad"):
            raise ValueError("unrecognized")
        return Tok()

    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", from_pretrained)
    decode = wmod._decoder(tmp_path / "model")
    assert decode((1, 2, 3)) == "text"
    assert asked == [str(tmp_path / "model"), [1, 2, 3]]  # a list, as every tokenizer takes
    assert wmod._decoder(tmp_path / "none") is None and wmod._decoder(tmp_path / "bad") is None


# -- the CPU attention stand-in --------------------------------------------------------------------------------------


def test_run_trainer_on_cpu_routes_trls_attention_to_the_cpu_kernel(monkeypatch: pytest.MonkeyPatch) -> None:
    from trl.experimental.async_grpo import async_grpo_trainer, packing

    from polar_cli.trl_async import cpu_attention

    # Restored after the test: TRL's own kernel loader and MFU probe.
    monkeypatch.setattr(packing, "_flash_attn", packing._flash_attn)
    monkeypatch.setattr(async_grpo_trainer, "get_peak_flops_per_device", async_grpo_trainer.get_peak_flops_per_device)
    cpu_attention.run_trainer_on_cpu()
    assert packing._flash_attn().flash_attn_varlen_func is cpu_attention.flash_attn_varlen_func
    assert async_grpo_trainer.get_peak_flops_per_device(object(), "bfloat16") is None


def attention_reference(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, allowed: torch.Tensor | None, softcap: float = 0.0
) -> torch.Tensor:
    """One segment's attention written out (q: (len_q, heads, dim); k, v: (len_k, kv_heads, dim)), in float64."""
    groups = q.shape[1] // k.shape[1]
    k, v = k[:, [h // groups for h in range(q.shape[1])]], v[:, [h // groups for h in range(q.shape[1])]]
    scores = torch.einsum("qhd,khd->hqk", q.double(), k.double()) * scale
    if softcap:
        scores = softcap * torch.tanh(scores / softcap)
    if allowed is not None:
        scores = scores.masked_fill(~allowed, float("-inf"))
    return torch.einsum("hqk,khd->qhd", torch.softmax(scores, dim=-1), v.double())


def segment_inputs(len_q: int, len_k: int, heads: int = 4, kv_heads: int = 2) -> tuple[torch.Tensor, ...]:
    generator = torch.Generator().manual_seed(len_q * 100 + len_k)
    q = torch.randn(len_q, heads, 8, generator=generator)
    return q, torch.randn(len_k, kv_heads, 8, generator=generator), torch.randn(len_k, kv_heads, 8, generator=generator)


def test_cpu_attention_is_full_attention_unless_causal_with_its_scale() -> None:
    q, k, v = segment_inputs(3, 5)
    cu_q, cu_k = torch.tensor([0, 3]), torch.tensor([0, 5])
    out = flash_attn_varlen_func(q, k, v, cu_q, cu_k, 3, 5)  # FlashAttention's default: not causal
    torch.testing.assert_close(out.double(), attention_reference(q, k, v, 1 / math.sqrt(8), None))
    scaled = flash_attn_varlen_func(q, k, v, cu_q, cu_k, 3, 5, softmax_scale=0.25)
    torch.testing.assert_close(scaled.double(), attention_reference(q, k, v, 0.25, None))
    # Causal, aligned to the bottom right: query i of 3 sees keys up to i + 2 of 5.
    causal = torch.tensor([[1, 1, 1, 0, 0], [1, 1, 1, 1, 0], [1, 1, 1, 1, 1]], dtype=torch.bool)
    got = flash_attn_varlen_func(q, k, v, cu_q, cu_k, 3, 5, causal=True)
    torch.testing.assert_close(got.double(), attention_reference(q, k, v, 1 / math.sqrt(8), causal))


def test_cpu_attention_softcap_and_left_window() -> None:
    q, k, v = segment_inputs(3, 5)
    cu_q, cu_k = torch.tensor([0, 3]), torch.tensor([0, 5])
    capped = flash_attn_varlen_func(q, k, v, cu_q, cu_k, 3, 5, softmax_scale=2.0, softcap=1.5)
    torch.testing.assert_close(capped.double(), attention_reference(q, k, v, 2.0, None, softcap=1.5))
    # A left window of 1: query i sees its own (aligned) key and the one before it only.
    window = torch.tensor([[0, 1, 1, 0, 0], [0, 0, 1, 1, 0], [0, 0, 0, 1, 1]], dtype=torch.bool)
    got = flash_attn_varlen_func(q, k, v, cu_q, cu_k, 3, 5, causal=True, window_size=(1, -1))
    torch.testing.assert_close(got.double(), attention_reference(q, k, v, 1 / math.sqrt(8), window))
    unlimited = flash_attn_varlen_func(q, k, v, cu_q, cu_k, 3, 5, causal=True, window_size=(-1, -1))
    torch.testing.assert_close(unlimited, flash_attn_varlen_func(q, k, v, cu_q, cu_k, 3, 5, causal=True))


def test_cpu_attention_segments_without_queries_and_the_input_dtype() -> None:
    q, k, v = segment_inputs(2, 4)
    # A first segment of 3 keys and no queries (a prefix node TRL packs once) is skipped, not attended.
    pad = torch.randn(3, 2, 8)
    out = flash_attn_varlen_func(
        q, torch.cat([pad, k]), torch.cat([pad, v]), torch.tensor([0, 0, 2]), torch.tensor([0, 3, 7]), 2, 4
    )
    torch.testing.assert_close(out.double(), attention_reference(q, k, v, 1 / math.sqrt(8), None))
    half = flash_attn_varlen_func(
        q.bfloat16(), k.bfloat16(), v.bfloat16(), torch.tensor([0, 2]), torch.tensor([0, 4]), 2, 4
    )
    assert half.dtype == torch.bfloat16 and half.shape == (2, 4, 8)
    torch.testing.assert_close(
        half.double(), attention_reference(q, k, v, 1 / math.sqrt(8), None), atol=0.05, rtol=0.05
    )


def test_cpu_attention_refuses_query_and_key_offsets_of_different_segment_counts() -> None:
    q, k, v = segment_inputs(2, 4)
    # Two segments of queries against three of keys: a packing bug, never a silently dropped segment.
    with pytest.raises(ValueError, match="zip"):
        flash_attn_varlen_func(q, k, v, torch.tensor([0, 1, 2]), torch.tensor([0, 1, 2, 4]), 1, 2)


def test_cpu_attention_window_of_zero_sees_only_the_aligned_key() -> None:
    q, k, v = segment_inputs(3, 5)
    got = flash_attn_varlen_func(
        q, k, v, torch.tensor([0, 3]), torch.tensor([0, 5]), 3, 5, causal=True, window_size=(0, -1)
    )
    groups = [h // 2 for h in range(4)]
    torch.testing.assert_close(got, v[2:5][:, groups])  # query i attends to key i + 2 alone: its value
