"""A chat answer whose server split no reasoning (vLLM or SGLang started without --reasoning-parser, as `polar engine
serve` starts vLLM) keeps the model's ``<think>`` block in its content; polar splits it off as the token input path
and the local engine do (polar's own parsers), so one session's calls have one message shape whichever path answered
them, and an Anthropic client gets a thinking block rather than tags in its text. What a server split is kept."""

from __future__ import annotations

import pytest

from polar_addon.canonical import AssistantMessage, CanonicalRequest
from polar_addon.engines.openai_compat import parse_chat_response, split_think
from polar_addon.engines.vllm import VLLMEngine
from polar_addon.tool_parsers.hermes import parse


def _answer(message: dict) -> dict:
    """A vLLM /v1/chat/completions answer (return_token_ids, logprobs) with ``message``."""
    return {
        "id": "chatcmpl-1", "object": "chat.completion", "model": "tiny", "prompt_token_ids": [1, 2, 3],
        "choices": [{
            "index": 0, "finish_reason": "stop", "token_ids": [7, 8, 9], "message": {"role": "assistant", **message},
            "logprobs": {"content": [{"token": "t", "logprob": -0.5, "bytes": [116], "top_logprobs": []}] * 3},
        }],
        "usage": {"prompt_tokens": 3, "completion_tokens": 3, "total_tokens": 6},
    }  # fmt: skip


@pytest.mark.parametrize(
    ("content", "reasoning", "rest"),
    [
        ("<think>\nplan the fix\n</think>\n\nThe answer.", "plan the fix", "The answer."),
        ("plan without the opening tag\n</think>\n\nThe answer.", "plan without the opening tag", "The answer."),
        ("<think>\ncut off while thinking", "cut off while thinking", ""),  # max_tokens hit inside the block
        ("<think></think>\n\nJust the answer.", None, "Just the answer."),  # thinking disabled: the tags go
    ],
)
def test_a_think_block_in_the_content_becomes_the_reasoning(content: str, reasoning: str | None, rest: str) -> None:
    engine = VLLMEngine("http://127.0.0.1:1")
    request = CanonicalRequest(api="openai_chat", model="tiny", messages=[{"role": "user", "content": "hi"}])
    completion = engine.chat_completion(request, parse_chat_response(_answer({"content": content})))
    assert (completion.message.reasoning, completion.message.content) == (reasoning, rest)
    # The same as the token input path makes of the same text (polar's hermes parser).
    assert parse(content).message == completion.message
    assert (completion.response_ids, completion.logprobs) == ([7, 8, 9], [-0.5] * 3)  # the tokens are untouched


@pytest.mark.parametrize(
    "message",
    [
        AssistantMessage(content="no think block here"),
        AssistantMessage(content="a <think> after text is text"),
        AssistantMessage(content="The server split it.", reasoning="its reasoning"),
        AssistantMessage(content="</think> stays when the server gave reasoning", reasoning="r"),
        AssistantMessage(content=None),
        AssistantMessage(content=""),
    ],
)
def test_what_has_no_think_block_or_was_split_by_the_server_is_kept(message: AssistantMessage) -> None:
    assert split_think(message) is message


def test_tool_calls_the_server_parsed_are_kept_beside_the_split() -> None:
    engine = VLLMEngine("http://127.0.0.1:1")
    request = CanonicalRequest(api="openai_chat", model="tiny", messages=[{"role": "user", "content": "hi"}])
    call = {"id": "call_1", "type": "function", "function": {"name": "ls", "arguments": "{}"}}
    answer = _answer({"content": "<think>look first</think>\n\n", "tool_calls": [call]})
    answer["choices"][0]["finish_reason"] = "tool_calls"
    completion = engine.chat_completion(request, parse_chat_response(answer))
    assert (completion.message.reasoning, completion.message.content) == ("look first", "")
    assert [(c.id, c.name, c.arguments) for c in completion.message.tool_calls] == [("call_1", "ls", "{}")]
    assert completion.finish_reason == "tool_calls"
