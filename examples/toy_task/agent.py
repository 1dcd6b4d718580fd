"""The toy agent: a two-turn chat loop written with the official openai SDK, unaware of polar.

It talks to ``https://api.openai.com/v1`` like any OpenAI client; with ``HTTPS_PROXY`` pointing at
mitmdump + the polar addon (and ``SSL_CERT_FILE`` at mitmproxy's CA) every call is captured and
answered by polar's engine. Each episode uses the API key it is given, the way a harness gets one
key per run; the proxy reads the session from keys of the form ``polar:session=...;group=...``.

    python examples/toy_task/agent.py episodes.jsonl > replies.jsonl

Input lines: ``{"id": ..., "api_key": ..., "question": ...}``; output lines: ``{"id": ..., "replies": [...]}``.
"""

from __future__ import annotations

import argparse
import json
import sys
from concurrent.futures import ThreadPoolExecutor

from openai import OpenAI

SYSTEM = "You are a loud assistant. Answer every question in CAPITAL LETTERS."
FOLLOW_UP = "Louder, please. Say it again."


def episode(api_key: str, question: str, *, model: str, turns: int, max_tokens: int, temperature: float) -> list[str]:
    client = OpenAI(api_key=api_key, max_retries=0, timeout=300)
    messages: list[dict] = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}]
    replies: list[str] = []
    for turn in range(turns):
        if turn:
            messages.append({"role": "user", "content": FOLLOW_UP})
        answer = client.chat.completions.create(
            model=model, messages=messages, max_tokens=max_tokens, temperature=temperature
        )
        text = answer.choices[0].message.content or ""
        replies.append(text)
        messages.append({"role": "assistant", "content": text})
    return replies


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("episodes", help="JSONL file of episodes")
    parser.add_argument("--model", default="policy")
    parser.add_argument("--turns", type=int, default=2)
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--concurrency", type=int, default=4)
    args = parser.parse_args()
    with open(args.episodes) as f:
        episodes = [json.loads(line) for line in f if line.strip()]

    def run(ep: dict) -> dict:
        replies = episode(
            ep["api_key"], ep["question"], model=args.model, turns=args.turns,
            max_tokens=args.max_tokens, temperature=args.temperature,
        )  # fmt: skip
        return {"id": ep["id"], "replies": replies}

    with ThreadPoolExecutor(args.concurrency) as pool:
        for result in pool.map(run, episodes):
            sys.stdout.write(json.dumps(result) + "\n")


if __name__ == "__main__":
    main()
