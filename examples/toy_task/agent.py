"""The toy agent: a two-turn chat written with the official openai SDK, unaware of polar.

    python examples/toy_task/agent.py "what is the capital of france"

It asks the question under a system prompt that wants CAPITAL LETTERS, then asks for it louder, and writes its
replies to ``answer.txt`` in the current directory (the task's workspace), where the task's verifier reads them.
The SDK takes its endpoint and key from ``OPENAI_BASE_URL`` and ``OPENAI_API_KEY``, which `polar rollout` / `polar
loop` set per session (the ``cmd:`` preset): the key carries the session's identity, so every call is captured under
the right session and group.
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

from openai import OpenAI

SYSTEM = "You are a loud assistant. Answer every question in CAPITAL LETTERS."
FOLLOW_UP = "Louder, please. Say it again."


def episode(client: OpenAI, question: str, *, model: str, turns: int, max_tokens: int, temperature: float) -> list[str]:
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
    parser.add_argument("question")
    parser.add_argument("--model", default=os.environ.get("OPENAI_MODEL", "policy"))
    parser.add_argument("--turns", type=int, default=2)
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--answer", type=Path, default=Path("answer.txt"))
    args = parser.parse_args()
    client = OpenAI(max_retries=0, timeout=300)
    replies = episode(client, args.question, model=args.model, turns=args.turns, max_tokens=args.max_tokens,
                      temperature=args.temperature)  # fmt: skip
    args.answer.write_text("\n".join(replies))


if __name__ == "__main__":
    main()
