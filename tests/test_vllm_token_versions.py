"""Per-token weight versions from vLLM's scale-out generate endpoint, read without a server: the spans are checked
(a label that skips, overlaps or stops short of the response would mislabel tokens for the staleness bound and
the mixed-version report), vLLM's ``default`` reads as the configured version, and the record keeps them."""

from __future__ import annotations

import orjson
import pytest

from polar_addon.canonical import AssistantMessage, CanonicalRequest, Completion, PolarError, VersionSpan
from polar_addon.capture import Identity, record_ok
from polar_addon.engines import make_engine
from polar_addon.engines.openai_compat import parse_generate_response, parse_version_spans
from polar_addon.engines.spec import EngineSpec


def _span(version: str, start: int, end: int) -> dict:
    return {"version": version, "start": start, "end": end}


def test_spans_covering_the_response_in_order_are_read_and_adjacent_equal_versions_merge() -> None:
    raw = [_span("3", 0, 4), _span("4", 4, 9)]
    assert parse_version_spans(raw, 9, None) == [VersionSpan("3", 0, 4), VersionSpan("4", 4, 9)]
    assert parse_version_spans([_span("3", 0, 2), _span("3", 2, 5)], 5, None) == [VersionSpan("3", 0, 5)]
    assert parse_version_spans(None, 0, "1") == []  # nothing sampled: nothing to label


def test_vllm_default_version_reads_as_the_configured_one_only_when_there_is_one() -> None:
    assert parse_version_spans([_span("default", 0, 3), _span("2", 3, 5)], 5, "1") == [
        VersionSpan("1", 0, 3),
        VersionSpan("2", 3, 5),
    ]
    assert parse_version_spans([_span("default", 0, 3)], 3, None) == [VersionSpan("default", 0, 3)]
    # "default" then the configured version is one span: the same weights.
    assert parse_version_spans([_span("default", 0, 3), _span("1", 3, 5)], 5, "1") == [VersionSpan("1", 0, 5)]


ENTRY = "weight_versions entry "
BOUNDS = "has non-integer bounds"
ORDER = "weight_versions do not cover the response tokens in order "


@pytest.mark.parametrize(
    ("raw", "tokens", "why"),
    [
        (None, 3, "no weight_versions (is the server started with --enable-scale-out?)"),
        ({"version": "1"}, 3, "weight_versions is not a list"),
        (["1"], 3, "weight_versions entry '1' is not an object"),
        ([_span("", 0, 3)], 3, ENTRY + "{'version': '', 'start': 0, 'end': 3} has no version"),
        ([{"version": 1, "start": 0, "end": 3}], 3, ENTRY + "{'version': 1, 'start': 0, 'end': 3} has no version"),
        ([{"version": "1", "start": 0.0, "end": 3}], 3, ENTRY + "{'version': '1', 'start': 0.0, 'end': 3} " + BOUNDS),
        ([{"version": "1", "start": 0, "end": True}], 3, ENTRY + "{'version': '1', 'start': 0, 'end': True} " + BOUNDS),
        ([_span("1", 1, 3)], 3, ORDER + "([{'version': '1', 'start': 1, 'end': 3}])"),
        ([_span("1", 0, 2), _span("2", 3, 4)], 4, "in order"),  # a gap
        ([_span("1", 0, 3), _span("2", 2, 4)], 4, "in order"),  # an overlap
        ([_span("1", 0, 0)], 0, "in order"),  # an empty span
        ([_span("1", 0, 2)], 3, "weight_versions cover 2 of 3 response tokens"),  # short
        ([_span("1", 0, 4)], 3, "weight_versions cover 4 of 3 response tokens"),  # past the end
    ],
)  # fmt: skip
def test_spans_that_do_not_label_every_token_once_are_refused(raw: object, tokens: int, why: str) -> None:
    with pytest.raises(PolarError) as err:
        parse_version_spans(raw, tokens, "1")
    assert err.value.status == 502
    message = err.value.message.removeprefix("malformed engine answer: ")
    assert message == why if why != "in order" else message.startswith("weight_versions do not cover"), message


def _generated(**choice: object) -> dict:
    base = {
        "index": 0, "finish_reason": "length", "stop_reason": None, "token_ids": [5, 6],
        "weight_versions": [_span("0", 0, 1), _span("1", 1, 2)],
        "logprobs": {"content": [{"token_id": 5, "logprob": -1.5}, {"token_id": 6, "logprob": -0.25}]},
    }  # fmt: skip
    return {"model": "policy", "prompt_token_ids": [1, 2, 3], "choices": [{**base, **choice}]}


def test_a_generate_answer_gives_ids_logprobs_finish_and_raw_spans() -> None:
    text, parsed, spans = parse_generate_response(_generated(text="ab", finish_reason="stop", stop_reason="</x>"))
    assert text == "ab" and list(parsed.prompt_ids) == [1, 2, 3] and parsed.response_ids == [5, 6]
    assert parsed.logprobs == [-1.5, -0.25] and parsed.finish_reason == "stop" and parsed.matched_stop == "</x>"
    assert parsed.served_model == "policy" and spans == [_span("0", 0, 1), _span("1", 1, 2)]
    assert parse_generate_response(_generated(stop_reason=2))[1].matched_stop is None  # a token id, not a string
    assert parse_generate_response(_generated())[0] is None  # output_mode tokens: no text


@pytest.mark.parametrize(
    ("answer", "why"),
    [
        ({"choices": []}, "no choices"),
        ({**_generated(), "prompt_token_ids": None}, "no prompt token ids (was return_token_ids honoured?)"),
        ({**_generated(), "prompt_token_ids": [1, "x"]}, "prompt_token_ids is not a list of token ids"),
        (_generated(token_ids=None), "no response token ids"),
        (_generated(token_ids=[5, "x"]), "choices[0].token_ids is not a list of token ids"),
        (_generated(logprobs=None), "no logprobs (was logprobs honoured?)"),
        (_generated(logprobs={"content": [{"token_id": 5}]}), "no logprobs (was logprobs honoured?)"),
        (_generated(logprobs={"content": [{"logprob": -1.0}]}), "1 logprobs for 2 response tokens"),
        (
            _generated(logprobs={"content": [{"logprob": -1.0}, {"logprob": "x"}]}),
            "choices[0].logprobs.content holds a non-number logprob 'x'",
        ),
        (_generated(finish_reason="weird"), "unknown finish_reason 'weird'"),
        (_generated(text=3), "choices[0].text is not text"),
        (_generated(token_ids=[5, -6]), "choices[0].token_ids holds a negative token id"),
    ],
)
def test_a_malformed_generate_answer_is_refused(answer: dict, why: str) -> None:
    with pytest.raises(PolarError) as err:
        parse_generate_response(answer)
    assert err.value.status == 502
    assert err.value.message.removeprefix("malformed engine answer: ").startswith(why), err.value.message


def test_a_generate_answer_without_a_model_name_leaves_it_unset_and_the_message_empty() -> None:
    answer = {**_generated(), "model": 7}
    _, parsed, _ = parse_generate_response(answer)
    assert parsed.served_model is None and parsed.message == AssistantMessage()
    assert parse_generate_response({k: v for k, v in _generated().items() if k != "model"})[1].served_model is None


def test_the_spec_option_turns_per_token_versions_on_for_vllm_only() -> None:
    assert make_engine("vllm:http://h:1?versions=spans", timeout_s=1).token_versions is True
    assert make_engine("vllm:http://h:1?weight_version=2", timeout_s=1).token_versions is False
    assert EngineSpec.parse("vllm:http://h:1?weight_version=2&versions=spans").token_versions
    with pytest.raises(ValueError, match="versions can only be 'spans'"):
        EngineSpec.parse("vllm:http://h:1?versions=all")
    with pytest.raises(ValueError, match="unknown option"):
        EngineSpec.parse("sglang:http://h:1?versions=spans")


def test_the_record_keeps_the_spans_as_json_and_none_when_the_engine_gave_none() -> None:
    request = CanonicalRequest(api="openai_chat", model="m", messages=[{"role": "user", "content": "hi"}])

    def record(spans: list[VersionSpan] | None) -> str | None:
        completion = Completion(
            message=AssistantMessage(content="x"), finish_reason="stop", prompt_ids=[1], response_ids=[2, 3],
            logprobs=[-0.1, -0.2], served_model="m", engine="vllm:u", weight_version="0", weight_versions=spans,
        )  # fmt: skip
        return record_ok(
            identity=Identity(session_id="s"), seq=0, request=request, completion=completion, harness=None,
            started_at=0.0, engine_latency_s=0.1,
        ).weight_versions_json  # fmt: skip

    assert orjson.loads(record([VersionSpan("0", 0, 1), VersionSpan("1", 1, 2)]) or "") == [
        _span("0", 0, 1),
        _span("1", 1, 2),
    ]
    assert record(None) is None
