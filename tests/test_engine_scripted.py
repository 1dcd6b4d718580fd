"""ScriptedEngine: replayed assistant turns with real template tokens and real logprobs."""

from __future__ import annotations

import asyncio
import json

import orjson
import pytest
from transformers import AutoTokenizer

from polar_addon.canonical import CanonicalRequest, PolarError, SamplingParams
from polar_addon.engines import make_engine
from polar_addon.engines.scripted import ScriptedEngine

TOOLS = [{"type": "function", "function": {"name": "read_file", "description": "Read a file.",
          "parameters": {"type": "object", "properties": {"path": {"type": "string"}}}}}]  # fmt: skip
TURNS = [
    {"reasoning_content": "I should read the file.", "content": "Reading it.",
     "tool_calls": [{"type": "function", "function": {"name": "read_file", "arguments": {"path": "a.py"}}}]},
    {"tool_calls": [{"type": "function", "function": {"name": "read_file", "arguments": {"path": "b.py"}}},
                    {"type": "function", "function": {"name": "read_file", "arguments": "{\"path\": \"c.py\"}"}}]},
    {"content": "Both files define main()."},
]  # fmt: skip


def write_script(tmp_path, model_dir, cycle=True):
    path = tmp_path / "script.json"
    path.write_text(json.dumps({"model_dir": str(model_dir), "turns": TURNS, "cycle": cycle}))
    return path


def request(messages, **sampling) -> CanonicalRequest:
    return CanonicalRequest(api="openai_chat", model="m", messages=messages, tools=TOOLS,
                            sampling=SamplingParams(**{"temperature": 1.0, **sampling}))  # fmt: skip


async def agent_loop(engine, first_user: str):
    """Run the script to its end like a harness would: answer every call with a tool result."""
    messages = [{"role": "system", "content": "You are an agent."}, {"role": "user", "content": first_user}]
    completions = []
    while True:
        completion = await engine.complete(request(list(messages)))
        completions.append(completion)
        messages.append(completion.message.to_openai())
        if not completion.message.tool_calls:
            return completions, messages
        for call in completion.message.tool_calls:
            messages.append({"role": "tool", "tool_call_id": call.id, "content": f"contents of {call.arguments}"})


def test_agent_loop_tokens_are_real_and_prefix_stable(tiny_model_dir, tmp_path, reference_logprobs):
    engine = make_engine(f"scripted:{write_script(tmp_path, tiny_model_dir)}", timeout_s=60)
    assert isinstance(engine, ScriptedEngine)
    completions, messages = asyncio.run(agent_loop(engine, "Compare a.py and b.py"))
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    im_end = tok.convert_tokens_to_ids("<|im_end|>")

    assert [c.finish_reason for c in completions] == ["tool_calls", "tool_calls", "stop"]
    first, second, last = completions
    assert first.message.reasoning == "I should read the file."
    assert first.message.content == "Reading it."
    assert [(c.name, orjson.loads(c.arguments)) for c in second.message.tool_calls] == [
        ("read_file", {"path": "b.py"}), ("read_file", {"path": "c.py"})]  # fmt: skip
    assert last.message.content == "Both files define main()." and not last.message.tool_calls

    for completion in completions:
        assert completion.response_ids[-1] == im_end and im_end not in completion.response_ids[:-1]
        ref = reference_logprobs(completion.prompt_ids, completion.response_ids, 1.0)
        assert max(abs(a - b) for a, b in zip(completion.logprobs, ref, strict=True)) <= 1e-4
        text = tok.decode(completion.response_ids)
        assert text.count("<tool_call>") == len(completion.message.tool_calls)
    # Each prompt extends the previous prompt + response: what prefix merging relies on.
    for before, after in zip(completions, completions[1:]):
        held = before.prompt_ids + before.response_ids
        assert after.prompt_ids[: len(held)] == held
    # The full conversation rendered by the template is exactly the last prompt + response + "\n".
    rendered = tok(tok.apply_chat_template(messages, tools=TOOLS, tokenize=False), add_special_tokens=False)[
        "input_ids"
    ]
    assert rendered[: len(last.prompt_ids) + len(last.response_ids)] == last.prompt_ids + last.response_ids
    assert asyncio.run(engine.count_tokens(request(messages[:2]))) == len(first.prompt_ids)


def test_parallel_sessions_are_deterministic(tiny_model_dir, tmp_path):
    engine = ScriptedEngine(write_script(tmp_path, tiny_model_dir))

    async def both():
        return await asyncio.gather(agent_loop(engine, "task"), agent_loop(engine, "task"))

    (a, _), (b, _) = asyncio.run(both())
    assert [c.response_ids for c in a] == [c.response_ids for c in b]
    assert [c.logprobs for c in a] == [c.logprobs for c in b]


def test_cycle_and_exhaustion(tiny_model_dir, tmp_path):
    three_done = [{"role": "user", "content": "x"}] + [
        {"role": "assistant", "content": "ok"},
        {"role": "user", "content": "more"},
    ] * 3
    cycling = ScriptedEngine(write_script(tmp_path, tiny_model_dir, cycle=True))
    assert asyncio.run(cycling.complete(request(three_done))).message.reasoning == "I should read the file."
    (tmp_path / "strict").mkdir()
    strict = ScriptedEngine(write_script(tmp_path / "strict", tiny_model_dir, cycle=False))
    with pytest.raises(PolarError) as err:
        asyncio.run(strict.complete(request(three_done)))
    assert (err.value.status, err.value.kind) == (400, "invalid_request")


def test_max_tokens_truncates_the_turn(tiny_model_dir, tmp_path, reference_logprobs):
    engine = ScriptedEngine(write_script(tmp_path, tiny_model_dir))
    messages = [{"role": "user", "content": "go"}]
    full = asyncio.run(engine.complete(request(messages, temperature=0.7)))
    cut = asyncio.run(engine.complete(request(messages, temperature=0.7, max_tokens=4)))
    assert cut.finish_reason == "length"
    assert cut.response_ids == full.response_ids[:4]
    assert cut.logprobs == pytest.approx(full.logprobs[:4], abs=1e-5)
    assert cut.logprobs == pytest.approx(reference_logprobs(cut.prompt_ids, cut.response_ids, 0.7), abs=1e-4)
    assert cut.message.tool_calls == []


def test_relative_model_dir_and_bad_scripts(tiny_model_dir, tmp_path):
    (tmp_path / "model").symlink_to(tiny_model_dir)
    script = tmp_path / "s.json"
    script.write_text(json.dumps({"model_dir": "model", "turns": [{"content": "hi"}]}))
    completion = asyncio.run(ScriptedEngine(script).complete(request([{"role": "user", "content": "hey"}])))
    assert completion.message.content == "hi" and completion.finish_reason == "stop"
    for bad in ({"model_dir": "model", "turns": []}, {"model_dir": "model", "turns": [{}]},
                {"model_dir": "model", "turns": [{"tool_calls": [{"function": {}}]}]}):  # fmt: skip
        script.write_text(json.dumps(bad))
        with pytest.raises(ValueError):
            ScriptedEngine(script)


def test_by_model_picks_the_turns_of_the_requested_model(tiny_model_dir, tmp_path):
    """One proxy drives several harnesses: each model name replays its own turns, others get ``turns``."""
    script = tmp_path / "s.json"
    script.write_text(
        json.dumps(
            {
                "model_dir": str(tiny_model_dir),
                "turns": [{"content": "default"}],
                "by_model": {"a": [{"content": "from a"}], "b": [{"content": "b1"}, {"content": "b2"}]},
            }
        )
    )
    engine = ScriptedEngine(script)

    def answer(model: str, messages: list) -> str:
        req = CanonicalRequest(
            api="openai_chat", model=model, messages=messages, sampling=SamplingParams(temperature=1.0)
        )
        return asyncio.run(engine.complete(req)).message.content

    first = [{"role": "user", "content": "go"}]
    assert [answer(m, first) for m in ("a", "b", "other")] == ["from a", "b1", "default"]
    assert answer("b", first + [{"role": "assistant", "content": "b1"}, {"role": "user", "content": "on"}]) == "b2"
    script.write_text(json.dumps({"model_dir": str(tiny_model_dir), "by_model": {"a": [{"content": "only a"}]}}))
    only = ScriptedEngine(script)
    with pytest.raises(PolarError) as err:
        asyncio.run(only.complete(CanonicalRequest(api="openai_chat", model="z", messages=first)))
    assert (err.value.status, err.value.kind) == (400, "invalid_request") and "'z'" in err.value.message
    for bad in ({"by_model": {"a": []}}, {"by_model": ["a"]}):
        script.write_text(json.dumps({"model_dir": str(tiny_model_dir), **bad}))
        with pytest.raises(ValueError):
            ScriptedEngine(script)
