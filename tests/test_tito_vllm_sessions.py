"""Token continuity on real vLLM CPU through a real mitmdump, sessions driven by the official openai and anthropic
SDKs: every call after a session's first is a continuation; the prompt ids polar stores are the ones vLLM itself
reported (read from a recording forwarder between the proxy and vLLM, not from polar); each continuation is the
previous prompt + the previous sampled ids + exactly the new messages' tokens of vLLM's own full render; each
session builds into one trace whose first-step importance ratios are 1 within 1e-4.

The shared tiny model never ends a turn (every answer is cut by length, and a length-cut turn is rendered in
full), so this module serves the ending model (tests/support/ending_model.py: same architecture and tokenizer,
Qwen3's chat template and sampling defaults in generation_config.json), stored in bf16 as released checkpoints are
and served with ``--dtype float32`` as the trainer computes on CPU (served in bf16, vLLM's own rounding moves the
ratios to 0.970..1.022: bench/continuity.py --vllm --serve-dtype bfloat16). One server for the module; ~50 s.

Planted bugs it catches: the continuation's first delta token (the template's glue after ``<|im_end|>``) dropped
(the prompt no longer matches vLLM's full render), and continuation calls that leave top_k out (vLLM falls back to
the model's top_k 20: ratios down to 0.43).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from polar_cli.mitm import free_port
from polar_cli.serving import serve_vllm, stop_process
from tests.support.ending_model import build_ending_model
from tests.support.proxy import run_mitmdump
from tests.support.slow_forwarder import Exchange, slow_forwarder
from tests.support.tito_sessions import build, figures, sampled_tokens_are_trained
from tests.support.tito_vllm import (
    TEMPERATURE,
    anthropic_chat,
    by_session,
    engine_answers,
    first_step_ratios,
    full_render_delta,
    openai_chat,
    trainer_logprobs,
)

pytestmark = pytest.mark.vllm

SERVED = "tiny"


@pytest.fixture(scope="module")
def ending_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_ending_model(tmp_path_factory.mktemp("models") / "ending", dtype="bfloat16")


@pytest.fixture(scope="module")
def ending_vllm(ending_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """vLLM as `polar engine serve` starts it, but with ``--generation-config auto`` (vLLM's default): a sampling
    parameter polar failed to send would fall back to the model's Qwen3 defaults (top_p 0.95, top_k 20) and show in
    the logprobs."""
    if not Path(".venv-vllm/bin/python").exists():
        pytest.fail("vLLM CPU venv missing (.venv-vllm); run `make engine`")
    server = serve_vllm(
        str(ending_model),
        port=free_port(),
        served_model_name=SERVED,
        state_dir=tmp_path_factory.mktemp("engines"),
        dtype="float32",
        max_model_len=4096,
        extra_args=["--generation-config", "auto", "--enforce-eager"],
        kvcache_gib="1",
    )
    try:
        yield server.url
    finally:
        stop_process(server)


def test_sessions_on_vllm_are_continuations_of_what_vllm_saw(
    ending_vllm: str, ending_model: Path, tmp_path: Path
) -> None:
    exchanges: list[Exchange] = []
    out = tmp_path / "shards"
    options = {"polar_tito": "on", "polar_tokenizer": str(ending_model), "polar_shard_seconds": "0.2"}
    with slow_forwarder(ending_vllm, 0.0, record=exchanges) as forwarder:
        with run_mitmdump(f"vllm:{forwarder}", out, options=options) as proxy:
            openai_chat(proxy, "oai", user_turns=4, seed=1)
            anthropic_chat(proxy, "ant", user_turns=3)
    records, traces = build(out)
    assert len(records) == 7 and all(r.status == "ok" and r.finish_reason == "stop" for r in records), [
        (r.status, r.finish_reason, r.error) for r in records
    ]

    # What vLLM answered, call by call (the sessions ran one after the other): polar stored exactly that.
    answers = engine_answers(exchanges)
    in_order = sorted(records, key=lambda r: r.started_at)
    assert len(answers) == len(in_order)
    for record, (prompt, sampled, logprobs) in zip(in_order, answers):
        assert list(record.prompt_ids) == prompt and record.response_ids == sampled and record.logprobs == logprobs
        assert (record.temperature, record.top_p, record.top_k) == (TEMPERATURE, 1.0, 0)
    reported = {r.record_id: a for r, a in zip(in_order, answers)}

    end_id = 2  # <|im_end|>
    for session, calls in by_session(records).items():
        first, *rest = calls
        assert (first.prompt_source, first.prompt_reason) == ("fresh", "first_call"), session
        for previous, call in zip(calls, rest):
            assert (call.prompt_source, call.prompt_reason) == ("continuity", "continues"), (session, call.seq)
            prev_prompt, prev_sampled, _ = reported[previous.record_id]
            prompt = reported[call.record_id][0]
            assert prev_sampled[-1] == end_id  # the answer ended its turn itself
            # The engine sampled after its own previous prompt and sample, unchanged...
            assert prompt[: len(prev_prompt) + len(prev_sampled)] == prev_prompt + prev_sampled, (session, call.seq)
            # ...then exactly the tokens vLLM's own full render of this request has after that turn's end
            # (the template's glue, the new user turn, the generation prompt).
            full = httpx.post(
                f"{ending_vllm}/tokenize",
                timeout=30,
                json={
                    "model": SERVED,
                    "messages": call.messages,
                    "tools": json.loads(call.tools_json),
                    "add_generation_prompt": True,
                },
            ).json()["tokens"]
            kept = prev_prompt + prev_sampled
            assert prompt[len(kept) :] == full_render_delta(full, end_id, kept.count(end_id)), (session, call.seq)

    by_id = {r.record_id: r for r in records}
    per_session = figures(records, traces)
    assert {s: f.traces for s, f in per_session.items()} == {"oai": 1, "ant": 1}
    assert all(f.off_policy_tokens == 0 for f in per_session.values())
    assert all(sampled_tokens_are_trained(t, by_id) for t in traces)

    ratios = first_step_ratios(traces, trainer_logprobs(ending_model))
    print(
        f"continuity on, vLLM fp32: {ratios.tokens} trainable tokens, ratio {ratios.min:.7f}..{ratios.max:.7f}, "
        f"mean |r-1| {ratios.mean_abs_dev:.2e}"
    )
    assert ratios.tokens == sum(len(r.response_ids) for r in records)
    assert ratios.max_abs_dev <= 1e-4, ratios
