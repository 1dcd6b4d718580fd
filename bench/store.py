"""Trace store vs one JSON file per completion (Polar's layout): bytes per session, write and read throughput.

Synthetic agent sessions: a 5k-token system prompt with tools, then turns that each add an assistant reply
(~150 tokens, with a tool call) and a tool result, growing to a 30k-token context at turn 50. Token ids are
random over a 151k vocabulary (incompressible, like real ids); message text is random words (compressible
about like prose). Tokens are counted logically: every call's full prompt + response.

The JSON side is a lean version of Polar's per-completion file (the canonical request once, the response
with prompt_token_ids / token_ids / logprobs, written with orjson and no fsync): real Polar files also
carry the original request and are written with more overhead, so the ratios here are lower bounds.
Our side fsyncs every group commit and its time includes writing the Parquet shards.

    .venv/bin/python bench/store.py [--sessions 16] [--turns 50] [--final-context 30000]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import shutil
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import orjson

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from polar_addon.capture import CaptureRecord, new_record_id  # noqa: E402
from polar_addon.store import TraceStore, read_records  # noqa: E402

VOCAB = 151_000
WORDS = [
    "the",
    "file",
    "function",
    "return",
    "error",
    "test",
    "import",
    "value",
    "config",
    "path",
    "build",
    "run",
    "class",
    "self",
    "def",
    "string",
    "list",
    "dict",
    "none",
    "true",
    "false",
    "index",
    "result",
    "output",
    "input",
    "module",
    "package",
    "version",
    "update",
    "check",
    "assert",
    "raise",
    "exception",
    "line",
    "word",
]
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": f"tool_{i}",
            "description": " ".join(WORDS[i % 30 :] + WORDS[: i % 30]) * 3,
            "parameters": {
                "type": "object",
                "properties": {
                    "path": {"type": "string", "description": "where"},
                    "content": {"type": "string", "description": "what"},
                },
            },
        },
    }
    for i in range(16)
]


def _text(rng: random.Random, tokens: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(tokens))


def make_session(sid: str, turns: int, final_context: int, seed: int) -> list[CaptureRecord]:
    rng = random.Random(seed)
    system_tokens = min(5000, final_context // 2)
    growth = (final_context - system_tokens) // max(1, turns - 1)
    response_len = max(1, min(150, growth // 3))
    tool_len = growth - response_len
    total = system_tokens + growth * turns
    ids = [rng.randrange(VOCAB) for _ in range(total)]  # one list: every prompt is a slice (shared ints)
    messages: list[dict] = [
        {"role": "system", "content": _text(rng, system_tokens)},
        {"role": "user", "content": "fix the failing test"},
    ]
    tools_json = orjson.dumps(TOOLS).decode()
    records = []
    prompt_len = system_tokens
    for turn in range(turns):
        response = ids[prompt_len : prompt_len + response_len]
        call_id = f"call_{turn}"
        answer = {
            "content": _text(rng, response_len - 20),
            "reasoning": None,
            "tool_calls": [{"id": call_id, "name": "tool_1", "arguments": '{"path": "a.py"}'}],
        }
        records.append(
            CaptureRecord(
                record_id=new_record_id(),
                session_id=sid,
                seq=turn,
                api="openai_chat",
                status="ok",
                task_id="task-1",
                harness="bench-agent/1.0",
                requested_model="m",
                served_model="m",
                started_at=time.time(),
                finished_at=time.time(),
                temperature=1.0,
                prompt_ids=ids[:prompt_len],
                response_ids=response,
                logprobs=[-rng.random() * 3 for _ in response],
                finish_reason="tool_calls",
                messages_json=orjson.dumps(messages).decode(),
                tools_json=tools_json,
                response_json=orjson.dumps(answer).decode(),
            )
        )
        messages = messages + [
            {
                "role": "assistant",
                "content": answer["content"],
                "tool_calls": [
                    {"id": call_id, "type": "function", "function": {"name": "tool_1", "arguments": '{"path": "a.py"}'}}
                ],
            },
            {"role": "tool", "tool_call_id": call_id, "content": _text(rng, tool_len)},
        ]
        prompt_len += growth
    return records


def tokens_of(records: list[CaptureRecord]) -> int:
    return sum(len(r.prompt_ids) + len(r.response_ids) for r in records)


def dir_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


@dataclass
class Result:
    bytes_total: int
    write_s: float
    read_s: float
    read_tokens: int


async def _write_store(out: Path, sessions: list[list[CaptureRecord]]) -> None:
    store = TraceStore(str(out))

    async def drive(records: list[CaptureRecord]) -> None:
        for record in records:
            await store.append(record)

    await asyncio.gather(*(drive(s) for s in sessions))
    await store.aclose()


def bench_store(out: Path, sessions: list[list[CaptureRecord]]) -> Result:
    t0 = time.perf_counter()
    asyncio.run(_write_store(out, sessions))
    write_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    records = read_records(str(out))
    read_s = time.perf_counter() - t0
    return Result(dir_bytes(out), write_s, read_s, tokens_of(records))


def _completion_json(r: CaptureRecord) -> bytes:
    request = {
        "model": r.requested_model,
        "messages": orjson.loads(r.messages_json),
        "tools": orjson.loads(r.tools_json),
        "temperature": r.temperature,
    }
    return orjson.dumps(
        {
            "completion_id": r.record_id,
            "timestamp": r.finished_at,
            "session_id": r.session_id,
            "task_id": r.task_id,
            "api_type": r.api,
            "model_requested": r.requested_model,
            "model_used": r.served_model,
            "transformed_request": request,
            "response": {
                "prompt_token_ids": r.prompt_ids,
                "choices": [
                    {
                        "message": orjson.loads(r.response_json),
                        "finish_reason": r.finish_reason,
                        "token_ids": r.response_ids,
                        "logprobs": {
                            "content": [{"token_id": t, "logprob": lp} for t, lp in zip(r.response_ids, r.logprobs)]
                        },
                    }
                ],
            },
            "metadata": {"harness": r.harness},
            "__written_at": time.time(),
        }
    )


def bench_json(out: Path, sessions: list[list[CaptureRecord]]) -> Result:
    t0 = time.perf_counter()
    for records in sessions:
        for r in records:
            directory = out / f"task_{r.task_id}" / "sessions" / r.session_id / "completions"
            directory.mkdir(parents=True, exist_ok=True)
            (directory / f"{r.seq:04d}-{r.record_id}.json").write_bytes(_completion_json(r))
    write_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    read_tokens = 0
    for path in sorted(out.rglob("*.json")):
        data = orjson.loads(path.read_bytes())
        choice = data["response"]["choices"][0]
        read_tokens += len(data["response"]["prompt_token_ids"]) + len(choice["token_ids"])
        _ = [c["logprob"] for c in choice["logprobs"]["content"]]
    read_s = time.perf_counter() - t0
    return Result(dir_bytes(out), write_s, read_s, read_tokens)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sessions", type=int, default=16)
    parser.add_argument("--turns", type=int, default=50)
    parser.add_argument("--final-context", type=int, default=30_000)
    parser.add_argument("--dir", type=Path, default=None, help="Scratch directory (default: a temp dir).")
    args = parser.parse_args()

    t0 = time.perf_counter()
    sessions = [make_session(f"session-{i:03d}", args.turns, args.final_context, seed=i) for i in range(args.sessions)]
    tokens = sum(tokens_of(s) for s in sessions)
    calls = sum(len(s) for s in sessions)
    print(
        f"{args.sessions} sessions x {args.turns} turns, final context {len(sessions[0][-1].prompt_ids):,} tokens: "
        f"{calls} calls, {tokens:,} tokens (generated in {time.perf_counter() - t0:.1f} s, cpus {os.cpu_count()})"
    )

    scratch = Path(tempfile.mkdtemp(prefix="polar-bench-", dir=args.dir))
    try:
        ours = bench_store(scratch / "store", sessions)
        theirs = bench_json(scratch / "json", sessions)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    assert ours.read_tokens == tokens == theirs.read_tokens, (ours.read_tokens, tokens, theirs.read_tokens)

    rows = [
        ("bytes per session", ours.bytes_total / args.sessions, theirs.bytes_total / args.sessions, "{:,.0f}"),
        ("write tokens/s", tokens / ours.write_s, tokens / theirs.write_s, "{:,.0f}"),
        ("write calls/s", calls / ours.write_s, calls / theirs.write_s, "{:,.0f}"),
        ("read tokens/s", tokens / ours.read_s, tokens / theirs.read_s, "{:,.0f}"),
    ]
    print(f"{'':22}{'trace store':>18}{'JSON per call':>18}{'ratio':>10}")
    for name, a, b, fmt in rows:
        ratio = b / a if name.startswith("bytes") else a / b
        print(f"{name:22}{fmt.format(a):>18}{fmt.format(b):>18}{ratio:>9.1f}x")
    size_ratio = theirs.bytes_total / ours.bytes_total
    write_rate = tokens / ours.write_s
    print(f"target >= 10x smaller: {size_ratio:.1f}x {'PASS' if size_ratio >= 10 else 'FAIL'}")
    print(f"target >= 1M tokens/s written: {write_rate / 1e6:.2f}M {'PASS' if write_rate >= 1e6 else 'FAIL'}")
    return 0 if size_ratio >= 10 and write_rate >= 1e6 else 1


if __name__ == "__main__":
    sys.exit(main())
