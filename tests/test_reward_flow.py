"""The README's offline flow, literally: capture through a real mitmdump (official openai SDK, tiny model),
`polar reward shards/ --session S --value V`, `polar train shards/`. A reward ends a running session as
completed; `polar reward --status` says how a session ended otherwise; "nothing to train" says why."""

from __future__ import annotations

import json
import os
import ssl
import subprocess
import sys
from pathlib import Path

import httpx
import openai
import pytest

from polar_addon.store import read_sessions
from polar_addon.store.rewards import RewardRecord
from polar_addon.store.sessions import merge_sessions
from polar_cli.trace import Trace
from polar_cli.train.dataset import explain_nothing_to_train
from tests.support.proxy import REPO, run_mitmdump


def polar(*args: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, TRL_EXPERIMENTAL_SILENCE="1")
    return subprocess.run([sys.executable, "-m", "polar_cli.app", *args], cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=600)  # fmt: skip


def _said(result: subprocess.CompletedProcess) -> str:
    return " ".join((result.stdout + result.stderr).split())


def _reward(session: str, value: float) -> RewardRecord:
    return RewardRecord(reward_id=session, session_id=session, name="reward", value=value, source="cli", created_at=2.0)


def test_a_reward_completes_a_running_session_unless_a_status_said_otherwise() -> None:
    updates = [{"session_id": s, "status": "running", "started_at": 1.0} for s in ("a", "b", "c")]
    updates.append({"session_id": "b", "status": "timeout"})
    sessions = {s.session_id: s for s in merge_sessions(updates, [_reward("a", 1.0), _reward("b", 0.5)], [])}
    assert (sessions["a"].status, sessions["b"].status, sessions["c"].status) == ("completed", "timeout", "running")


def test_an_error_status_is_never_overwritten_by_a_later_status() -> None:
    # The proxy ends a session of an engine it took out as error; the runner posts completed (and a reward) after.
    lost = {"error": "engine vllm:a taken out mid-session"}
    updates = [{"session_id": "lost", "status": "running", "started_at": 1.0, "updated_at": 1.0},
               {"session_id": "lost", "status": "error", "ended_at": 2.0, "updated_at": 2.0,
                "metadata_json": json.dumps(lost)},
               {"session_id": "lost", "status": "completed", "ended_at": 3.0, "updated_at": 3.0,
                "metadata_json": json.dumps({"harness": "cmd"})},
               {"session_id": "late", "status": "completed", "updated_at": 1.0},
               {"session_id": "late", "status": "error", "updated_at": 2.0}]  # fmt: skip
    sessions = {s.session_id: s for s in merge_sessions(updates, [_reward("lost", 1.0)], [])}
    assert sessions["lost"].status == "error" and sessions["lost"].rewards == {"reward": 1.0}
    assert sessions["lost"].metadata == {**lost, "harness": "cmd"}  # metadata still merges
    assert sessions["late"].status == "error"


def _trace(session: str, group: str, reward: float, trainable: bool, status: str) -> Trace:
    return Trace(trace_id=session, session_id=session, group_id=group, prompt_ids=[1], completion_ids=[2],
                 loss_mask=[1], behavior_logprobs=[-0.5], reward=reward, trainable=trainable,
                 status=status)  # fmt: skip


def test_nothing_to_train_names_each_reason_with_counts() -> None:
    traces = [_trace("r1", "g0", 0.0, False, "running"), _trace("r2", "g0", 0.0, False, "running"),
              _trace("e1", "g0", 0.0, False, "error"), _trace("n1", "g0", 0.0, False, "completed"),
              _trace("a", "g1", 1.0, True, "completed"), _trace("b", "g1", 1.0, True, "completed")]  # fmt: skip
    said = explain_nothing_to_train(traces, {"zero_advantage": 2})
    assert "2 sessions still running: post a reward" in said
    assert "1 sessions ended in an infrastructure error" in said
    assert "1 sessions have no outcome reward" in said
    assert "2 traces in 1 groups have zero advantage: all sessions of the group got the same reward" in said
    assert "GRPO needs several sessions per group" in said
    assert "--broadcast-rewards" in explain_nothing_to_train(traces[3:4], {}, unrewarded_per_request=True)


def test_readme_offline_flow_trains(tiny_model_dir: Path, tmp_path: Path) -> None:
    shards = tmp_path / "shards"
    sessions = ["flow-a", "flow-b", "flow-c"]
    with run_mitmdump(f"local:{tiny_model_dir}", shards, options={"polar_shard_seconds": "0.2"}) as proxy:
        for session in sessions:
            http = httpx.Client(
                proxy=proxy.proxy_url(f"{session}:task=t1;group=g1"),
                verify=ssl.create_default_context(cafile=str(proxy.ca)),
                timeout=120,
            )
            client = openai.OpenAI(api_key="sk-not-a-real-key", http_client=http, max_retries=0)
            client.chat.completions.create(
                model="tiny", messages=[{"role": "user", "content": "Say hi."}], max_tokens=6
            )
    assert {s.session_id: s.status for s in read_sessions(str(shards))} == dict.fromkeys(sessions, "running")

    train = ["train", str(shards), "--model", str(tiny_model_dir), "--max-steps", "1", "--no-progress"]
    before = polar(*train, "--output", str(tmp_path / "none"))
    assert before.returncode == 3, _said(before)
    assert "3 sessions still running: post a reward" in _said(before)

    for session in sessions[:2]:
        rewarded = polar("reward", str(shards), "--session", session, "--value", "1.0")
        assert rewarded.returncode == 0, _said(rewarded)
    ended = polar("reward", str(shards), "--session", "flow-c", "--status", "error")
    assert ended.returncode == 0 and "marked 1 session(s) error" in _said(ended)
    assert {s.session_id: s.status for s in read_sessions(str(shards))} == {
        "flow-a": "completed",
        "flow-b": "completed",
        "flow-c": "error",
    }
    same = polar(*train, "--output", str(tmp_path / "same"))
    assert same.returncode == 3, _said(same)
    assert "1 sessions ended in an infrastructure error" in _said(same)
    assert "in 1 groups have zero advantage: all sessions of the group got the same reward" in _said(same)

    assert polar("reward", str(shards), "--session", "flow-b", "--value", "0.0").returncode == 0
    trained = polar(*train, "--output", str(tmp_path / "ckpt"))
    assert trained.returncode == 0, _said(trained)
    assert (tmp_path / "ckpt" / "model.safetensors").is_file()
    assert "1 groups / 2 sessions" in _said(trained)


@pytest.mark.parametrize("args", [["--session", "x", "--status", "running"], ["--session", "x"]])
def test_reward_refuses_a_status_that_is_no_outcome(tmp_path: Path, args: list[str]) -> None:
    result = polar("reward", str(tmp_path / "shards"), *args, "--allow-unknown")
    assert result.returncode == 2, _said(result)
