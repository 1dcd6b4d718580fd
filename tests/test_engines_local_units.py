"""polar_addon.engines.local's decisions on a scripted stand-in for the model (no weights loaded): the logprobs it
records (unfiltered, at the sampling temperature), how a turn ends (EOS kept, a stop string cut, the length cap),
top-k / top-p / min-p, the served window and the request checks; _load's EOS ids and window on stand-ins of
transformers' loaders."""

from __future__ import annotations

import math
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from polar_addon.canonical import (
    CanonicalRequest,
    Completion,
    ContextLengthExceeded,
    PolarError,
    SamplingParams,
)
from polar_addon.engines import local
from polar_addon.engines.local import DEFAULT_MAX_TOKENS, LocalEngine, _filter_top_k_top_p, served_window

INF = float("-inf")


class ScriptedModel:
    """Answers each forward pass with the next row of ``rows`` as the last position's logits; remembers the inputs."""

    def __init__(self, rows: list[list[float]]) -> None:
        self.rows = rows
        self.calls: list[dict[str, Any]] = []

    def __call__(self, *, input_ids: torch.Tensor, **kwargs: Any) -> Any:
        self.calls.append({"input_ids": input_ids.tolist(), **kwargs})
        row = self.rows[min(len(self.calls) - 1, len(self.rows) - 1)]
        return SimpleNamespace(logits=torch.tensor([[row]]), cache=f"cache{len(self.calls)}")


class Letters:
    """A tokenizer stand-in: id i is the letter chr(97 + i), or ``pieces[i]`` where given."""

    def __init__(self, pieces: dict[int, str] | None = None) -> None:
        self.pieces = pieces or {}

    def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str:
        return "".join(self.pieces.get(i, chr(97 + i)) for i in ids)


def _engine(rows: list[list[float]], eos: set[int] = frozenset(), max_len: int = 0) -> LocalEngine:  # type: ignore[assignment]
    engine = LocalEngine("/models/tiny-x")
    engine._model, engine._tokenizer, engine._eos_ids, engine._max_len = (
        ScriptedModel(rows),
        Letters(),
        set(eos),
        max_len,
    )
    return engine


def _log_softmax(row: list[float], scale: float = 1.0) -> list[float]:
    return torch.log_softmax(torch.tensor(row) / scale, dim=-1).tolist()


def test_served_window_is_the_models_lowered_by_max_len() -> None:
    assert served_window(None, 0) is None
    assert served_window(0, 0) is None
    assert served_window(100, 0) == 100
    assert served_window(None, 50) == 50
    assert served_window(0, 50) == 50
    assert served_window(100, 50) == 50
    assert served_window(50, 100) == 50  # max_len never raises the model's own
    assert served_window(100, 100) == 100


def test_the_context_check_refuses_a_prompt_that_fills_the_window() -> None:
    engine = _engine([[0.0]], max_len=10)
    engine.check_context(9)  # one token left to sample
    with pytest.raises(ContextLengthExceeded) as caught:
        engine.check_context(10)
    assert str(caught.value) == (
        "This model's maximum context length is 10 tokens. However, your prompt contains 10 input tokens."
    )
    assert (caught.value.prompt_tokens, caught.value.window, caught.value.status) == (10, 10, 400)
    _engine([[0.0]], max_len=0).check_context(10**9)  # no window known: no check


def test_greedy_takes_the_argmax_and_records_t1_logprobs() -> None:
    rows = [[0.0, 2.0, 1.0], [3.0, 0.0, 0.0], [0.0, 0.0, 5.0]]
    engine = _engine(rows, eos={2})
    ids, logprobs, finish, matched, text = engine.sample([7, 8], SamplingParams(temperature=0.0), 10)
    assert (ids, finish, matched, text) == ([1, 0, 2], "stop", None, "bac")  # the EOS id is kept
    assert logprobs == pytest.approx([_log_softmax(rows[0])[1], _log_softmax(rows[1])[0], _log_softmax(rows[2])[2]])
    model = engine._model
    # The prompt once (only its last logits kept), then each sampled token on the cache before it.
    assert model.calls[0] == {"input_ids": [[7, 8]], "use_cache": True, "logits_to_keep": 1}
    assert model.calls[1] == {"input_ids": [[1]], "cache": "cache1", "use_cache": True}
    assert model.calls[2] == {"input_ids": [[0]], "cache": "cache2", "use_cache": True}
    assert len(model.calls) == 3  # nothing sampled after the EOS


def test_sampled_logprobs_are_at_the_temperature_and_before_the_filters() -> None:
    row = [0.0, 1.0, 3.0, 2.0]
    engine = _engine([row])
    # top_k 1 leaves one candidate, so the draw is known; its logprob is still the whole distribution's at T = 2.
    ids, logprobs, finish, matched, text = engine.sample([1], SamplingParams(temperature=2.0, top_k=1, seed=0), 3)
    assert (ids, finish, matched, text) == ([2, 2, 2], "length", None, "ccc")
    assert logprobs == pytest.approx([_log_softmax(row, 2.0)[2]] * 3)
    assert logprobs[0] != pytest.approx(_log_softmax(row)[2])
    # top_p and min_p filter the draw too: token 25 has half the mass, 25 others the rest; each filter alone
    # leaves only token 25 (unfiltered, 30 draws of it would have a chance of 1e-9).
    half = [0.0] * 25 + [math.log(25)]
    for sampling in (SamplingParams(temperature=1.0, top_p=0.4), SamplingParams(temperature=1.0, min_p=0.5)):
        ids, logprobs, *_ = _engine([half]).sample([1], sampling, 30)
        assert ids == [25] * 30 and logprobs == pytest.approx([math.log(0.5)] * 30)


def test_a_seed_makes_the_draws_repeat() -> None:
    row = [0.0] * 26
    draws = [_engine([row]).sample([1], SamplingParams(temperature=1.0, seed=s), 12)[0] for s in (3, 3, 4)]
    assert draws[0] == draws[1] != draws[2]
    assert len(set(draws[0])) > 1  # drawn, not the argmax


def test_a_stop_string_cuts_the_text_at_the_earliest_stop_and_keeps_the_tokens() -> None:
    # Scripted to write "abcbd": the stop "cb" is found once "abcb" is written.
    rows = [[9.0, 0, 0, 0], [0, 9.0, 0, 0], [0, 0, 9.0, 0], [0, 9.0, 0, 0], [0, 0, 0, 9.0]]
    sampling = SamplingParams(temperature=0.0, stop=["", "zz", "bc", "cb"])
    ids, _, finish, matched, text = _engine(rows).sample([1], sampling, 10)
    assert (ids, finish, matched, text) == ([0, 1, 2], "stop", "bc", "a")  # "bc" appears first, at "abc"
    sampling = SamplingParams(temperature=0.0, stop=["bcb", "cb"])
    ids, _, finish, matched, text = _engine(rows).sample([1], sampling, 10)
    assert (ids, finish, matched, text) == ([0, 1, 2, 1], "stop", "bcb", "a")  # both at once: the earlier one
    ids, _, finish, matched, text = _engine(rows).sample([1], SamplingParams(temperature=0.0, stop=[""]), 5)
    assert (ids, finish, matched, text) == ([0, 1, 2, 1, 3], "length", None, "abcbd")  # an empty stop is none
    # One token can write a stop string twice: the text ends before the first.
    engine = _engine([[9.0, 0.0]])
    engine._tokenizer = Letters({0: "xyxy"})
    assert engine.sample([1], SamplingParams(temperature=0.0, stop=["xy"]), 3)[2:] == ("stop", "xy", "")


def test_the_length_cap_is_exact() -> None:
    ids, logprobs, finish, _, text = _engine([[1.0, 0.0]]).sample([1], SamplingParams(temperature=0.0), 1)
    assert (ids, len(logprobs), finish, text) == ([0], 1, "length", "a")


def test_scoring_is_teacher_forced_at_the_temperature() -> None:
    logits = torch.tensor([[[0.0, 1.0, 2.0], [2.0, 0.0, 1.0], [1.0, 1.0, 1.0], [5.0, 5.0, 5.0]]])
    seen: list[dict[str, Any]] = []

    def model(*, input_ids: torch.Tensor, logits_to_keep: int) -> Any:
        seen.append({"input_ids": input_ids.tolist(), "logits_to_keep": logits_to_keep})
        return SimpleNamespace(logits=logits[:, -logits_to_keep:])

    engine = _engine([[0.0]])
    engine._model = model
    got = engine.score([9, 9], [2, 0, 1], 0.5)
    # Positions: logits[-4] predicts the first response token ... the last position predicts nothing.
    want = [torch.log_softmax(logits[0, i] / 0.5, dim=-1)[t].item() for i, t in zip(range(3), [2, 0, 1])]
    assert got == pytest.approx(want)
    assert seen == [{"input_ids": [[9, 9, 2, 0, 1]], "logits_to_keep": 4}]
    greedy = engine.score([9, 9], [2, 0, 1], 0.0)  # T = 0 scores at T = 1
    assert greedy == pytest.approx([torch.log_softmax(logits[0, i], dim=-1)[t].item() for i, t in enumerate([2, 0, 1])])
    assert engine.score([9], [], 1.0) == [] and len(seen) == 2  # nothing to score: no forward pass


def test_top_k_keeps_the_k_best_ties_included() -> None:
    x = torch.tensor([1.0, 4.0, 3.0, 2.0])
    assert _filter_top_k_top_p(x, 2, None).tolist() == [INF, 4.0, 3.0, INF]
    assert _filter_top_k_top_p(x, 3, None).tolist() == [INF, 4.0, 3.0, 2.0]
    for off in (None, 0, 4, 5):  # off, or as many as the vocabulary: nothing masked
        assert _filter_top_k_top_p(x, off, None).tolist() == x.tolist()
    assert _filter_top_k_top_p(torch.tensor([2.0, 2.0, 1.0]), 1, None).tolist() == [2.0, 2.0, INF]


def test_top_p_keeps_the_smallest_set_that_reaches_it_in_probability_order() -> None:
    probs = torch.tensor([0.2, 0.5, 0.3])  # unsorted: the mask goes back to each token's own place
    x = probs.log()
    assert _filter_top_k_top_p(x, None, 0.5).tolist() == [INF, pytest.approx(math.log(0.5)), INF]
    kept = _filter_top_k_top_p(x, None, 0.51).tolist()
    assert kept[0] == INF and kept[1:] == pytest.approx([math.log(0.5), math.log(0.3)])
    assert _filter_top_k_top_p(x, None, 0.81).tolist() == pytest.approx(x.tolist())
    for off in (None, 0.0, 1.0):
        assert _filter_top_k_top_p(x, None, off).tolist() == pytest.approx(x.tolist())
    tiny = _filter_top_k_top_p(x, None, 1e-9).tolist()  # the top token always stays
    assert tiny[1] == pytest.approx(math.log(0.5)) and tiny[0] == tiny[2] == INF


def test_min_p_drops_tokens_below_that_fraction_of_the_top() -> None:
    x = torch.tensor([0.5, 0.3, 0.2]).log()
    assert _filter_top_k_top_p(x, None, None, 0.5).tolist() == pytest.approx([math.log(0.5), math.log(0.3), INF])
    kept = _filter_top_k_top_p(x, None, None, 0.3).tolist()
    assert kept == pytest.approx(x.tolist())  # 0.2 > 0.3 * 0.5
    for off in (None, 0.0):
        assert _filter_top_k_top_p(x, None, None, off).tolist() == pytest.approx(x.tolist())
    # The filters together keep what each keeps.
    both = _filter_top_k_top_p(torch.tensor([0.6, 0.1, 0.3]).log(), 2, None, 0.4).tolist()
    assert both[1] == INF and both[0] == pytest.approx(math.log(0.6)) and both[2] == pytest.approx(math.log(0.3))


def _request(**sampling: Any) -> CanonicalRequest:
    tools = [{"type": "function", "function": {"name": "ls", "parameters": {"type": "object"}}}]
    return CanonicalRequest(api="openai_chat", model="m", messages=[], tools=tools, sampling=SamplingParams(**sampling))


def _stubbed(text: str, finish: str, max_len: int = 0, matched: str | None = None) -> tuple[LocalEngine, list[Any]]:
    engine = _engine([[0.0]], max_len=max_len)
    asked: list[Any] = []

    def sample(prompt_ids: list[int], sampling: SamplingParams, max_tokens: int) -> Any:
        assert isinstance(sampling, SamplingParams)
        asked.append((prompt_ids, max_tokens))
        return [4, 5], [-0.1, -0.2], finish, matched, text

    engine.sample = sample  # type: ignore[method-assign]
    engine.weight_version = "w2"
    return engine, asked


def test_a_completion_is_the_sampled_turn_parsed_and_labelled() -> None:
    engine, asked = _stubbed("hello", "stop")
    completion = engine._complete_sync(_request(), [1, 2, 3])
    assert isinstance(completion, Completion)
    assert asked == [([1, 2, 3], DEFAULT_MAX_TOKENS)]
    assert (completion.message.content, completion.finish_reason) == ("hello", "stop")
    assert (completion.prompt_ids, completion.response_ids, completion.logprobs) == ([1, 2, 3], [4, 5], [-0.1, -0.2])
    assert (completion.served_model, completion.engine, completion.weight_version) == (
        "tiny-x",
        "local:/models/tiny-x",
        "w2",
    )
    assert (completion.matched_stop, completion.parse_failures, completion.tool_call_parser) == (None, 0, None)


def test_a_turn_with_tool_calls_finishes_tool_calls_unless_cut_by_length() -> None:
    call = '<tool_call>\n{"name": "ls", "arguments": {}}\n</tool_call>'
    engine, _ = _stubbed(call, "stop")
    completion = engine._complete_sync(_request(), [1])
    assert completion.finish_reason == "tool_calls" and completion.tool_call_parser == "hermes"
    assert [c.name for c in completion.message.tool_calls] == ["ls"]
    assert _stubbed(call, "length")[0]._complete_sync(_request(), [1]).finish_reason == "length"
    broken = _stubbed("<tool_call>\n{bad\n</tool_call>", "stop")[0]._complete_sync(_request(), [1])
    assert (broken.finish_reason, broken.parse_failures) == ("stop", 1)


def test_max_tokens_is_asked_or_the_default_and_never_past_the_window() -> None:
    engine, asked = _stubbed("x", "stop", max_len=10)
    engine._complete_sync(_request(max_tokens=5), [0] * 4)  # 6 left: 5 asked
    engine._complete_sync(_request(max_tokens=7), [0] * 4)  # 6 left
    engine._complete_sync(_request(), [0] * 9)  # 1 left
    engine._complete_sync(_request(max_tokens=1), [0] * 9)
    assert [m for _, m in asked] == [5, 6, 1, 1]
    with pytest.raises(ContextLengthExceeded):
        engine._complete_sync(_request(), [0] * 10)
    assert len(asked) == 4


def test_requests_the_engine_cannot_sample_are_refused() -> None:
    engine, asked = _stubbed("x", "stop")
    for sampling, said in (
        ({"temperature": -0.01}, "temperature must be >= 0"),
        ({"max_tokens": 0}, "max_tokens must be at least 1"),
        ({"max_tokens": -1}, "max_tokens must be at least 1"),
    ):
        with pytest.raises(PolarError) as caught:
            engine._complete_sync(_request(**sampling), [1])
        assert (caught.value.status, caught.value.kind, str(caught.value)) == (400, "invalid_request", said)
    engine._complete_sync(_request(temperature=0.0, max_tokens=1), [1])  # both bounds accepted
    assert asked == [([1], 1)]


class _Loaded:
    def __init__(self, eos: Any, window: int | None, generation: bool = True) -> None:
        self.generation_config = SimpleNamespace(eos_token_id=eos) if generation else None
        # window None: a config without max_position_embeddings at all
        self.config = SimpleNamespace() if window is None else SimpleNamespace(max_position_embeddings=window)
        self.evaluated = False

    def eval(self) -> None:
        self.evaluated = True


def _load(monkeypatch: pytest.MonkeyPatch, tmp_path: Path, model: _Loaded, tokenizer_eos: int | None, **kw: Any):
    (tmp_path / "config.json").write_text("{}")
    tokenizer = SimpleNamespace(eos_token_id=tokenizer_eos)
    loads: list[Any] = []

    def tokenizer_from(path: str) -> Any:
        loads.append(path)
        return tokenizer

    def model_from(path: str, dtype: Any) -> _Loaded:
        loads.append((path, dtype))
        return model

    # Stand-ins for transformers' loaders (importing its Auto classes alone takes seconds).
    fake = SimpleNamespace(
        AutoTokenizer=SimpleNamespace(from_pretrained=tokenizer_from),
        AutoModelForCausalLM=SimpleNamespace(from_pretrained=model_from),
    )
    monkeypatch.setitem(sys.modules, "transformers", fake)
    engine = LocalEngine(tmp_path, **kw)
    engine._load(str(tmp_path))
    return engine, loads


def test_load_gathers_every_eos_id_and_the_served_window(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    model = _Loaded([5, None, 7], 64)
    engine, loads = _load(monkeypatch, tmp_path, model, 9)
    assert loads == [str(tmp_path), (str(tmp_path), torch.float32)] and model.evaluated
    assert engine._eos_ids == {5, 7, 9} and engine._max_len == 64 and engine._model is model
    engine, _ = _load(monkeypatch, tmp_path, _Loaded(3, 64), None, max_len=32)
    assert engine._eos_ids == {3} and engine._max_len == 32
    engine, _ = _load(monkeypatch, tmp_path, _Loaded(None, None, generation=False), 0)
    assert engine._eos_ids == {0} and engine._max_len == 0  # token 0 is an id; no window known


def test_no_model_directory_is_an_unavailable_engine(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setitem(sys.modules, "transformers", SimpleNamespace(AutoTokenizer=None, AutoModelForCausalLM=None))
    with pytest.raises(PolarError) as caught:
        LocalEngine(tmp_path)._load(str(tmp_path))
    assert (caught.value.status, caught.value.kind) == (503, "overloaded")
    assert str(caught.value) == f"local engine: no model at {tmp_path}"


def test_names_reload_and_close(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    engine = LocalEngine("/a/b/model-1", default_max_tokens=9, weight_version="w0")
    assert (engine.name, engine.served_model, engine.kind, engine.default_max_tokens) == (
        "local:/a/b/model-1",
        "model-1",
        "local",
        9,
    )
    loaded: list[str] = []
    monkeypatch.setattr(engine, "_load", loaded.append)
    engine.reload(tmp_path / "step-2", weight_version="step-2")
    assert loaded == [str(tmp_path / "step-2")]
    assert (engine.model_dir, engine.weight_version, engine.served_model) == (
        str(tmp_path / "step-2"),
        "step-2",
        "step-2",
    )
    engine._model, engine._tokenizer = object(), object()
    engine.load()  # already loaded: nothing more
    assert loaded == [str(tmp_path / "step-2")]
    import asyncio

    asyncio.run(engine.close())
    assert engine._model is None and engine._tokenizer is None
    assert local.DEFAULT_MAX_TOKENS == 256


def test_a_request_without_token_input_is_rendered_and_parsed_by_the_models_parser() -> None:
    from polar_addon.tool_parsers import ParserChoice

    text = "<tool_call>\n<function=ls>\n<parameter=n>\n5\n</parameter>\n</function>\n</tool_call>"
    engine, asked = _stubbed(text, "stop", matched="</tool_call>")
    engine.tool_parsers = ParserChoice("tiny-x=qwen3_coder")  # this model's parser; hermes for any other
    rendered: list[CanonicalRequest] = []
    engine.prompt_ids = lambda request: rendered.append(request) or [7, 8]  # type: ignore[method-assign]
    request = _request()
    request.tools[0]["function"]["parameters"] = {"type": "object", "properties": {"n": {"type": "integer"}}}
    completion = engine._complete_sync(request)
    assert rendered == [request] and asked == [([7, 8], DEFAULT_MAX_TOKENS)]
    # The parameter typed by the request's tools (an integer, not the text "5").
    assert [(c.name, c.arguments) for c in completion.message.tool_calls] == [("ls", '{"n": 5}')]
    assert (completion.tool_call_parser, completion.finish_reason) == ("qwen3_coder", "tool_calls")
    assert completion.matched_stop == "</tool_call>" and completion.prompt_ids == [7, 8]


def test_filters_at_their_bounds() -> None:
    x = torch.tensor([1.0, 1.0, 0.0])
    # min_p 1: only the top tokens stay (not none of them).
    assert _filter_top_k_top_p(x, None, None, 1.0).tolist() == [1.0, 1.0, INF]
    # top_p 1 keeps every token, even one too unlikely to add to the float32 sum.
    negligible = torch.tensor([0.0, -30.0])
    assert _filter_top_k_top_p(negligible, None, 1.0).tolist() == [0.0, -30.0]
