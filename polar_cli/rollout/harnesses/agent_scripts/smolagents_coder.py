"""A small coding agent on smolagents: a ``CodeAgent`` (it acts by writing Python) with one ``bash`` tool, the task
as the prompt, Chat Completions through ``OpenAIServerModel``.

Copy it and make it yours; polar's ``--harness smolagents`` preset runs it as it is. Everything it needs comes from
the environment and the command line, so the same script runs against polar's reverse proxy or any OpenAI-compatible
endpoint:

    OPENAI_BASE_URL=http://127.0.0.1:8081/v1 OPENAI_API_KEY=polar:SESSION \\
        python smolagents_coder.py --model MODEL "Fix the failing test in stats.py."
"""

from __future__ import annotations

import argparse
import os
import subprocess

import smolagents
from smolagents import CodeAgent, OpenAIServerModel, tool

OUTPUT_LIMIT = 10_000  # characters of a command's output the model sees (the end of it)


@tool
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("task")
    parser.add_argument("--model", required=True)
    parser.add_argument("--max-steps", type=int, default=20)
    parser.add_argument("--max-tokens", type=int, default=None, help="output cap per model call")
    args = parser.parse_args()
    model = OpenAIServerModel(
        model_id=args.model,
        api_base=os.environ["OPENAI_BASE_URL"],
        api_key=os.environ["OPENAI_API_KEY"],
        # The OpenAI SDK's own User-Agent says nothing of the agent: name it, for whoever reads the traffic.
        client_kwargs={"default_headers": {"User-Agent": f"smolagents/{smolagents.__version__}"}},
        **({"max_tokens": args.max_tokens} if args.max_tokens else {}),
    )
    agent = CodeAgent(tools=[bash], model=model, max_steps=args.max_steps)
    print(agent.run(args.task))


if __name__ == "__main__":
    main()
