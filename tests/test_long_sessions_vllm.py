"""Real harnesses meet a real engine's own window: vLLM CPU with ``--max-model-len 8192``
(``vllm_small_window_server``) behind a real mitmdump, each harness configured by its rollout preset with the
window polar reads from vLLM's ``/v1/models``.

The tiny random model never calls a tool, so a session cannot grow by tool rounds here: the harness's own
prompt and a long instruction pass the window on the first call (Claude Code, Codex, Qwen Code), or a second
prompt in the same session does (Pi, which sends each of several ``-p`` messages in turn). What each harness does
then is the README's "Long sessions" table, now against vLLM's refusal and vLLM's counts.
"""

from __future__ import annotations

import ssl

import httpx
import orjson
import pytest

from polar_addon.context_compaction import compaction_prompt, summarised_history
from polar_addon.store.validate import validate_store
from polar_cli.rollout.window import engine_window
from tests.conftest import VLLM_SMALL_WINDOW
from tests.support.proxy import run_mitmdump

pytestmark = [pytest.mark.vllm, pytest.mark.harness]

WORD = " word"  # two tokens in the tiny tokenizer
# Every generation is cut short by the proxy (the tiny model's answers are noise): the runs stay quick.
PROXY_OPTIONS = {"polar_shard_seconds": "0.5", "polar_keepalive": "600", "polar_max_tokens": "16"}


def vllm_run(preset, tmp_path, url: str, session: str, commands, mode: str | None,
             settings: tuple[str, dict] | None = None, extra_env: dict[str, str] | None = None, timeout: float = 180):
    """Run ``preset`` as a rollout would (its config, its env, the window polar reads from the engine) against vLLM
    through a real mitmdump: ``commands(ctx)`` gives the command lines, run one after the other in the same HOME."""
    from tests.support.harnesses import calls, configured_session, run

    home, out = tmp_path / "home", tmp_path / "shards"
    home.mkdir()
    window = engine_window(f"vllm:{url}")
    assert window == VLLM_SMALL_WINDOW  # what vLLM's /v1/models reports as max_model_len
    with run_mitmdump(f"vllm:{url}", out, mode=mode, options=PROXY_OPTIONS) as proxy:
        ctx = configured_session(preset, proxy, home, session, window, settings)
        # ``run`` raises TimeoutExpired past its bound: a harness that hangs on the error fails the test.
        results = [run(cmd, {**preset.env(ctx), **(extra_env or {})}, home, timeout=timeout) for cmd in commands(ctx)]
        records = calls(out, session, include_failed=True)
        logs = proxy.logs()[-3000:]
    t0 = records[0].started_at if records else 0
    for r in records:
        print(session, r.seq, f"{r.started_at - t0:.1f}s", r.status, len(r.prompt_ids), compaction_prompt(r.messages),
              summarised_history(r.messages), (r.error or "")[:100])
    for result in results:
        print(session, "exit", result.returncode, result.stdout[-1500:], result.stderr[-1500:])
    assert [r.seq for r in records] == list(range(len(records))), "a call is missing from the shards"
    assert validate_store(str(out)) == []
    return results, records, logs


def refused(record) -> int:
    """The prompt length vLLM counted for a refused call (polar keeps vLLM's own numbers)."""
    assert record.status == "failed", (record.status, record.error)
    assert record.error.startswith("400 context_length_exceeded: prompt_tokens="), record.error
    assert f"window={VLLM_SMALL_WINDOW}" in record.error, record.error
    prompt_tokens = int(record.error.split("prompt_tokens=")[1].split()[0])
    assert prompt_tokens > VLLM_SMALL_WINDOW
    return prompt_tokens


def test_vllm_overflow_becomes_each_providers_error(vllm_small_window_server, tiny_model_dir, tmp_path):
    """vLLM refuses a prompt past its ``--max-model-len`` (saying only "at least window + 1" tokens: it stops
    tokenizing there); polar counts the prompt on vLLM's ``/tokenize``, records it and answers in the caller's
    provider shape with the real count."""
    import anthropic
    import openai
    from transformers import AutoTokenizer

    from tests.support.shards import session_records

    messages = [{"role": "user", "content": "Read this:" + WORD * 4500}]
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    text = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    expected = len(tok(text, add_special_tokens=False)["input_ids"])
    assert expected > VLLM_SMALL_WINDOW + 500
    with run_mitmdump(f"vllm:{vllm_small_window_server}", tmp_path / "shards", options={"polar_shard_seconds": "0.2"}) as proxy:
        http = lambda session: httpx.Client(proxy=proxy.proxy_url(session), timeout=120,  # noqa: E731
                                            verify=ssl.create_default_context(cafile=str(proxy.ca)))
        chat = openai.OpenAI(api_key="sk-not-real", http_client=http("vllm-chat"), max_retries=0)
        with pytest.raises(openai.BadRequestError) as chat_err:
            list(chat.chat.completions.create(model="tiny", max_tokens=8, stream=True, messages=messages))
        ant = anthropic.Anthropic(api_key="sk-ant-not-real", http_client=http("vllm-ant"), max_retries=0)
        with pytest.raises(anthropic.BadRequestError) as ant_err:
            ant.messages.create(model="tiny", max_tokens=8, messages=messages)
        (chat_record,) = session_records(proxy.out, "vllm-chat", include_failed=True, at_least=1)
        (ant_record,) = session_records(proxy.out, "vllm-ant", include_failed=True, at_least=1)
    assert "at least 8193 input tokens" in chat_record.error  # vLLM's own words, kept
    assert refused(chat_record) == refused(ant_record) == expected
    assert chat_err.value.code == "context_length_exceeded"
    assert f"maximum context length is {VLLM_SMALL_WINDOW} tokens" in chat_err.value.message
    assert f"resulted in {expected} tokens" in chat_err.value.message
    assert ant_err.value.body["error"] == {"type": "invalid_request_error",
                                           "message": f"prompt is too long: {expected} tokens > {VLLM_SMALL_WINDOW} maximum"}


def test_claude_code_meets_vllms_window(vllm_small_window_server, tmp_path):
    """Claude Code (its preset: ``CLAUDE_CODE_MAX_CONTEXT_TOKENS`` = vLLM's 8,192) with its own system prompt and
    tools and a ~12k-token instruction: vLLM refuses the first call; a one-exchange conversation cannot be
    compacted, so Claude Code ends at once with its own verdict, exit 1."""
    from polar_cli.rollout.harnesses.claude_code import ClaudeCode

    preset = ClaudeCode()
    (result,), records, logs = vllm_run(preset, tmp_path, vllm_small_window_server, "cc-8k",
                                        lambda ctx: [preset.command("Summarise this text:" + WORD * 6000, ctx)],
                                        mode="reverse:https://api.anthropic.com")
    assert result.returncode == 1, result.stdout + result.stderr[-1500:] + logs
    (call,) = records
    prompt_tokens = refused(call)
    assert prompt_tokens > 12_000
    answer = orjson.loads(result.stdout)
    assert (answer["is_error"], answer["terminal_reason"]) == (True, "prompt_too_long")
    # It reads polar's "prompt is too long: N tokens > M maximum" (N: vLLM's count of the whole prompt).
    said = answer["result"].replace(",", "")
    assert said.startswith(f"Prompt is too long · the request is ~{prompt_tokens} tokens (limit {VLLM_SMALL_WINDOW})"), said
    assert "A single-exchange conversation cannot be compacted" in answer["result"]


def test_claude_code_continued_meets_vllms_window(vllm_small_window_server, tmp_path):
    """Claude Code with a short system prompt and one tool: a first ``claude -p`` (~3.6k tokens) is answered,
    then ``claude -p --continue`` adds a ~4.8k-token prompt to that conversation and vLLM refuses it. Claude Code
    does not compact there (no summary call is sent): it ends with "Prompt is too long", exit 1."""
    from polar_cli.rollout.harnesses.claude_code import ClaudeCode

    preset = ClaudeCode()
    short = ["--system-prompt", "You are a file finder.", "--tools", "Glob"]
    (first, second), records, logs = vllm_run(
        preset, tmp_path, vllm_small_window_server, "cc-8k-continued",
        lambda ctx: [preset.command("Remember this:" + WORD * 1500, ctx) + short,
                     preset.command("And this:" + WORD * 2400, ctx) + short + ["--continue"]],
        mode="reverse:https://api.anthropic.com")
    assert first.returncode == 0, first.stdout + first.stderr[-1500:] + logs
    assert second.returncode == 1, second.stdout + second.stderr[-1500:] + logs
    answered, too_long = records
    assert answered.status == "ok" and orjson.loads(first.stdout)["usage"]["input_tokens"] == len(answered.prompt_ids)
    assert refused(too_long) > len(answered.prompt_ids) + 4_800
    assert compaction_prompt(too_long.messages) is None
    answer = orjson.loads(second.stdout)
    assert (answer["is_error"], answer["result"], answer["terminal_reason"]) == (True, "Prompt is too long", "prompt_too_long")


def test_codex_meets_vllms_window(vllm_small_window_server, tmp_path):
    """Codex on its default provider (Responses over the WebSocket, through the forward proxy; its preset:
    ``model_context_window`` = 8,192): its own first prompt (~15k tokens of instructions and tools) is past
    vLLM's window; the streamed ``response.failed`` / ``context_length_exceeded`` ends the run, exit 1."""
    from polar_cli.rollout.harnesses.codex import Codex

    preset = Codex()
    (result,), records, logs = vllm_run(preset, tmp_path, vllm_small_window_server, "codex-8k",
                                        lambda ctx: [preset.command("Say hello.", ctx)], mode=None)
    assert result.returncode == 1, result.stdout + result.stderr[-1500:] + logs
    (call,) = records
    assert call.api == "openai_responses" and refused(call) > 12_000
    assert "ERROR: Codex ran out of room in the model's context window." in result.stderr, result.stderr[-1500:]


def test_qwen_code_meets_vllms_window(vllm_small_window_server, tmp_path):
    """Qwen Code (its preset: ``contextWindowSize`` = 8,192) with its default system prompt and tools: they alone
    pass vLLM's window. Qwen reads the overflow, compresses at once (its compression call, no tools, fits) and
    retries; the retry is refused again (the system prompt and tools are not compressible) and the run ends with
    its API error, exit 1, no hang."""
    from polar_cli.rollout.harnesses.qwen_code import QwenCode

    preset = QwenCode()
    (result,), records, logs = vllm_run(preset, tmp_path, vllm_small_window_server, "qwen-8k",
                                        lambda ctx: [preset.command("Say hello.", ctx)], mode="reverse:https://api.openai.com")
    assert result.returncode == 1, result.stdout + result.stderr[-1500:] + logs
    first, compression, retry = records
    assert refused(first) > 20_000 and refused(retry) > 20_000  # Qwen's own prompt: ~30k tokens
    assert compression.status == "ok" and compaction_prompt(compression.messages) == "qwen-code"
    assert len(compression.prompt_ids) < VLLM_SMALL_WINDOW
    assert (f"[API Error: 400 This model's maximum context length is {VLLM_SMALL_WINDOW} tokens. However, your messages "
            f"resulted in {refused(retry)} tokens") in result.stderr, result.stderr[-1500:]


def test_pi_meets_vllms_window(vllm_small_window_server, tmp_path):
    """Pi (its preset: ``contextWindow`` = 8,192; ``reserveTokens`` 1,024 so it does not compact before the
    overflow, ``keepRecentTokens`` 100) sends three prompts in one ``pi -p`` session: the first (~5.3k tokens) is
    answered, the second passes vLLM's window. Pi recognises "maximum context length is N tokens", compacts with
    its own checkpoint prompt (which fits) and retries on the summary, which vLLM answers; ``pi -p`` had already
    read the refused turn, so it prints vLLM's error and exits 1."""
    from polar_cli.rollout.harnesses.pi import Pi

    preset = Pi()
    (result,), records, logs = vllm_run(
        preset, tmp_path, vllm_small_window_server, "pi-8k",
        lambda ctx: [preset.command("Remember this:" + WORD * 1500, ctx) + ["And this:" + WORD * 1500, "Done?"]],
        mode="reverse:https://api.openai.com",
        settings=(".pi/agent/settings.json", {"compaction": {"reserveTokens": 1024, "keepRecentTokens": 100}}))
    assert result.returncode == 1, result.stdout + result.stderr[-1500:] + logs
    assert f"maximum context length is {VLLM_SMALL_WINDOW} tokens" in result.stderr, result.stderr[-1500:]
    assert records[0].status == "ok" and 5_000 < len(records[0].prompt_ids) < VLLM_SMALL_WINDOW
    failed = [r for r in records if r.status == "failed"]
    assert failed[0].seq == 1 and all(refused(r) > len(records[0].prompt_ids) + 3_000 for r in failed)
    (compaction,) = [r for r in records if compaction_prompt(r.messages) == "pi"]
    assert compaction.status == "ok" and compaction.seq > 1 and len(compaction.prompt_ids) < VLLM_SMALL_WINDOW
    retried = records[compaction.seq + 1:]
    assert retried and all(r.status == "ok" and summarised_history(r.messages) == "pi" for r in retried)
