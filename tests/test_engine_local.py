"""LocalEngine: in-process transformers on the tiny model."""

from __future__ import annotations

import asyncio
import json
import shutil
from pathlib import Path

import pytest
from transformers import AutoTokenizer

from polar_addon.canonical import CanonicalRequest, PolarError, SamplingParams
from polar_addon.engines import make_engine
from polar_addon.engines.local import LocalEngine

TOOLS = [{"type": "function", "function": {"name": "ls", "description": "List a directory.",
          "parameters": {"type": "object", "properties": {"path": {"type": "string"}}}}}]  # fmt: skip
MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is in /tmp?"}]


def request(messages=MESSAGES, tools=TOOLS, **sampling) -> CanonicalRequest:
    return CanonicalRequest(
        api="openai_chat", model="m", messages=messages, tools=tools, sampling=SamplingParams(**sampling)
    )


@pytest.fixture(scope="module")
def engine(tiny_model_dir):
    eng = make_engine(f"local:{tiny_model_dir}", timeout_s=60)
    assert isinstance(eng, LocalEngine)
    yield eng
    asyncio.run(eng.close())


def variant(src: Path, dst: Path, config: dict | None = None, generation: dict | None = None) -> Path:
    """A copy of the tiny model with edited config files."""
    shutil.copytree(src, dst)
    for name, edit in (("config.json", config), ("generation_config.json", generation)):
        if edit:
            path = dst / name
            path.write_text(json.dumps(json.loads(path.read_text()) | edit))
    return dst


def test_prompt_ids_are_the_chat_template_and_count_agrees(engine, tiny_model_dir):
    completion = asyncio.run(engine.complete(request(temperature=1.0, max_tokens=5, seed=1)))
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    text = tok.apply_chat_template(MESSAGES, tools=TOOLS, add_generation_prompt=True, tokenize=False)
    assert completion.prompt_ids == tok(text, add_special_tokens=False)["input_ids"]
    assert asyncio.run(engine.count_tokens(request())) == len(completion.prompt_ids)
    assert len(completion.response_ids) == len(completion.logprobs) == 5
    assert completion.finish_reason == "length"
    assert completion.engine == f"local:{tiny_model_dir}"
    assert completion.served_model == Path(tiny_model_dir).name
    assert completion.message.content == tok.decode(completion.response_ids, skip_special_tokens=True)


@pytest.mark.parametrize(
    "sampling",
    [dict(temperature=1.0), dict(temperature=0.7), dict(temperature=0.7, top_p=0.8, top_k=40), dict(temperature=0)],
)
def test_logprobs_match_a_plain_forward_pass(engine, reference_logprobs, sampling):
    completion = asyncio.run(engine.complete(request(max_tokens=24, seed=5, **sampling)))
    # Recorded logprobs are log_softmax(logits / T), never renormalised for top-p/top-k; greedy -> T = 1.
    ref = reference_logprobs(completion.prompt_ids, completion.response_ids, sampling["temperature"])
    diffs = [abs(a - b) for a, b in zip(completion.logprobs, ref, strict=True)]
    assert sum(diffs) / len(diffs) <= 1e-3, diffs


def test_seed_makes_sampling_reproducible(engine):
    a = asyncio.run(engine.complete(request(temperature=1.0, max_tokens=12, seed=42)))
    b = asyncio.run(engine.complete(request(temperature=1.0, max_tokens=12, seed=42)))
    c = asyncio.run(engine.complete(request(temperature=1.0, max_tokens=12, seed=43)))
    assert a.response_ids == b.response_ids and a.logprobs == b.logprobs
    assert a.response_ids != c.response_ids


def test_stop_string_cuts_text_but_keeps_sampled_tokens(engine):
    free_run = asyncio.run(engine.complete(request(temperature=1.0, max_tokens=24, seed=11)))
    text = free_run.message.content or ""
    stop = text[len(text) // 2 : len(text) // 2 + 3]
    assert len(stop) == 3
    cut = asyncio.run(engine.complete(request(temperature=1.0, max_tokens=24, seed=11, stop=["\x00never", stop])))
    assert (cut.finish_reason, cut.matched_stop) == ("stop", stop)
    assert cut.message.content == text[: text.find(stop)]
    assert 0 < len(cut.response_ids) < len(free_run.response_ids)
    assert cut.response_ids == free_run.response_ids[: len(cut.response_ids)]
    assert cut.logprobs == free_run.logprobs[: len(cut.logprobs)]


def test_eos_from_generation_config_ends_the_turn_and_is_kept(tiny_model_dir, tmp_path):
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    probe = LocalEngine(tiny_model_dir)
    first = asyncio.run(probe.complete(request(temperature=0, max_tokens=1))).response_ids[0]
    # Declare the token greedy decoding emits first as an extra EOS id: generation must stop on it.
    eos = json.loads((Path(tiny_model_dir) / "generation_config.json").read_text())["eos_token_id"]
    eng = LocalEngine(variant(Path(tiny_model_dir), tmp_path / "m", generation={"eos_token_id": [*eos, first]}))
    completion = asyncio.run(eng.complete(request(temperature=0, max_tokens=10)))
    assert completion.response_ids == [first]
    assert len(completion.logprobs) == 1
    assert (completion.finish_reason, completion.matched_stop) == ("stop", None)
    assert completion.message.content == tok.decode([first], skip_special_tokens=True)


def test_context_length(tiny_model_dir, tmp_path):
    eng = LocalEngine(variant(Path(tiny_model_dir), tmp_path / "m", config={"max_position_embeddings": 40}))
    short = [{"role": "user", "content": "hi"}]
    prompt_len = asyncio.run(eng.count_tokens(request(messages=short, tools=[])))
    assert prompt_len < 40
    # max_tokens is clipped to the room left in the context.
    completion = asyncio.run(eng.complete(request(messages=short, tools=[], temperature=1.0, max_tokens=100, seed=0)))
    assert len(completion.prompt_ids) + len(completion.response_ids) == 40
    assert completion.finish_reason == "length"
    with pytest.raises(PolarError) as err:
        asyncio.run(eng.complete(request(messages=[{"role": "user", "content": "word " * 60}], tools=[])))
    assert (err.value.status, err.value.kind) == (400, "context_length_exceeded")


def test_invalid_requests(engine):
    for sampling in (dict(temperature=-1.0), dict(max_tokens=0)):
        with pytest.raises(PolarError) as err:
            asyncio.run(engine.complete(request(**sampling)))
        assert (err.value.status, err.value.kind) == (400, "invalid_request")


def test_missing_model_is_unavailable(tmp_path):
    with pytest.raises(PolarError) as err:
        asyncio.run(LocalEngine(tmp_path / "nothing").complete(request()))
    assert err.value.status == 503


def test_generation_leaves_the_event_loop_free(engine):
    """Other coroutines run while generations are in flight (a generation run on the loop itself
    would finish before the loop turned twice). How fast the loop keeps turning is measured by
    bench/engine_loop.py, not asserted here."""

    async def scenario():
        generations = asyncio.gather(
            *(engine.complete(request(temperature=1.0, max_tokens=64, seed=s)) for s in range(3))
        )
        turns_while_generating = 0
        while not generations.done():
            await asyncio.sleep(0.005)
            turns_while_generating += 1
        return await generations, turns_while_generating

    results, turns = asyncio.run(scenario())
    assert [len(r.response_ids) for r in results] == [64, 64, 64]
    assert turns >= 10


def test_reload_tags_later_completions(tiny_model_dir, tmp_path):
    eng = LocalEngine(tiny_model_dir)
    before = asyncio.run(eng.complete(request(temperature=0, max_tokens=3)))
    assert before.weight_version is None
    eng.reload(shutil.copytree(tiny_model_dir, tmp_path / "step-1"), weight_version="step-1")
    after = asyncio.run(eng.complete(request(temperature=0, max_tokens=3)))
    assert after.weight_version == "step-1"
    assert after.response_ids == before.response_ids


def test_thinking_flag_reaches_a_template_that_reads_it(thinking_model_dir):
    """Off: the prompt ends in Qwen3's empty think block; on, or not said: the template's default."""
    eng = LocalEngine(thinking_model_dir)
    ids = {}
    for flag in (None, True, False):
        req = request(temperature=0, max_tokens=2)
        req.enable_thinking = flag
        completion = asyncio.run(eng.complete(req))
        ids[flag] = completion.prompt_ids
        assert asyncio.run(eng.count_tokens(req)) == len(completion.prompt_ids)
    assert ids[True] == ids[None]
    assert ids[False] == ids[None] + eng.encode("<think>\n\n</think>\n\n")
