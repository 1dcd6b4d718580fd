"""`polar build` / `polar stats` on a real trace store, read back with `datasets` as a trainer would."""

from __future__ import annotations

import asyncio
from pathlib import Path

import datasets
import orjson
import pytest
from build_helpers import (
    QWEN3_STYLE_TEMPLATE,
    AgentSim,
    Turn,
    check_trace,
    coding_turns,
    decode,
    tiny_tokenizer,
    tool_loop,
)
from typer.testing import CliRunner

from polar_addon.store import TraceStore, read_records, read_sessions
from polar_cli.app import app
from polar_cli.build import build_traces
from polar_cli.build.inputs import session_info
from polar_cli.build.output import read_build_stats, read_traces

SYSTEM = {"role": "system", "content": "You are a coding agent."}
runner = CliRunner()


def _sessions() -> list[AgentSim]:
    sims = []
    for i, (harness, template) in enumerate(
        [
            ("claude-cli/2.1.197 (external, cli)", None),
            ("codex_exec/0.171.0", None),
            ("claude-cli/2.1.197", QWEN3_STYLE_TEMPLATE),
        ]
    ):
        sim = AgentSim(f"sess-{i}", harness=harness, **({"template": template} if template else {}))
        messages = tool_loop(sim, [SYSTEM, {"role": "user", "content": f"task {i}"}], coding_turns(4, reasoning=i == 2))
        if i == 2:  # a second user turn: the Qwen3-style template re-renders earlier thinking
            tool_loop(sim, messages + [{"role": "user", "content": "and the docs"}], coding_turns(2, reasoning=True))
        if i == 1:  # a call that failed at the engine
            sim.call(messages, Turn(content="x"), status="failed")
        sims.append(sim)
    return sims


@pytest.fixture(scope="module")
def store(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[AgentSim]]:
    root = tmp_path_factory.mktemp("store")
    sims = _sessions()

    async def write() -> None:
        async with TraceStore(str(root), shard_max_records=5) as trace_store:
            for sim in sims:
                for record in sim.records:
                    await trace_store.append(record)
            await trace_store.session_update("sess-0", status="completed", task_id="t0", group_id="g0", sample_index=0)
            await trace_store.add_reward("sess-0", 1.0)
            await trace_store.session_update("sess-1", status="timeout", task_id="t0", group_id="g0", sample_index=1)
            await trace_store.session_update("sess-2", status="error")

    asyncio.run(write())
    return root, sims


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("tok")
    tiny_tokenizer().save_pretrained(path)
    return path


def test_build_writes_a_dataset_trl_can_load(store, tokenizer_dir: Path, tmp_path: Path) -> None:
    root, sims = store
    out = tmp_path / "traces"
    result = runner.invoke(
        app, ["build", str(root), "-o", str(out), "--tokenizer", str(tokenizer_dir), "--rows-per-file", "2"]
    )
    assert result.exit_code == 0, result.output
    assert "traces" in result.output

    dataset = datasets.load_dataset("parquet", data_dir=str(out), split="train")
    assert dataset.num_rows == 4  # one chain each for sess-0 and sess-1, two for sess-2
    traces = read_traces(out)
    assert [t.trace_id for t in traces] == dataset["trace_id"]

    by_session = {t.session_id: t for t in traces if t.chain_index == 0}
    assert (by_session["sess-0"].reward, by_session["sess-0"].trainable, by_session["sess-0"].group_id) == (
        1.0,
        True,
        "g0",
    )
    assert (by_session["sess-1"].reward, by_session["sess-1"].trainable, by_session["sess-1"].status) == (
        0.0,
        True,
        "timeout",
    )
    sess2 = [t for t in traces if t.session_id == "sess-2"]
    # infrastructure failure: not for RL, but the mask still marks the sampled tokens (issue 10 #8)
    assert all(not t.trainable and sum(t.loss_mask) > 0 for t in sess2)
    assert sess2[0].break_cause == "template_rerender"

    records = {r.record_id: r for sim in sims for r in sim.records}
    for trace in traces:
        check_trace(trace, records)
    # Same traces as the pure builder over the store's own reader output.
    stored = read_records(str(root))
    sessions = {s.session_id: session_info(s) for s in read_sessions(str(root))}
    direct = build_traces(stored, sessions, decode=decode)
    assert len(direct.traces) == len(traces)
    for a, b in zip(direct.traces, traces):
        da, db = a.to_dict(), b.to_dict()
        la, lb = da.pop("behavior_logprobs"), db.pop("behavior_logprobs")
        assert da == db
        assert la == pytest.approx(lb, abs=1e-6)  # stored as float32

    stats = read_build_stats(out)
    assert stats["strategy"] == "prefix_merging" and stats["eot_token_id"] == tiny_tokenizer().convert_tokens_to_ids(
        "<|im_end|>"
    )
    assert stats["total"]["calls_unusable"] == {"failed call": 1}
    assert set(stats["by_harness"]) == {"claude-cli", "codex_exec"}
    assert stats["by_harness"]["claude-cli"]["breaks"] == {"template_rerender": 1}


def test_build_refuses_to_overwrite_and_per_request_needs_the_flag(store, tmp_path: Path) -> None:
    root, _ = store
    out = tmp_path / "pr"
    assert runner.invoke(app, ["build", str(root), "-o", str(out), "--strategy", "per_request"]).exit_code == 0
    traces = read_traces(out)
    assert len(traces) == 4 + 4 + 6 and not any(t.trainable for t in traces)
    again = runner.invoke(app, ["build", str(root), "-o", str(out), "--strategy", "per_request"])
    assert again.exit_code != 0 and "exists" in again.output
    result = runner.invoke(
        app, ["build", str(root), "-o", str(out), "--strategy", "per_request", "--broadcast-rewards", "--overwrite"]
    )
    assert result.exit_code == 0, result.output
    traces = read_traces(out)
    assert {(t.session_id, t.reward, t.trainable) for t in traces} == {
        ("sess-0", 1.0, True),
        ("sess-1", 0.0, True),
        ("sess-2", 0.0, False),
    }
    assert runner.invoke(app, ["build", str(root), "-o", str(tmp_path / "x"), "--strategy", "nope"]).exit_code != 0


def test_stats_prints_a_table_per_harness(store, tokenizer_dir: Path) -> None:
    root, _ = store
    result = runner.invoke(app, ["stats", str(root), "--tokenizer", str(tokenizer_dir)])
    assert result.exit_code == 0, result.output
    for text in ("claude-cli", "codex_exec", "total", "merge rate", "template_rerender"):
        assert text in result.output
    as_json = runner.invoke(app, ["stats", str(root), "--tokenizer", str(tokenizer_dir), "--json"])
    data = orjson.loads(as_json.stdout)
    total = data["total"]
    assert (total["sessions"], total["calls"], total["chains_total"], total["chains_truncated"]) == (3, 14, 4, 1)
    assert total["merge_rate"] == pytest.approx(10 / 14)
    # Without a tokenizer the same calls still split the same way here (no re-tokenization in them).
    blind = orjson.loads(runner.invoke(app, ["stats", str(root), "--json"]).stdout)
    assert blind["total"]["breaks"] == total["breaks"]
