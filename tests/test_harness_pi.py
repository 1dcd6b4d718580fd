"""Pi (npm ``@mariozechner/pi-coding-agent``) through the proxy with a ``models.json`` provider for each
API it speaks: openai-completions, openai-responses, anthropic-messages and google-generative-ai.

Pi has no base-URL variable; its ``~/.pi/agent/models.json`` names the provider's base URL (here the
mitmdump reverse proxy) and the API key, which carries the session (``polar:SESSION``). The engine
is real vLLM CPU serving the tiny model; each run also checks the fidelity of the translation on
what Pi actually sent (bench/fidelity.py).
"""

from __future__ import annotations

import json

import pytest

from bench.fidelity import compare_flows, print_table
from tests.support.harnesses import calls, harness, run
from tests.support.proxy import run_mitmdump

pytestmark = [pytest.mark.vllm, pytest.mark.harness]

# api -> (recorded provider, path after the proxy's URL, reverse target)
APIS = {
    "openai-completions": ("openai_chat", "/v1", "https://api.openai.com"),
    "openai-responses": ("openai_responses", "/v1", "https://api.openai.com"),
    "anthropic-messages": ("anthropic_messages", "", "https://api.anthropic.com"),
    "google-generative-ai": ("gemini", "/v1beta", "https://generativelanguage.googleapis.com"),
}


@pytest.mark.parametrize("api", sorted(APIS))
def test_pi_print_mode(api, vllm_server, tmp_path):
    pi = harness("pi")
    recorded, prefix, target = APIS[api]
    session = f"pi-{api}"
    out, flows, home = tmp_path / "shards", tmp_path / "flows", tmp_path / "home"
    # polar_keepalive above the engine's latency: answers go back whole, so the flow file keeps bodies.
    options = {
        "polar_max_tokens": "32",
        "polar_shard_seconds": "0.5",
        "polar_keepalive": "600",
        "save_stream_file": str(flows),
    }
    with run_mitmdump(f"vllm:{vllm_server}", out, mode=f"reverse:{target}", options=options) as proxy:
        provider = {
            "baseUrl": proxy.url + prefix,
            "api": api,
            "apiKey": f"polar:{session}",
            "models": [{"id": "tiny", "contextWindow": 100000, "maxTokens": 200}],
        }
        if api.startswith("openai"):
            provider["compat"] = {"supportsDeveloperRole": False, "supportsReasoningEffort": False}
        (home / ".pi" / "agent").mkdir(parents=True)
        (home / ".pi" / "agent" / "models.json").write_text(json.dumps({"providers": {"polar": provider}}))
        result = run(
            [str(pi), "-p", "--provider", "polar", "--model", "tiny", "--no-session", "Say hello."],
            {"PI_OFFLINE": "1"},
            home,
        )
        assert result.returncode == 0, result.stdout + result.stderr + proxy.logs()[-3000:]
        records = calls(out, session)
    assert records and all(r.status == "ok" for r in records), [r.error for r in records]
    assert {r.api for r in records} == {recorded}
    assert all(len(r.logprobs) == len(r.response_ids) > 0 for r in records)
    assert records[0].messages[0]["role"] == "system" and records[0].tools  # Pi's prompt and its tools arrive whole
    # Pi sends only its SDK's User-Agent; it is named from its system prompt, so stats per harness mean something.
    assert all(r.harness and r.harness.startswith("pi (") for r in records), {r.harness for r in records}

    fidelity = compare_flows([flows], harness="pi")
    print_table(fidelity, title=f"fidelity: pi {api}")
    assert fidelity.calls[(recorded, "pi")] == len(records)
    assert not fidelity.unexplained(), [(r.field, r.example) for r in fidelity.unexplained()]
