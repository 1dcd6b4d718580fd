"""`polar loop --async`'s decisions as plain functions, at their boundaries: which calls' versions bound a group's
staleness, which groups a trainer may learn from, the busy fractions of a resumed run, and a batch's record. The
loops themselves run in test_async_loop.py."""

from __future__ import annotations

from pathlib import Path

import pytest

from polar_addon.store.status import SessionStatus
from polar_cli.rollout.async_loop import _batch_of, busy_fraction, busy_within, oldest_version, select_groups
from polar_cli.rollout.runner import RolloutResult
from polar_cli.rollout.session import SessionResult


@pytest.mark.parametrize(
    ("tags", "oldest"),
    [
        (["3"], 3),
        (["5", "2", "9"], 2),
        (["-1", "0"], -1),
        (["10", "9"], 9),  # numbers, not strings: "10" < "9" as text
        ([], None),
        (["3", None], None),
        (["3", "v2"], None),
        (["1.5"], None),
        ([""], None),
        (["X5"], None),  # only a minus sign may lead
    ],
)
def test_oldest_version(tags: list[str | None], oldest: int | None) -> None:
    assert oldest_version(tags) == oldest


def test_staleness_exactly_at_the_bound_is_kept_and_one_past_it_dropped() -> None:
    versions = {"at": ["3", "5"], "past": ["2", "5"], "now": ["5"]}
    chosen = select_groups(versions, current=5, max_staleness=2)
    assert chosen.kept == ["at", "now"]
    assert chosen.stale == {"past": 3}
    assert chosen.untagged == []
    zero = select_groups({"g": ["0"]}, current=0, max_staleness=0)
    assert (zero.kept, zero.stale, zero.untagged) == (["g"], {}, [])


def test_a_group_newer_than_the_trainer_names_its_version() -> None:
    with pytest.raises(ValueError, match=r"group 'g' was sampled by version 4, newer than 3"):
        select_groups({"g": ["4", "5"]}, current=3, max_staleness=1)


def test_groups_come_out_in_a_stable_order() -> None:
    chosen = select_groups({"b": ["1"], "a": ["1"], "c": ["1"]}, current=1, max_staleness=0)
    assert chosen.kept == ["a", "b", "c"]


def test_an_untagged_group_does_not_end_the_selection() -> None:
    chosen = select_groups({"a": [None], "b": ["1"], "c": ["0"]}, current=1, max_staleness=0)
    assert (chosen.kept, chosen.stale, chosen.untagged) == (["b"], {"c": 1}, ["a"])


def test_a_negative_bound_is_refused_in_those_words() -> None:
    with pytest.raises(ValueError, match=r"^max staleness must be 0 or more$"):
        select_groups({}, current=0, max_staleness=-1)


def test_busy_fraction_edges() -> None:
    assert busy_fraction([(0, 10)], 0, 10) == 1.0
    assert busy_fraction([(0, 3), (3, 5)], 0, 10) == pytest.approx(0.5)  # touching intervals
    assert busy_fraction([(0, 5), (1, 2)], 0, 10) == pytest.approx(0.5)  # one inside another counts once
    assert busy_fraction([(2, 4), (0, 1)], 0, 10) == pytest.approx(0.3)  # any order
    assert busy_fraction([(10, 12), (-3, 0)], 0, 10) == 0.0  # only touching the window
    assert busy_fraction([(1, 2)], 5, 4) == 0.0  # an empty window


def test_busy_within_counts_only_the_runs_of_a_resumed_loop() -> None:
    # Two runs, [0, 10] and [20, 30]; the gap between them is nobody's idle time.
    windows = [(0.0, 10.0), (20.0, 30.0)]
    assert busy_within([(0, 10)], windows, 0, 30) == pytest.approx(0.5)
    assert busy_within([(0, 5), (20, 30)], windows, 0, 30) == pytest.approx(0.75)
    assert busy_within([(10, 20)], windows, 0, 30) == 0.0  # busy only between the runs
    # The measuring window clips the runs: [5, 10] and [20, 25] (10 s), busy [5, 10].
    assert busy_within([(0, 10)], windows, 5, 25) == pytest.approx(0.5)
    assert busy_within([(0, 10)], [], 0, 30) == 0.0
    assert busy_within([(0, 10)], [(40.0, 50.0)], 0, 30) == 0.0  # no run inside the window
    assert busy_within([(0, 0.25)], [(0.0, 0.5)], 0, 1) == pytest.approx(0.5)  # a run shorter than a second


def test_a_batch_record_holds_the_rewarded_sessions_mean_and_se(tmp_path: Path) -> None:
    S = SessionStatus
    sessions = [
        SessionResult("s1", "t", "g", 0, S.COMPLETED, reward=1.0),
        SessionResult("s2", "t", "g", 1, S.FAILED, reward=0.0),
        SessionResult("s3", "t", "g", 2, S.TIMEOUT, reward=1.0),  # no outcome reward: not in the mean
        SessionResult("s4", "t", "g", 3, S.COMPLETED, reward=None),
        SessionResult("s5", "t", "g", 4, S.ERROR, reward=1.0),
    ]
    result = RolloutResult("r", sessions, 0.0, 1.0, store=None)
    batch = _batch_of(3, 2, tmp_path / "ckpt", tmp_path / "shards", 10.0, 20.0, result, cut=True)
    assert (batch.index, batch.version, batch.policy, batch.shards) == (
        3, 2, str(tmp_path / "ckpt"), str(tmp_path / "shards"),
    )  # fmt: skip
    assert (batch.started_at, batch.ended_at, batch.sessions, batch.rewarded, batch.cut) == (10.0, 20.0, 5, 2, True)
    assert batch.reward_mean == pytest.approx(0.5)
    assert batch.reward_se == pytest.approx(0.5)  # stdev([1, 0]) / sqrt(2)
    assert batch.statuses == result.counts()
    empty = _batch_of(0, 0, tmp_path, tmp_path, 0.0, 0.0, RolloutResult("r", [], 0.0, 0.0, None), cut=False)
    assert (empty.reward_mean, empty.reward_se, empty.rewarded, empty.cut) == (None, None, 0, False)
