"""Trajectories built from real captured harness sessions: Claude Code runs a real tool loop
through the proxy against the scripted engine (real tokenizer, chat template and model logprobs),
and the captured calls merge into one token-exact trace."""

from __future__ import annotations

import json

import httpx
import pytest

from polar_addon.store import read_records, read_sessions
from polar_cli.build import build_traces
from polar_cli.build.inputs import session_info
from tests.build_helpers import check_trace
from tests.support.atif import check_atif_export
from tests.support.harnesses import harness, run
from tests.support.proxy import run_mitmdump

pytestmark = pytest.mark.harness


def test_claude_code_tool_loop_merges_into_one_trace(tiny_model_dir, tmp_path):
    claude = harness("claude")
    script = tmp_path / "script.json"
    script.write_text(
        json.dumps(
            {
                "model_dir": str(tiny_model_dir),
                "cycle": True,
                "turns": [
                    {
                        "content": "I will look for text files.",
                        "tool_calls": [
                            {"type": "function", "function": {"name": "Glob", "arguments": '{"pattern": "*.txt"}'}}
                        ],
                    },
                    {"content": "There is one text file: notes.txt."},
                ],
            }
        )
    )
    home = tmp_path / "home"
    home.mkdir()
    (home / "notes.txt").write_text("hello\n")
    out = tmp_path / "shards"
    env = {
        "ANTHROPIC_API_KEY": "polar:session=cc-loop;task=find-files;group=g0;sample=0",
        "ANTHROPIC_MODEL": "tiny",
        "ANTHROPIC_DEFAULT_HAIKU_MODEL": "tiny",
        "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1",
        "CLAUDE_CODE_MAX_RETRIES": "1",
    }
    with run_mitmdump(
        f"scripted:{script}", out, mode="reverse:https://api.anthropic.com", options={"polar_shard_seconds": "0.5"}
    ) as proxy:
        # A short system prompt and one tool keep the prompt small enough for a CPU forward pass.
        result = run(
            [
                str(claude),
                "-p",
                "Which text files are here?",
                "--output-format",
                "json",
                "--tools",
                "Glob",
                "--system-prompt",
                "You are a file finder.",
            ],
            {**env, "ANTHROPIC_BASE_URL": proxy.url},
            home,
        )
        assert result.returncode == 0, result.stdout + result.stderr + proxy.logs()[-3000:]
        # The verifier's verdict, posted to the reverse listener with the proxy's control token.
        for what, body in (("reward", {"value": 1.0}), ("status", {"status": "completed"})):
            httpx.post(
                f"{proxy.url}/sessions/cc-loop/{what}", json=body, headers=proxy.control_headers()
            ).raise_for_status()
    answer = json.loads(result.stdout)
    assert answer["num_turns"] == 2 and "notes.txt" in answer["result"]

    records = [r for r in read_records(str(out)) if r.session_id == "cc-loop"]
    assert len(records) == 2 and [r.finish_reason for r in records] == ["tool_calls", "stop"]
    # The tool really ran: its output is in the second call's history.
    assert "notes.txt" in records[1].messages_json
    sessions = {s.session_id: session_info(s) for s in read_sessions(str(out))}
    result = build_traces(records, sessions, "prefix_merging")
    (trace,) = result.traces
    assert trace.calls_merged == 2 and trace.break_cause is None
    assert (trace.task_id, trace.group_id, trace.sample_index) == ("find-files", "g0", 0)
    check_trace(trace, {r.record_id: r for r in records}, retokenized_ok=False)
    assert trace.trainable and trace.reward == 1.0
    assert sum(trace.loss_mask) == sum(len(r.response_ids) for r in records)

    # The same real session exported as Harbor ATIF: valid under Harbor's models, the Glob call paired with its
    # result, each sampled turn with its exact tokens, the verifier's reward on the trajectory.
    atif = check_atif_export(str(out), ["cc-loop"])["cc-loop"]
    agent = [s for s in atif.steps if s.source == "agent"]
    assert [s.metrics.completion_token_ids for s in agent] == [r.response_ids for r in records]
    (glob,) = agent[0].tool_calls
    assert glob.function_name == "Glob" and glob.arguments == {"pattern": "*.txt"}
    (result,) = agent[0].observation.results
    assert result.source_call_id == glob.tool_call_id and "notes.txt" in result.content
    assert atif.final_metrics.extra == {"reward": 1.0, "status": "completed"}
