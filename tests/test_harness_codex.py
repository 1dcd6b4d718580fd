"""Codex 0.171 (npm ``@openai/codex``) through the proxy, against the tiny model.

- Default provider, no config change: ``HTTPS_PROXY`` + mitmproxy's CA. Codex speaks Responses over
  its WebSocket (``wss://api.openai.com/v1/responses``), which the proxy answers: no fallback to
  HTTP, and the second turn continues the first with ``previous_response_id``.
- A custom provider with a base URL (``wire_api = "responses"``, WebSockets off): plain HTTP POSTs.

The tool loop is driven by the scripted engine (a random tiny model never calls a tool): turn one
runs ``exec_command``, turn two answers. Codex's other calls (api.github.com, chatgpt.com,
ab.chatgpt.com) fail fast offline and must not stall the run. Each run also checks the fidelity of
the Responses translation on what Codex actually sent (bench/fidelity.py).
"""

from __future__ import annotations

import time
from pathlib import Path

import orjson
import pytest

from bench.fidelity import compare_flows, print_table
from polar_cli.build import build_traces
from tests.build_helpers import check_trace, tiny_tokenizer
from tests.support.atif import check_atif_export
from tests.support.harnesses import calls, harness, run
from tests.support.proxy import run_mitmdump

pytestmark = pytest.mark.harness

PROMPT = "Run `echo polar-was-here` and tell me what it printed."
MARKER = "polar-was-here"
# polar_keepalive above any engine latency: every answer goes back whole, so the flow file keeps
# each request body for the fidelity check (relayed streams leave none).
OPTIONS = {"polar_shard_seconds": "0.5", "polar_keepalive": "600"}
# Where bubblewrap is installed (make sandbox), Codex 0.171 runs its commands through it and its npm package's
# `codex-linux-sandbox` helper is not found ("bwrap: execvp codex-linux-sandbox"): the tool loop runs unsandboxed,
# as polar rollout's codex preset runs it (inside polar's own sandbox).
NO_CODEX_SANDBOX = ("--dangerously-bypass-approvals-and-sandbox",)


def script(tmp_path: Path, model_dir: Path) -> str:
    path = tmp_path / "codex-script.json"
    path.write_bytes(
        orjson.dumps(
            {
                "model_dir": str(model_dir),
                "cycle": True,
                "turns": [
                    {
                        "content": None,
                        "tool_calls": [
                            {
                                "type": "function",
                                "function": {"name": "exec_command", "arguments": {"cmd": f"echo {MARKER}"}},
                            }
                        ],
                    },
                    {"content": "It printed polar-was-here."},
                ],
            }
        )
    )
    return f"scripted:{path}"


def codex_env(home: Path, **extra: str) -> dict[str, str]:
    (home / ".codex").mkdir(parents=True, exist_ok=True)
    return {"CODEX_HOME": str(home / ".codex"), "RUST_LOG": "warn", **extra}


def check_tool_loop(records: list) -> None:
    assert [r.status for r in records] == ["ok", "ok"], [r.error for r in records]
    assert {r.api for r in records} == {"openai_responses"}
    assert all("codex" in (r.harness or "") for r in records)
    first, second = records
    assert first.response_message["tool_calls"][0]["name"] == "exec_command"
    # The second prompt is the first plus the model's call and the command's real output.
    roles = [m["role"] for m in second.messages]
    assert roles[-2:] == ["assistant", "tool"] and MARKER in second.messages[-1]["content"]
    assert second.messages[: len(first.messages)] == first.messages
    assert second.prompt_ids[: len(first.prompt_ids)] == first.prompt_ids
    assert len(second.logprobs) == len(second.response_ids) > 0
    # Reconstruction: the two calls merge into one token-exact trace.
    (trace,) = build_traces(records, {}, "prefix_merging", decode=tiny_tokenizer().decode).traces
    assert trace.calls_merged == 2 and trace.break_cause is None
    check_trace(trace, {r.record_id: r for r in records}, retokenized_ok=False)


def check_fidelity(flows: Path, label: str) -> None:
    result = compare_flows([flows], harness=label)
    print_table(result, title=f"fidelity: {label}")
    assert result.calls[("openai_responses", label)] >= 2
    assert not result.unexplained(), [(r.field, r.example) for r in result.unexplained()]


def test_codex_default_provider_over_websocket(tiny_model_dir, tmp_path):
    codex = harness("codex")
    out, flows, home = tmp_path / "shards", tmp_path / "flows", tmp_path / "home"
    with run_mitmdump(
        script(tmp_path, tiny_model_dir), out, options={**OPTIONS, "save_stream_file": str(flows)}
    ) as proxy:
        env = codex_env(
            home,
            HTTPS_PROXY=proxy.proxy_url("codex-ws"),
            CODEX_CA_CERTIFICATE=str(proxy.ca),
            SSL_CERT_FILE=str(proxy.ca),
            OPENAI_API_KEY="sk-not-a-real-key",
        )
        started = time.monotonic()
        result = run([str(codex), "exec", "--skip-git-repo-check", *NO_CODEX_SANDBOX, "-m", "tiny", PROMPT], env, home)
        elapsed = time.monotonic() - started
        output = result.stdout + result.stderr
        assert result.returncode == 0, output + proxy.logs()[-3000:]
        records = calls(out, "codex-ws")
    assert "Falling back from WebSockets" not in output and "It printed polar-was-here." in result.stdout
    check_tool_loop(records)
    check_atif_export(str(out), ["codex-ws"])  # each turn sent only its new items: the export still pairs them
    # Codex's calls to hosts that are unreachable offline failed fast: the run is the two engine
    # calls (a few seconds each on CPU) plus the command, not a minute of retries.
    assert elapsed < 150, elapsed

    from mitmproxy import io

    with open(flows, "rb") as fh:
        sockets = [f for f in io.FlowReader(fh).stream() if getattr(f, "websocket", None) is not None]
    assert len(sockets) == 1  # one connection for the whole session
    messages = [(m.from_client, orjson.loads(m.content)) for m in sockets[0].websocket.messages]
    sent = [m for from_client, m in messages if from_client]
    answered = [
        m["response"]["id"] for from_client, m in messages if not from_client and m["type"] == "response.completed"
    ]
    assert [m["type"] for m in sent] == ["response.create"] * 3 and len(answered) == 3
    prewarm, first, second = sent
    # Codex warms the connection (nothing generated), then each turn sends only the new items and
    # continues the previous response.
    assert prewarm["generate"] is False
    assert first["previous_response_id"] == answered[0] and first.get("generate") is not False
    assert second["previous_response_id"] == answered[1]
    assert [i["type"] for i in second["input"]] == ["function_call_output"]
    check_fidelity(flows, "codex-websocket")


def test_codex_custom_provider_over_http(tiny_model_dir, tmp_path):
    codex = harness("codex")
    out, flows, home = tmp_path / "shards", tmp_path / "flows", tmp_path / "home"
    with run_mitmdump(
        script(tmp_path, tiny_model_dir),
        out,
        mode="reverse:https://api.openai.com",
        options={**OPTIONS, "save_stream_file": str(flows)},
    ) as proxy:
        env = codex_env(home, POLAR_API_KEY="polar:session=codex-http;task=echo")
        (home / ".codex" / "config.toml").write_text(
            'model = "tiny"\nmodel_provider = "polar"\n\n[model_providers.polar]\nname = "polar"\n'
            f'base_url = "{proxy.url}/v1"\nenv_key = "POLAR_API_KEY"\nwire_api = "responses"\n'
            "supports_websockets = false\nrequest_max_retries = 0\nstream_max_retries = 0\n"
        )
        result = run([str(codex), "exec", "--skip-git-repo-check", *NO_CODEX_SANDBOX, PROMPT], env, home)
        assert result.returncode == 0, result.stdout + result.stderr + proxy.logs()[-3000:]
        records = calls(out, "codex-http")
    assert "It printed polar-was-here." in result.stdout
    check_tool_loop(records)
    check_atif_export(str(out), ["codex-http"])
    assert all(r.task_id == "echo" for r in records)
    check_fidelity(flows, "codex-http")


@pytest.mark.vllm
def test_codex_default_provider_with_vllm(vllm_server, tmp_path):
    """A real engine behind the WebSocket path: generation capped at 32 tokens, exit 0."""
    codex = harness("codex")
    out, home = tmp_path / "shards", tmp_path / "home"
    with run_mitmdump(
        f"vllm:{vllm_server}", out, options={"polar_shard_seconds": "0.5", "polar_max_tokens": "32"}
    ) as proxy:
        env = codex_env(
            home,
            HTTPS_PROXY=proxy.proxy_url("codex-vllm"),
            CODEX_CA_CERTIFICATE=str(proxy.ca),
            SSL_CERT_FILE=str(proxy.ca),
            OPENAI_API_KEY="sk-not-a-real-key",
        )
        result = run([str(codex), "exec", "--skip-git-repo-check", "-m", "tiny", "Say hello."], env, home)
        assert result.returncode == 0, result.stdout + result.stderr + proxy.logs()[-3000:]
        assert "Falling back from WebSockets" not in result.stdout + result.stderr
        records = calls(out, "codex-vllm")
    assert records and all(r.status == "ok" and r.api == "openai_responses" for r in records), [
        r.error for r in records
    ]
    assert all(len(r.logprobs) == len(r.response_ids) > 0 for r in records)
