"""Token continuity end to end: a real mitmdump, the official openai and anthropic SDKs, multi-turn tool-using
sessions on the scripted engine with Qwen3's template (which drops earlier think blocks at a new user turn, and
which Chat Completions clients' dropped reasoning re-renders differently on every turn).

With polar_tito on every linear session builds into one trace whose trained tokens are exactly the sampled ids, at
the prompts the engine reported; with it off the same sessions split or merge re-tokenized turns off-policy."""

from __future__ import annotations

from pathlib import Path

import pytest
from transformers import AutoTokenizer

from tests.support.proxy import run_mitmdump
from tests.support.tito_sessions import (
    anthropic_session,
    build,
    figures,
    openai_session,
    qwen3_model,
    sampled_tokens_are_trained,
    write_script,
)


@pytest.fixture(scope="module")
def script(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("tito")
    return write_script(qwen3_model(tiny_model_dir, root), root / "script.json")


def _capture(script: Path, out: Path, tito: str, *, anthropic: bool = True) -> None:
    # Two user turns on openai (the second drops the first's think blocks), one on anthropic (tool inputs echoed as
    # objects); the off run needs one: its chains break at every turn already.
    with run_mitmdump(f"scripted:{script}", out, options={"polar_tito": tito, "polar_shard_seconds": "0.2"}) as proxy:
        openai_session(proxy, "oai", user_turns=2 if anthropic else 1)
        if anthropic:
            anthropic_session(proxy, "ant", user_turns=1)


def test_linear_sessions_are_one_exact_trace_with_tito_and_split_without(script: Path, tmp_path: Path) -> None:
    _capture(script, tmp_path / "on", "on")
    records, traces = build(tmp_path / "on")
    by_id = {r.record_id: r for r in records}
    assert len(records) == 9 and all(r.status == "ok" for r in records)
    for session, stats in figures(records, traces).items():
        assert stats.traces == 1, (session, stats)
        assert stats.off_policy_tokens == 0
    assert all(sampled_tokens_are_trained(t, by_id) for t in traces)
    for record in records:
        first = record.seq == 0
        assert (record.prompt_source, record.prompt_reason) == (
            ("fresh", "first_call") if first else ("continuity", "continues")
        )

    _capture(script, tmp_path / "off", "off", anthropic=False)
    records_off, traces_off = build(tmp_path / "off", merge_retokenized=False)
    assert {(r.prompt_source, r.prompt_reason) for r in records_off} == {("fresh", "tito_off")}
    # Re-rendered history without the sampled reasoning: the chains break at every turn.
    assert all(stats.traces > 1 for stats in figures(records_off, traces_off).values())


def test_thinking_off_sessions_are_one_exact_trace_too(tiny_model_dir: Path, tmp_path: Path) -> None:
    """Thinking off (the Messages API's ``thinking: disabled``): Qwen3's generation prompt opens an empty think block
    that its render of earlier tool-call turns leaves out, so a full re-render is not what the model sampled after;
    continuity keeps the sampled tokens."""
    script = write_script(qwen3_model(tiny_model_dir, tmp_path), tmp_path / "script.json", thinking=False)
    for tito in ("on", "off"):
        with run_mitmdump(
            f"scripted:{script}", tmp_path / tito, options={"polar_tito": tito, "polar_shard_seconds": "0.2"}
        ) as proxy:
            anthropic_session(proxy, "nothink", user_turns=2, thinking={"type": "disabled"})
    records, traces = build(tmp_path / "on")
    by_id = {r.record_id: r for r in records}
    assert len(records) == 6 and all(r.status == "ok" for r in records)
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    # Every prompt, the continued ones included, ends in the empty think block of thinking off.
    assert all(tokenizer.decode(r.prompt_ids).endswith("<think>\n\n</think>\n\n") for r in records)
    assert [r.prompt_source for r in sorted(records, key=lambda r: r.seq)] == ["fresh"] + ["continuity"] * 5
    assert figures(records, traces)["nothink"].traces == 1
    assert all(sampled_tokens_are_trained(t, by_id) for t in traces)
    records_off, traces_off = build(tmp_path / "off", merge_retokenized=False)
    assert figures(records_off, traces_off)["nothink"].traces > 1  # without continuity the chain breaks
