"""``rollout-progress.json`` (polar_cli.rollout.progress_file): what it holds, its whole and redacted writes, the
writer thread's pace and retries, and the last write's ``final``. No rollout: counters set by hand."""

from __future__ import annotations

import json
import os
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

import polar_cli.rollout.progress_file as progress_module
from polar_addon.store.status import SessionStatus
from polar_cli.rollout.progress_file import (
    PROGRESS_FILE,
    progress_config,
    progress_document,
    progress_file,
    write_progress,
)
from polar_cli.rollout.session import RolloutProgress

SECRET = "tok-" + "s" * 28


def _progress() -> RolloutProgress:
    progress = RolloutProgress(total=5, started_at=time.time() - 120, ran=3)
    progress.stages.update({"done": 4, "run": 1})
    progress.statuses.update({SessionStatus.COMPLETED: 3, SessionStatus.ERROR: 1})
    progress.group_rewards.update({"g1": [1.0, 0.0], "g2": []})
    progress.errors.append(("s9", "harness exited 1"))
    progress.nodes.update({"node-a": 2})
    return progress


def test_the_document_holds_every_counter_as_plain_json(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(progress_module, "time", SimpleNamespace(time=lambda: 1234.5))
    progress = _progress()
    document = progress_document(progress, final=True)
    per_minute = document.pop("sessions_per_minute")
    assert document == {
        "total": 5,
        "stages": {"done": 4, "run": 1},
        "statuses": {"completed": 3, "error": 1},
        "group_rewards": {"g1": [1.0, 0.0], "g2": []},
        "errors": [["s9", "harness exited 1"]],
        "started_at": progress.started_at,
        "ran": 3,
        "nodes": {"node-a": 2},
        "updated_at": 1234.5,
        "final": True,
    }
    assert per_minute == pytest.approx(2.0, rel=0.05)  # 4 done in two minutes
    assert progress_document(progress, final=False)["final"] is False
    # Plain types (a Counter, a deque, an enum key would not survive json or would alias the live counters).
    assert type(document["stages"]) is dict and type(document["nodes"]) is dict
    assert all(type(k) is str for k in document["statuses"])
    assert document["group_rewards"]["g1"] is not progress.group_rewards["g1"]
    json.dumps(document)


def test_a_write_is_whole_redacted_and_leaves_no_temporary_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    progress = _progress()
    progress.errors.append(("s10", f"the agent printed {SECRET}"))
    renames: list[tuple[Path, Path]] = []
    real_replace = os.replace

    def replace(src: Any, dst: Any) -> None:
        renames.append((Path(src), Path(dst)))
        assert Path(src).is_file() and not Path(dst).exists()  # written aside, then renamed over
        real_replace(src, dst)

    monkeypatch.setattr(progress_module.os, "replace", replace)
    write_progress(tmp_path, progress, [SECRET, None], final=False)
    path = tmp_path / PROGRESS_FILE
    text = path.read_text()
    assert SECRET not in text and "the agent printed" in text
    assert json.loads(text)["errors"][-1][0] == "s10" and json.loads(text)["final"] is False
    [(src, dst)] = renames
    # A hidden temporary in the same directory (the rename stays on one filesystem), one per writing process.
    assert dst == path and src.parent == tmp_path and src.name.startswith(".") and str(os.getpid()) in src.name
    assert [p.name for p in tmp_path.iterdir()] == [PROGRESS_FILE]
    assert PROGRESS_FILE == "rollout-progress.json"


class _Event:
    """threading.Event that records each wait's timeout and lets the writer loop run a set number of times."""

    def __init__(self) -> None:
        self.waits: list[float] = []
        self._real = threading.Event()
        self.rounds = 3

    def wait(self, timeout: float) -> bool:
        self.waits.append(timeout)
        if len(self.waits) > self.rounds:
            return self._real.wait()
        return self._real.is_set()

    def set(self) -> None:
        self._real.set()


@dataclass
class _Spy:
    events: list[_Event]
    threads: list[threading.Thread]


@pytest.fixture
def spy(monkeypatch: pytest.MonkeyPatch) -> _Spy:
    spy = _Spy([], [])

    def event() -> _Event:
        spy.events.append(_Event())
        return spy.events[-1]

    def thread(**kwargs: Any) -> threading.Thread:
        spy.threads.append(threading.Thread(**kwargs))
        return spy.threads[-1]

    monkeypatch.setattr(progress_module, "threading", SimpleNamespace(Event=event, Thread=thread))
    return spy


def test_the_writer_thread_rewrites_every_half_second_and_a_last_final_write_follows(tmp_path: Path, spy: _Spy) -> None:
    progress = RolloutProgress(total=1)
    asked: list[str] = []

    def known() -> list[str]:
        asked.append(threading.current_thread().name)
        return [SECRET]

    report = tmp_path / "a" / "b"  # made, parents too
    with progress_file(report, progress, known):
        assert json.loads((report / PROGRESS_FILE).read_text())["final"] is False  # written before the block
        deadline = time.monotonic() + 10
        while len(asked) < 4 and time.monotonic() < deadline:
            time.sleep(0.01)
        progress.stages["done"] = 1
    [event] = spy.events
    [thread] = spy.threads
    assert event.waits[:4] == [0.5, 0.5, 0.5, 0.5] and progress_module.INTERVAL_S == 0.5
    assert thread.name == "rollout-progress" and thread.daemon and not thread.is_alive()
    # The first write is the caller's, three from the thread, then the last one (the caller's again).
    assert asked == ["MainThread", "rollout-progress", "rollout-progress", "rollout-progress", "MainThread"]
    document = json.loads((report / PROGRESS_FILE).read_text())
    assert document["final"] is True and document["stages"] == {"done": 1}


@pytest.mark.parametrize("error", [OSError("disk full"), RuntimeError("deque mutated"), ValueError("x")])
def test_a_failed_write_in_the_thread_is_tried_again(tmp_path: Path, spy: _Spy, error: Exception) -> None:
    calls: list[bool] = []

    def known() -> list[str]:
        calls.append(True)
        if len(calls) == 2:  # the thread's first write
            raise error
        return []

    with progress_file(tmp_path, RolloutProgress(), known):
        deadline = time.monotonic() + 10
        while len(calls) < 4 and time.monotonic() < deadline:
            time.sleep(0.01)
    assert len(calls) == 5  # the failed write did not stop the thread: two more, then the final one
    assert json.loads((tmp_path / PROGRESS_FILE).read_text())["final"] is True


def test_the_last_write_waits_for_a_write_the_thread_is_still_making(tmp_path: Path, spy: _Spy) -> None:
    def known() -> list[str]:
        if threading.current_thread().name == "rollout-progress":
            # A slow write still under way when the block ends: it must not land after the final one.
            spy.events[0]._real.wait(5)
            time.sleep(0.1)
        return []

    with progress_file(tmp_path, RolloutProgress(), known):
        deadline = time.monotonic() + 5
        while not spy.events[0].waits and time.monotonic() < deadline:
            time.sleep(0.01)
    assert json.loads((tmp_path / PROGRESS_FILE).read_text())["final"] is True


def test_the_last_write_happens_when_the_block_raises(tmp_path: Path) -> None:
    progress = RolloutProgress(total=3)
    with pytest.raises(KeyError), progress_file(tmp_path, progress):
        progress.stages["done"] = 2
        raise KeyError("the rollout failed")
    document = json.loads((tmp_path / PROGRESS_FILE).read_text())
    assert document["final"] is True and document["stages"] == {"done": 2}


@dataclass(frozen=True)
class _Config:
    name: str
    progress: RolloutProgress | None = None


def test_progress_config_gives_the_config_fresh_counters_that_the_file_follows(tmp_path: Path) -> None:
    old = RolloutProgress(total=99)
    config = _Config("c", progress=old)
    with progress_config(tmp_path, config, lambda: [SECRET]) as given:
        assert given.name == "c" and given.progress is not old and isinstance(given.progress, RolloutProgress)
        given.progress.total = 7
        given.progress.errors.append(("s1", f"leaked {SECRET}"))
    text = (tmp_path / PROGRESS_FILE).read_text()
    assert json.loads(text)["total"] == 7 and json.loads(text)["final"] is True
    assert SECRET not in text and config.progress is old
