"""polar's qwen3_coder parser and the installed vLLM's, side by side on the same outputs and tools: the same
calls with byte-equal arguments, except the malformed blocks polar reports as failed parses where vLLM guesses."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from polar_addon.tool_parsers.qwen3_coder import parse
from tests.support.prereq import missing
from tests.test_tool_parsers_qwen3_coder import MALFORMED, TOOLS, VLLM_CASES

pytestmark = pytest.mark.vllm

VLLM_PYTHON = Path(__file__).resolve().parent.parent / ".venv-vllm" / "bin" / "python"

TYPED_TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "t",
            "parameters": {
                "type": "object",
                "properties": {
                    "s": {"type": "string"},
                    "b": {"type": "boolean"},
                    "n": {"type": "number"},
                    "i": {"type": "integer"},
                    "a": {"type": "array"},
                    "e": {"enum": [1, 2, None]},
                    "u": {"anyOf": [{"type": "object"}, {"type": "null"}]},
                    "f": {"type": "float64"},
                    "o": {"type": ["string", "null"]},
                },
            },
        },
    }
]
VALUES = [
    "null",
    "NULL",
    "yes",
    "4.0",
    "['a', 'b']",
    "nan",
    "1e999",
    "[1e999]",
    "1",
    "0",
    " 42 ",
    "1_000",
    "True",
    '{"x": [1, 2.50]}',
    "null ",
    "-0",
    "9" * 30,
    "ü\n<b>",
    "",
]

# vLLM's parser, run in the engine's own venv on the cases given as JSON on stdin.
VLLM_SIDE = """
import json, sys
from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest
from vllm.tokenizers import get_tokenizer
from vllm.tool_parsers import ToolParserManager
tokenizer, cases = get_tokenizer(sys.argv[1]), json.load(sys.stdin)
parser_cls = ToolParserManager.get_tool_parser("qwen3_coder")
out = []
for text, tools in cases:
    request = ChatCompletionRequest(model="tiny", messages=[{"role": "user", "content": "x"}], tools=tools)
    info = parser_cls(tokenizer, request.tools).extract_tool_calls(text, request)
    out.append([[c.function.name, c.function.arguments] for c in info.tool_calls])
print(json.dumps(out))
"""


def test_same_calls_as_vllm(tiny_model_dir: Path) -> None:
    if not VLLM_PYTHON.exists():
        missing(f"vLLM CPU venv missing ({VLLM_PYTHON}); run `make engine`")
    cases = [(text, TOOLS) for _, text, _, _ in VLLM_CASES]
    for value in VALUES:
        params = "".join(f"<parameter={k}>\n{value}\n</parameter>\n" for k in "sbniaeufoz")
        cases.append((f"<tool_call>\n<function=t>\n{params}</function>\n</tool_call>", TYPED_TOOLS))
    malformed = [(text, TOOLS) for _, text in MALFORMED]
    done = subprocess.run(
        [str(VLLM_PYTHON), "-c", VLLM_SIDE, str(tiny_model_dir)],
        input=json.dumps(cases + malformed),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    theirs = json.loads(done.stdout.strip().splitlines()[-1])
    ours = [[[c.name, c.arguments] for c in parse(text, tools).message.tool_calls] for text, tools in cases + malformed]
    assert ours[: len(cases)] == theirs[: len(cases)]
    # Malformed blocks: no call from polar (a visible failed parse); vLLM reads some of them as calls anyway.
    assert ours[len(cases) :] == [[] for _ in malformed]
    assert any(theirs[len(cases) :])
