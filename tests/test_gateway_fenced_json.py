"""The opt-in fenced-JSON fallback end to end: a real mitmdump on the scripted engine replaying the answer
Qwen2.5-Coder-0.5B-Instruct gives a tool-using prompt (a fenced JSON call, no ``<tool_call>`` tags), the official
OpenAI SDK as the client. Opted in (``polar_tool_parser=hermes+fenced_json``) the client gets a real tool call and the
record names the parser that found it; by default the same answer is plain text, as before. The sampled tokens are
the same either way, and the next prompt continues them exactly."""

from __future__ import annotations

import json
import ssl
from pathlib import Path

import httpx
import openai
import orjson
import pytest
from typer.testing import CliRunner

from polar_addon.store.validate import validate_store
from polar_cli.app import app
from tests.support.proxy import run_mitmdump
from tests.support.shards import session_records

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "bash",
            "description": "Run a shell command.",
            "parameters": {"type": "object", "properties": {"command": {"type": "string"}}, "required": ["command"]},
        },
    }
]
FENCED = 'I will list the files.\n\n```json\n{"name": "bash", "arguments": {"command": "ls"}}\n```'


@pytest.fixture(scope="module")
def script(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("fenced") / "script.json"
    turns = [
        {"content": FENCED},  # what the small model writes
        {"content": None, "tool_calls": [
            {"type": "function", "function": {"name": "bash", "arguments": {"command": "pwd"}}}]},
        {"content": "There is one file."},
    ]  # fmt: skip
    path.write_text(json.dumps({"model_dir": str(tiny_model_dir), "cycle": False, "turns": turns}))
    return path


def client(proxy, session: str) -> openai.OpenAI:
    http = httpx.Client(
        proxy=proxy.proxy_url(session), verify=ssl.create_default_context(cafile=str(proxy.ca)), timeout=120
    )
    return openai.OpenAI(api_key="sk-not-a-real-key", http_client=http, max_retries=0)


def first_answer(script: Path, out: Path, session: str, options: dict[str, str]):
    with run_mitmdump(f"scripted:{script}", out, options={"polar_shard_seconds": "0.2", **options}) as proxy:
        oai = client(proxy, session)
        messages: list = [{"role": "user", "content": "What files are here?"}]
        first = oai.chat.completions.create(model="tiny", messages=messages, tools=TOOLS, max_tokens=200)
        message = first.choices[0].message
        if message.tool_calls:  # the harness runs the tool and asks again, twice
            messages += [message.model_dump(exclude_none=True)]
            messages += [{"role": "tool", "tool_call_id": message.tool_calls[0].id, "content": "a.txt"}]
            second = oai.chat.completions.create(model="tiny", messages=messages, tools=TOOLS, max_tokens=200)
            messages += [second.choices[0].message.model_dump(exclude_none=True)]
            messages += [{"role": "tool", "tool_call_id": second.choices[0].message.tool_calls[0].id, "content": "/w"}]
            oai.chat.completions.create(model="tiny", messages=messages, tools=TOOLS, max_tokens=200)
        records = sorted(session_records(out, session), key=lambda r: r.seq)
    assert validate_store(str(out)) == []
    return first, records, out


@pytest.fixture(scope="module")
def runs(script: Path, tmp_path_factory: pytest.TempPathFactory) -> dict:
    """The same script through one proxy opted in and one on the default parser (two mitmdump starts in all)."""
    out = tmp_path_factory.mktemp("fenced-runs")
    return {
        "on": first_answer(script, out / "on", "fj-on", {"polar_tool_parser": "hermes+fenced_json"}),
        "off": first_answer(script, out / "off", "fj-off", {}),
    }


def test_opted_in_a_fenced_answer_is_a_tool_call_and_the_record_says_which_parser(runs: dict, tiny_model_dir: Path):
    first, records, out = runs["on"]
    choice = first.choices[0]
    assert choice.finish_reason == "tool_calls"
    [call] = choice.message.tool_calls
    assert (call.function.name, json.loads(call.function.arguments)) == ("bash", {"command": "ls"})
    assert choice.message.content == "I will list the files."
    # One record per call, each naming who found its calls: the fallback, the engine (a scripted call), nobody.
    assert [r.tool_call_parser for r in records] == ["fenced_json", "engine", None]
    assert [r.finish_reason for r in records] == ["tool_calls", "tool_calls", "stop"]
    assert orjson.loads(records[0].response_json)["tool_calls"][0]["name"] == "bash"
    # The next prompt continues the sampled tokens (the fenced text the model wrote), not a re-rendered
    # <tool_call>: the harness echoed the message polar returned, so the chain holds.
    a, b = records[0], records[1]
    assert b.prompt_source == "continuity"
    assert list(b.prompt_ids[: len(a.prompt_ids) + len(a.response_ids)]) == list(a.prompt_ids) + a.response_ids
    # What a user counts: calls by who found their tool calls.
    stats = CliRunner().invoke(app, ["stats", str(out), "--tokenizer", str(tiny_model_dir), "--json"])
    assert stats.exit_code == 0, stats.output
    assert orjson.loads(stats.stdout)["total"]["tool_call_parsers"] == {"engine": 1, "fenced_json": 1}


def test_by_default_the_same_answer_is_text_with_the_same_tokens(runs: dict):
    first, [record], _ = runs["off"]
    choice = first.choices[0]
    assert (choice.finish_reason, choice.message.tool_calls, choice.message.content) == ("stop", None, FENCED)
    assert record.tool_call_parser is None and record.finish_reason == "stop"
    # The opted-in proxy's first call sampled exactly these tokens: only the parsed message differs.
    on = runs["on"][1][0]
    assert on.prompt_ids == record.prompt_ids and on.response_ids == record.response_ids
    assert on.logprobs == pytest.approx(record.logprobs, abs=1e-6)
