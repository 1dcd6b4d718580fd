"""The canonical form's own rules, tested directly: the sampling defaults' bounds, greedy below GREEDY_BELOW, the
round trips a record and a chain tip rely on, the assistant turn as OpenAI's wire shape, the errors' fields."""

from __future__ import annotations

import math

import pytest

from polar_addon.canonical import (
    GREEDY_BELOW,
    AssistantMessage,
    CanonicalRequest,
    ContextLengthExceeded,
    EngineFault,
    PolarError,
    SamplingDefaults,
    SamplingParams,
    ToolCall,
    with_defaults,
)


@pytest.mark.parametrize(
    ("field", "value", "said"),
    [
        ("temperature", -0.1, "default temperature must be a finite number >= 0, got -0.1"),
        ("temperature", math.inf, "default temperature must be a finite number >= 0, got inf"),
        ("temperature", math.nan, "default temperature must be a finite number >= 0, got nan"),
        ("top_p", 0.0, "default top_p must be in (0, 1], got 0.0"),
        ("top_p", 1.5, "default top_p must be in (0, 1], got 1.5"),
        ("top_k", -1, "default top_k must be >= 0 (0: off), got -1"),
        ("min_p", -0.01, "default min_p must be in [0, 1], got -0.01"),
        ("min_p", 1.5, "default min_p must be in [0, 1], got 1.5"),
    ],
)
def test_sampling_defaults_refuse_values_outside_their_bounds(field: str, value: float, said: str) -> None:
    with pytest.raises(ValueError) as caught:
        SamplingDefaults(**{field: value})
    assert str(caught.value) == said


def test_sampling_defaults_accept_their_bounds() -> None:
    """Greedy (T 0), top_p 1, top_k 0 (off), min_p 0 and 1 are all valid."""
    for edge in ({"temperature": 0.0}, {"top_p": 1.0}, {"top_k": 0}, {"min_p": 0.0}, {"min_p": 1.0}):
        SamplingDefaults(**edge)


def test_with_defaults_fills_what_the_client_left_out_and_rounds_tiny_temperatures_to_greedy() -> None:
    defaults = SamplingDefaults(temperature=0.7, top_p=0.9, top_k=20, min_p=0.05)
    filled = with_defaults(SamplingParams(max_tokens=5), defaults)
    assert (filled.temperature, filled.top_p, filled.top_k, filled.min_p, filled.max_tokens) == (0.7, 0.9, 20, 0.05, 5)
    given = with_defaults(SamplingParams(temperature=1, top_p=1, top_k=-1, min_p=0), defaults)
    assert (given.temperature, given.top_p, given.top_k, given.min_p) == (1.0, 1.0, 0, 0.0)
    assert type(given.temperature) is float and type(given.top_p) is float and type(given.min_p) is float
    for greedy in (0.0, GREEDY_BELOW / 2):
        assert with_defaults(SamplingParams(temperature=greedy), defaults).temperature == 0.0
    assert with_defaults(SamplingParams(temperature=GREEDY_BELOW), defaults).temperature == GREEDY_BELOW
    assert (
        SamplingParams().effective_temperature() == 1.0 and SamplingParams(temperature=0).effective_temperature() == 0
    )


def test_a_request_round_trips_through_its_dict() -> None:
    request = CanonicalRequest(
        "anthropic_messages",
        "m",
        [{"role": "user", "content": "hi"}],
        tools=[{"type": "function", "function": {"name": "bash"}}],
        sampling=SamplingParams(temperature=0.5, top_k=3, stop=["</s>"]),
        enable_thinking=False,
        extra={"stream_options": {"include_usage": True}},
    )
    data = request.to_dict()
    assert data["sampling"] == {"temperature": 0.5, "top_p": None, "top_k": 3, "min_p": None, "max_tokens": None,
                                "stop": ["</s>"], "seed": None}  # fmt: skip
    again = CanonicalRequest.from_dict(data)
    assert again == request and isinstance(again.sampling, SamplingParams)
    assert isinstance(data["sampling"], dict)  # from_dict copies: the dict it was given is left as it was
    bare = CanonicalRequest.from_dict({"api": "openai_chat", "model": "m", "messages": [], "sampling": None})
    assert bare.sampling == SamplingParams()


def test_the_assistant_turn_in_openais_shape_and_back() -> None:
    call = ToolCall("call_1", "bash", '{"cmd": "ls"}')
    message = AssistantMessage("Looking.", "I should list.", [call])
    assert message.to_openai() == {
        "role": "assistant",
        "content": "Looking.",
        "reasoning_content": "I should list.",
        "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "bash", "arguments": '{"cmd": "ls"}'}}
        ],
    }
    assert AssistantMessage("x").to_openai() == {"role": "assistant", "content": "x"}  # no empty extras
    stored = {"content": "Looking.", "reasoning": "I should list.", "tool_calls": [vars(call)]}
    assert AssistantMessage.from_dict(stored) == message
    assert AssistantMessage.from_dict({"tool_calls": None}) == AssistantMessage()


def test_errors_carry_their_status_kind_and_message() -> None:
    plain = PolarError(429, "overloaded", "busy")
    assert (plain.status, plain.kind, plain.message, str(plain)) == (429, "overloaded", "busy", "busy")
    fault = EngineFault(502, "api_error", "connection refused")
    assert (fault.status, fault.kind, fault.message, fault.refused) == (502, "api_error", "connection refused", False)
    assert EngineFault(503, "overloaded", "down", refused=True).refused is True
    too_long = ContextLengthExceeded("too long", prompt_tokens=9000, window=8192)
    assert (too_long.status, too_long.kind, too_long.message) == (400, "context_length_exceeded", "too long")
    assert (too_long.prompt_tokens, too_long.window, too_long.counted) == (9000, 8192, True)
    assert not ContextLengthExceeded("?", prompt_tokens=9000).counted and not ContextLengthExceeded("?").counted
