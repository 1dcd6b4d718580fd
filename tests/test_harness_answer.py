"""A task scored on what the harness SAYS (its final answer in print mode), through the real Pi CLI: one rollout and
verification of examples/harness_shout (the task set `make demo-harness` learns on), with the scripted engine so
the answer, and so the reward, is known exactly. The learning run itself is `make demo-harness`, not a test.

The trace a trainer gets from each session must hold exactly the tokens the engine sampled, whole: Pi's system
prompt and tools make a prompt of thousands of tokens, which must fit `polar train`'s window without clipping the
completion."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest

from polar_addon.store import read_records
from polar_cli.rollout.runner import RolloutConfig, run_rollout
from polar_cli.rollout.tasks import load_tasks
from polar_cli.train.config import TrainConfig
from polar_cli.train.dataset import clip_to_length, load_traces
from tests.support.proxy import REPO

pytestmark = pytest.mark.harness

TASKS = REPO / "examples" / "harness_shout" / "tasks.jsonl"
ANSWER = "HELLO World"  # 6 capitals of 10 letters


def test_pi_final_answer_is_the_reward(tiny_model_dir: Path, tmp_path: Path) -> None:
    script = tmp_path / "script.json"
    script.write_text(json.dumps({"model_dir": str(tiny_model_dir), "turns": [{"content": ANSWER}]}))
    store = tmp_path / "store"
    config = RolloutConfig(tasks=load_tasks(TASKS, limit=1), harness="pi", samples=2, engine=f"scripted:{script}",
                           out=str(store), confdir=tmp_path / "conf", logs_dir=tmp_path / "logs",
                           work_dir=tmp_path / "work", seed=0, proxy_options={"polar_shard_seconds": "0.2"},
                           runtime="local", trust_agent=True)  # fmt: skip
    result = asyncio.run(run_rollout(config))
    logs = {s.session_id: (tmp_path / "logs" / "sessions" / s.session_id / "harness.log").read_text()
            for s in result.sessions}  # fmt: skip
    assert [(s.status, s.reward) for s in result.sessions] == [("completed", 0.6)] * 2, (
        [s.reason for s in result.sessions],
        logs,
    )
    assert all(f"--- stdout\n{ANSWER}\n" in log for log in logs.values()), logs

    records = {r.record_id: r for r in read_records(str(store))}
    traces = load_traces([store], "prefix_merging", tokenizer=tiny_model_dir)
    assert len(traces) == 2 and {t.reward for t in traces} == {0.6}
    for trace in traces:
        (record,) = [records[i] for i in trace.record_ids]
        assert len(trace.prompt_ids) > 1000  # Pi's own system prompt and tools, whole
        assert trace.prompt_ids == record.prompt_ids
        assert [t for t, m in zip(trace.completion_ids, trace.loss_mask) if m] == record.response_ids
        assert clip_to_length(trace, TrainConfig.max_length)[3] is False  # polar train's default window
