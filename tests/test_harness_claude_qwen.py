"""Real harness CLIs (npm) finish a non-interactive prompt through the proxy against the tiny model.

Claude Code through a forward proxy (HTTPS_PROXY + NODE_EXTRA_CA_CERTS, no base URL) and through
ANTHROPIC_BASE_URL (reverse mode); Qwen Code through OPENAI_BASE_URL. The engine is real vLLM CPU.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from polar_addon.store.validate import validate_store
from tests.support.harnesses import calls as session_calls
from tests.support.harnesses import harness, run
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
PROXY_OPTIONS = {"polar_max_tokens": "16", "polar_shard_seconds": "0.5"}


def calls(out: Path, session: str) -> list:
    records = session_calls(out, session)
    assert validate_store(str(out)) == []
    return records


def claude_env(**extra: str) -> dict[str, str]:
    return {
        **MODEL_ENV,
        "ANTHROPIC_API_KEY": "sk-ant-not-real",
        "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1",
        "CLAUDE_CODE_MAX_RETRIES": "1",
        "DISABLE_AUTOUPDATER": "1",
        **extra,
    }


def test_claude_code_through_https_proxy(vllm_server, tmp_path):
    claude = harness("claude")
    out = tmp_path / "shards"
    with run_mitmdump(f"vllm:{vllm_server}", out, options=PROXY_OPTIONS) as proxy:
        # Claude Code's API client fails to connect when HTTPS_PROXY carries credentials
        # (FailedToOpenSocket), so its session rides on the API key instead.
        env = claude_env(HTTPS_PROXY=proxy.url, NODE_EXTRA_CA_CERTS=str(proxy.ca), ANTHROPIC_API_KEY="polar:cc-proxy")
        result = run([str(claude), "-p", "Say hello.", "--output-format", "json"], env, tmp_path / "home")
        assert result.returncode == 0, result.stdout + result.stderr + proxy.logs()[-3000:]
        assert json.loads(result.stdout)["is_error"] is False
        records = calls(out, "cc-proxy")
    assert records and all(r.status == "ok" for r in records), [r.error for r in records]
    assert {r.api for r in records} == {"anthropic_messages"}
    assert all(r.harness and "claude" in r.harness.lower() for r in records)
    # Claude Code's per-request billing line never reaches the engine or the record.
    assert all("x-anthropic-billing-header" not in r.messages_json for r in records)


def test_claude_code_with_base_url(vllm_server, tmp_path):
    claude = harness("claude")
    out = tmp_path / "shards"
    with run_mitmdump(
        f"vllm:{vllm_server}", out, mode="reverse:https://api.anthropic.com", options=PROXY_OPTIONS
    ) as proxy:
        env = claude_env(ANTHROPIC_BASE_URL=proxy.url, ANTHROPIC_API_KEY="polar:session=cc-base;task=hello")
        result = run([str(claude), "-p", "Say hello.", "--output-format", "json"], env, tmp_path / "home")
        assert result.returncode == 0, result.stdout + result.stderr + proxy.logs()[-3000:]
        records = calls(out, "cc-base")
    assert records and all(r.status == "ok" and r.task_id == "hello" for r in records)


def test_qwen_code_with_base_url(vllm_server, tmp_path):
    qwen = harness("qwen")
    out = tmp_path / "shards"
    with run_mitmdump(
        f"vllm:{vllm_server}", out, mode="reverse:https://api.openai.com", options=PROXY_OPTIONS
    ) as proxy:
        env = {"OPENAI_BASE_URL": proxy.url + "/v1", "OPENAI_API_KEY": "polar:qwen-1", "OPENAI_MODEL": "tiny"}
        result = run([str(qwen), "-p", "Say hello.", "--auth-type", "openai"], env, tmp_path / "home")
        assert result.returncode == 0, result.stdout + result.stderr + proxy.logs()[-3000:]
        records = calls(out, "qwen-1")
    assert records and all(r.status == "ok" for r in records), [r.error for r in records]
    assert {r.api for r in records} == {"openai_chat"}
    assert all(len(r.logprobs) == len(r.response_ids) > 0 for r in records)
