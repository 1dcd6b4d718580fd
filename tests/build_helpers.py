"""Agent sessions made the way an engine makes them, for reconstruction tests.

Prompts are the real tiny-model tokenizer applied to the real chat template (or a variant that
renders history differently, as Qwen3's does); a sampled turn is the token ids of the assistant
turn as the model writes it (think block, content, ``<tool_call>`` markup, ``<|im_end|>``),
optionally tokenized non-canonically the way a sampler can produce ``[fish, ing]`` where the
tokenizer would write ``[fishing]``. Also: the trace invariants every built trace must satisfy.
"""

from __future__ import annotations

import functools
import math
from dataclasses import asdict, dataclass, field
from typing import Any

import orjson

from polar_addon.canonical import AssistantMessage, ToolCall
from polar_addon.capture import CaptureRecord
from polar_cli.tiny_model import CHAT_TEMPLATE, build_tokenizer
from polar_cli.trace import Trace

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "bash",
            "description": "Run a shell command.",
            "parameters": {"type": "object", "properties": {"cmd": {"type": "string"}}, "required": ["cmd"]},
        },
    },
    {
        "type": "function",
        "function": {
            "name": "read_file",
            "description": "Read a file.",
            "parameters": {"type": "object", "properties": {"path": {"type": "string"}}, "required": ["path"]},
        },
    },
]

_ASSISTANT_HISTORY = (
    "{%- if message.reasoning_content %}"
    "{{- '<think>\\n' + message.reasoning_content + '\\n</think>\\n\\n' }}{%- endif %}"
)
# Qwen3: reasoning survives in history only after the last user query (the current tool loop).
QWEN3_STYLE_TEMPLATE = CHAT_TEMPLATE.replace(
    "{%- for message in messages %}",
    "{%- set ns = namespace(last_query=-1) %}"
    "{%- for m in messages %}{%- if m.role == 'user' %}{%- set ns.last_query = loop.index0 %}{%- endif %}{%- endfor %}"
    "{%- for message in messages %}",
    1,
).replace(
    _ASSISTANT_HISTORY,
    "{%- if message.reasoning_content and loop.index0 > ns.last_query %}"
    "{{- '<think>\\n' + message.reasoning_content + '\\n</think>\\n\\n' }}{%- endif %}",
)
# Templates that never show reasoning in history (DeepSeek-R1 style).
DROP_THINK_TEMPLATE = CHAT_TEMPLATE.replace(_ASSISTANT_HISTORY, "")
# Qwen3 with thinking off: the generation prompt opens an empty think block that history never shows.
EMPTY_THINK_PROMPT_TEMPLATE = CHAT_TEMPLATE.replace(
    "{{- '<|im_start|>assistant\\n' }}{%- endif %}\n",
    "{{- '<|im_start|>assistant\\n<think>\\n\\n</think>\\n\\n' }}{%- endif %}\n",
)
assert len({CHAT_TEMPLATE, QWEN3_STYLE_TEMPLATE, DROP_THINK_TEMPLATE, EMPTY_THINK_PROMPT_TEMPLATE}) == 4


def ok_call(session: str, seq: int, prompt: list[int], response: list[int], **fields: Any) -> CaptureRecord:
    """An answered call's record with token ids and nothing else to speak of (logprobs -0.5 unless given)."""
    base: dict[str, Any] = dict(
        record_id=f"{session}{seq}", session_id=session, seq=seq, api="openai_chat", status="ok", prompt_ids=prompt,
        response_ids=response, logprobs=[-0.5] * len(response), finish_reason="stop", temperature=1.0,
        started_at=float(seq), finished_at=seq + 0.5,
    )  # fmt: skip
    return CaptureRecord(**(base | fields))


@functools.cache
def tiny_tokenizer() -> Any:
    return build_tokenizer()


@functools.cache
def eot_id() -> int:
    return tiny_tokenizer().convert_tokens_to_ids("<|im_end|>")


def encode(text: str) -> list[int]:
    return tiny_tokenizer()(text, add_special_tokens=False)["input_ids"]


def decode(ids: list[int]) -> str:
    return tiny_tokenizer().decode(ids)


def render(template: str, messages: list[dict[str, Any]], tools: list[dict[str, Any]], generation: bool) -> str:
    return tiny_tokenizer().apply_chat_template(
        messages, tools=tools or None, chat_template=template, tokenize=False, add_generation_prompt=generation
    )


def split_one_token(ids: list[int], *, skip: int = 0) -> list[int]:
    """The same text with one multi-byte token written as two vocabulary tokens (after ``skip`` candidates)."""
    tok = tiny_tokenizer()
    vocab = tok.get_vocab()
    special = set(tok.all_special_ids) | {vocab[t] for t in ("<think>", "</think>", "<tool_call>", "</tool_call>")}
    for i, t in enumerate(ids):
        if t in special:
            continue
        piece = tok.convert_ids_to_tokens(t)
        for cut in range(1, len(piece)):
            left, right = vocab.get(piece[:cut]), vocab.get(piece[cut:])
            if left is not None and right is not None:
                if skip == 0:
                    return ids[:i] + [left, right] + ids[i + 1 :]
                skip -= 1
                break
    raise AssertionError("no token could be split")


@dataclass
class Turn:
    """What the model writes in one call."""

    content: str | None = None
    reasoning: str | None = None
    tool_calls: list[tuple[str, dict[str, Any]]] = field(default_factory=list)
    max_tokens: int | None = None  # cap the sampled ids (finish "length", no end-of-turn token)
    retokenize: bool = False  # sample a non-canonical tokenization of the same text
    stop_token: str | None = None  # end the turn with this stop token instead of <|im_end|>


class AgentSim:
    """One session's calls as the proxy would capture them from an engine serving ``template``."""

    def __init__(
        self,
        session_id: str = "s1",
        *,
        template: str = CHAT_TEMPLATE,
        tools: list[dict[str, Any]] | None = None,
        harness: str = "claude-cli/2.1.197 (external, cli)",
        temperature: float = 1.0,
    ) -> None:
        self.session_id = session_id
        self.template = template
        self.tools = TOOLS if tools is None else tools
        self.harness = harness
        self.temperature = temperature
        self.seq = 0
        self.records: list[CaptureRecord] = []

    def call(
        self,
        messages: list[dict[str, Any]],
        turn: Turn,
        *,
        status: str = "ok",
        temperature: float | None = None,
        tools: list[dict[str, Any]] | None = None,
    ) -> CaptureRecord:
        tools = self.tools if tools is None else tools
        seq = self.seq
        self.seq += 1
        message = AssistantMessage(
            content=turn.content,
            reasoning=turn.reasoning,
            tool_calls=[
                ToolCall(id=f"call_{seq}_{i}", name=name, arguments=orjson.dumps(args).decode().replace('":', '": '))
                for i, (name, args) in enumerate(turn.tool_calls)
            ],
        )
        record = CaptureRecord(
            record_id=f"{self.session_id}-{seq:04d}",
            session_id=self.session_id,
            seq=seq,
            api="openai_chat",
            status=status,
            harness=self.harness,
            temperature=self.temperature if temperature is None else temperature,
            messages_json=orjson.dumps(messages).decode(),
            tools_json=orjson.dumps(tools).decode(),
        )
        if status != "ok":
            record.error = "engine unavailable"
            self.records.append(record)
            return record
        prompt_text = render(self.template, messages, tools, generation=True)
        prompt = encode(prompt_text)
        # The model writes its turn in the base template's full form (think block included).
        full = render(CHAT_TEMPLATE, messages + [message.to_openai()], tools, generation=False)
        assert full.startswith(render(CHAT_TEMPLATE, messages, tools, generation=True))
        turn_text = full[len(render(CHAT_TEMPLATE, messages, tools, generation=True)) :]
        assert turn_text.endswith("<|im_end|>\n")
        sampled = encode(turn_text[: -len("\n")])
        finish = "tool_calls" if turn.tool_calls else "stop"
        if turn.retokenize:
            sampled = split_one_token(sampled)
        if turn.stop_token is not None:
            sampled = sampled[:-1] + [tiny_tokenizer().convert_tokens_to_ids(turn.stop_token)]
        if turn.max_tokens is not None:
            sampled = sampled[: turn.max_tokens]
            finish = "length"
        record.prompt_ids = prompt
        record.response_ids = sampled
        record.logprobs = [-((seq * 7 + i * 13) % 97) / 31.0 for i in range(len(sampled))]
        record.finish_reason = finish
        record.response_json = orjson.dumps(asdict(message)).decode()
        record.served_model = "tiny"
        record.weight_version = "w0"
        self.records.append(record)
        return record

    @staticmethod
    def sent_back(record: CaptureRecord, *, reasoning: bool = True, compact_args: bool = False) -> dict[str, Any]:
        """The assistant turn as the harness puts it into its next request."""
        message = AssistantMessage.from_dict(record.response_message).to_openai()
        if not reasoning:
            message.pop("reasoning_content", None)
        if compact_args:
            for call in message.get("tool_calls", []):
                call["function"]["arguments"] = orjson.dumps(orjson.loads(call["function"]["arguments"])).decode()
        return message


def tool_result(record: CaptureRecord, output: str, index: int = 0) -> dict[str, Any]:
    call_id = record.response_message["tool_calls"][index]["id"]
    return {"role": "tool", "tool_call_id": call_id, "content": output}


def tool_loop(
    sim: AgentSim, messages: list[dict[str, Any]], turns: list[Turn], **sent_back: Any
) -> list[dict[str, Any]]:
    """Run ``turns`` as one agent loop: each tool call is answered, each turn sent back."""
    for turn in turns:
        record = sim.call(messages, turn)
        messages = messages + [sim.sent_back(record, **sent_back)]
        messages += [
            tool_result(record, f"output of {name} #{record.seq}", i) for i, (name, _) in enumerate(turn.tool_calls)
        ]
    return messages


def coding_turns(n: int, *, reasoning: bool = False) -> list[Turn]:
    turns = []
    for i in range(n - 1):
        turns.append(
            Turn(
                content=f"Step {i}: looking at the repository." if i % 2 else None,
                reasoning=f"I should inspect file number {i} before editing." if reasoning else None,
                tool_calls=[("bash", {"cmd": f"ls -la src/pkg{i}"})]
                if i % 3
                else [("read_file", {"path": f"src/mod{i}.py"})],
            )
        )
    turns.append(Turn(content="All tests pass now.", reasoning="Done." if reasoning else None))
    return turns


def check_trace(trace: Trace, records: dict[str, CaptureRecord], *, retokenized_ok: bool = True) -> None:
    """The invariants of every built trace.

    - lengths agree; the prompt is the first call's canonical prompt;
    - mask-1 tokens are each call's sampled ids, in order, with their captured logprobs;
    - each mask-0 run is the end of the next call's canonical prompt and, unless that call
      re-tokenized the previous turn, prompt + completion so far is exactly that prompt.
    """
    calls = [records[r] for r in trace.record_ids]
    n = len(trace.completion_ids)
    assert len(trace.loss_mask) == n and len(trace.behavior_logprobs) == n
    assert list(trace.prompt_ids) == calls[0].prompt_ids
    assert all(math.isfinite(x) for x in trace.behavior_logprobs)
    assert set(trace.loss_mask) <= {0, 1}
    completion = list(trace.completion_ids)
    pos = 0
    for m, call in enumerate(calls):
        a = call.response_ids
        assert completion[pos : pos + len(a)] == a, f"call {call.seq}: sampled ids out of place"
        # trainable or not, the mask marks every sampled token (issue 10 #8)
        assert all(x == 1 for x in trace.loss_mask[pos : pos + len(a)])
        got = [float(x) for x in trace.behavior_logprobs[pos : pos + len(a)]]
        assert all(abs(x - y) < 1e-5 for x, y in zip(got, call.logprobs)), f"call {call.seq}: logprobs differ"
        pos += len(a)
        if m + 1 == len(calls):
            break
        nxt = calls[m + 1]
        end = pos
        while end < n and trace.loss_mask[end] == 0:
            end += 1
        u = completion[pos:end]
        assert u and all(x == 0.0 for x in trace.behavior_logprobs[pos:end])
        assert nxt.prompt_ids[-len(u) :] == u, f"call {nxt.seq}: interstitial is not the end of its prompt"
        if list(trace.prompt_ids) + completion[:end] != nxt.prompt_ids:
            assert retokenized_ok, f"call {nxt.seq}: merged stream differs from its prompt"
            assert decode(list(trace.prompt_ids) + completion[:end]) == decode(nxt.prompt_ids)
        pos = end
    assert pos == n, "completion has tokens after the last sampled turn"
