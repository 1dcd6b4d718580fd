"""A small tool-using agent for the rollout tests, written with the official openai SDK and unaware of polar: it
reads OPENAI_API_KEY / OPENAI_BASE_URL from its environment (the cmd preset sets them), runs a chat loop with one
tool, ``write_file``, executed in its working directory, and stops when the model answers without a tool call,
printing that final answer (as harnesses do in print mode).

    python rollout_agent.py "INSTRUCTION"

The instruction may carry a test behaviour after ``MODE=``: ``crash`` (SIGKILL itself after the first call),
``hang`` (sleep forever after the first call), ``self-reward`` (try to post its own reward through the proxy, both
without credentials and with its session's, and write the HTTP statuses to ``self-reward.txt``), ``slow-unless-0``
(sample 0 runs at once, the others wait 60 s first), ``hang-if`` (``hang`` while the file named by ``FLAG=PATH``
in the instruction exists, else ``normal``: one task hangs in a first run and completes in its rerun).
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from pathlib import Path

from openai import OpenAI

TOOLS = [{"type": "function", "function": {
    "name": "write_file", "description": "Write a text file in the working directory.",
    "parameters": {"type": "object", "properties": {"path": {"type": "string"}, "content": {"type": "string"}},
                   "required": ["path", "content"]}}}]  # fmt: skip


def try_self_reward() -> list[int]:
    import httpx

    session = os.environ["POLAR_SESSION"]
    url = f"http://polar.local/sessions/{session}/reward"
    statuses = []
    with_identity = os.environ["HTTPS_PROXY"]
    plain = "http://" + with_identity.rsplit("@", 1)[1]
    for proxy in (plain, with_identity):
        with httpx.Client(proxy=proxy, timeout=30) as client:
            statuses.append(client.post(url, json={"value": 0.77}).status_code)
            statuses.append(
                client.post(
                    url, json={"value": 0.77}, headers={"authorization": f"Bearer {os.environ['OPENAI_API_KEY']}"}
                ).status_code
            )
    base = os.environ["OPENAI_BASE_URL"].removesuffix("/v1")
    statuses.append(httpx.post(f"{base}/sessions/{session}/reward", json={"value": 0.77}, timeout=30).status_code)
    return statuses


def main() -> None:
    instruction = sys.argv[1]
    mode = instruction.split("MODE=", 1)[1].split()[0] if "MODE=" in instruction else "normal"
    if mode == "hang-if":
        mode = "hang" if Path(instruction.split("FLAG=", 1)[1].split()[0]).exists() else "normal"
    if mode == "slow-unless-0" and os.environ["POLAR_SAMPLE"] != "0":
        time.sleep(60)
    client = OpenAI(max_retries=0, timeout=120)
    messages: list[dict] = [{"role": "user", "content": instruction}]
    for _ in range(8):
        answer = client.chat.completions.create(
            model=os.environ["POLAR_MODEL"], messages=messages, tools=TOOLS, max_tokens=64
        )
        if mode == "crash":
            os.kill(os.getpid(), signal.SIGKILL)
        if mode == "hang":
            time.sleep(3600)
        message = answer.choices[0].message
        messages.append(message.model_dump(exclude_none=True))
        if not message.tool_calls:
            print(message.content or "")
            break
        for call in message.tool_calls:
            args = json.loads(call.function.arguments)
            Path(args["path"]).write_text(args["content"])
            messages.append({"role": "tool", "tool_call_id": call.id, "content": "ok"})
    if mode == "self-reward":
        Path("self-reward.txt").write_text(" ".join(map(str, try_self_reward())))


if __name__ == "__main__":
    main()
