"""train.dataset's newer rules (issue 29 audit): sessions holding only side calls named as such when nothing is left to
train, the token budget of a length bucket at its limit, and the build options reaching the build from a raw store."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

import polar_addon.store
import polar_addon.store.reader
import polar_cli.build
import polar_cli.build.inputs
from polar_cli.trace import Trace
from polar_cli.train.dataset import explain_nothing_to_train, length_buckets, load_traces

SIDE = (
    "sessions hold only auxiliary or discarded calls (titles, classifiers, retries), which are not trained unless "
    "--roles names them (e.g. --roles agent,auxiliary)"
)
UNREWARDED = (
    "sessions have no outcome reward (or no session row): post one with `polar reward STORE --session S --value V`"
)
RUNNING = (
    "sessions still running: post a reward (`polar reward STORE --session S --value V`, which marks the session "
    "completed) or a status (`--status completed|timeout|agent_error|error`)"
)


def untrainable(session: str, role: str | None, status: str = "completed") -> Trace:
    return Trace(
        trace_id=f"{session}-{role}",
        session_id=session,
        group_id="g",
        prompt_ids=[1],
        completion_ids=[2],
        loss_mask=[1],
        behavior_logprobs=[-0.1],
        reward=0.0,
        trainable=False,
        status=status,
        role=role,
    )


def test_completed_sessions_of_side_calls_alone_are_named_apart_from_the_unrewarded_ones() -> None:
    traces = [
        untrainable("aux", "auxiliary"),
        untrainable("dis", "discarded"),
        untrainable("both", "auxiliary"),  # also has an agent call: its own reason is the missing reward
        untrainable("both", "agent"),
        untrainable("run", "discarded", status="running"),  # still running: said as running, not as side calls
    ]
    assert explain_nothing_to_train(traces, {}) == f"2 {SIDE}; 1 {RUNNING}; 1 {UNREWARDED}"


def test_a_dataset_built_before_roles_counts_its_calls_as_the_agents() -> None:
    traces = [untrainable("old", None), untrainable("old", "auxiliary")]
    assert explain_nothing_to_train(traces, {}) == f"1 {UNREWARDED}"
    assert explain_nothing_to_train([untrainable("aux", "auxiliary")], {}) == f"1 {SIDE}"


def test_a_bucket_fills_up_to_exactly_its_token_budget_and_no_further() -> None:
    assert length_buckets([2, 2], max_waste=0.0, max_tokens=4) == [[0, 1]]
    assert length_buckets([2, 2], max_waste=0.0, max_tokens=3) == [[0], [1]]
    assert length_buckets([1, 1], max_waste=0.0, max_tokens=1) == [[0], [1]]  # a budget of one token still binds
    assert length_buckets([1, 1], max_waste=0.0, max_tokens=0) == [[0, 1]]  # 0: no budget
    assert length_buckets([3, 3, 3], max_waste=0.0, max_tokens=6) == [[0, 1], [2]]


def test_a_raw_store_is_built_with_the_trainings_options(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    seen: dict[str, Any] = {}

    def builds(records: Any, sessions: Any, strategy: str, **options: Any) -> list:
        seen.update(options, strategy=strategy, sessions=sessions)
        return []

    monkeypatch.setattr(polar_cli.build, "iter_session_builds", builds)
    monkeypatch.setattr(polar_addon.store.reader, "require_store", lambda uri: None)
    monkeypatch.setattr(polar_addon.store, "iter_records", lambda uri: iter(()))
    monkeypatch.setattr(polar_cli.build.inputs, "find_tokenizer", lambda path, store: (None, None))
    monkeypatch.setattr(polar_cli.build.inputs, "session_infos", lambda store: {"s": "info"})
    traces = load_traces(
        [tmp_path],
        "prefix_merging",
        broadcast_rewards=True,
        eot_token_id=7,
        merge_retokenized=False,
        roles=("agent", "auxiliary"),
        tool_call_reward=0.25,
    )
    assert traces == []
    assert seen == {
        "strategy": "prefix_merging",
        "sessions": {"s": "info"},
        "eot_token_id": 7,
        "decode": None,
        "broadcast_rewards": True,
        "merge_retokenized": False,
        "roles": ("agent", "auxiliary"),
        "tool_call_reward": 0.25,
        "fallback_eot_token_id": None,
    }
