"""SGLangEngine: response parsing on every known shape (pure), then the engine against a server
built from SGLang 0.5.23's own protocol classes (tests/support/sglang_contract_server.py)."""

from __future__ import annotations

import asyncio
import copy
import json
import shutil
import socket

import orjson
import pytest
from transformers import AutoTokenizer

from polar_addon.canonical import AssistantMessage, CanonicalRequest, PolarError, SamplingParams
from polar_addon.engines import make_engine
from polar_addon.engines.local import LocalEngine
from polar_addon.engines.openai_compat import engine_error, parse_chat_response, parse_completion_response
from polar_addon.engines.scripted import ScriptedEngine
from polar_addon.engines.sglang import SGLangEngine

PROMPT = [1, 87, 512, 201]
IDS = [300, 301, 2]
LPS = [-0.5, -1.25, -0.01]
TRIPLES = [[lp, i, f"t{i}"] for lp, i in zip(LPS, IDS)]
CONTENT_LPS = {
    "content": [{"token": f"t{i}", "bytes": [], "logprob": lp, "top_logprobs": []} for lp, i in zip(LPS, IDS)]
}


def sglang_answer(**choice_extra) -> dict:
    """An SGLang 0.5.23 chat answer (fields as ChatCompletionResponse serialises them)."""
    choice = {"index": 0, "message": {"role": "assistant", "content": "hi", "reasoning_content": None},
              "logprobs": copy.deepcopy(CONTENT_LPS), "finish_reason": "stop", "matched_stop": 2}  # fmt: skip
    choice.update(choice_extra)
    return {"id": "x", "object": "chat.completion", "created": 0, "model": "tiny", "choices": [choice],
            "usage": {"prompt_tokens": 4, "completion_tokens": 3, "total_tokens": 7},
            "metadata": {"weight_version": "default"}}  # fmt: skip


META = {"id": "x", "finish_reason": {"type": "stop", "matched": 2}, "prompt_tokens": 4, "weight_version": "v7",
        "output_token_logprobs": TRIPLES, "completion_tokens": 3, "cached_tokens": 2}  # fmt: skip


@pytest.mark.parametrize(
    "data",
    [
        pytest.param(sglang_answer(prompt_token_ids=PROMPT, response_token_ids=IDS, meta_info=META), id="release"),
        pytest.param(sglang_answer(prompt_token_ids=PROMPT, token_ids=IDS, meta_info=META), id="token_ids"),
        pytest.param(sglang_answer(prompt_token_ids=PROMPT, meta_info=META), id="meta_info_only"),
        pytest.param(sglang_answer(input_token_ids=PROMPT, token_ids=IDS), id="input_token_ids"),
        pytest.param(sglang_answer(prompt_token_ids=PROMPT, response_token_ids=IDS), id="content_logprobs"),
        pytest.param(sglang_answer() | {"sglext": {"input_ids": PROMPT, "output_ids": [IDS]}}, id="sglext"),
        pytest.param(sglang_answer() | {"sglext": {"input_ids": [PROMPT], "output_ids": [IDS]}}, id="sglext_nested"),
        pytest.param(sglang_answer(token_ids=IDS) | {"prompt_token_ids": PROMPT}, id="vllm_shape"),
    ],
)
def test_every_id_shape_parses_to_the_same_tokens(data):
    parsed = parse_chat_response(data)
    assert list(parsed.prompt_ids) == PROMPT
    assert parsed.response_ids == IDS
    assert parsed.logprobs == LPS
    assert parsed.finish_reason == "stop"
    assert parsed.matched_stop is None  # an int match is a stop token, not a stop string
    assert parsed.message.content == "hi" and parsed.message.reasoning is None
    assert parsed.served_model == "tiny"
    assert parsed.weight_version in {"v7", "default"}


def test_meta_info_wins_for_weight_version_and_cache():
    parsed = parse_chat_response(sglang_answer(prompt_token_ids=PROMPT, response_token_ids=IDS, meta_info=META))
    assert (parsed.weight_version, parsed.cached_tokens) == ("v7", 2)
    data = sglang_answer(prompt_token_ids=PROMPT, response_token_ids=IDS)
    data["usage"]["prompt_tokens_details"] = {"cached_tokens": 3}
    parsed = parse_chat_response(data)
    assert (parsed.weight_version, parsed.cached_tokens) == ("default", 3)


def test_tool_calls_reasoning_and_stop_strings():
    data = sglang_answer(prompt_token_ids=PROMPT, response_token_ids=IDS, finish_reason="tool_calls", matched_stop=None)
    data["choices"][0]["message"] = {
        "role": "assistant", "content": "", "reasoning_content": "think",
        "tool_calls": [
            {"id": "call_a", "index": 0, "type": "function", "function": {"name": "ls", "arguments": {"p": "/"}}},
            {"id": None, "index": 1, "type": "function", "function": {"name": "cat", "arguments": '{"f": 1}'}},
        ],
    }  # fmt: skip
    parsed = parse_chat_response(data)
    assert parsed.finish_reason == "tool_calls"
    assert parsed.message.reasoning == "think"
    first, second = parsed.message.tool_calls
    assert (first.id, first.name, orjson.loads(first.arguments)) == ("call_a", "ls", {"p": "/"})
    assert second.id.startswith("call_") and second.arguments == '{"f": 1}'
    # A named tool_choice makes vLLM say "stop"; a parsed call still means tool_calls.
    data["choices"][0]["finish_reason"] = "stop"
    assert parse_chat_response(data).finish_reason == "tool_calls"
    # vLLM: stop_reason carries the stop string, "reasoning" the reasoning text.
    vllm = sglang_answer(token_ids=IDS, stop_reason="END") | {"prompt_token_ids": PROMPT}
    del vllm["choices"][0]["matched_stop"]
    vllm["choices"][0]["message"] = {"role": "assistant", "content": "x", "reasoning": "r"}
    parsed = parse_chat_response(vllm)
    assert (parsed.matched_stop, parsed.message.reasoning) == ("END", "r")
    # finish_reason missing on the choice: meta_info's dict says it.
    meta_only = sglang_answer(
        prompt_token_ids=PROMPT, meta_info=META | {"finish_reason": {"type": "length", "length": 3}}
    )
    meta_only["choices"][0]["finish_reason"] = None
    assert parse_chat_response(meta_only).finish_reason == "length"


def _broken(mutate):
    data = sglang_answer(prompt_token_ids=PROMPT, response_token_ids=IDS, meta_info=copy.deepcopy(META))
    mutate(data["choices"][0], data)
    return data


@pytest.mark.parametrize(
    ("data", "said"),
    [
        pytest.param(
            _broken(lambda c, d: c["meta_info"].update(output_token_logprobs=TRIPLES[:-1])),
            "meta_info.output_token_logprobs ids differ from the response token ids",
            id="triples_short",
        ),
        pytest.param(
            _broken(lambda c, d: c.update(response_token_ids=[300, 999, 2])),
            "meta_info.output_token_logprobs ids differ from the response token ids",
            id="ids_disagree",
        ),
        pytest.param(
            _broken(lambda c, d: (c.pop("meta_info"), c["logprobs"]["content"].pop())),
            "2 logprobs for 3 response tokens",
            id="content_short",
        ),
        pytest.param(
            _broken(lambda c, d: (c.pop("meta_info"), c.pop("logprobs"))),
            "no logprobs (was logprobs=true honoured?)",
            id="no_logprobs",
        ),
        pytest.param(
            _broken(lambda c, d: c.pop("prompt_token_ids")),
            "no prompt token ids (is the engine new enough to return them?)",
            id="no_prompt_ids",
        ),
        pytest.param(
            _broken(lambda c, d: c.update(prompt_token_ids="1 87 512")),
            "choices[0].prompt_token_ids is not a list of token ids",
            id="prompt_ids_not_a_list",
        ),
        pytest.param(
            _broken(lambda c, d: (c.pop("response_token_ids"), c.pop("meta_info"))),
            "no response token ids",
            id="no_response_ids",
        ),
        pytest.param(
            _broken(lambda c, d: c["meta_info"]["output_token_logprobs"][0].__setitem__(0, None)),
            "meta_info.output_token_logprobs holds a non-number logprob None",
            id="null_logprob",
        ),
        pytest.param(
            _broken(lambda c, d: c["meta_info"]["output_token_logprobs"][1].__setitem__(0, True)),
            "meta_info.output_token_logprobs holds a non-number logprob True",
            id="bool_logprob",
        ),
        pytest.param(
            _broken(lambda c, d: c["meta_info"].update(output_token_logprobs=[[-0.5]] * 3)),
            "meta_info.output_token_logprobs is not a list of [logprob, id, text]",
            id="triples_without_ids",
        ),
        pytest.param(
            _broken(lambda c, d: c["meta_info"].update(output_token_logprobs={"0": TRIPLES[0]})),
            "meta_info.output_token_logprobs is not a list of [logprob, id, text]",
            id="triples_not_a_list",
        ),
        pytest.param(
            _broken(lambda c, d: (c.pop("meta_info"), c["logprobs"]["content"][1].pop("logprob"))),
            "choices[0].logprobs.content entries without logprob",
            id="content_entry_without_logprob",
        ),
        pytest.param(
            _broken(lambda c, d: c.update(response_token_ids=["a", "b", "c"])),
            "choices[0].response_token_ids is not a list of token ids (choices[0].response_token_ids must hold",
            id="ids_not_ints",
        ),
        pytest.param(
            _broken(lambda c, d: (c.pop("response_token_ids"), c.update(token_ids=[300, -1, 2]))),
            "choices[0].token_ids holds a negative token id",
            id="negative_token_ids",
        ),
        pytest.param(
            _broken(lambda c, d: (c.pop("response_token_ids"), d.update(sglext={"output_ids": [[300, -1, 2]]}))),
            "sglext.output_ids holds a negative token id",
            id="negative_sglext_ids",
        ),
        pytest.param(
            _broken(lambda c, d: c["meta_info"]["output_token_logprobs"][0].__setitem__(1, -300)),
            "meta_info.output_token_logprobs ids holds a negative token id",
            id="negative_triple_id",
        ),
        pytest.param(
            _broken(lambda c, d: c.update(finish_reason="eos")), "unknown finish_reason 'eos'", id="unknown_finish"
        ),
        pytest.param(_broken(lambda c, d: d.update(choices=[])), "no choices", id="no_choices"),
        pytest.param(_broken(lambda c, d: d.update(choices=["x"])), "no choices", id="choice_not_an_object"),
        pytest.param(_broken(lambda c, d: c.pop("message")), "choices[0].message missing", id="no_message"),
        pytest.param(
            _broken(lambda c, d: c["message"].update(tool_calls=[{"function": {}}])),
            "tool call without a function name: {'function': {}}",
            id="nameless_call",
        ),
        pytest.param(
            _broken(lambda c, d: c["message"].update(tool_calls={"function": {"name": "ls"}})),
            "message.tool_calls is not a list",
            id="calls_not_a_list",
        ),
        pytest.param([1, 2], "not a JSON object", id="not_an_object"),
    ],
)
def test_misaligned_or_missing_fields_are_api_errors(data, said):
    """Each malformed answer is refused by the check meant for it, with what it found."""
    with pytest.raises(PolarError) as err:
        parse_chat_response(data)
    assert (err.value.status, err.value.kind) == (502, "api_error")
    assert err.value.message.startswith(f"malformed engine answer: {said}"), err.value.message


def test_a_call_without_arguments_is_an_empty_object_and_content_logprobs_serve_explicit_ids():
    data = sglang_answer(prompt_token_ids=PROMPT, token_ids=IDS, finish_reason="tool_calls")
    data["choices"][0]["message"]["tool_calls"] = [{"id": "c1", "function": {"name": "ls"}}]
    data["choices"][0]["message"]["content"] = None
    parsed = parse_chat_response(data)
    [call] = parsed.message.tool_calls
    assert (call.id, call.name, call.arguments) == ("c1", "ls", "{}") and parsed.message.content is None
    assert parsed.logprobs == LPS and parsed.response_ids == IDS  # no meta_info: the content block's logprobs
    assert type(parsed.logprobs[0]) is float
    # The ids already cut out of the answer (cut_prompt_ids) are used as given, the answer's own not read.
    cut = parse_chat_response(sglang_answer(response_token_ids=IDS), prompt_ids=[5, 6])
    assert list(cut.prompt_ids) == [5, 6]
    # An empty reasoning text is no reasoning; a vLLM-style "reasoning" field is read when reasoning_content is absent.
    data["choices"][0]["message"].update(reasoning_content="", content="x")
    assert parse_chat_response(data).message.reasoning is None
    data["choices"][0]["message"].pop("reasoning_content")
    data["choices"][0]["message"]["reasoning"] = "r"
    assert parse_chat_response(data).message.reasoning == "r"


def test_served_model_stop_string_and_cache_are_read_only_when_well_typed():
    data = sglang_answer(prompt_token_ids=PROMPT, response_token_ids=IDS, matched_stop="</end>") | {"model": 7}
    data["usage"]["prompt_tokens_details"] = {"cached_tokens": "3"}
    parsed = parse_chat_response(data)
    assert (parsed.served_model, parsed.matched_stop, parsed.cached_tokens) == (None, "</end>", None)
    meta = META | {"finish_reason": {"type": "stop", "matched": "STOP"}, "cached_tokens": 1}
    parsed = parse_chat_response(sglang_answer(prompt_token_ids=PROMPT, meta_info=meta, matched_stop=None))
    assert (parsed.matched_stop, parsed.cached_tokens, parsed.weight_version) == ("STOP", 1, "v7")


def completion_answer(**choice_extra) -> dict:
    """An SGLang 0.5.23 /v1/completions answer to a token prompt (CompletionResponse, return_token_ids, logprobs=0)."""
    choice = {
        "index": 0,
        "text": "hi",
        "prompt_token_ids": PROMPT,
        "token_ids": IDS,
        "finish_reason": "stop",
        "matched_stop": 2,
        "logprobs": {"token_logprobs": LPS, "tokens": [], "text_offset": [], "top_logprobs": []},
    }
    choice.update(choice_extra)
    return {
        "id": "x",
        "object": "text_completion",
        "created": 0,
        "model": "tiny",
        "choices": [choice],
        "usage": {"prompt_tokens": 4, "completion_tokens": 3, "total_tokens": 7},
        "metadata": {"weight_version": "v2"},
    }


def test_completion_answer_parses():
    text, parsed = parse_completion_response(completion_answer())
    assert (text, list(parsed.prompt_ids), parsed.response_ids, parsed.weight_version) == ("hi", PROMPT, IDS, "v2")


@pytest.mark.parametrize(
    ("data", "said"),
    [
        pytest.param(
            completion_answer(token_ids=[300, -1, 2]), "choices[0].token_ids holds a negative token id",
            id="negative_response_id",
        ),
        pytest.param(
            completion_answer(prompt_token_ids=[1, -87, 512, 201]),
            "choices[0].prompt_token_ids holds a negative token id", id="negative_prompt_id",
        ),
        pytest.param(
            completion_answer(token_ids=[300, 2**31, 2]),
            "choices[0].token_ids is not a list of token ids (choices[0].token_ids holds a token id outside int32",
            id="id_past_int32",
        ),
        pytest.param(completion_answer(token_ids=[300, 301]), "3 logprobs for 2 response tokens", id="misaligned"),
        pytest.param(completion_answer(token_ids=None), "no response token ids", id="no_response_ids"),
        pytest.param(completion_answer(text=None), "choices[0].text missing", id="no_text"),
        pytest.param(completion_answer(logprobs=None), "no logprobs (was logprobs honoured?)", id="no_logprobs"),
        pytest.param(
            completion_answer(logprobs={"token_logprobs": [-0.5, "x", -0.1]}),
            "choices[0].logprobs.token_logprobs holds a non-number logprob 'x'", id="text_logprob",
        ),
        pytest.param(
            completion_answer(prompt_token_ids=[]), "no prompt token ids (is the engine new enough to return them?)",
            id="no_prompt_ids",
        ),
        pytest.param(completion_answer(finish_reason="eos"), "unknown finish_reason 'eos'", id="unknown_finish"),
        pytest.param({"choices": "x"}, "no choices", id="no_choices"),
    ],
)  # fmt: skip
def test_garbage_completion_answers_are_api_errors(data, said):
    """An engine's garbage is a 502 for the caller, never a record whose ids a trainer cannot look up."""
    with pytest.raises(PolarError) as err:
        parse_completion_response(data)
    assert (err.value.status, err.value.kind) == (502, "api_error")
    assert err.value.message.startswith(f"malformed engine answer: {said}"), err.value.message


def test_a_completion_answer_in_vllms_shape():
    """vLLM: the stop string in stop_reason, the cache in usage, no weight version, a float for every logprob."""
    data = completion_answer(stop_reason="</s>", logprobs={"token_logprobs": [-1, -0.5, 0]}) | {"metadata": None}
    del data["choices"][0]["matched_stop"]
    data["usage"]["prompt_tokens_details"] = {"cached_tokens": 4}
    text, parsed = parse_completion_response(data)
    assert (text, parsed.matched_stop, parsed.cached_tokens, parsed.weight_version) == ("hi", "</s>", 4, None)
    assert parsed.logprobs == [-1.0, -0.5, 0.0] and all(type(v) is float for v in parsed.logprobs)
    assert (parsed.finish_reason, parsed.served_model, parsed.message) == ("stop", "tiny", AssistantMessage())
    assert parse_completion_response(completion_answer(matched_stop=2))[1].matched_stop is None  # a stop token id


def test_negative_ids_in_a_chat_answer_are_api_errors():
    with pytest.raises(PolarError) as err:
        parse_chat_response(sglang_answer(prompt_token_ids=PROMPT, response_token_ids=[300, -301, 2]))
    assert (err.value.status, err.value.kind) == (502, "api_error")


@pytest.mark.parametrize(
    "status,body,expected",
    [
        (
            400,
            {
                "object": "error",
                "message": "The input (9000 tokens) is longer than the model's context length (8192 tokens).",
                "type": "BadRequestError",
                "param": None,
                "code": 400,
            },
            (400, "context_length_exceeded"),
        ),  # fmt: skip
        (
            400,
            {
                "error": {
                    "message": "max_tokens=200000 cannot be greater than max_model_len=100000.",
                    "type": "BadRequestError",
                    "param": "max_tokens",
                    "code": 400,
                }
            },
            (400, "context_length_exceeded"),
        ),  # fmt: skip
        (
            400,
            {"error": {"message": "This model's maximum context length is 2048 tokens.", "code": 400}},
            (400, "context_length_exceeded"),
        ),
        (
            400,
            {"object": "error", "message": "Unknown tool 'x'", "type": "BadRequestError", "code": 400},
            (400, "invalid_request"),
        ),
        (404, {"error": {"message": "The model `gpt-9` does not exist.", "code": 404}}, (400, "invalid_request")),
        (422, {"detail": [{"loc": ["body", "messages"], "msg": "field required"}]}, (400, "invalid_request")),
        (
            500,
            {"object": "error", "message": "Internal server error: boom", "type": "InternalServerError", "code": 500},
            (502, "api_error"),
        ),
        (502, b"<html>bad gateway</html>", (502, "api_error")),
        (503, b"", (503, "overloaded")),
        (
            429,
            {"object": "error", "message": "The request queue is full.", "type": "TooManyRequests", "code": 429},
            (503, "overloaded"),
        ),
    ],
)
def test_engine_errors_map_to_canonical_kinds(status, body, expected):
    err = engine_error(status, body if isinstance(body, bytes) else json.dumps(body).encode())
    assert (err.status, err.kind) == expected
    assert err.message
    if isinstance(body, dict):
        inner = body.get("error", body)
        assert str(inner.get("message", "field required")) in err.message or "field required" in err.message


# --- against the contract server -------------------------------------------------------------

TOOLS = [{"type": "function", "function": {"name": "ls", "description": "List a directory.",
          "parameters": {"type": "object", "properties": {"path": {"type": "string"}}}}}]  # fmt: skip
MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is in /tmp?"}]


def request(messages=MESSAGES, **sampling) -> CanonicalRequest:
    return CanonicalRequest(api="openai_chat", model="client-name", messages=messages, tools=TOOLS, tool_choice="auto",
                            sampling=SamplingParams(**sampling))  # fmt: skip


@pytest.fixture(scope="module")
def server(sglang_protocol, tiny_model_dir):
    from tests.support.sglang_contract_server import SGLangContractServer

    with SGLangContractServer(LocalEngine(tiny_model_dir), protocol=sglang_protocol, context_len=4096) as srv:
        yield srv


async def _call(url: str, req: CanonicalRequest, timeout_s: float = 60):
    engine = SGLangEngine(url, timeout_s=timeout_s)
    try:
        return await engine.complete(req)
    finally:
        await engine.close()


@pytest.mark.parametrize("variant", ["release", "token_ids", "sglext", "meta_info_only"])
def test_engine_reads_every_sglang_build(server, tiny_model_dir, variant):
    req = request(temperature=0.8, top_p=0.95, max_tokens=12, seed=4)
    with server.configured(variant=variant):
        completion = asyncio.run(_call(server.url, req))
    sent = server.requests[-1]
    assert (
        sent["return_token_ids"] and sent["return_prompt_token_ids"] and sent["return_meta_info"] and sent["logprobs"]
    )
    assert sent["model"] == "tiny" and sent["stream"] is False and sent["tool_choice"] == "auto"
    assert (sent["temperature"], sent["top_p"], sent["max_tokens"], sent["seed"]) == (0.8, 0.95, 12, 4)

    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    text = tok.apply_chat_template(MESSAGES, tools=TOOLS, add_generation_prompt=True, tokenize=False)
    assert list(completion.prompt_ids) == tok(text, add_special_tokens=False)["input_ids"]
    # The same seeded request run in-process gives the tokens and logprobs SGLang's shapes carried.
    direct = asyncio.run(LocalEngine(tiny_model_dir).complete(req))
    assert completion.response_ids == direct.response_ids
    assert completion.logprobs == pytest.approx(direct.logprobs, abs=1e-6)
    assert completion.finish_reason == "length"
    assert completion.served_model == "tiny"
    assert completion.weight_version == "default"
    assert completion.engine == f"sglang:{server.url}"
    assert completion.message.content == direct.message.content


def test_stop_string_and_thinking_flag(server):
    free_run = asyncio.run(_call(server.url, request(temperature=1.0, max_tokens=24, seed=11)))
    text = free_run.message.content or ""
    stop = text[len(text) // 2 : len(text) // 2 + 3]
    req = request(temperature=1.0, max_tokens=24, seed=11, stop=[stop])
    req.enable_thinking = False
    cut = asyncio.run(_call(server.url, req))
    assert server.requests[-1]["chat_template_kwargs"] == {"enable_thinking": False}
    assert server.requests[-1]["stop"] == [stop]
    assert (cut.finish_reason, cut.matched_stop) == ("stop", stop)
    assert cut.response_ids == free_run.response_ids[: len(cut.response_ids)]


def test_count_tokens_uses_sglang_tokenize(server):
    async def both():
        engine = SGLangEngine(server.url, timeout_s=60)
        try:
            return await engine.count_tokens(request()), await engine.complete(request(max_tokens=2))
        finally:
            await engine.close()

    count, completion = asyncio.run(both())
    assert count == len(completion.prompt_ids)
    assert server.requests[-2]["tools"] == TOOLS


def test_tool_calls_through_sglang_shape(sglang_protocol, tiny_model_dir, tmp_path):
    from tests.support.sglang_contract_server import SGLangContractServer

    script = tmp_path / "script.json"
    script.write_text(json.dumps({"model_dir": str(tiny_model_dir), "turns": [
        {"content": "Listing.", "tool_calls": [
            {"type": "function", "function": {"name": "ls", "arguments": {"path": "/tmp"}}}]}]}))  # fmt: skip
    with SGLangContractServer(ScriptedEngine(script), protocol=sglang_protocol) as srv:
        completion = asyncio.run(_call(srv.url, request(temperature=1.0)))
    assert completion.finish_reason == "tool_calls"
    assert completion.matched_stop is None
    [call] = completion.message.tool_calls
    assert (call.name, orjson.loads(call.arguments)) == ("ls", {"path": "/tmp"})
    assert completion.message.content == "Listing."
    assert completion.tool_call_parser == "engine"
    assert completion.response_ids[-1] == AutoTokenizer.from_pretrained(tiny_model_dir).convert_tokens_to_ids(
        "<|im_end|>"
    )


def test_fenced_json_fallback_on_the_chat_endpoint(sglang_protocol, tiny_model_dir, tmp_path):
    """The server parsed no call (a small model's fenced JSON is not its format): opted in (hermes+fenced_json),
    HTTPEngine.complete, the chat path SGLang and vLLM share, turns the fenced call into one; by default it stays
    text. The tokens are the engine's either way."""
    from polar_addon.engines import EngineSettings
    from polar_addon.tool_parsers import ParserChoice
    from tests.support.sglang_contract_server import SGLangContractServer

    fenced = 'Listing.\n\n```json\n{"name": "ls", "arguments": {"path": "/tmp"}}\n```'
    script = tmp_path / "script.json"
    script.write_text(json.dumps({"model_dir": str(tiny_model_dir), "turns": [{"content": fenced}]}))

    async def both(url: str):
        answers = []
        for spec in ("hermes+fenced_json", "hermes"):
            engine = SGLangEngine(url, timeout_s=60)
            engine.configure(EngineSettings(tool_parsers=ParserChoice(spec)))
            try:
                answers.append(await engine.complete(request(temperature=1.0)))
            finally:
                await engine.close()
        return answers

    with SGLangContractServer(ScriptedEngine(script), protocol=sglang_protocol) as srv:
        on, off = asyncio.run(both(srv.url))
    assert (on.finish_reason, on.tool_call_parser, on.message.content) == ("tool_calls", "fenced_json", "Listing.")
    [call] = on.message.tool_calls
    assert (call.name, orjson.loads(call.arguments)) == ("ls", {"path": "/tmp"})
    assert (off.finish_reason, off.tool_call_parser, off.message.content, off.message.tool_calls) == (
        "stop", None, fenced, [])  # fmt: skip
    assert list(on.response_ids) == list(off.response_ids) and list(on.prompt_ids) == list(off.prompt_ids)
    assert on.parse_failures is None  # the engine parsed the text: polar counts no failures


@pytest.mark.parametrize(
    "fail,expected",
    [
        ("internal", (502, "api_error")),
        ("misaligned", (502, "api_error")),
        ("no_ids", (502, "api_error")),
        ("not_json", (502, "api_error")),
    ],  # fmt: skip
)
def test_engine_faults(server, fail, expected):
    with server.configured(fail=fail), pytest.raises(PolarError) as err:
        asyncio.run(_call(server.url, request(max_tokens=3)))
    assert (err.value.status, err.value.kind) == expected


def test_context_length_and_invalid_requests(server):
    long = [{"role": "user", "content": "alpha beta gamma " * 2000}]
    with pytest.raises(PolarError) as err:
        asyncio.run(_call(server.url, request(messages=long, max_tokens=3)))
    assert (err.value.status, err.value.kind) == (400, "context_length_exceeded")
    assert "context length (4096 tokens)" in err.value.message
    with pytest.raises(PolarError) as err:
        asyncio.run(_call(server.url, request(messages=[{"role": "nobody", "content": "x"}], max_tokens=3)))
    assert (err.value.status, err.value.kind) == (400, "invalid_request")
    assert "validation error" in err.value.message


def test_timeout_and_unreachable(server):
    with server.configured(delay_s=2.0), pytest.raises(PolarError) as err:
        asyncio.run(_call(server.url, request(max_tokens=2), timeout_s=0.5))
    assert (err.value.status, err.value.kind) == (504, "timeout")
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    with pytest.raises(PolarError) as err:
        asyncio.run(_call(f"http://127.0.0.1:{port}", request(max_tokens=2)))
    assert (err.value.status, err.value.kind) == (503, "overloaded")
    # Clients never learn where the engine lives.
    assert str(port) not in err.value.message and "127.0.0.1" not in err.value.message


def test_update_weights_from_disk(sglang_protocol, tiny_model_dir, tmp_path):
    from tests.support.sglang_contract_server import SGLangContractServer

    checkpoint = shutil.copytree(tiny_model_dir, tmp_path / "step-1")

    async def scenario(url):
        engine = make_engine(f"sglang:{url}", timeout_s=60)
        assert isinstance(engine, SGLangEngine)
        try:
            before = await engine.complete(request(max_tokens=2))
            answer = await engine.update_weights(str(checkpoint), weight_version="step-1")
            after = await engine.complete(request(max_tokens=2))
            with pytest.raises(PolarError) as err:
                await engine.update_weights(str(tmp_path / "missing"))
            return before, answer, after, err.value
        finally:
            await engine.close()

    with SGLangContractServer(LocalEngine(tiny_model_dir), protocol=sglang_protocol) as srv:
        before, answer, after, err = asyncio.run(scenario(srv.url))
        assert srv.requests[-3] == {"model_path": str(checkpoint), "weight_version": "step-1"}
    assert (before.weight_version, after.weight_version) == ("default", "step-1")
    assert answer["success"] is True
    assert err.status == 400 and "missing" in err.message


def test_thinking_flag_reaches_a_template_that_reads_it(sglang_protocol, thinking_model_dir):
    """Through SGLang's chat_template_kwargs to a Qwen3-style template: off opens an empty think block."""
    from tests.support.sglang_contract_server import SGLangContractServer

    local = LocalEngine(thinking_model_dir)
    with SGLangContractServer(local, protocol=sglang_protocol) as srv:
        prompts, counts = {}, {}

        async def count(req: CanonicalRequest) -> int:
            engine = SGLangEngine(srv.url, timeout_s=60)
            try:
                return await engine.count_tokens(req)
            finally:
                await engine.close()

        for flag in (None, False):
            req = request(temperature=0, max_tokens=2)
            req.enable_thinking = flag
            prompts[flag] = list(asyncio.run(_call(srv.url, req)).prompt_ids)
            counts[flag] = asyncio.run(count(req))
        assert counts == {flag: len(ids) for flag, ids in prompts.items()}
        assert srv.requests[0].get("chat_template_kwargs") is None
        generation_bodies = [r for r in srv.requests if "max_tokens" in r]
        assert generation_bodies[1]["chat_template_kwargs"] == {"enable_thinking": False}
    assert prompts[False] == prompts[None] + local.encode("<think>\n\n</think>\n\n")


# --- token input: /v1/completions with a token-id prompt (continuity.chains) ------------------------------------------


def _prompt_ids(tiny_model_dir) -> list[int]:
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    text = tok.apply_chat_template(MESSAGES, tools=TOOLS, add_generation_prompt=True, tokenize=False)
    return tok(text, add_special_tokens=False)["input_ids"]


async def _tokens(url: str, req: CanonicalRequest, prompt_ids: list[int]):
    engine = SGLangEngine(url, timeout_s=60)
    try:
        return await engine.complete_tokens(req, prompt_ids)
    finally:
        await engine.close()


def test_token_input_request_and_answer(server, tiny_model_dir):
    """The body SGLang's CompletionRequest validated, and an answer equal to the same seeded chat call's."""
    prompt = _prompt_ids(tiny_model_dir)
    req = request(temperature=0.8, top_p=0.95, max_tokens=12, seed=4)
    completion = asyncio.run(_tokens(server.url, req, prompt))
    assert server.requests[-1] == {
        "model": "tiny", "prompt": prompt, "max_tokens": 12, "seed": 4, "temperature": 0.8, "top_p": 0.95, "top_k": -1,
        "min_p": 0.0, "repetition_penalty": 1.0, "logprobs": 0, "return_token_ids": True, "stream": False,
    }  # fmt: skip
    assert list(completion.prompt_ids) == prompt == server.completion_prompts[-1]
    # The chat render of the same messages is this prompt: the same seeded request samples the same tokens.
    direct = asyncio.run(LocalEngine(tiny_model_dir).complete(req))
    assert completion.response_ids == direct.response_ids
    assert completion.logprobs == pytest.approx(direct.logprobs, abs=1e-6)
    assert completion.message.content == direct.message.content  # polar parsed the text SGLang detokenized
    assert (completion.finish_reason, completion.weight_version, completion.parse_failures) == ("length", "default", 0)
    assert completion.engine == f"sglang:{server.url}" and completion.served_model == "tiny"


def test_token_input_without_max_tokens_asks_for_the_rest_of_the_window(sglang_protocol, tiny_model_dir):
    from tests.support.sglang_contract_server import SGLangContractServer

    prompt = _prompt_ids(tiny_model_dir)
    # CompletionRequest reads a missing max_tokens as 16; the chat endpoint as the rest of the window.
    with SGLangContractServer(
        LocalEngine(tiny_model_dir), protocol=sglang_protocol, context_len=len(prompt) + 5
    ) as srv:
        completion = asyncio.run(_tokens(srv.url, request(temperature=1.0, seed=3), prompt))
        assert srv.requests[-1]["max_tokens"] == 5
    assert len(completion.response_ids) <= 5


@pytest.mark.parametrize(
    "fail,expected",
    [
        ("internal", (502, "api_error")),
        ("misaligned", (502, "api_error")),
        ("no_ids", (502, "api_error")),
        ("not_json", (502, "api_error")),
    ],  # fmt: skip
)
def test_token_input_faults(server, tiny_model_dir, fail, expected):
    with server.configured(fail=fail), pytest.raises(PolarError) as err:
        asyncio.run(_tokens(server.url, request(max_tokens=3), _prompt_ids(tiny_model_dir)))
    assert (err.value.status, err.value.kind) == expected


def test_token_input_past_the_window_is_a_context_length_error(server):
    with pytest.raises(PolarError) as err:
        asyncio.run(_tokens(server.url, request(max_tokens=3), [1] * 5000))
    assert (err.value.status, err.value.kind) == (400, "context_length_exceeded")
