"""The Gemini CLI (npm ``@google/gemini-cli`` 0.61.0) through the proxy, against the tiny model on vLLM.

What it takes: an API-key auth choice in ``~/.gemini/settings.json``
(``security.auth.selectedType = "gemini-api-key"``), ``GEMINI_API_KEY`` (``polar:SESSION``: the
session rides on ``x-goog-api-key``), and ``--skip-trust`` for a headless run in a fresh folder.
Then either ``GOOGLE_GEMINI_BASE_URL`` at mitmdump in reverse mode, or ``HTTPS_PROXY`` +
``NODE_EXTRA_CA_CERTS`` with no base URL. The CLI streams (``streamGenerateContent?alt=sse``); its
telemetry (play.googleapis.com) fails fast offline.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench.fidelity import compare_flows, print_table
from tests.support.harnesses import calls, harness, run
from tests.support.proxy import run_mitmdump

pytestmark = [pytest.mark.vllm, pytest.mark.harness]


def gemini_home(home: Path) -> Path:
    (home / ".gemini").mkdir(parents=True)
    (home / ".gemini" / "settings.json").write_text(
        json.dumps({"security": {"auth": {"selectedType": "gemini-api-key"}}})
    )
    return home


def check(records: list) -> None:
    assert records and all(r.status == "ok" for r in records), [r.error for r in records]
    assert {r.api for r in records} == {"gemini"}
    assert all(r.harness and r.harness.startswith("GeminiCLI") for r in records)
    assert all(len(r.logprobs) == len(r.response_ids) > 0 for r in records)
    assert records[0].messages[0]["role"] == "system" and records[0].tools


def test_gemini_cli_with_base_url(vllm_server, tmp_path):
    gemini = harness("gemini")
    out, flows, home = tmp_path / "shards", tmp_path / "flows", gemini_home(tmp_path / "home")
    options = {
        "polar_max_tokens": "32",
        "polar_shard_seconds": "0.5",
        "polar_keepalive": "600",
        "save_stream_file": str(flows),
    }
    with run_mitmdump(
        f"vllm:{vllm_server}", out, mode="reverse:https://generativelanguage.googleapis.com", options=options
    ) as proxy:
        env = {"GOOGLE_GEMINI_BASE_URL": proxy.url, "GEMINI_API_KEY": "polar:gemini-base"}
        result = run([str(gemini), "-p", "Say hello.", "-m", "tiny", "--skip-trust"], env, home)
        assert result.returncode == 0, result.stdout + result.stderr + proxy.logs()[-3000:]
        records = calls(out, "gemini-base")
    check(records)
    fidelity = compare_flows([flows], harness="gemini-cli")
    print_table(fidelity, title="fidelity: gemini-cli")
    assert fidelity.calls[("gemini", "gemini-cli")] == len(records)
    assert not fidelity.unexplained(), [(r.field, r.example) for r in fidelity.unexplained()]


def test_gemini_cli_through_https_proxy_with_keepalives(vllm_server, tmp_path):
    """No base URL; keep-alives every 0.2 s, so the answer streams through the relay after blank-line
    keep-alives (which the CLI's SSE reader must skip)."""
    gemini = harness("gemini")
    out, home = tmp_path / "shards", gemini_home(tmp_path / "home")
    options = {"polar_max_tokens": "32", "polar_shard_seconds": "0.5", "polar_keepalive": "0.2"}
    with run_mitmdump(f"vllm:{vllm_server}", out, options=options) as proxy:
        env = {"HTTPS_PROXY": proxy.url, "NODE_EXTRA_CA_CERTS": str(proxy.ca), "GEMINI_API_KEY": "polar:gemini-proxy"}
        result = run([str(gemini), "-p", "Say hello.", "-m", "tiny", "--skip-trust"], env, home)
        assert result.returncode == 0, result.stdout + result.stderr + proxy.logs()[-3000:]
        records = calls(out, "gemini-proxy")
    check(records)
