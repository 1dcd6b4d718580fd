"""What the proxy costs: the same requests, interleaved in one run, over three paths.

(a) direct to an engine that answers at once (vLLM's wire shape, token ids in the answer);
(b) through a plain ``mitmdump --mode reverse:`` with no addon (the floor of this architecture);
(c) through mitmdump + the polar addon (engine ``vllm:`` = the same instant engine; every call is
    parsed, sent to the engine, recorded durably, and answered in the provider's shape);
(d) the same with ``polar_durability=write``: each record written to the journal before its answer and
    fdatasync'd just behind it (survives the proxy's death, not a power cut).

Prints p50/p99 added latency over (a) at ~1k and ~32k-token contexts (plain and streaming), and the
sustained completions/s with 16 concurrent clients. Each row is one session, as an agent's calls are;
"32k new" rotates prompts that share no prefix with the previous call (a session's first call, or rewritten
history), so nothing about the session's last call can be reused; "harness" is an Anthropic call shaped like a
coding harness's (17 tools with schemas, 20-27 tool rounds, ~32k tokens), whose structure the translation and the
continuity check walk. Targets (issue 26): (c)'s added p50 within 1.2x of (b)'s, p99 within 2x, and >= 0.8x its
completions/s.

    .venv/bin/python bench/proxy_overhead.py [--rounds 300] [--seconds 8]
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

import httpx
import orjson

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from tests.support.proxy import free_port, run_mitmdump, wait_for_port  # noqa: E402

RESPONSE_TOKENS = 32

ENGINE = (
    textwrap.dedent(
        """
    import sys, orjson
    from aiohttp import web
    """
    )
    + f"N_OUT = {RESPONSE_TOKENS}\n"
    + textwrap.dedent(
        """
    def answer(n_prompt, first=1000):
        return orjson.dumps({
            "id": "chatcmpl-bench", "object": "chat.completion", "created": 0, "model": "bench",
            "prompt_token_ids": list(range(first, first + n_prompt)),
            "choices": [{"index": 0, "finish_reason": "length", "stop_reason": None,
                         "token_ids": list(range(7, 7 + N_OUT)),
                         "message": {"role": "assistant", "content": "tok " * N_OUT, "tool_calls": []},
                         "logprobs": {"content": [{"token": "tok", "logprob": -1.25, "bytes": [116],
                                                   "top_logprobs": []}] * N_OUT}}],
            "usage": {"prompt_tokens": n_prompt, "completion_tokens": N_OUT, "total_tokens": n_prompt + N_OUT}})

    SMALL, LARGE = answer(1024), answer(32768)
    # Prompts that share no prefix with the previous one: a user message starting "other-N " picks one.
    OTHERS = [answer(32768, first=2000 + 7919 * i) for i in range(8)]

    async def chat(request):
        body = await request.read()
        marker = body.find(b"other-")  # at the start of the user message: it survives polar's translation
        if marker >= 0:
            answer = OTHERS[int(body[marker + 6:body.index(b" ", marker + 6)]) % len(OTHERS)]
        else:
            answer = LARGE if len(body) > 40000 else SMALL
        return web.Response(body=answer, content_type="application/json")

    async def models(request):
        return web.json_response({"object": "list", "data": [{"id": "bench", "object": "model"}]})

    app = web.Application(client_max_size=1 << 30)
    app.router.add_post("/v1/chat/completions", chat)
    app.router.add_post("/v1/messages", chat)  # plain mitmdump relays a harness's Anthropic call here unread
    app.router.add_get("/v1/models", models)
    web.run_app(app, host="127.0.0.1", port=int(sys.argv[1]), print=None, access_log=None)
    """
    )
)


def request_body(tokens: int, stream: bool, other: int | None = None) -> bytes:
    # ~4 characters per token of ordinary text.
    text = ("The quick brown fox jumps over the lazy dog. " * (tokens * 4 // 45 + 1))[: tokens * 4]
    if other is not None:
        text = f"other-{other} {text}"
    return orjson.dumps(
        {
            "model": "bench",
            "max_tokens": RESPONSE_TOKENS,
            "stream": stream,
            "logprobs": True,
            "return_token_ids": True,
            "messages": [{"role": "system", "content": "You are terse."}, {"role": "user", "content": text}],
        }
    )


def harness_body(turns: int) -> bytes:
    """An Anthropic Messages call shaped like a coding harness's (~32k tokens): a long system prompt, 17 tools with
    JSON schemas, and ``turns`` tool-use rounds, each a tool call and its result: the structure, not only the size,
    that each call's parse, translation and continuity check walk."""
    schema = {
        "type": "object",
        "required": ["p0"],
        "additionalProperties": False,
        "properties": {f"p{j}": {"type": "string", "description": "A parameter. " * 8} for j in range(8)},
    }
    tools = [{"name": f"Tool{i}", "description": "Does a thing with files and the shell. " * 30, "input_schema": schema}
             for i in range(17)]  # fmt: skip
    messages: list[dict] = [{"role": "user", "content": [{"type": "text", "text": "Fix the failing test. " * 30}]}]
    for t in range(turns):
        call = {"type": "tool_use", "id": f"toolu_{t:04d}", "name": f"Tool{t % 17}", "input": {"p0": f"/repo/f{t}.py"}}
        messages.append({"role": "assistant", "content": [{"type": "text", "text": f"Step {t}."}, call]})
        result = {"type": "tool_result", "tool_use_id": call["id"], "content": "line of output\n" * 266}
        messages.append({"role": "user", "content": [result]})
    return orjson.dumps(
        {"model": "bench", "max_tokens": RESPONSE_TOKENS, "system": [{"type": "text", "text": "You are terse. " * 500}],
         "tools": tools, "messages": messages}
    )  # fmt: skip


class Case:
    """One row of the table: a request (or a rotation of them) sent as one session."""

    def __init__(self, name: str, bodies: list[bytes], path: str = "/v1/chat/completions") -> None:
        self.name, self.bodies, self.path = name, bodies, path
        self.stream = b'"stream":true' in bodies[0]
        self.headers = {
            "content-type": "application/json",
            "authorization": f"Bearer polar:bench-{name.replace(' ', '-')}",
        }

    def body(self, i: int) -> bytes:
        return self.bodies[i % len(self.bodies)]


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def latency_run(paths: dict[str, str], cases: list[Case], rounds: int) -> dict[tuple[str, str], list[float]]:
    clients = {name: httpx.Client(base_url=url, timeout=60) for name, url in paths.items()}
    samples: dict[tuple[str, str], list[float]] = {(p, c.name): [] for p in paths for c in cases}
    for i in range(rounds + 5):
        for case in cases:
            for path, client in clients.items():
                if case.stream and not path.startswith(("c_", "d_")):
                    continue
                t0 = time.perf_counter()
                response = client.post(case.path, content=case.body(i), headers=case.headers)
                response.read()
                elapsed = time.perf_counter() - t0
                assert response.status_code == 200, (path, response.status_code, response.text[:300])
                if i >= 5:  # warm-up rounds are not counted
                    samples[(path, case.name)].append(elapsed * 1000)
    return samples


async def throughput(url: str, body: bytes, seconds: float, concurrency: int = 16) -> float:
    done = 0
    deadline = time.perf_counter() + seconds
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    async with httpx.AsyncClient(base_url=url, timeout=60, limits=limits) as client:

        async def worker(k: int) -> None:  # one agent session per client
            nonlocal done
            headers = {"content-type": "application/json", "authorization": f"Bearer polar:bench-client-{k}"}
            while time.perf_counter() < deadline:
                response = await client.post("/v1/chat/completions", content=body, headers=headers)
                assert response.status_code == 200, response.text[:300]
                done += 1

        t0 = time.perf_counter()
        await asyncio.gather(*(worker(k) for k in range(concurrency)))
        return done / (time.perf_counter() - t0)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=300, help="timed requests per path and case")
    parser.add_argument("--seconds", type=float, default=8.0, help="duration of each throughput run")
    args = parser.parse_args()

    engine_port = free_port()
    engine = subprocess.Popen([sys.executable, "-c", ENGINE, str(engine_port)])
    try:
        wait_for_port(engine_port, 30, engine)
        engine_url = f"http://127.0.0.1:{engine_port}"
        with tempfile.TemporaryDirectory() as tmp:
            work = Path(tmp)
            with (
                run_mitmdump("", work / "plain" / "out", mode=f"reverse:{engine_url}", addon=False) as plain,
                run_mitmdump(f"vllm:{engine_url}", work / "polar" / "shards", mode=f"reverse:{engine_url}") as polar,
                run_mitmdump(
                    f"vllm:{engine_url}",
                    work / "polar-write" / "shards",
                    mode=f"reverse:{engine_url}",
                    options={"polar_durability": "write"},
                ) as polar_write,
            ):
                paths = {
                    "a_direct": engine_url,
                    "b_mitmdump": plain.url,
                    "c_polar": polar.url,
                    "d_polar_write": polar_write.url,
                }
                cases = [
                    Case("1k", [request_body(1024, False)]),
                    Case("32k", [request_body(32768, False)]),
                    Case("32k new", [request_body(32768, False, other=i) for i in range(8)]),
                    # Eight calls of a growing history: none continues the last (the instant engine answers
                    # something else than the history says), so each is checked against the session's chains.
                    Case("harness", [harness_body(20 + i) for i in range(8)], path="/v1/messages"),
                    Case("1k stream", [request_body(1024, True)]),
                    Case("32k stream", [request_body(32768, True)]),
                ]
                samples = latency_run(paths, cases, args.rounds)
                rates = {}
                for name in ("b_mitmdump", "c_polar", "d_polar_write"):
                    rates[name] = asyncio.run(throughput(paths[name], cases[0].body(0), args.seconds))
    finally:
        engine.terminate()
        engine.wait()

    print(
        f"\nproxy overhead, {args.rounds} interleaved requests per path and case "
        f"({RESPONSE_TOKENS} response tokens; added latency = path - direct)"
    )
    print(
        f"{'case':<12}{'direct p50':>12}{'mitmdump +p50':>15}{'+p99':>9}"
        f"{'polar +p50':>13}{'+p99':>9}{'x mitm':>8}{'write +p50':>13}{'+p99':>9}{'x mitm':>8}"
    )
    for case in (c.name for c in cases):
        base = samples[("a_direct", case.replace(" stream", ""))]
        b = samples.get(("b_mitmdump", case)) or []
        base50, base99 = statistics.median(base), pct(base, 0.99)
        row = f"{case:<12}{base50:>10.2f}ms"
        b50 = None
        if b:
            b50, b99 = statistics.median(b) - base50, pct(b, 0.99) - base99
            row += f"{b50:>13.2f}ms{b99:>7.2f}ms"
        else:
            row += f"{'(vs direct)':>24}"
        for path in ("c_polar", "d_polar_write"):
            c = samples[(path, case)]
            c50, c99 = statistics.median(c) - base50, pct(c, 0.99) - base99
            ratio = f"{c50 / b50:>7.2f}x" if b50 else f"{'':>8}"
            row += f"{c50:>11.2f}ms{c99:>7.2f}ms{ratio}"
        print(row)
    print(
        f"\nsustained completions/s, 16 concurrent clients, 1k context: mitmdump {rates['b_mitmdump']:.0f}/s, "
        f"polar {rates['c_polar']:.0f}/s, polar write {rates['d_polar_write']:.0f}/s (target >= 0.8x mitmdump)"
    )


if __name__ == "__main__":
    main()
