"""A small tool-using agent written with the official openai SDK, unaware of polar.

It talks to ``https://api.openai.com/v1`` like any agent; run it with ``HTTPS_PROXY`` pointing at
mitmdump + the polar addon (and ``SSL_CERT_FILE`` at mitmproxy's CA) and every call it makes is
captured. The session is named in the proxy URL: ``HTTPS_PROXY=http://SESSION@127.0.0.1:8080``.

    python examples/calculator_agent.py "What is 17 + 25?" --model tiny --turns 3
"""

from __future__ import annotations

import argparse
import json

from openai import OpenAI

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "add",
            "description": "Add two integers.",
            "parameters": {
                "type": "object",
                "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
                "required": ["a", "b"],
            },
        },
    }
]


def run_tool(name: str, arguments: str) -> str:
    try:
        args = json.loads(arguments)
        if name == "add":
            return str(int(args["a"]) + int(args["b"]))
        return f"unknown tool {name}"
    except (ValueError, KeyError, TypeError) as exc:
        return f"bad arguments: {exc}"


def run(question: str, model: str, turns: int, max_tokens: int, temperature: float) -> list[dict]:
    client = OpenAI(api_key="unused", max_retries=0)
    messages: list[dict] = [
        {"role": "system", "content": "You are a careful calculator. Use the add tool."},
        {"role": "user", "content": question},
    ]
    for _ in range(turns):
        stream = client.chat.completions.create(
            model=model,
            messages=messages,
            tools=TOOLS,
            stream=True,
            max_tokens=max_tokens,
            temperature=temperature,
            stream_options={"include_usage": True},
        )
        text, calls = "", {}
        for chunk in stream:
            for choice in chunk.choices:
                delta = choice.delta
                text += delta.content or ""
                for tc in delta.tool_calls or []:
                    slot = calls.setdefault(tc.index, {"id": tc.id, "name": "", "arguments": ""})
                    slot["name"] += (tc.function.name or "") if tc.function else ""
                    slot["arguments"] += (tc.function.arguments or "") if tc.function else ""
        assistant: dict = {"role": "assistant", "content": text}
        if calls:
            assistant["tool_calls"] = [
                {"id": c["id"], "type": "function", "function": {"name": c["name"], "arguments": c["arguments"]}}
                for c in calls.values()
            ]
        messages.append(assistant)
        if not calls:
            # No tool call: give the model the "observation" the task needs and go on, as agents do.
            messages.append({"role": "user", "content": "Please use the add tool."})
            continue
        for c in calls.values():
            messages.append({"role": "tool", "tool_call_id": c["id"], "content": run_tool(c["name"], c["arguments"])})
    return messages


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("question")
    parser.add_argument("--model", default="tiny")
    parser.add_argument("--turns", type=int, default=3)
    parser.add_argument("--max-tokens", type=int, default=24)
    parser.add_argument("--temperature", type=float, default=1.0)
    args = parser.parse_args()
    messages = run(args.question, args.model, args.turns, args.max_tokens, args.temperature)
    print(json.dumps({"turns": sum(m["role"] == "assistant" for m in messages)}))


if __name__ == "__main__":
    main()
