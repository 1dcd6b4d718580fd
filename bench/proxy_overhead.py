"""What the proxy costs: the same requests, interleaved in one run, over three paths.

(a) direct to an engine that answers at once (vLLM's wire shape, token ids in the answer);
(b) through a plain ``mitmdump --mode reverse:`` with no addon (the floor of this architecture);
(c) through mitmdump + the polar addon (engine ``vllm:`` = the same instant engine; every call is
    parsed, sent to the engine, recorded durably, and answered in the provider's shape).

Prints p50/p99 added latency over (a) at ~1k and ~32k-token contexts (plain and streaming), and the
sustained completions/s with 16 concurrent clients. Targets (issue 2): (c)'s added p50 within 1.5x
of (b)'s, and >= 200 completions/s.

    .venv/bin/python bench/proxy_overhead.py [--rounds 200] [--seconds 8]
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

ENGINE = textwrap.dedent(
    """
    import sys, orjson
    from aiohttp import web
    N_OUT = %d

    def answer(n_prompt):
        return orjson.dumps({
            "id": "chatcmpl-bench", "object": "chat.completion", "created": 0, "model": "bench",
            "prompt_token_ids": list(range(1000, 1000 + n_prompt)),
            "choices": [{"index": 0, "finish_reason": "length", "stop_reason": None, "token_ids": list(range(7, 7 + N_OUT)),
                         "message": {"role": "assistant", "content": "tok " * N_OUT, "tool_calls": []},
                         "logprobs": {"content": [{"token": "tok", "logprob": -1.25, "bytes": [116], "top_logprobs": []}] * N_OUT}}],
            "usage": {"prompt_tokens": n_prompt, "completion_tokens": N_OUT, "total_tokens": n_prompt + N_OUT}})

    SMALL, LARGE = answer(1024), answer(32768)

    async def chat(request):
        body = await request.read()
        return web.Response(body=LARGE if len(body) > 40000 else SMALL, content_type="application/json")

    async def models(request):
        return web.json_response({"object": "list", "data": [{"id": "bench", "object": "model"}]})

    app = web.Application(client_max_size=1 << 30)
    app.router.add_post("/v1/chat/completions", chat)
    app.router.add_get("/v1/models", models)
    web.run_app(app, host="127.0.0.1", port=int(sys.argv[1]), print=None, access_log=None)
    """
    % RESPONSE_TOKENS
)


def request_body(tokens: int, stream: bool) -> bytes:
    # ~4 characters per token of ordinary text.
    text = ("The quick brown fox jumps over the lazy dog. " * (tokens * 4 // 45 + 1))[: tokens * 4]
    return orjson.dumps({"model": "bench", "max_tokens": RESPONSE_TOKENS, "stream": stream, "logprobs": True,
                         "return_token_ids": True, "messages": [{"role": "system", "content": "You are terse."},
                                                                {"role": "user", "content": text}]})


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def latency_run(paths: dict[str, str], cases: dict[str, bytes], rounds: int) -> dict[tuple[str, str], list[float]]:
    clients = {name: httpx.Client(base_url=url, timeout=60) for name, url in paths.items()}
    samples: dict[tuple[str, str], list[float]] = {(p, c): [] for p in paths for c in cases}
    headers = {"content-type": "application/json", "authorization": "Bearer polar:bench"}
    for i in range(rounds + 5):
        for case, body in cases.items():
            stream = b'"stream":true' in body
            for path, client in clients.items():
                if stream and path != "c_polar":
                    continue
                t0 = time.perf_counter()
                response = client.post("/v1/chat/completions", content=body, headers=headers)
                response.read()
                elapsed = time.perf_counter() - t0
                assert response.status_code == 200, (path, response.status_code, response.text[:300])
                if i >= 5:  # warm-up rounds are not counted
                    samples[(path, case)].append(elapsed * 1000)
    return samples


async def throughput(url: str, body: bytes, seconds: float, concurrency: int = 16) -> float:
    done = 0
    deadline = time.perf_counter() + seconds
    headers = {"content-type": "application/json", "authorization": "Bearer polar:bench"}
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    async with httpx.AsyncClient(base_url=url, timeout=60, limits=limits) as client:
        async def worker() -> None:
            nonlocal done
            while time.perf_counter() < deadline:
                response = await client.post("/v1/chat/completions", content=body, headers=headers)
                assert response.status_code == 200, response.text[:300]
                done += 1

        t0 = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        return done / (time.perf_counter() - t0)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=150, help="timed requests per path and case")
    parser.add_argument("--seconds", type=float, default=8.0, help="duration of each throughput run")
    args = parser.parse_args()

    engine_port = free_port()
    engine = subprocess.Popen([sys.executable, "-c", ENGINE, str(engine_port)])
    try:
        wait_for_port(engine_port, 30, engine)
        engine_url = f"http://127.0.0.1:{engine_port}"
        with tempfile.TemporaryDirectory() as tmp:
            work = Path(tmp)
            with run_mitmdump("", work / "plain" / "out", mode=f"reverse:{engine_url}", addon=False) as plain, \
                    run_mitmdump(f"vllm:{engine_url}", work / "polar" / "shards", mode=f"reverse:{engine_url}") as polar:
                paths = {"a_direct": engine_url, "b_mitmdump": plain.url, "c_polar": polar.url}
                cases = {"1k": request_body(1024, False), "32k": request_body(32768, False),
                         "1k stream": request_body(1024, True), "32k stream": request_body(32768, True)}
                samples = latency_run(paths, cases, args.rounds)
                rates = {}
                for name in ("b_mitmdump", "c_polar"):
                    rates[name] = asyncio.run(throughput(paths[name], cases["1k"], args.seconds))
    finally:
        engine.terminate()
        engine.wait()

    print(f"\nproxy overhead, {args.rounds} interleaved requests per path and case "
          f"({RESPONSE_TOKENS} response tokens; added latency = path - direct)")
    print(f"{'case':<12}{'direct p50':>12}{'mitmdump +p50':>15}{'+p99':>9}{'polar +p50':>13}{'+p99':>9}{'polar/mitmdump':>16}")
    for case in cases:
        base = samples[("a_direct", case.replace(" stream", ""))]
        b = samples.get(("b_mitmdump", case)) or []
        c = samples[("c_polar", case)]
        base50, base99 = statistics.median(base), pct(base, 0.99)
        c50, c99 = statistics.median(c) - base50, pct(c, 0.99) - base99
        if b:
            b50, b99 = statistics.median(b) - base50, pct(b, 0.99) - base99
            print(f"{case:<12}{base50:>10.2f}ms{b50:>13.2f}ms{b99:>7.2f}ms{c50:>11.2f}ms{c99:>7.2f}ms{c50 / b50:>15.2f}x")
        else:
            print(f"{case:<12}{base50:>10.2f}ms{'':>15}{'':>9}{c50:>11.2f}ms{c99:>7.2f}ms{'(vs plain direct)':>16}")
    print(f"\nsustained completions/s, 16 concurrent clients, 1k context: mitmdump {rates['b_mitmdump']:.0f}/s, "
          f"polar {rates['c_polar']:.0f}/s (target >= 200/s)")


if __name__ == "__main__":
    main()
