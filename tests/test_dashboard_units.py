"""The dashboard's counts and its server, unit by unit: which directory is which kind, where each rollout's store is,
what changes the fingerprint, every figure of a run, loop and engine (exact values, zeros, NaN, the percentiles'
ranks), the cache of stores; and the server's answers: the static allowlist (no file outside it, whatever the name),
headers, the event stream's keepalives and end, the session page's misses and tokenizer cache, nothing secret in
what it serves."""

from __future__ import annotations

import asyncio
import base64
import hashlib
import json
import os
import warnings
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

with warnings.catch_warnings():  # Starlette's TestClient would have httpx2; httpx works the same
    warnings.simplefilter("ignore")
    from starlette.testclient import TestClient

from polar_cli.dashboard import server
from polar_cli.dashboard import snapshot as snap
from polar_cli.dashboard.server import PAGE_CSP, STATIC, Dashboard, create_app
from polar_cli.rollout.progress_file import PROGRESS_FILE

# -- kinds and places --------------------------------------------------------------------------------------------------


def make(path: Path, *names: str) -> Path:
    """Directories (a trailing /) and files (``{}``) under ``path``."""
    for name in names:
        target = path / name
        if name.endswith("/"):
            target.mkdir(parents=True, exist_ok=True)
        else:
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_text("{}")
    return path


@pytest.mark.parametrize(
    ("names", "kind"),
    [
        (["loop.json"], "loop"),
        ([f"iter-000/{PROGRESS_FILE}"], "loop"),
        ([f"batch-0000/{PROGRESS_FILE}"], "loop"),
        (["rollout-manifest.json"], "run"),
        ([PROGRESS_FILE], "run"),
        ([PROGRESS_FILE, "calls/"], "run"),
        (["rollouts/"], "store"),
        (["calls/"], "store"),
        (["sessions/"], "store"),
        (["rewards/"], "store"),
        (["_journal/"], "store"),
    ],
)
def test_detect_kind(names: list[str], kind: str, tmp_path: Path) -> None:
    assert snap.detect_kind(make(tmp_path, *names)) == kind


@pytest.mark.parametrize("names", [[], ["loop.json/"], ["rollout-manifest.json/", "calls"], ["iter-000/"]])
def test_a_directory_of_no_kind_is_refused_by_name(names: list[str], tmp_path: Path) -> None:
    with pytest.raises(ValueError) as raised:
        snap.detect_kind(make(tmp_path, *names))
    assert str(raised.value) == (
        f"{tmp_path} is no store (calls/, sessions/), rollout report directory (rollout-manifest.json) or loop "
        "directory (loop.json)"
    )


def aged(path: Path, mtime: float) -> Path:
    os.utime(path, (mtime, mtime))
    return path


def test_report_dirs_in_the_order_they_ran(tmp_path: Path) -> None:
    loop = make(tmp_path / "loop", "iter-000/", "iter-001/", "batch-0000/", "eval/iter-000/", "iter-002", "other/")
    aged(loop / "iter-000", 300)
    aged(loop / "iter-001", 100)
    aged(loop / "batch-0000", 200)
    aged(loop / "eval" / "iter-000", 100)
    assert snap.report_dirs(loop, "loop") == [
        loop / "eval" / "iter-000", loop / "iter-001", loop / "batch-0000", loop / "iter-000"
    ]  # fmt: skip
    store = make(tmp_path / "store", "calls/", "rollouts/b/", "rollouts/a/", "rollouts/file")
    aged(store / "rollouts" / "a", 100)
    aged(store / "rollouts" / "b", 100)
    assert snap.report_dirs(store, "store") == [store / "rollouts" / "a", store / "rollouts" / "b"]
    assert snap.report_dirs(tmp_path / "loop", "run") == [tmp_path / "loop"]
    assert snap.report_dirs(make(tmp_path / "bare", "calls/"), "store") == []


def test_mtime_of_a_missing_path_is_zero(tmp_path: Path) -> None:
    assert snap._mtime(tmp_path / "gone") == 0.0
    assert snap._mtime(aged(make(tmp_path, "d/") / "d", 1234.5)) == 1234.5


def test_run_store_beside_the_report_above_it_or_named_by_the_manifest(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    beside = make(tmp_path / "iter-000", "shards/")
    assert snap.run_store(beside) == beside / "shards"
    store = make(tmp_path / "store", "calls/", "rollouts/r1/")
    assert snap.run_store(store / "rollouts" / "r1") == store
    # Under a rollouts/ that is no store's: the manifest says where the calls went.
    elsewhere = make(tmp_path / "elsewhere", "sessions/")
    report = make(tmp_path / "plain" / "rollouts" / "r2", "x/")
    assert snap.run_store(report) is None
    (report / "rollout-manifest.json").write_text(json.dumps({"store": str(elsewhere)}))
    assert snap.run_store(report) == elsewhere
    # A relative --out: tried from the working directory, then from each of the report's parents.
    (report / "rollout-manifest.json").write_text(json.dumps({"store": "elsewhere"}))
    cwd = make(tmp_path / "cwd", "elsewhere/rewards/")
    monkeypatch.chdir(cwd)
    assert snap.run_store(report) == cwd / "elsewhere"
    monkeypatch.chdir(tmp_path / "iter-000")
    assert snap.run_store(report) == tmp_path / "elsewhere"
    for manifest in ({"store": "missing"}, {"store": ""}, {"store": 7}, {}, []):
        (report / "rollout-manifest.json").write_text(json.dumps(manifest))
        assert snap.run_store(report) is None, manifest


def test_stores_of_each_kind(tmp_path: Path) -> None:
    store = make(tmp_path / "store", "calls/")
    assert snap.stores_of(store, "store", []) == [store]
    assert snap.stores_of(make(tmp_path / "reports-only", "rollouts/"), "store", []) == []
    a = make(tmp_path / "loop" / "iter-000", "shards/")
    b = make(tmp_path / "loop" / "iter-001", "x/")
    c = make(tmp_path / "loop" / "iter-002", "shards/")
    assert snap.stores_of(tmp_path / "loop", "loop", [c, b, a, c]) == [c / "shards", a / "shards"]


# -- fingerprints ------------------------------------------------------------------------------------------------------


def stat_of(path: Path) -> tuple[str, int, int]:
    st = path.stat()
    return (str(path), st.st_size, st.st_mtime_ns)


def test_store_fingerprint_lists_every_shard_and_journal_file(tmp_path: Path) -> None:
    store = make(tmp_path, "calls/", "sessions/", "_journal/w-1/", "other/")
    for name, body in [("calls/b.parquet", "bb"), ("calls/a.parquet", "a"), ("_journal/w-1/0001.arrow", "jjj"),
                       ("rewards/r.parquet", ""), ("other/x", "not the store's")]:  # fmt: skip
        (store / name).parent.mkdir(parents=True, exist_ok=True)
        (store / name).write_text(body)
    names = ["_journal/w-1/0001.arrow", "calls/a.parquet", "calls/b.parquet", "rewards/r.parquet"]
    assert snap.store_fingerprint(store) == tuple(sorted(stat_of(store / n) for n in names))
    assert snap.store_fingerprint(tmp_path / "none") == ()


def test_a_file_gone_between_listing_and_stat_is_left_out(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    store = make(tmp_path, "calls/1.parquet", "calls/2.parquet", "calls/3.parquet")
    real_stat, gone = os.stat, []

    def stat(path: Any, *args: Any, **kwargs: Any) -> Any:
        if str(path).startswith(str(store / "calls")) and not gone:
            gone.append(str(path))  # the first one listed: renamed away by a compaction
            raise FileNotFoundError(path)
        return real_stat(path, *args, **kwargs)

    monkeypatch.setattr(os, "stat", stat)
    got = snap.store_fingerprint(store)
    assert [p for p, _, _ in got] == sorted({str(store / "calls" / f"{i}.parquet") for i in (1, 2, 3)} - set(gone))


def test_fingerprint_of_each_kind(tmp_path: Path) -> None:
    empty = make(tmp_path / "early", "b", "a/")
    assert snap.fingerprint(empty) == ((str(empty / "a"), 0, 0), (str(empty / "b"), 0, 0))
    loop = make(tmp_path / "loop", "loop.json", f"iter-000/{PROGRESS_FILE}", "iter-000/rollout-summary.json",
                "iter-000/shards/calls/1.parquet", "iter-001/rollout-manifest.json")  # fmt: skip
    aged(loop / "iter-001", 10)
    assert snap.fingerprint(loop) == (
        stat_of(loop / "loop.json"),
        stat_of(loop / "iter-001" / "rollout-manifest.json"),
        stat_of(loop / "iter-000" / PROGRESS_FILE),
        stat_of(loop / "iter-000" / "rollout-summary.json"),
        stat_of(loop / "iter-000" / "shards" / "calls" / "1.parquet"),
    )
    store = make(tmp_path / "store", "calls/1.parquet", f"rollouts/r/{PROGRESS_FILE}")
    assert snap.fingerprint(store) == (
        stat_of(store / "rollouts" / "r" / PROGRESS_FILE),
        stat_of(store / "calls" / "1.parquet"),
    )
    bare = make(tmp_path / "bare", "sessions/1.parquet")  # a store no rollout reported into
    assert snap.fingerprint(bare) == (stat_of(bare / "sessions" / "1.parquet"),)


# -- one rollout, a loop -----------------------------------------------------------------------------------------------


def write(path: Path, data: Any) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data))


def test_estimate_drops_what_is_not_a_finite_number() -> None:
    assert snap._estimate([]) == {"mean": None, "se": None, "n": 0}
    assert snap._estimate([0.5, float("nan"), float("inf")]) == {"mean": 0.5, "se": None, "n": 1}
    assert snap._estimate([0.0, 1.0, None, "1"]) == {"mean": 0.5, "se": 0.5, "n": 2}  # type: ignore[list-item]


def test_a_live_run(tmp_path: Path) -> None:
    report = tmp_path / "loop" / "iter-003"
    write(report / PROGRESS_FILE, {
        "total": 6, "stages": {"agent": 2, "done": 4}, "statuses": {"completed": 3, "error": 1, "timeout": 0},
        "group_rewards": {"g1": [1.0, 0.0], "g2": [0.5], "bad": "x"}, "errors": [["s1", "boom"]],
        "sessions_per_minute": 2.5, "updated_at": 123.0, "final": False,
    })  # fmt: skip
    got = snap.run_snapshot(report, tmp_path / "loop")
    assert got == {
        "name": "iter-003", "total": 6, "stages": {"agent": 2, "done": 4},
        "statuses": {"completed": 3, "error": 1}, "sessions_per_minute": 2.5, "errors": [["s1", "boom"]],
        "running": True, "updated_at": 123.0,
        "reward": {"mean": 0.5, "se": pytest.approx(0.2886751, rel=1e-6), "n": 3},
        "groups": {"g1": {"mean": 0.5, "se": 0.5, "n": 2}, "g2": {"mean": 0.5, "se": None, "n": 1}},
    }  # fmt: skip


def test_an_ended_run_counts_from_its_summary(tmp_path: Path) -> None:
    write(tmp_path / PROGRESS_FILE, {"total": 2, "statuses": {"completed": 1}, "group_rewards": {"g": [1.0]},
                                     "sessions_per_minute": float("nan"), "final": False})  # fmt: skip
    write(tmp_path / "rollout-summary.json", {
        "statuses": {"completed": 1, "failed": 1, "error": 0},
        "groups": {"b": {"rewards": [0.0, 1.0]}, "a": {"rewards": None}},
    })  # fmt: skip
    got = snap.run_snapshot(tmp_path, tmp_path)
    assert got["name"] == tmp_path.name and got["running"] is False
    assert got["statuses"] == {"completed": 1, "failed": 1} and got["sessions_per_minute"] is None
    assert list(got["groups"]) == ["a", "b"] and got["groups"]["a"] == {"mean": None, "se": None, "n": 0}
    assert got["reward"] == {"mean": 0.5, "se": 0.5, "n": 2}
    # A summary without statuses keeps the live ones.
    write(tmp_path / "rollout-summary.json", {"groups": {}})
    assert snap.run_snapshot(tmp_path, tmp_path)["statuses"] == {"completed": 1}


def test_a_run_with_nothing_yet_and_one_that_finished(tmp_path: Path) -> None:
    got = snap.run_snapshot(tmp_path, tmp_path)
    assert got["running"] is False and got["total"] is None and got["stages"] == {} and got["errors"] == []
    assert got["statuses"] == {} and got["groups"] == {} and got["reward"] == {"mean": None, "se": None, "n": 0}
    write(tmp_path / PROGRESS_FILE, ["not", "a", "dict"])
    assert snap.run_snapshot(tmp_path, tmp_path)["running"] is False
    write(tmp_path / PROGRESS_FILE, {"total": 1, "final": True})
    assert snap.run_snapshot(tmp_path, tmp_path)["running"] is False
    write(tmp_path / PROGRESS_FILE, {"total": 1})
    assert snap.run_snapshot(tmp_path, tmp_path)["running"] is True
    write(tmp_path / "rollout-summary.json", ["no summary"])
    assert snap.run_snapshot(tmp_path, tmp_path)["running"] is True


def test_loop_snapshot_takes_what_is_well_formed(tmp_path: Path) -> None:
    write(tmp_path / "loop.json", {
        "iterations": [
            {"iteration": 0, "reward_mean": 0.5, "reward_se": float("inf"), "push_s": 1.5, "train": {"status": "ok"}},
            {"iteration": 1, "train": "trained", "reward_se": 0.125}, {"iteration": 2, "train": {}}, 7,
        ],
        "evals": [{"iteration": 0, "overall": {"pass@1": {"mean": 0.25, "se": None}, "pass@2": 0.5}}, "x",
                  {"iteration": 1}],
    })  # fmt: skip
    assert snap.loop_snapshot(tmp_path) == {
        "iterations": [
            {"iteration": 0, "reward_mean": 0.5, "reward_se": None, "push_s": 1.5, "train": "ok"},
            {"iteration": 1, "reward_mean": None, "reward_se": 0.125, "push_s": None, "train": None},
            {"iteration": 2, "reward_mean": None, "reward_se": None, "push_s": None, "train": None},
        ],
        "evals": [{"iteration": 0, "pass": {"pass@1": {"mean": 0.25, "se": None}}}, {"iteration": 1, "pass": {}}],
    }
    write(tmp_path / "loop.json", ["not", "a", "dict"])
    assert snap.loop_snapshot(tmp_path) == {"iterations": [], "evals": []}


# -- engine and harness figures ----------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("n", "q", "rank"), [(1, 0.5, 1), (1, 0.95, 1), (2, 0.5, 1), (20, 0.5, 10), (20, 0.95, 19), (21, 0.95, 20)]
)
def test_percentile_is_the_nearest_rank(n: int, q: float, rank: int) -> None:
    values = [float(v) for v in range(n, 0, -1)]  # n .. 1: sorted first
    assert snap._percentile(values, q) == float(rank)


def test_percentile_of_nothing_and_of_the_ends() -> None:
    assert snap._percentile([], 0.5) is None
    assert snap._percentile([3.0, 1.0, 2.0], 0.0) == 1.0 and snap._percentile([3.0, 1.0, 2.0], 1.0) == 3.0


def test_engine_stats_over_every_store() -> None:
    views = [
        snap.StoreView(calls=2, latencies=[1.0, 3.0], tokens=40),
        snap.StoreView(calls=1, latencies=[4.0], tokens=40),
    ]
    assert snap.engine_stats(views) == {
        "calls": 3, "latency_p50_s": 3.0, "latency_p95_s": 4.0, "tokens": 80, "tokens_per_s": 10.0
    }  # fmt: skip
    # A call the engine did not time: no tokens/s (its tokens have no seconds).
    partly = snap.engine_stats([*views, snap.StoreView(calls=1, latencies=[], tokens=5)])
    assert partly["tokens"] == 85 and partly["tokens_per_s"] is None and partly["calls"] == 4
    untimed = snap.engine_stats([snap.StoreView(calls=0, latencies=[], tokens=0)])
    assert untimed == {"calls": 0, "latency_p50_s": None, "latency_p95_s": None, "tokens": 0, "tokens_per_s": None}
    zero = snap.engine_stats([snap.StoreView(calls=1, latencies=[0.0], tokens=3)])
    assert zero["tokens_per_s"] is None
    # Under a second of engine time still has a rate; twenty calls: p95 is the 19th.
    assert snap.engine_stats([snap.StoreView(calls=1, latencies=[0.5], tokens=3)])["tokens_per_s"] == 6.0
    many = snap.engine_stats([snap.StoreView(calls=20, latencies=[float(v) for v in range(1, 21)], tokens=0)])
    assert (many["latency_p50_s"], many["latency_p95_s"]) == (10.0, 19.0)


def test_harness_stats_sum_each_harness_over_stores() -> None:
    from polar_cli.build.stats import BuildStats

    a = BuildStats(sessions=1, calls=4, calls_merged=3, breaks={"tools": 1})
    b = BuildStats(sessions=1, calls=4, calls_merged=1, breaks={"tools": 1, "system": 2})
    c = BuildStats(sessions=1, calls=2, calls_merged=0)
    views = [snap.StoreView(builds=[("pi", a), ("codex", c)]), snap.StoreView(builds=[("pi", b)])]
    assert snap.harness_stats(views) == {
        "codex": {"sessions": 1, "calls": 2, "merge_rate": 0.0, "breaks": {}},
        "pi": {"sessions": 2, "calls": 8, "merge_rate": 0.5, "breaks": {"tools": 2, "system": 2}},
    }
    assert list(snap.harness_stats(views)) == ["codex", "pi"]


def test_totals_sum_stages_and_statuses_over_runs() -> None:
    runs = [
        {"stages": {"done": 2, "agent": 1}, "statuses": {"completed": 2}},
        {"stages": {"done": 1, 3: 1, "agent": None}, "statuses": {"completed": 1, "error": "x"}},
        {"stages": None, "statuses": None},
    ]
    assert snap._totals(runs) == {
        "stages": {"done": 3, "agent": 1, "3": 1},
        "statuses": {"completed": 3, "error": 0},
    }
    assert snap._totals([]) == {"stages": {}, "statuses": {}}


# -- a real store ------------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def real_store(tmp_path_factory: pytest.TempPathFactory) -> SimpleNamespace:
    """Three sessions: ``new`` (a named reward and ``reward``, a failed call, one call timed 2 s), ``old`` (only a named
    reward, one untimed call and one timed 4 s), ``bare`` (no call, an error with its reason); and a store whose only
    call failed."""
    from build_helpers import AgentSim, Turn

    from polar_addon.store import TraceStore

    root = tmp_path_factory.mktemp("units")
    messages = [{"role": "user", "content": "go"}]
    new, old, failed = AgentSim("new", harness="pi"), AgentSim("old", harness="codex"), AgentSim("f", harness="pi")
    new.call(messages, Turn(content="done")).engine_latency_s = 2.0
    new.call(messages, Turn(content="again"), status="error")
    old.call(messages, Turn(content="ok then"))
    old.call(messages, Turn(content="fine")).engine_latency_s = 4.0
    failed.call(messages, Turn(content="x"), status="error")

    async def write() -> None:
        async with TraceStore(str(root / "store")) as store:
            for record in new.records + old.records:
                await store.append(record)
            await store.session_update("new", status="completed", task_id="t1", group_id="g1", started_at=200.0,
                                       ended_at=260.0)  # fmt: skip
            await store.session_update("old", status="completed", task_id="t2", group_id="g2", started_at=0.5,
                                       ended_at=1.5, metadata={"reason": "tests failed"})  # fmt: skip
            await store.session_update("bare", status="error", metadata={"reason": "boom"})
            await store.add_reward("new", 0.9, name="score")
            await store.add_reward("new", 0.5)
            await store.add_reward("old", 0.25, name="score")
        async with TraceStore(str(root / "failed")) as store:
            await store.append(failed.records[0])

    asyncio.run(write())
    return SimpleNamespace(store=str(root / "store"), failed=str(root / "failed"), new=new.records, old=old.records)


def test_read_store_takes_each_sessions_figures_newest_first(real_store: SimpleNamespace) -> None:
    view = snap.read_store(real_store.store)
    assert [r["session_id"] for r in view.sessions] == ["new", "old", "bare"]
    new, old, bare = view.sessions
    assert new == {
        "session_id": "new", "task_id": "t1", "group_id": "g1", "status": "completed", "reward": 0.5, "harness": "pi",
        "calls": 2, "failed_calls": 1, "response_tokens": len(real_store.new[0].response_ids), "started_at": 200.0,
        "ended_at": 260.0, "reason": None, "store": real_store.store,
    }  # fmt: skip
    # No ``reward`` reward: the first named one.
    assert (old["reward"], old["reason"], old["task_id"], old["group_id"]) == (0.25, "tests failed", "t2", "g2")
    assert old["response_tokens"] == sum(len(r.response_ids) for r in real_store.old)
    assert (bare["reward"], bare["reason"], bare["status"], bare["calls"]) == (None, "boom", "error", 0)
    ok = [real_store.new[0], *real_store.old]
    assert view.calls == 3 and view.latencies == [2.0, 4.0]
    assert view.tokens == sum(len(r.response_ids) for r in ok)
    assert sorted(harness for harness, _ in view.builds) == ["codex", "pi"]


def test_read_store_keeps_the_newest_sessions_only(
    real_store: SimpleNamespace, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(snap, "MAX_SESSIONS", 2)
    assert [r["session_id"] for r in snap.read_store(real_store.store).sessions] == ["new", "old"]


def test_read_store_of_failed_calls_only(real_store: SimpleNamespace) -> None:
    view = snap.read_store(real_store.failed)
    assert (view.calls, view.latencies, view.tokens) == (0, [], 0)
    assert [(r["session_id"], r["calls"], r["failed_calls"]) for r in view.sessions] == [("f", 1, 1)]


# -- the snapshot and its cache ----------------------------------------------------------------------------------------


def session_row(sid: str, started: float | None, store: str) -> dict[str, Any]:
    return {"session_id": sid, "started_at": started, "store": store}


def test_snapshot_of_nothing_yet(tmp_path: Path) -> None:
    got = snap.snapshot(tmp_path)
    assert got == {
        "kind": None, "path": str(tmp_path), "runs": [], "totals": {"stages": {}, "statuses": {}}, "loop": None,
        "sessions": [], "harnesses": {}, "engine": None,
        "problems": [f"{tmp_path} is no store (calls/, sessions/), rollout report directory (rollout-manifest.json) "
                     "or loop directory (loop.json)"],
    }  # fmt: skip


def test_snapshot_merges_stores_newest_first_up_to_the_limit(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    loop = make(tmp_path / "loop", "loop.json", "iter-000/shards/calls/", "iter-001/shards/calls/")
    aged(loop / "iter-001", 10)
    a, b = str(loop / "iter-000" / "shards"), str(loop / "iter-001" / "shards")
    views = {
        a: snap.StoreView(sessions=[session_row("a1", 5.0, a), session_row("a2", None, a)], calls=1, latencies=[2.0]),
        b: snap.StoreView(sessions=[session_row("b1", 7.0, b), session_row("b2", 0.5, b)], calls=1, latencies=[4.0]),
    }
    monkeypatch.setattr(snap, "read_store", lambda store: views[store])
    monkeypatch.setattr(snap, "MAX_SESSIONS", 3)
    board = snap.Snapshotter(loop)
    got = board.snapshot()
    assert [s["session_id"] for s in got["sessions"]] == ["b1", "a1", "b2"]
    assert board.session_stores == {"b1": b, "a1": a, "b2": b}
    assert got["kind"] == "loop" and got["loop"] == {"iterations": [], "evals": []} and got["problems"] == []
    assert got["path"] == str(loop)
    assert [r["name"] for r in got["runs"]] == ["iter-001", "iter-000"]
    assert got["engine"]["calls"] == 2 and got["engine"]["latency_p50_s"] == 2.0 and got["harnesses"] == {}
    store = make(tmp_path / "store", "calls/")
    monkeypatch.setattr(snap, "read_store", lambda s: snap.StoreView())
    assert snap.snapshot(store)["loop"] is None


def test_a_store_that_fails_to_read_keeps_its_last_view_and_says_why(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    store = make(tmp_path / "store", "calls/1.parquet")
    reads: list[str] = []
    good = snap.StoreView(sessions=[session_row("s1", 1.0, str(store))], calls=1)

    def read(path: str) -> snap.StoreView:
        reads.append(path)
        if len(reads) > 1:
            raise ValueError("a shard half replaced")
        return good

    monkeypatch.setattr(snap, "read_store", read)
    board = snap.Snapshotter(store)
    assert board._view(store) == (good, None)
    assert board._view(store) == (good, None) and reads == [str(store)]  # unchanged: not read again
    (store / "calls" / "2.parquet").write_text("x")
    assert board._view(store) == (good, f"{store}: a shard half replaced")
    got = board.snapshot()
    assert got["problems"] == [f"{store}: a shard half replaced"] and got["sessions"][0]["session_id"] == "s1"
    fresh = snap.Snapshotter(store)
    monkeypatch.setattr(snap, "read_store", lambda path: (_ for _ in ()).throw(OSError("gone")))
    assert fresh._view(store) == (None, f"{store}: gone")
    assert fresh.snapshot()["engine"] is None


# -- the server ------------------------------------------------------------------------------------------------------

COMMON = {"x-content-type-options": "nosniff", "referrer-policy": "no-referrer", "cache-control": "no-store"}


@pytest.fixture
def board_dir(tmp_path: Path) -> Path:
    store = make(tmp_path / "store", "calls/")
    write(store / "rollouts" / "r1" / PROGRESS_FILE, {"total": 2, "statuses": {"completed": 1}})
    return store


@pytest.fixture
def client(board_dir: Path, monkeypatch: pytest.MonkeyPatch) -> TestClient:
    monkeypatch.setattr(snap, "read_store", lambda s: snap.StoreView(sessions=[session_row("s-1", 1.0, s)]))
    with TestClient(create_app(board_dir, poll_s=0.01, max_events=1), base_url="http://127.0.0.1:8321") as c:
        yield c


def headers_of(response: Any) -> dict[str, str]:
    return {k: response.headers.get(k) for k in COMMON}


@pytest.mark.parametrize("name", STATIC)
def test_each_static_file_is_served_whole_with_its_type_and_policy(name: str, client: TestClient) -> None:
    got = client.get(f"/static/{name}")
    assert got.status_code == 200 and got.content == server._static(name)
    assert got.content == (Path(server.__file__).parent / "static" / name).read_bytes()
    kind = {".html": "text/html; charset=utf-8", ".js": "text/javascript; charset=utf-8", ".css": "text/css"}
    assert got.headers["content-type"].split(";")[0] == kind[Path(name).suffix].split(";")[0]
    assert got.headers["content-security-policy"] == PAGE_CSP and headers_of(got) == COMMON


def test_the_root_is_the_page(client: TestClient) -> None:
    got = client.get("/")
    assert got.content == server._static("dashboard.html") and got.headers["content-type"] == "text/html; charset=utf-8"
    assert client.get("/static/dashboard.js").headers["content-type"] == "text/javascript; charset=utf-8"


@pytest.mark.parametrize(
    "path",
    [
        "/static/snapshot.py",
        "/static/..%2Fsnapshot.py",
        "/static/..%2F..%2Fserver.py",
        "/static/%2e%2e%2fserver.py",
        "/static/__init__.py",
        "/static/dashboard.HTML",
        "/static/dashboard.html%00",
        "/static/.%2Fdashboard.html",
        "/static/%2Fetc%2Fpasswd",
        "/static/",
    ],
)
def test_nothing_outside_the_allowlist_is_served(path: str, client: TestClient) -> None:
    got = client.get(path)
    assert got.status_code == 404
    assert got.text in ("not found", "Not Found") and "import" not in got.text and "root:" not in got.text


def test_a_name_not_in_the_allowlist_is_not_found_with_the_safe_headers(board_dir: Path) -> None:
    board = Dashboard(board_dir)
    for name in ("../server.py", "dashboard.js/../../server.py", "/etc/passwd", "dashboard"):
        got = asyncio.run(board.page(SimpleNamespace(path_params={"name": name})))  # type: ignore[arg-type]
        assert (got.status_code, got.body) == (404, b"not found")
        assert got.headers["content-type"].startswith("text/plain") and headers_of(got) == COMMON


def test_the_app_answers_only_its_routes_with_get(board_dir: Path) -> None:
    app = create_app(board_dir, poll_s=0.25, max_events=3)
    board = app.state.dashboard
    assert (board.path, board.poll_s, board.max_events) == (board_dir, 0.25, 3)
    routes = {r.path: r.methods for r in app.routes}
    assert routes == {p: {"GET", "HEAD"} for p in ("/", "/static/{name}", "/api/snapshot", "/events",
                                                   "/session/{session_id:path}")}  # fmt: skip
    default = create_app(board_dir).state.dashboard
    assert (default.poll_s, default.max_events) == (1.0, None)


def test_the_snapshot_api_is_json_without_nan_and_with_the_safe_headers(client: TestClient, board_dir: Path) -> None:
    got = client.get("/api/snapshot")
    assert got.headers["content-type"] == "application/json" and headers_of(got) == COMMON
    assert got.json() == snap.snapshot(board_dir) | {"sessions": got.json()["sessions"]}
    assert server._json({"a": float("nan"), 1: float("inf"), "t": "x\ny"}) == b'{"a":null,"1":null,"t":"x\\ny"}'


def test_nothing_secret_is_served(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A report directory's manifest and a store's session rows hold what the agent never sees (the rollout's
    control token, the session keys): the snapshot takes none of it."""
    secret = "polar-sk-" + "s" * 24
    store = make(tmp_path / "store", "calls/")
    write(store / "rollouts" / "r1" / "rollout-manifest.json",
          {"store": str(store), "control_token": secret, "sessions": [{"key": secret}]})  # fmt: skip
    monkeypatch.setattr(snap, "read_store", lambda s: snap.StoreView())
    with TestClient(create_app(store, max_events=1), base_url="http://localhost:8321") as c:
        for path in ("/api/snapshot", "/events", "/", "/static/dashboard.js"):
            assert secret not in c.get(path).text, path


# -- the event stream ------------------------------------------------------------------------------------------------


class FakeRequest:
    def __init__(self, connected_for: int) -> None:
        self.left = connected_for

    async def is_disconnected(self) -> bool:
        self.left -= 1
        return self.left < 0


def collect(board: Dashboard, request: Any, monkeypatch: pytest.MonkeyPatch, prints: list[Any]) -> list[Any]:
    """The stream's chunks and its polls' sleeps (their seconds), in the order they came, with the directory's
    fingerprint taken from ``prints`` in turn and no real sleeps."""
    log: list[Any] = []
    real_sleep = asyncio.sleep

    async def sleep(seconds: float) -> None:
        log.append(seconds)
        await real_sleep(0)

    monkeypatch.setattr(server.asyncio, "sleep", sleep)
    monkeypatch.setattr(server, "fingerprint", lambda path: prints.pop(0) if len(prints) > 1 else prints[0])

    async def snapshot(now: Any = None) -> dict[str, Any]:
        return {"now": now}

    board.snapshot = snapshot  # type: ignore[method-assign]

    async def run() -> None:
        async for chunk in board._stream(request):
            log.append(chunk)

    asyncio.run(run())
    return log


def test_the_stream_sends_each_change_once_and_keeps_the_connection_alive(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(server, "KEEPALIVE_S", 3.0)
    board = Dashboard(tmp_path, poll_s=1.0)
    log = collect(board, FakeRequest(connected_for=7), monkeypatch, [1, 1, 2, 2, 2, 2, 2, 2, 2, 2])
    keepalive = b": keepalive\n\n"
    assert log == [
        b"retry: 2000\n\n",
        b'event: snapshot\ndata: {"now":1}\n\n',
        1.0,
        b'event: snapshot\ndata: {"now":2}\n\n',  # a change: sent at once, and the quiet starts again
        *[1.0, 1.0, 1.0],
        keepalive,  # after exactly KEEPALIVE_S of quiet
        *[1.0, 1.0, 1.0],
        keepalive,  # the page went away after it: the stream ends
    ]


def test_the_stream_ends_after_max_events_or_on_shutdown(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    board = Dashboard(tmp_path, poll_s=0.5, max_events=2)
    chunks = collect(board, FakeRequest(connected_for=100), monkeypatch, [1, 2, 3, 4])
    assert chunks == [
        b"retry: 2000\n\n",
        b'event: snapshot\ndata: {"now":1}\n\n',
        b'event: snapshot\ndata: {"now":2}\n\n',
    ]
    closing = Dashboard(tmp_path, poll_s=0.5)
    closing.close_streams()
    assert closing.closing is True
    assert collect(closing, FakeRequest(connected_for=100), monkeypatch, [1]) == [b"retry: 2000\n\n"]
    assert Dashboard(tmp_path).closing is False


def test_the_events_response_streams_for_the_request_it_answers(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    board = Dashboard(tmp_path, poll_s=0.5)
    monkeypatch.setattr(server, "fingerprint", lambda path: ("same",))

    async def snapshot(now: Any = None) -> dict[str, Any]:
        return {}

    board.snapshot = snapshot  # type: ignore[method-assign]

    async def run() -> list[bytes]:
        response = await board.events(FakeRequest(connected_for=0))  # type: ignore[arg-type]
        return [chunk async for chunk in response.body_iterator]

    # Nothing changed after the first snapshot and the page has gone: the stream ends.
    assert asyncio.run(run()) == [b"retry: 2000\n\n", b"event: snapshot\ndata: {}\n\n"]


def test_the_events_route_is_an_unbuffered_event_stream(client: TestClient) -> None:
    with client.stream("GET", "/events") as stream:
        assert stream.headers["content-type"].startswith("text/event-stream")
        assert stream.headers["x-accel-buffering"] == "no" and headers_of(stream) == COMMON
        text = "".join(stream.iter_text())
    assert text.startswith("retry: 2000\n\nevent: snapshot\ndata: {")


def test_one_snapshot_per_change_for_every_caller(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    board = Dashboard(tmp_path)
    made: list[int] = []
    monkeypatch.setattr(board.snapshots, "snapshot", lambda: made.append(1) or {"n": len(made)})
    prints = iter([("a",), ("a",), ("b",)])
    monkeypatch.setattr(server, "fingerprint", lambda path: next(prints))

    async def run() -> list[Any]:
        return [await board.snapshot(), await board.snapshot(), await board.snapshot(), await board.snapshot(("b",))]

    assert asyncio.run(run()) == [{"n": 1}, {"n": 1}, {"n": 2}, {"n": 2}]


# -- the session page ------------------------------------------------------------------------------------------------


def test_trace_csp_allows_exactly_the_pages_scripts() -> None:
    def digest(body: str) -> str:
        return base64.b64encode(hashlib.sha256(body.encode()).digest()).decode()

    markup = "<p>x</p><script>let a = 1;</script><b></b><script>\nrun()\n</script>"
    tail = "style-src 'unsafe-inline'; img-src data:; base-uri 'none'; form-action 'none'; frame-ancestors 'none'"
    hashes = f"'sha256-{digest('let a = 1;')}' 'sha256-{digest(chr(10) + 'run()' + chr(10))}'"
    assert server._trace_csp(markup) == f"default-src 'none'; script-src {hashes}; {tail}"
    assert server._trace_csp("<p>no script</p>") == f"default-src 'none'; script-src 'none'; {tail}"


@pytest.fixture
def pages(monkeypatch: pytest.MonkeyPatch) -> SimpleNamespace:
    import polar_cli.build.inputs as inputs
    import polar_cli.build_cmd as build_cmd

    seen = SimpleNamespace(tokenizers=[], pages=[], page="<html><script>go()</script></html>")

    def find_tokenizer(given: Any, store: str) -> tuple[Any, str]:
        seen.tokenizers.append(store)
        if store.endswith("broken"):
            raise inputs.NoTokenizerThere("none here")
        return (f"tok:{store}", "found")

    def session_page(store: str, session_id: str, tokenizer: Any) -> tuple[str, int, int] | None:
        seen.pages.append((store, session_id, tokenizer))
        return None if session_id == "empty" else (seen.page, 1, 1)

    monkeypatch.setattr(inputs, "find_tokenizer", find_tokenizer)
    monkeypatch.setattr(build_cmd, "session_page", session_page)
    return seen


def test_a_session_page_is_built_from_its_store_with_one_tokenizer_load(
    tmp_path: Path, pages: SimpleNamespace, monkeypatch: pytest.MonkeyPatch
) -> None:
    board = Dashboard(tmp_path)
    board.snapshots.session_stores = {"s/1": "/st/a", "s2": "/st/a", "empty": "/st/a", "b": "/st/broken"}

    def get(session_id: str) -> Any:
        return asyncio.run(board.session(SimpleNamespace(path_params={"session_id": session_id})))  # type: ignore[arg-type]

    page = get("s/1")
    assert page.status_code == 200 and page.body == pages.page.encode()
    assert page.headers["content-security-policy"] == server._trace_csp(pages.page) and headers_of(page) == COMMON
    assert page.headers["content-type"] == "text/html; charset=utf-8"
    get("s2")
    assert pages.tokenizers == ["/st/a"] and pages.pages == [
        ("/st/a", "s/1", "tok:/st/a"),
        ("/st/a", "s2", "tok:/st/a"),
    ]
    empty = get("empty")
    assert (empty.status_code, empty.body) == (404, b"no calls stored yet for session empty")
    assert empty.headers["content-type"].startswith("text/plain") and headers_of(empty) == COMMON
    assert get("b").status_code == 200 and pages.pages[-1] == ("/st/broken", "b", None)


def test_the_session_route_serves_the_page_of_a_session_id_with_slashes(
    client: TestClient, pages: SimpleNamespace, board_dir: Path
) -> None:
    client.get("/api/snapshot")  # the snapshot that places session s-1 in its store
    got = client.get("/session/s-1")
    assert got.status_code == 200 and got.text == pages.page
    assert pages.pages == [(str(board_dir), "s-1", f"tok:{board_dir}")]
    missing = client.get("/session/a/b")
    assert missing.status_code == 404 and missing.text == f"no session 'a/b' in {board_dir}"


def test_a_session_not_in_the_last_snapshot_is_looked_up_again(
    tmp_path: Path, pages: SimpleNamespace, monkeypatch: pytest.MonkeyPatch
) -> None:
    board = Dashboard(tmp_path)
    snapshots: list[int] = []

    async def snapshot(now: Any = None) -> dict[str, Any]:
        snapshots.append(1)
        board.snapshots.session_stores = {"new": "/st/n"}
        return {}

    board.snapshot = snapshot  # type: ignore[method-assign]

    def get(session_id: str) -> Any:
        return asyncio.run(board.session(SimpleNamespace(path_params={"session_id": session_id})))  # type: ignore[arg-type]

    assert get("new").status_code == 200 and snapshots == [1]
    assert get("new").status_code == 200 and snapshots == [1]
    hostile = "<script>x</script>'"
    missing = get(hostile)
    assert missing.status_code == 404 and snapshots == [1, 1]
    assert missing.body.decode() == f"no session {hostile!r} in {tmp_path}"
    assert missing.headers["content-type"].startswith("text/plain") and headers_of(missing) == COMMON
