"""The cheapest coding agent: one model call. It shows the model the task's instruction and ``solution.py``, and
writes back the first fenced Python block of the answer (the whole answer when it has none).

A `cmd:` harness for HumanEval-style tasks (examples/humaneval/build_tasks.py), the base rate below every real
harness: it needs no tool protocol, so it measures what the model can code, not whether it speaks a harness's
action format. The openai SDK finds polar through the environment the `cmd:` preset sets (``OPENAI_BASE_URL``,
``OPENAI_API_KEY=polar:SECRET``):

    polar eval humaneval/heldout --samples 2 --engine vllm:http://127.0.0.1:8000 --out store \\
        --harness "cmd:$PWD/.venv/bin/python $PWD/examples/humaneval/coder.py {instruction}"
"""

from __future__ import annotations

import os
import re
import sys
from pathlib import Path

from openai import OpenAI

FENCE = re.compile(r"```(?:python|py)?[ \t]*\n(.*?)```", re.DOTALL)
MAX_TOKENS = int(os.environ.get("CODER_MAX_TOKENS", "512"))


def extract_code(answer: str) -> str:
    """The first fenced block of ``answer`` (a bare fence too), else the answer itself."""
    found = FENCE.search(answer)
    return (found.group(1) if found else answer).strip() + "\n"


def main() -> int:
    instruction = sys.argv[1] if len(sys.argv) > 1 else os.environ.get("POLAR_INSTRUCTION", "")
    solution = Path("solution.py")
    prompt = (
        f"{instruction}\n\nHere is `solution.py`:\n\n```python\n{solution.read_text()}```\n\n"
        "Answer with the complete new `solution.py` in one ```python block."
    )
    reply = OpenAI().chat.completions.create(
        model=os.environ.get("POLAR_MODEL", "policy"),
        messages=[{"role": "user", "content": prompt}],
        max_tokens=MAX_TOKENS,
    )
    answer = reply.choices[0].message.content or ""
    print(answer)
    solution.write_text(extract_code(answer))
    return 0


if __name__ == "__main__":
    sys.exit(main())
