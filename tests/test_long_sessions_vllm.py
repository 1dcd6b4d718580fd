"""Real harnesses meet a real engine's own window: vLLM CPU with ``--max-model-len 20480``
(``vllm_small_window_server``: above every harness's own first prompt, Codex's ~15k the largest) behind a real
mitmdump, each harness configured by its rollout preset with the window polar reads from vLLM's ``/v1/models``.

The tiny random model never calls a tool, so a session cannot grow by tool rounds here (the scripted engine's
tool loops in tests/test_long_sessions.py do that): a first run with a long instruction passes the harness's
compaction threshold, a second run continues the same session (``--continue``, ``exec resume``, ``--resume``; Pi
sends several ``-p`` messages in one run), and the harness compacts by its own mechanism before that turn,
answers from the summary and exits 0. The built traces break exactly at the compaction. Qwen Code, Gemini CLI
and the forced overflows (a prompt past vLLM's window) run the same way in ``bench/long_sessions.py``, by hand:
they would take this module past its time budget.
"""

from __future__ import annotations

import ssl

import httpx
import orjson
import pytest

from polar_addon.context_compaction import compaction_prompt, summarised_history
from polar_addon.store.validate import validate_store
from polar_cli.build import build_traces
from polar_cli.rollout.window import engine_window
from tests.build_helpers import tiny_tokenizer
from tests.conftest import VLLM_SMALL_WINDOW
from tests.support.proxy import run_mitmdump

pytestmark = [pytest.mark.vllm, pytest.mark.harness]

WORD = " word"  # two tokens in the tiny tokenizer
# Every generation is cut short by the proxy (the tiny model's answers are noise): the runs stay quick.
PROXY_OPTIONS = {"polar_shard_seconds": "0.5", "polar_keepalive": "600", "polar_max_tokens": "16"}


def vllm_run(
    preset,
    tmp_path,
    url: str,
    session: str,
    commands,
    mode: str | None,
    settings: tuple[str, dict] | None = None,
    extra_env: dict[str, str] | None = None,
    timeout: float = 180,
    window: int | None = VLLM_SMALL_WINDOW,
):
    """Run ``preset`` as a rollout would (its config, its env, the window polar reads from the engine; ``window=None``:
    none told) against vLLM through a real mitmdump: ``commands(ctx)`` gives the command lines, run one after the
    other in the same HOME."""
    from tests.support.harnesses import calls, configured_session, run

    home, out = tmp_path / "home", tmp_path / "shards"
    home.mkdir()
    assert engine_window(f"vllm:{url}") == VLLM_SMALL_WINDOW  # what vLLM's /v1/models reports as max_model_len
    with run_mitmdump(f"vllm:{url}", out, mode=mode, options=PROXY_OPTIONS) as proxy:
        ctx = configured_session(preset, proxy, home, session, window, settings)
        # ``run`` raises TimeoutExpired past its bound: a harness that hangs on the error fails the test.
        results = [run(cmd, {**preset.env(ctx), **(extra_env or {})}, home, timeout=timeout) for cmd in commands(ctx)]
        records = calls(out, session, include_failed=True)
        logs = proxy.logs()[-3000:]
    t0 = records[0].started_at if records else 0
    for r in records:
        print(
            session,
            r.seq,
            f"{r.started_at - t0:.1f}s",
            r.status,
            len(r.prompt_ids),
            compaction_prompt(r.messages),
            summarised_history(r.messages),
            (r.error or "")[:100],
        )
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

    messages = [{"role": "user", "content": "Read this:" + WORD * 10_500}]
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    text = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    expected = len(tok(text, add_special_tokens=False)["input_ids"])
    assert expected > VLLM_SMALL_WINDOW + 500
    with run_mitmdump(
        f"vllm:{vllm_small_window_server}", tmp_path / "shards", options={"polar_shard_seconds": "0.2"}
    ) as proxy:

        def http(session: str) -> httpx.Client:
            return httpx.Client(
                proxy=proxy.proxy_url(session), timeout=120, verify=ssl.create_default_context(cafile=str(proxy.ca))
            )

        chat = openai.OpenAI(api_key="sk-not-real", http_client=http("vllm-chat"), max_retries=0)
        with pytest.raises(openai.BadRequestError) as chat_err:
            list(chat.chat.completions.create(model="tiny", max_tokens=8, stream=True, messages=messages))
        ant = anthropic.Anthropic(api_key="sk-ant-not-real", http_client=http("vllm-ant"), max_retries=0)
        with pytest.raises(anthropic.BadRequestError) as ant_err:
            ant.messages.create(model="tiny", max_tokens=8, messages=messages)
        (chat_record,) = session_records(proxy.out, "vllm-chat", include_failed=True, at_least=1)
        (ant_record,) = session_records(proxy.out, "vllm-ant", include_failed=True, at_least=1)
    assert f"at least {VLLM_SMALL_WINDOW + 1} input tokens" in chat_record.error  # vLLM's own words, kept
    assert refused(chat_record) == refused(ant_record) == expected
    assert chat_err.value.code == "context_length_exceeded"
    assert f"maximum context length is {VLLM_SMALL_WINDOW} tokens" in chat_err.value.message
    assert f"resulted in {expected} tokens" in chat_err.value.message
    assert ant_err.value.body["error"] == {
        "type": "invalid_request_error",
        "message": f"prompt is too long: {expected} tokens > {VLLM_SMALL_WINDOW} maximum",
    }


def compacted_once(records, results, asks: str, summarises: str | None, side_calls: int = 0) -> list[int]:
    """Every run exited 0 and every call was answered; the harness compacted once: one call, or a run of calls
    back to back (Gemini CLI's snapshot and its self-check, Pi's history and turn-prefix summaries), asks for a
    summary with its own prompt (``asks``), the calls after it carry the summary (``summarises``; None where the
    summary is the tiny model's own text, which has no fixed marker: the build knows it as the compaction call's
    answer). The built traces break at the compaction, with cause compaction, and elsewhere only where the proxy's
    16-token cap cut an answer before its end-of-turn token (cause ``other``) or at ``side_calls`` side calls
    (cause ``sub_agent``: Qwen Code's memory extractor). Returns the compaction calls' seqs."""
    for result in results:
        assert result.returncode == 0, result.stdout[-1500:] + result.stderr[-1500:]
    assert all(r.status == "ok" for r in records), [(r.seq, r.error) for r in records]
    asking = [r.seq for r in records if compaction_prompt(r.messages) == asks]
    assert asking and asking == list(range(asking[0], asking[-1] + 1)), asking
    # The proxy tagged the compaction calls as the harness's side job, and nothing else but its side calls.
    roles = [(r.seq, r.role, r.role_reason) for r in records]
    assert all(role == "auxiliary" and reason.endswith(" compaction") for seq, role, reason in roles if seq in asking)
    assert sum(role != "agent" for seq, role, _ in roles if seq not in asking) <= side_calls, roles
    after = records[asking[-1] + 1 :]
    assert after, "nothing was sent after the compaction"
    if summarises is not None:
        assert all(summarised_history(r.messages) == summarises for r in after), [
            summarised_history(r.messages) for r in after
        ]
    built = build_traces(records, {}, "prefix_merging", decode=tiny_tokenizer().decode)
    seq_of = {r.record_id: r.seq for r in records}
    starts = sorted(seq_of[t.record_ids[0]] for t in built.traces)
    print("trace starts", starts, built.report.total.breaks)
    assert sum(t.calls_merged for t in built.traces) == len(records)
    cut = {seq for seq in starts if seq and records[seq - 1].finish_reason == "length"}
    assert {0, asking[0], asking[-1] + 1} <= set(starts), starts  # broken at the compaction, both sides
    extra = set(starts) - {0, *asking, asking[-1] + 1}
    breaks = dict(built.report.total.breaks)
    assert breaks.pop("compaction") >= 1 and breaks.pop("sub_agent", 0) == side_calls
    assert breaks.get("other", 0) <= len(cut) and set(breaks) <= {"other"}, built.report.total.breaks
    assert len(extra) <= len(cut) + side_calls, (starts, cut)
    return asking


def test_claude_code_compacts_on_vllm_and_exits_0(vllm_small_window_server, tmp_path):
    """Claude Code (its preset: ``CLAUDE_CODE_MAX_CONTEXT_TOKENS`` = ``CLAUDE_CODE_AUTO_COMPACT_WINDOW`` = 20,480
    and an output cap of 2,560, so it compacts past 20,480 - 2,560 - 13,000 = 4,920 tokens of usage) with a short
    system prompt and one tool: a first ``claude -p`` of ~5.6k tokens is answered. Past the threshold Claude Code
    routes its compaction through its reactive path, which keeps the latest exchange and bails while nothing older
    is left to summarise: the first ``claude -p --continue`` is sent as it is; the second compacts first with its
    own summary prompt, answers on the summary and exits 0. (Without the auto-compact window Claude Code skips
    proactive compaction altogether.)"""
    from polar_cli.rollout.harnesses.claude_code import ClaudeCode

    preset = ClaudeCode()
    short = ["--system-prompt", "You are a file finder.", "--tools", "Glob"]
    results, records, logs = vllm_run(
        preset,
        tmp_path,
        vllm_small_window_server,
        "cc-20k",
        lambda ctx: [
            preset.command("Remember this:" + WORD * 2500, ctx) + short,
            preset.command("And now?", ctx) + short + ["--continue"],
            preset.command("And then?", ctx) + short + ["--continue"],
        ],
        mode="reverse:https://api.anthropic.com",
    )
    assert 4_920 < len(records[0].prompt_ids) < VLLM_SMALL_WINDOW
    assert compacted_once(records, results, "claude-code", "claude-code") == [2]
    assert orjson.loads(results[2].stdout)["is_error"] is False


def test_codex_compacts_on_vllm_and_exits_0(vllm_small_window_server, tmp_path):
    """Codex on its default provider (Responses over the WebSocket, through the forward proxy; its preset:
    ``model_context_window`` = 20,480, auto-compact at 16,384): a first ``codex exec`` of ~16.6k tokens is
    answered; ``codex exec resume --last`` compacts remotely through polar first (polar has vLLM write the
    summary), answers on it and exits 0."""
    from polar_cli.rollout.harnesses.codex import Codex

    preset = Codex()
    results, records, logs = vllm_run(
        preset,
        tmp_path,
        vllm_small_window_server,
        "codex-20k",
        lambda ctx: [
            preset.command("Remember this:" + WORD * 900, ctx),
            preset.command("Go on.", ctx)[:-1] + ["resume", "--last", "Go on."],
        ],
        mode=None,
    )
    assert 16_384 < len(records[0].prompt_ids) < VLLM_SMALL_WINDOW
    compacted_once(records, results, "polar", "polar")


def test_pi_compacts_on_vllm_and_exits_0(vllm_small_window_server, tmp_path):
    """Pi (its preset: ``contextWindow`` = 20,480; ``reserveTokens`` 16,384, so it compacts past 4,096) sends three
    prompts in one ``pi -p`` session: the first (~3.5k tokens) is answered, the second passes 4,096; Pi compacts
    when that turn ends (its checkpoint prompt, keeping the second turn), and the third runs on the summary, below
    the threshold again; exit 0."""
    from polar_cli.rollout.harnesses.pi import Pi

    preset = Pi()
    results, records, logs = vllm_run(
        preset,
        tmp_path,
        vllm_small_window_server,
        "pi-20k",
        lambda ctx: [preset.command("Remember this:" + WORD * 600, ctx) + ["And this:" + WORD * 600, "Done?"]],
        mode="reverse:https://api.openai.com",
        settings=(".pi/agent/settings.json", {"compaction": {"reserveTokens": 16_384, "keepRecentTokens": 100}}),
    )
    assert len(records[0].prompt_ids) < 4_096 < len(records[1].prompt_ids)
    assert compacted_once(records, results, "pi", "pi")[0] == 2
