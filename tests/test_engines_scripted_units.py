"""The scripted test engine (engines.scripted) on a stand-in for its local model: a character tokenizer (one id per
character, ``>`` followed by a newline merged into one id, as real BPE merges across a prompt's end, and a letter that
opens the text given its word-initial id, as SentencePiece's leading ``▁`` makes text encoded alone differ) and a chat
template that ends each message with an end-of-turn character and a newline. What is checked is what the engine
records for training: which scripted turn answers (by the count of assistant turns, per model, after a compaction),
its response ids cut just after the end-of-turn token, those ids scored after exactly the prompt (or the given token
prompt) at the request's temperature, a turn cut by max_tokens decoded and parsed, and each refusal in its words.
The real tokenizer and template are in tests/test_engine_scripted.py (seconds: it loads the tiny model)."""

from __future__ import annotations

import asyncio
import threading
import time
from pathlib import Path
from typing import Any

import orjson
import pytest

from polar_addon.canonical import CanonicalRequest, PolarError, SamplingParams
from polar_addon.context_compaction import POLAR_SUMMARY_PREFIX
from polar_addon.engines import EngineSettings
from polar_addon.engines.scripted import ScriptedEngine, _normalise_turn
from polar_addon.tool_parsers import ParserChoice

EOT = "\x03"  # the template's end-of-turn character (its id, 3, is the model's eos)
MERGED = 999  # ">\n" as one token
INITIAL = 1000  # added to the id of a letter that opens the encoded text


class FakeLocal:
    """What ScriptedEngine asks of its LocalEngine, with every call it gets recorded."""

    def __init__(self, eos_ids: set[int] | None = None, window: int = 10_000, continuation_marker: bool = True) -> None:
        self.lock = threading.Lock()
        self.eos_ids = {3} if eos_ids is None else eos_ids
        self.window = window
        self.weight_version = "step-9"
        self.served_model = "tiny-served"
        self.tool_parsers = ParserChoice()
        self.continuation_marker = continuation_marker
        self.rendered: list[tuple[Any, ...]] = []
        self.checked: list[int] = []
        self.scored: list[tuple[list[int], list[int], float]] = []
        self.calls: list[Any] = []

    def render_text(
        self, messages: list[dict[str, Any]], tools: Any, *, add_generation_prompt: bool, enable_thinking: Any
    ) -> str:
        self.rendered.append((len(messages), tools, add_generation_prompt, enable_thinking))
        text = "".join(f"<{m['role']}>{_text(m)}{EOT}\n" for m in messages)
        if add_generation_prompt:  # a template whose generation prompt is not how it renders a turn: "<model>"
            text += "<assistant>" if self.continuation_marker else "<model>"
        return text

    def encode(self, text: str) -> list[int]:
        ids, i = [], 0
        while i < len(text):
            if text.startswith(">\n", i):
                ids.append(MERGED)
                i += 2
            else:
                ids.append(ord(text[i]) + (INITIAL if i == 0 and text[i].isalpha() else 0))
                i += 1
        return ids

    def decode(self, ids: list[int]) -> str:
        return "".join(">\n" if i == MERGED else chr(i % INITIAL) for i in ids)

    def check_context(self, n: int) -> None:
        self.checked.append(n)
        if n > self.window:
            raise PolarError(400, "context_length_exceeded", f"{n} > {self.window}")

    def score(self, prompt: list[int], response: list[int], temperature: float) -> list[float]:
        self.scored.append((list(prompt), list(response), temperature))
        return [-0.5 - i for i in range(len(response))]

    def configure(self, settings: EngineSettings) -> None:
        self.calls.append(("configure", settings))

    def load(self) -> None:
        self.calls.append("load")

    def continuation(self, **kwargs: Any) -> str:
        self.calls.append(("continuation", kwargs))
        return "delta"

    async def count_tokens(self, request: CanonicalRequest) -> int:
        self.calls.append(("count_tokens", request))
        return 42

    async def close(self) -> None:
        self.calls.append("close")


def _text(message: dict[str, Any]) -> str:
    text = message.get("content") or ""
    for call in message.get("tool_calls") or []:
        fn = call["function"]
        text += f'<tool_call>\n{{"name": "{fn["name"]}", "arguments": {fn["arguments"]}}}\n</tool_call>'
    return text


def script(tmp_path: Path, **data: Any) -> Path:
    path = tmp_path / "run.json"
    path.write_bytes(orjson.dumps({"model_dir": "model", **data}))
    return path


def engine(tmp_path: Path, local: FakeLocal | None = None, **data: Any) -> tuple[ScriptedEngine, FakeLocal]:
    scripted = ScriptedEngine(script(tmp_path, **data))
    scripted.local = local or FakeLocal()  # type: ignore[assignment]
    return scripted, scripted.local  # type: ignore[return-value]


def request(
    assistant_turns: int = 0,
    model: str = "m",
    max_tokens: int | None = None,
    temperature: float | None = 0.5,
    messages: list[dict[str, Any]] | None = None,
    thinking: bool | None = None,
    tools: list[dict[str, Any]] | None = None,
) -> CanonicalRequest:
    history: list[dict[str, Any]] = [{"role": "user", "content": "go"}]
    for i in range(assistant_turns):
        history += [{"role": "assistant", "content": f"a{i}"}, {"role": "user", "content": f"u{i}"}]
    return CanonicalRequest(
        api="openai_chat",
        model=model,
        messages=messages if messages is not None else history,
        tools=tools or [],
        enable_thinking=thinking,
        sampling=SamplingParams(max_tokens=max_tokens, temperature=temperature),
    )


LS = [{"type": "function", "function": {"name": "ls", "parameters": {"type": "object"}}}]
TURNS = [{"content": "one"}, {"content": "two"}, {"content": "three"}]


# --- the script ----------------------------------------------------------------------------------------------


def test_a_script_takes_its_options_and_its_model_dir_relative_to_itself(tmp_path: Path) -> None:
    path = script(tmp_path, turns=TURNS, cycle=False, latency_s=0.25, max_len=96, summary="S")
    scripted = ScriptedEngine(path)
    assert (scripted.kind, scripted.name) == ("scripted", f"scripted:{path}")
    assert (scripted.cycle, scripted.latency_s, scripted.summary, scripted.after_compaction) == (False, 0.25, "S", [])
    assert scripted.local.model_dir == str(tmp_path / "model")
    assert scripted.local.max_len_override == 96
    assert [t["content"] for t in scripted.turns] == ["one", "two", "three"]
    absolute = tmp_path / "elsewhere"
    path.write_bytes(orjson.dumps({"model_dir": str(absolute), "turns": TURNS}))
    defaults = ScriptedEngine(str(path))
    assert defaults.local.model_dir == str(absolute)
    assert (defaults.cycle, defaults.latency_s, defaults.summary, defaults.local.max_len_override) == (
        True,
        0.0,
        None,
        0,
    )
    assert defaults.by_model == {}


@pytest.mark.parametrize(
    ("data", "message"),
    [
        ({"turns": []}, "'turns' must be a non-empty list"),
        ({}, "'turns' must be a non-empty list"),
        ({"turns": {"content": "x"}}, "'turns' must be a non-empty list"),
        ({"turns": TURNS, "by_model": ["x"]}, "'by_model' must map model names to non-empty lists of turns"),
        ({"turns": TURNS, "by_model": {"a": []}}, "'by_model' must map model names to non-empty lists of turns"),
        ({"turns": TURNS, "by_model": {"a": {"content": "x"}}},
         "'by_model' must map model names to non-empty lists of turns"),
        ({"turns": TURNS, "by_model": {"a": TURNS, "b": []}},
         "'by_model' must map model names to non-empty lists of turns"),
    ],
)  # fmt: skip
def test_a_malformed_script_is_refused_naming_the_file(tmp_path: Path, data: dict[str, Any], message: str) -> None:
    path = script(tmp_path, **data)
    with pytest.raises(ValueError) as err:
        ScriptedEngine(path)
    assert str(err.value) == f"{path}: {message}"


def test_by_model_alone_needs_no_turns_and_other_models_are_refused(tmp_path: Path) -> None:
    scripted, _ = engine(tmp_path, by_model={"claude": [{"content": "c0"}, {"content": "c1"}]})
    assert scripted.turns == []
    assert scripted.turn_for(request(1, model="claude"))["content"] == "c1"
    with pytest.raises(PolarError) as err:
        scripted.turn_for(request(0, model="gpt"))
    assert (err.value.status, err.value.kind) == (400, "invalid_request")
    assert err.value.message == "script has no turns for model 'gpt'"


def test_a_requests_model_picks_its_turns_and_any_other_gets_the_default(tmp_path: Path) -> None:
    scripted, _ = engine(tmp_path, turns=TURNS, by_model={"claude": [{"content": "c0"}]})
    assert scripted.turn_for(request(0, model="claude"))["content"] == "c0"
    assert scripted.turn_for(request(0, model="gpt"))["content"] == "one"


def test_each_turn_is_normalised_to_an_openai_assistant_message() -> None:
    turn = {
        "content": "reading",
        "reasoning": "think",
        "tool_calls": [
            {"id": "call_7", "type": "function", "function": {"name": "read", "arguments": {"path": "a", "n": 2}}},
            {"name": "ls"},  # a flat call, no arguments
            {"function": {"name": "cat", "arguments": '{"raw": true}'}},
        ],
    }
    assert _normalise_turn(turn, 0) == {
        "role": "assistant",
        "content": "reading",
        "reasoning_content": "think",
        "tool_calls": [
            {"id": "call_7", "type": "function", "function": {"name": "read", "arguments": '{"path":"a","n":2}'}},
            {"id": None, "type": "function", "function": {"name": "ls", "arguments": "{}"}},
            {"id": None, "type": "function", "function": {"name": "cat", "arguments": '{"raw": true}'}},
        ],
    }
    # reasoning_content wins over reasoning; an empty one is left out, as are empty calls.
    both = _normalise_turn({"content": "x", "reasoning_content": "rc", "reasoning": "r"}, 1)
    assert both == {"role": "assistant", "content": "x", "reasoning_content": "rc"}
    assert _normalise_turn({"content": "x", "reasoning": "", "tool_calls": []}, 2) == {
        "role": "assistant",
        "content": "x",
    }
    assert _normalise_turn({"reasoning_content": "only thinking"}, 3)["content"] is None
    assert _normalise_turn({"tool_calls": [{"name": "ls"}]}, 4)["content"] is None


@pytest.mark.parametrize(
    ("turn", "message"),
    [
        ("hello", "turn 5 is not an object"),
        ({}, "turn 5 is empty"),
        ({"content": "", "tool_calls": [], "reasoning": ""}, "turn 5 is empty"),
        ({"tool_calls": [{"function": {}}]}, "turn 5: tool call without a function name: {'function': {}}"),
        ({"tool_calls": [{"function": "ls"}]}, "turn 5: tool call without a function name: {'function': 'ls'}"),
        ({"tool_calls": [{"name": 3}]}, "turn 5: tool call without a function name: {'name': 3}"),
        ({"tool_calls": ["ls"]}, "turn 5: tool call without a function name: 'ls'"),
    ],
)
def test_a_malformed_turn_is_refused_with_its_index(turn: Any, message: str) -> None:
    with pytest.raises(ValueError) as err:
        _normalise_turn(turn, 5)
    assert str(err.value) == message


def test_a_malformed_turn_in_a_script_names_its_place_in_its_list(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="^turn 1 is empty$"):
        ScriptedEngine(script(tmp_path, turns=[{"content": "a"}, {}]))
    with pytest.raises(ValueError, match="^turn 1 is empty$"):
        ScriptedEngine(script(tmp_path, by_model={"m": [{"content": "a"}, {}]}))
    with pytest.raises(ValueError, match="^turn 0 is not an object$"):
        ScriptedEngine(script(tmp_path, turns=TURNS, after_compaction=["x"]))


# --- which turn answers ------------------------------------------------------------------------------------------


def test_the_turn_is_the_count_of_assistant_turns_and_cycles_past_the_last(tmp_path: Path) -> None:
    scripted, _ = engine(tmp_path, turns=TURNS)
    assert [scripted.turn_for(request(n))["content"] for n in range(7)] == [
        "one",
        "two",
        "three",
        "one",
        "two",
        "three",
        "one",
    ]


def test_without_cycle_the_last_turn_answers_and_one_past_it_is_refused(tmp_path: Path) -> None:
    scripted, _ = engine(tmp_path, turns=TURNS, cycle=False)
    assert scripted.turn_for(request(2))["content"] == "three"
    with pytest.raises(PolarError) as err:
        scripted.turn_for(request(3))
    assert (err.value.status, err.value.kind) == (400, "invalid_request")
    assert err.value.message == "script has 3 turns; the request already holds 3"


def test_a_compaction_call_gets_the_summary_whatever_turn_is_due(tmp_path: Path) -> None:
    scripted, _ = engine(tmp_path, turns=TURNS, summary="The summary.")
    compaction = request(messages=[
        {"role": "user", "content": "go"}, {"role": "assistant", "content": "a0"},
        {"role": "user", "content": "Your task is to create a detailed summary of the conversation so far"},
    ])  # fmt: skip
    assert scripted.turn_for(compaction) == {"role": "assistant", "content": "The summary."}
    plain, _ = engine(tmp_path, turns=TURNS)  # no summary scripted: the due turn
    assert plain.turn_for(compaction)["content"] == "two"
    assert scripted.turn_for(request(1))["content"] == "two"  # any other call: the due turn


def test_a_compacted_history_replays_the_after_compaction_turns_counted_from_the_summary(tmp_path: Path) -> None:
    after = [{"content": "fresh0"}, {"content": "fresh1"}, {"content": "fresh2"}]
    scripted, _ = engine(tmp_path, turns=TURNS, after_compaction=after)
    summary = {"role": "user", "content": POLAR_SUMMARY_PREFIX + " it went well"}
    old = [{"role": "assistant", "content": "x"}, {"role": "user", "content": "y"}]
    # Assistant turns before the last summary do not count; those after it do.
    messages = [summary, *old, summary, {"role": "assistant", "content": "z"}, {"role": "user", "content": "w"}]
    assert scripted.turn_for(request(messages=messages))["content"] == "fresh1"
    assert scripted.turn_for(request(messages=[summary]))["content"] == "fresh0"
    assert scripted.turn_for(request(messages=[*old, summary, *old, *old]))["content"] == "fresh2"
    without, _ = engine(tmp_path, turns=TURNS)  # no after_compaction: the history's own count
    assert without.turn_for(request(messages=messages))["content"] == "three"
    assert scripted.turn_for(request(2))["content"] == "three"  # an uncompacted history: the script's turns


# --- the tokens recorded -----------------------------------------------------------------------------------------


def test_a_turn_is_its_template_tokens_up_to_the_end_of_turn_scored_after_the_prompt(tmp_path: Path) -> None:
    scripted, local = engine(tmp_path, turns=[{"content": "hi"}])
    req = request(0, temperature=0.5, thinking=False)
    completion = scripted._complete_sync(req)
    prompt = local.encode(f"<user>go{EOT}\n<assistant>")
    response = [ord("h"), ord("i"), 3]  # the end-of-turn token, not the newline after it
    assert (list(completion.prompt_ids), completion.response_ids) == (prompt, response)
    assert local.scored == [(prompt, response, 0.5)]
    assert completion.logprobs == [-0.5, -1.5, -2.5]
    assert local.rendered == [(1, [], True, False), (2, [], False, False)]
    assert local.checked == [len(prompt)]
    assert (completion.message.content, completion.finish_reason, completion.parse_failures) == ("hi", "stop", None)
    assert (completion.served_model, completion.engine, completion.weight_version) == (
        "tiny-served",
        f"scripted:{tmp_path / 'run.json'}",
        "step-9",
    )
    assert completion.tool_call_parser is None


def test_without_a_temperature_the_turn_is_scored_at_one(tmp_path: Path) -> None:
    scripted, local = engine(tmp_path, turns=[{"content": "hi"}])
    scripted._complete_sync(request(0, temperature=None))
    assert local.scored[-1][2] == 1.0


def test_a_turn_the_whole_render_tokenizes_across_the_prompts_end_is_its_own_texts_tokens(tmp_path: Path) -> None:
    # "<assistant>" ends the prompt; the turn opens with a newline, so the whole render merges ">\n".
    scripted, local = engine(tmp_path, turns=[{"content": "\nok"}])
    completion = scripted._complete_sync(request(0))
    assert completion.response_ids == [ord("\n"), ord("o"), ord("k"), 3]
    assert list(completion.prompt_ids) == local.encode(f"<user>go{EOT}\n<assistant>")


def test_a_template_that_does_not_continue_the_prompt_is_refused(tmp_path: Path) -> None:
    scripted, _ = engine(tmp_path, FakeLocal(continuation_marker=False), turns=[{"content": "hi"}])
    with pytest.raises(PolarError) as err:
        scripted._complete_sync(request(0))
    assert (err.value.status, err.value.kind) == (502, "api_error")
    assert err.value.message == "scripted turn: the chat template does not render it as a continuation of the prompt"


def test_a_render_without_an_end_of_turn_token_is_refused(tmp_path: Path) -> None:
    scripted, _ = engine(tmp_path, FakeLocal(eos_ids={0}), turns=[{"content": "hi"}])
    with pytest.raises(PolarError) as err:
        scripted._complete_sync(request(0))
    assert (err.value.status, err.value.kind) == (502, "api_error")
    assert err.value.message == "scripted turn: the chat template rendered no end-of-turn token"


def test_the_first_end_of_turn_token_ends_the_turn(tmp_path: Path) -> None:
    scripted, _ = engine(tmp_path, FakeLocal(eos_ids={3, ord("i")}), turns=[{"content": "hi"}])
    assert scripted._complete_sync(request(0)).response_ids == [ord("h"), ord("i")]


def test_token_input_scores_the_turn_after_exactly_the_given_prompt(tmp_path: Path) -> None:
    scripted, local = engine(tmp_path, turns=[{"content": "hi"}])
    given = [5, 6, 7, 8, 9]
    completion = scripted._complete_sync(request(0), given)
    assert list(completion.prompt_ids) == given
    assert local.scored == [(given, [ord("h"), ord("i"), 3], 0.5)]
    rendered_prompt = len(local.encode(f"<user>go{EOT}\n<assistant>"))
    assert local.checked == [rendered_prompt, 5]  # the given prompt is held to the window too


def test_a_given_prompt_past_the_window_is_refused(tmp_path: Path) -> None:
    scripted, _ = engine(tmp_path, FakeLocal(window=30), turns=[{"content": "hi"}])
    with pytest.raises(PolarError) as err:
        scripted._complete_sync(request(0), list(range(31)))
    assert err.value.message == "31 > 30"
    assert scripted._complete_sync(request(0), list(range(30))).prompt_ids == list(range(30))


def test_a_turn_of_exactly_max_tokens_is_whole_and_one_more_token_cuts_it(tmp_path: Path) -> None:
    call = {"function": {"name": "ls", "arguments": {"p": 1}}}
    scripted, local = engine(tmp_path, turns=[{"content": "hi", "tool_calls": [call]}])
    whole_ids = scripted._complete_sync(request(0)).response_ids
    n = len(whole_ids)
    whole = scripted._complete_sync(request(0, max_tokens=n))
    assert whole.response_ids == whole_ids and whole.finish_reason == "tool_calls"
    assert (whole.parse_failures, whole.tool_call_parser) == (None, "engine")
    [given] = whole.message.tool_calls
    assert (given.name, given.arguments) == ("ls", '{"p":1}') and given.id.startswith("call_")
    # One token short: the end-of-turn token goes, the text is decoded and read by hermes (here, in full).
    cut = scripted._complete_sync(request(0, max_tokens=n - 1))
    assert cut.response_ids == whole_ids[: n - 1] and cut.finish_reason == "length"
    assert local.scored[-1] == (local.scored[-2][0], whole_ids[: n - 1], 0.5)
    assert (cut.parse_failures, cut.tool_call_parser, cut.message.content) == (0, "hermes", "hi")
    assert [(c.name, c.arguments) for c in cut.message.tool_calls] == [("ls", '{"p":1}')]
    # Cut inside the call: the unfinished block counts as a failure and no call is made up.
    short = scripted._complete_sync(request(0, max_tokens=16))
    assert short.response_ids == whole_ids[:16] and short.finish_reason == "length"
    assert (short.message.tool_calls, short.tool_call_parser) == ([], None)
    assert short.parse_failures == 1


def test_a_cut_turn_is_read_with_the_served_models_fallbacks(tmp_path: Path) -> None:
    fenced = 'Listing.\n```json\n{"name": "ls", "arguments": {"path": "/tmp"}}\n```'
    scripted, local = engine(tmp_path, turns=[{"content": fenced}])
    local.tool_parsers = ParserChoice("tiny-served=hermes+fenced_json,hermes")
    n = len(scripted._complete_sync(request(0, tools=LS)).response_ids)
    # fenced_json only makes calls of the request's tools: the cut turn is read against them (as token input is).
    cut = scripted._complete_sync(request(0, max_tokens=n - 1, tools=LS))
    assert (cut.finish_reason, cut.tool_call_parser, cut.parse_failures) == ("length", "fenced_json", 0)
    assert [(c.name, c.arguments) for c in cut.message.tool_calls] == [("ls", '{"path":"/tmp"}')]
    untooled = scripted._complete_sync(request(0, max_tokens=n - 1))
    assert (untooled.finish_reason, untooled.tool_call_parser, untooled.message.tool_calls) == ("length", None, [])
    # A whole turn's content goes through the same fallback, as an engine server's parsed turn does.
    whole = scripted._complete_sync(request(0, tools=LS))
    assert (whole.finish_reason, whole.tool_call_parser) == ("tool_calls", "fenced_json")
    local.tool_parsers = ParserChoice("other=hermes+fenced_json,hermes")  # the served model's fallback, not another's
    assert scripted._complete_sync(request(0, max_tokens=n - 1, tools=LS)).tool_call_parser is None
    assert scripted._complete_sync(request(0, tools=LS)).tool_call_parser is None


def test_a_scripted_call_keeps_its_id_and_reasoning(tmp_path: Path) -> None:
    turn = {"reasoning_content": "hmm", "content": "x", "tool_calls": [{"id": "call_fixed", "name": "ls"}]}
    scripted, _ = engine(tmp_path, turns=[turn])
    completion = scripted._complete_sync(request(0))
    assert completion.message.reasoning == "hmm"
    assert [(c.id, c.name, c.arguments) for c in completion.message.tool_calls] == [("call_fixed", "ls", "{}")]


# --- the async face and what is passed on to the local engine ------------------------------------------------


def test_each_answer_takes_at_least_the_scripted_latency(tmp_path: Path) -> None:
    scripted, _ = engine(tmp_path, turns=[{"content": "hi"}], latency_s=0.3)
    start = time.monotonic()
    completion = asyncio.run(scripted.complete(request(0)))
    assert time.monotonic() - start >= 0.3 and completion.message.content == "hi"
    start = time.monotonic()
    tokens = asyncio.run(scripted.complete_tokens(request(0), [1, 2]))
    assert time.monotonic() - start >= 0.3 and list(tokens.prompt_ids) == [1, 2]


def test_setup_counting_continuation_and_close_go_to_the_local_engine(tmp_path: Path) -> None:
    scripted, local = engine(tmp_path, turns=[{"content": "hi"}])
    settings = EngineSettings(tool_parsers=ParserChoice("hermes"))
    scripted.configure(settings)
    scripted.load()
    req = request(0)
    assert asyncio.run(scripted.count_tokens(req)) == 42
    assert scripted.continuation(previous=[1], messages=[]) == "delta"
    asyncio.run(scripted.close())
    assert local.calls == [
        ("configure", settings),
        "load",
        ("count_tokens", req),
        ("continuation", {"previous": [1], "messages": []}),
        "close",
    ]
