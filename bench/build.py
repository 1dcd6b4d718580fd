"""Reconstruction benchmark: build throughput and the per_request / prefix_merging token ratio.

Synthetic agent sessions at the token level (ChatML-shaped, random content ids): a system prompt,
a task, then T calls, each sampling an assistant turn closed by <|im_end|> and getting a tool
result back; some sessions spawn a sub-agent or compact their history, so the chain analysis has
real breaks to classify. Every session is generated, built with both strategies, and dropped,
so memory stays at one session. Only the builds are timed.

    .venv/bin/python bench/build.py                 # 1,000 sessions x 50 turns
    .venv/bin/python bench/build.py --sessions 50   # a quick run

"Processed tokens" is prompt + completion summed over the traces a trainer would run forward
(the quantity behind the paper's 1,185 -> 218 trainer updates and 5.39x wall-clock);
"trained tokens" (loss mask 1) are the same for both strategies.
"""

from __future__ import annotations

import argparse
import random
import time
from dataclasses import dataclass

import orjson

from polar_addon.capture import CaptureRecord
from polar_cli.build import BuildReport, SessionInfo, build_session

IM_START, EOT, NEWLINE = 1, 2, 201
ROLE = {"system": 300, "user": 301, "assistant": 302}
CONTENT = (400, 2000)


@dataclass
class Shape:
    turns: int
    system_tokens: int
    turn_tokens: int
    tool_tokens: int
    sub_agent_rate: float
    compaction_rate: float


def _ids(rng: random.Random, n: int) -> list[int]:
    lo, hi = CONTENT
    return [rng.randrange(lo, hi) for _ in range(n)]


def _message(role: str, body: list[int]) -> list[int]:
    return [IM_START, ROLE[role], NEWLINE, *body, EOT, NEWLINE]


class _Conversation:
    """One agent loop's prompt tokens and messages, grown call by call."""

    def __init__(self, rng: random.Random, system: list[int], system_text: str, task: str, shape: Shape) -> None:
        self.rng = rng
        self.shape = shape
        self.prompt = _message("system", system) + _message("user", _ids(rng, 60))
        self.messages = [{"role": "system", "content": system_text}, {"role": "user", "content": task}]

    def call(self, session_id: str, seq: int, final: bool) -> CaptureRecord:
        rng, shape = self.rng, self.shape
        n = max(8, int(rng.gauss(shape.turn_tokens, shape.turn_tokens / 4)))
        sampled = _ids(rng, n) + [EOT]
        call_id = f"call_{seq}"
        message = {
            "content": None,
            "reasoning": None,
            "tool_calls": [] if final else [{"id": call_id, "name": "bash", "arguments": '{"cmd": "ls"}'}],
        }
        record = CaptureRecord(
            record_id=f"{session_id}-{seq}",
            session_id=session_id,
            seq=seq,
            api="anthropic_messages",
            status="ok",
            harness="bench/1.0",
            temperature=1.0,
            prompt_ids=self.prompt + [IM_START, ROLE["assistant"], NEWLINE],
            response_ids=sampled,
            logprobs=[-rng.random() for _ in sampled],
            finish_reason="stop" if final else "tool_calls",
            messages_json=orjson.dumps(self.messages).decode(),
            response_json=orjson.dumps(message).decode(),
        )
        # The harness sends the turn back and appends the tool result; the template re-renders
        # the sampled turn exactly (so the next prompt extends this one).
        output = _ids(rng, max(8, int(rng.gauss(shape.tool_tokens, shape.tool_tokens / 2))))
        self.prompt = record.prompt_ids + sampled + [NEWLINE] + _message("user", output)
        self.messages = self.messages + [
            {
                "role": "assistant",
                "content": None,
                "tool_calls": [
                    {"id": call_id, "type": "function", "function": {"name": "bash", "arguments": '{"cmd": "ls"}'}}
                ],
            },
            {"role": "tool", "tool_call_id": call_id, "content": f"output {seq}"},
        ]
        return record


def synthetic_session(index: int, shape: Shape, system: list[int], seed: int) -> list[CaptureRecord]:
    rng = random.Random(seed * 1_000_003 + index)
    session_id = f"bench-{index:05d}"
    main = _Conversation(rng, system, "You are a coding agent.", f"task {index}", shape)
    sub_at = rng.randrange(5, shape.turns - 5) if rng.random() < shape.sub_agent_rate else -1
    compact_at = rng.randrange(shape.turns // 2, shape.turns - 2) if rng.random() < shape.compaction_rate else -1
    records: list[CaptureRecord] = []
    for turn in range(shape.turns):
        if turn == sub_at:
            sub = _Conversation(rng, _ids(rng, 300), "You are a search sub-agent.", "find the bug", shape)
            for k in range(5):
                records.append(sub.call(session_id, len(records), final=k == 4))
        if turn == compact_at:
            summary = _Conversation(rng, system, "You are a coding agent.", f"summary of task {index}", shape)
            main = summary
        records.append(main.call(session_id, len(records), final=turn == shape.turns - 1))
    return records


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sessions", type=int, default=1000)
    parser.add_argument("--turns", type=int, default=50)
    parser.add_argument("--system-tokens", type=int, default=2000)
    parser.add_argument("--turn-tokens", type=int, default=150)
    parser.add_argument("--tool-tokens", type=int, default=400)
    parser.add_argument("--sub-agent-rate", type=float, default=0.1)
    parser.add_argument("--compaction-rate", type=float, default=0.05)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    shape = Shape(
        args.turns, args.system_tokens, args.turn_tokens, args.tool_tokens, args.sub_agent_rate, args.compaction_rate
    )
    system = _ids(random.Random(args.seed), args.system_tokens)

    reports = {"prefix_merging": BuildReport(), "per_request": BuildReport()}
    seconds = dict.fromkeys(reports, 0.0)
    input_tokens = calls = 0
    final_context = 0
    for index in range(args.sessions):
        records = synthetic_session(index, shape, system, args.seed)
        calls += len(records)
        input_tokens += sum(len(r.prompt_ids) + len(r.response_ids) for r in records)
        final_context = max(final_context, len(records[-1].prompt_ids) + len(records[-1].response_ids))
        info = SessionInfo(records[0].session_id, reward=float(index % 2))
        for strategy, report in reports.items():
            started = time.perf_counter()
            built = build_session(
                info.session_id, records, info, strategy=strategy, eot_token_id=EOT, broadcast_rewards=True
            )
            seconds[strategy] += time.perf_counter() - started
            report.add(built.harness, built.stats)

    merged, per_request = reports["prefix_merging"].total, reports["per_request"].total
    print(f"sessions {args.sessions} x {args.turns} turns: {calls:,} calls, {input_tokens:,} captured tokens "
          f"(prompt + response summed over calls), final context up to {final_context:,} tokens")  # fmt: skip
    for strategy, report in reports.items():
        s = report.total
        print(
            f"{strategy:>15}: {seconds[strategy]:7.2f} s  "
            f"{input_tokens / seconds[strategy] / 1e6:7.1f} M captured tokens/s  "
            f"{args.sessions / seconds[strategy]:7.1f} sessions/s  "
            f"{s.traces:,} traces  {s.processed_tokens:,} tokens processed  {s.trainable_tokens:,} trained"
        )
    print(
        f"chains {merged.chains_total:,} ({merged.chains_full:,} full, {merged.chains_truncated:,} truncated), "
        f"merge rate {merged.merge_rate:.1%}, breaks {merged.breaks}"
    )
    print(
        "per_request / prefix_merging: "
        f"{per_request.processed_tokens / merged.processed_tokens:.2f}x tokens processed, "
        f"{per_request.traces / merged.traces:.2f}x traces (trainer samples), "
        f"{per_request.trainable_tokens / merged.trainable_tokens:.2f}x tokens trained"
    )


if __name__ == "__main__":
    main()
