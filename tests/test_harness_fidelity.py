"""Fidelity of the OpenAI Chat and Anthropic translations on what Claude Code and Qwen Code send.

(Codex, Pi and the Gemini CLI check theirs in their own harness tests.) Each harness runs once through
mitmdump with ``save_stream_file``; every leaf of every captured request must come back from the
canonical round trip or carry a documented reason (bench/fidelity.py).
"""

from __future__ import annotations

import pytest

from bench.fidelity import compare_flows, print_table
from tests.support.harnesses import calls, harness, run
from tests.support.proxy import run_mitmdump

pytestmark = [pytest.mark.vllm, pytest.mark.harness]

MODEL_ENV = {
    k: "tiny"
    for k in (
        "ANTHROPIC_MODEL",
        "ANTHROPIC_DEFAULT_HAIKU_MODEL",
        "ANTHROPIC_DEFAULT_SONNET_MODEL",
        "ANTHROPIC_DEFAULT_OPUS_MODEL",
        "CLAUDE_CODE_SUBAGENT_MODEL",
    )
}
CASES = {
    # name: (binary, api, reverse target, env (PROXY = the proxy's URL), arguments)
    "claude-code": (
        "claude",
        "anthropic_messages",
        "https://api.anthropic.com",
        {
            **MODEL_ENV,
            "ANTHROPIC_BASE_URL": "PROXY",
            "ANTHROPIC_API_KEY": "polar:fid-claude-code",
            "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1",
            "CLAUDE_CODE_MAX_RETRIES": "1",
            "DISABLE_AUTOUPDATER": "1",
        },
        ["-p", "Say hello.", "--output-format", "json"],
    ),
    "qwen-code": (
        "qwen",
        "openai_chat",
        "https://api.openai.com",
        {"OPENAI_BASE_URL": "PROXY/v1", "OPENAI_API_KEY": "polar:fid-qwen-code", "OPENAI_MODEL": "tiny"},
        ["-p", "Say hello.", "--auth-type", "openai"],
    ),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_round_trip_of_what_the_harness_sent(name, vllm_server, tmp_path):
    binary, api, target, env, args = CASES[name]
    exe = harness(binary)
    out, flows = tmp_path / "shards", tmp_path / "flows"
    # polar_keepalive above the engine's latency: answers go back whole, so the flow file keeps bodies.
    options = {
        "polar_max_tokens": "16",
        "polar_shard_seconds": "0.5",
        "polar_keepalive": "600",
        "save_stream_file": str(flows),
    }
    with run_mitmdump(f"vllm:{vllm_server}", out, mode=f"reverse:{target}", options=options) as proxy:
        result = run([str(exe), *args], {k: v.replace("PROXY", proxy.url) for k, v in env.items()}, tmp_path / "home")
        assert result.returncode == 0, result.stdout + result.stderr + proxy.logs()[-3000:]
        records = calls(out, f"fid-{name}")
    assert records and all(r.status == "ok" and r.api == api for r in records), [r.error for r in records]
    fidelity = compare_flows([flows], harness=name)
    print_table(fidelity, title=f"fidelity: {name}")
    assert fidelity.calls[(api, name)] == len(records)
    assert not fidelity.unexplained(), [(r.field, r.example) for r in fidelity.unexplained()]
