"""A small coding agent on the OpenAI Agents SDK: one shell tool, the task as the prompt, the Responses API.

Copy it and make it yours; polar's ``--harness openai-agents`` preset runs it as it is. Everything it needs comes
from the environment, so the same script runs against polar's reverse proxy, a plain OpenAI endpoint or anything
that speaks the Responses API:

    OPENAI_BASE_URL=http://127.0.0.1:8081/v1 OPENAI_API_KEY=polar:SESSION \\
        python openai_agents_coder.py --model MODEL "Fix the failing test in stats.py."

Tracing is off: the SDK would otherwise upload every run's spans to OpenAI.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import subprocess

from agents import Agent, ModelSettings, Runner, function_tool, set_default_openai_api, set_tracing_disabled

INSTRUCTIONS = (
    "You are a coding agent working in the current directory. Use the bash tool to inspect files, edit them and run "
    "tests. When the task is done, answer with a one-line summary of what you changed."
)
OUTPUT_LIMIT = 10_000  # characters of a command's output the model sees (the end of it)


@function_tool
def bash(command: str) -> str:
    """Run a shell command in the working directory; returns its exit code and output.

    Args:
        command: the command line, run by bash.
    """
    try:
        done = subprocess.run(["bash", "-c", command], capture_output=True, text=True, timeout=120)
    except subprocess.TimeoutExpired:
        return "exit: timeout after 120 s"
    output = (done.stdout + done.stderr)[-OUTPUT_LIMIT:]
    return f"exit: {done.returncode}\n{output}"


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("task")
    parser.add_argument("--model", required=True)
    parser.add_argument("--max-turns", type=int, default=30)
    parser.add_argument("--max-tokens", type=int, default=None, help="output cap per model call")
    args = parser.parse_args()
    set_tracing_disabled(True)
    set_default_openai_api("responses")
    agent = Agent(
        name="coder",
        instructions=INSTRUCTIONS,
        tools=[bash],
        model=args.model,
        model_settings=ModelSettings(max_tokens=args.max_tokens),
    )
    result = await Runner.run(agent, args.task, max_turns=args.max_turns)
    print(result.final_output)


if __name__ == "__main__":
    os.environ.setdefault("OPENAI_AGENTS_DISABLE_TRACING", "1")
    asyncio.run(main())
