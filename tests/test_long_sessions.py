"""Long sessions through the proxy: overflow errors in each provider's own shape, Codex's remote
compaction, token counts, and compaction breaks in the built traces.

- Overflow: a real mitmdump serving the tiny model with a 64-token window (``local:DIR?max_len=64``);
  each official SDK raises its own typed error carrying its provider's wording, streaming and not, and
  the failed call is recorded with its prompt length.
- Codex (default provider through the forward proxy, Responses WebSocket) with a tiny
  ``model_auto_compact_token_limit``: it asks polar for a remote compaction (v2: a ``compaction_trigger``
  item), polar has the engine write the summary, Codex carries on from it and exits 0; the built trace
  breaks exactly there, with cause ``compaction``.
- Claude Code, Qwen Code, Gemini CLI, Pi and Codex on a custom provider (``codex:http``), each with the window
  its rollout preset writes, run past it on the scripted engine and compact by their own mechanism; Qwen Code
  and Pi also recover from an overflow the engine forces; Claude Code, Codex (default provider) and Gemini CLI
  meet one and end with their own message, exit 1, within a bounded time.
- A real vLLM CPU engine's overflow, and real harnesses against its small window: tests/test_long_sessions_vllm.py.
"""

from __future__ import annotations

import ssl

import anthropic
import httpx
import openai
import orjson
import pytest
from google import genai
from google.genai import errors as genai_errors
from google.genai import types

from polar_addon.canonical import AssistantMessage, Completion, ContextLengthExceeded
from polar_addon.context_compaction import (
    POLAR_COMPACTION_PROMPT,
    compaction_prompt,
    decode_summary,
    encode_summary,
    summarised_history,
)
from polar_addon.engines.openai_compat import engine_error
from polar_addon.providers import ResponseContext, Route
from polar_addon.providers.openai_responses import OpenAIResponsesProvider
from polar_cli.build import build_traces
from tests.build_helpers import tiny_tokenizer
from tests.support.proxy import run_mitmdump
from tests.support.shards import session_records

WINDOW = 64
LONG = "word " * 200  # far past the window in any tokenizer


@pytest.fixture(scope="module")
def small_window_proxy(tiny_model_dir, tmp_path_factory):
    root = tmp_path_factory.mktemp("long-sessions")
    with run_mitmdump(
        f"local:{tiny_model_dir}?max_len={WINDOW}",
        root / "shards",
        options={"polar_shard_seconds": "0.2", "polar_keepalive": "30"},
    ) as proxy:
        yield proxy


def assert_side_jobs(records, side_jobs: dict[int, str]) -> None:
    """The proxy tagged exactly these calls (seq -> role_reason) as the harness's side jobs; every other is agent."""
    assert {r.seq: r.role_reason for r in records if r.role != "agent"} == side_jobs
    assert all(r.role == "auxiliary" for r in records if r.seq in side_jobs)


def _http(proxy, session: str) -> httpx.Client:
    return httpx.Client(
        proxy=proxy.proxy_url(session), verify=ssl.create_default_context(cafile=str(proxy.ca)), timeout=120
    )


def _failed_record(proxy, session: str):
    (record,) = session_records(proxy.out, session, include_failed=True, at_least=1)
    assert record.status == "failed"
    assert record.error.startswith("400 context_length_exceeded: prompt_tokens=")
    prompt_tokens = int(record.error.split("prompt_tokens=")[1].split()[0])
    assert prompt_tokens > WINDOW and f"window={WINDOW}" in record.error
    return prompt_tokens


@pytest.mark.parametrize("stream", [False, True])
def test_anthropic_overflow_is_prompt_too_long(small_window_proxy, stream):
    session = f"ant-overflow-{stream}"
    client = anthropic.Anthropic(
        api_key="sk-ant-not-real", http_client=_http(small_window_proxy, session), max_retries=0
    )
    with pytest.raises(anthropic.BadRequestError) as err:
        response = client.messages.create(
            model="tiny", max_tokens=8, stream=stream, messages=[{"role": "user", "content": LONG}]
        )
        if stream:
            list(response)
    body = err.value.body["error"]
    prompt_tokens = _failed_record(small_window_proxy, session)
    # Claude Code matches /prompt is too long[^0-9]*(\d+)\s*tokens?\s*>\s*(\d+)/ and compacts.
    assert body == {
        "type": "invalid_request_error",
        "message": f"prompt is too long: {prompt_tokens} tokens > {WINDOW} maximum",
    }


@pytest.mark.parametrize("stream", [False, True])
def test_openai_chat_overflow_is_context_length_exceeded(small_window_proxy, stream):
    session = f"chat-overflow-{stream}"
    client = openai.OpenAI(api_key="sk-not-real", http_client=_http(small_window_proxy, session), max_retries=0)
    with pytest.raises(openai.BadRequestError) as err:
        response = client.chat.completions.create(
            model="tiny", max_tokens=8, stream=stream, messages=[{"role": "user", "content": LONG}]
        )
        if stream:
            list(response)
    prompt_tokens = _failed_record(small_window_proxy, session)
    assert err.value.code == "context_length_exceeded" and err.value.status_code == 400
    assert f"maximum context length is {WINDOW} tokens" in err.value.message
    assert f"resulted in {prompt_tokens} tokens" in err.value.message


def test_responses_overflow_plain_is_400_and_stream_is_response_failed(small_window_proxy):
    client = openai.OpenAI(api_key="sk-not-real", http_client=_http(small_window_proxy, "resp-overflow"), max_retries=0)
    with pytest.raises(openai.BadRequestError) as err:
        client.responses.create(model="tiny", input=LONG)
    assert err.value.code == "context_length_exceeded"
    # Codex maps only a streamed response.failed with this code to ContextWindowExceeded (then compacts).
    stream_client = openai.OpenAI(
        api_key="sk-not-real", http_client=_http(small_window_proxy, "resp-overflow-stream"), max_retries=0
    )
    events = list(stream_client.responses.create(model="tiny", input=LONG, stream=True))
    assert [e.type for e in events] == ["response.created", "response.in_progress", "response.failed"]
    failed = events[-1].response
    assert failed.status == "failed" and failed.error.code == "context_length_exceeded"
    prompt_tokens = _failed_record(small_window_proxy, "resp-overflow-stream")
    assert f"{prompt_tokens} input tokens > {WINDOW} maximum" in failed.error.message


@pytest.mark.parametrize("stream", [False, True])
def test_gemini_overflow_is_invalid_argument(small_window_proxy, stream):
    session = f"gemini-overflow-{stream}"
    client = genai.Client(
        api_key="not-a-real-key", http_options=types.HttpOptions(httpx_client=_http(small_window_proxy, session))
    )
    with pytest.raises(genai_errors.ClientError) as err:
        if stream:
            list(client.models.generate_content_stream(model="tiny", contents=LONG))
        else:
            client.models.generate_content(model="tiny", contents=LONG)
    prompt_tokens = _failed_record(small_window_proxy, session)
    assert err.value.code == 400 and err.value.status == "INVALID_ARGUMENT"
    assert err.value.message == (
        f"The input token count ({prompt_tokens}) exceeds the maximum number of tokens allowed ({WINDOW})."
    )


def test_token_counts_are_the_served_models(small_window_proxy, tiny_model_dir):
    """count_tokens / countTokens and usage count the chat-templated prompt with the real tokenizer."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    messages = [{"role": "user", "content": "hi"}]
    text = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    expected = len(tok(text, add_special_tokens=False)["input_ids"])
    ant = anthropic.Anthropic(api_key="sk-ant-not-real", http_client=_http(small_window_proxy, "count"), max_retries=0)
    assert ant.messages.count_tokens(model="tiny", messages=messages).input_tokens == expected
    message = ant.messages.create(model="tiny", max_tokens=4, messages=messages)
    assert message.usage.input_tokens + (message.usage.cache_read_input_tokens or 0) == expected
    gem = genai.Client(
        api_key="not-a-real-key", http_options=types.HttpOptions(httpx_client=_http(small_window_proxy, "count"))
    )
    assert gem.models.count_tokens(model="tiny", contents="hi").total_tokens == expected


# --- Codex remote compaction, pure ------------------------------------------------------------


def _completion(text: str) -> Completion:
    return Completion(
        message=AssistantMessage(content=text),
        finish_reason="stop",
        prompt_ids=[1, 2, 3],
        response_ids=[4, 5],
        logprobs=[-0.1, -0.2],
        served_model="tiny",
        engine="test",
    )


def test_compaction_trigger_asks_the_engine_for_a_summary_and_answers_one_compaction_item():
    provider = OpenAIResponsesProvider()
    body = {
        "model": "tiny",
        "stream": True,
        "tools": [{"type": "function", "name": "ls", "parameters": {"type": "object"}}],
        "input": [
            {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "fix it"}]},
            {"type": "function_call", "call_id": "c1", "name": "ls", "arguments": "{}"},
            {"type": "function_call_output", "call_id": "c1", "output": "a.py"},
            {"type": "compaction_trigger"},
        ],
    }
    request = provider.parse_request(body, Route(kind="generate"))
    assert request.extra["compaction"] == "remote_v2" and request.tool_choice == "none"
    assert request.messages[-1] == {"role": "user", "content": POLAR_COMPACTION_PROMPT}
    assert compaction_prompt(request.messages) == "polar"
    ctx = ResponseContext(response_id="resp_x", created=0, model="tiny")
    events = [e.data for e in provider.render_stream(request, _completion("Goal: fix it. Seen: a.py."), ctx)]
    done = [e["item"] for e in events if e["type"] == "response.output_item.done"]
    assert [i["type"] for i in done] == ["compaction"] and events[-1]["type"] == "response.completed"
    assert decode_summary(done[0]["encrypted_content"]) == "Goal: fix it. Seen: a.py."
    # Codex sends the item back in the next window: the engine reads the summary.
    later = provider.parse_request(
        {"model": "tiny", "input": [done[0], {"type": "message", "role": "user", "content": "go on"}]},
        Route(kind="generate"),
    )
    assert summarised_history(later.messages) == "polar"
    assert "Goal: fix it. Seen: a.py." in later.messages[0]["content"]


def test_responses_compact_endpoint_answers_the_compacted_window():
    provider = OpenAIResponsesProvider()
    user = {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "fix it"}]}
    body = {
        "model": "tiny",
        "instructions": "You are Codex.",
        "tools": [],
        "parallel_tool_calls": False,
        "input": [user, {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "ok"}]}],
    }
    request = provider.parse_request(body, provider.route("POST", "/v1/responses/compact"))
    assert request.extra["compaction"] == "remote_v1" and not request.stream
    answer = provider.render_response(request, _completion("summary"), ResponseContext("resp_y", 0, "tiny"))
    assert answer["output"][0] == user
    assert (
        answer["output"][1]["type"] == "compaction"
        and decode_summary(answer["output"][1]["encrypted_content"]) == "summary"
    )
    assert decode_summary(encode_summary("é")) == "é" and decode_summary("gAAAA-openai-blob") is None


def test_engine_overflow_messages_keep_the_counts():
    vllm = engine_error(
        400,
        orjson.dumps(
            {
                "error": {
                    "message": (
                        "This model's maximum context length is 8192 tokens. "
                        "However, your prompt contains 9000 input tokens, "
                        "which exceeds this limit even without any output tokens. "
                        "Please reduce the length of the input prompt."
                    )
                }
            }
        ),
    )
    sglang = engine_error(
        400,
        orjson.dumps(
            {
                "object": "error",
                "message": "The input (9000 tokens) is longer than the model's context length (8192 tokens).",
            }
        ),
    )
    for err in (vllm, sglang):
        assert isinstance(err, ContextLengthExceeded) and (err.prompt_tokens, err.window) == (9000, 8192)


CLAUDE_SUMMARY = (
    "This session is being continued from a previous conversation that ran out of context. "
    "The summary below covers the earlier portion of the conversation.\n\nSummary: listed files."
)
CLAUDE_PROMPT = "Your task is to create a detailed summary of the conversation so far, paying close attention to ..."


def test_compaction_breaks_the_chain_with_cause_compaction():
    """Claude Code's shape: the compaction call (no tools, its summarisation prompt) and then a history
    that starts from the summary. Each starts its own chain with cause ``compaction``; nothing else breaks."""
    from tests.build_helpers import AgentSim, Turn

    sim = AgentSim("compacting")
    system = {"role": "system", "content": "You are a coding agent."}
    messages = [system, {"role": "user", "content": "list the files"}]
    first = sim.call(messages, Turn(tool_calls=[("ls", {"path": "."})]))
    messages = messages + [sim.sent_back(first), {"role": "tool", "tool_call_id": "call_0_0", "content": "a.py"}]
    second = sim.call(messages, Turn(content="There is a.py."))
    messages = messages + [sim.sent_back(second)]
    sim.call(messages + [{"role": "user", "content": CLAUDE_PROMPT}], Turn(content="Summary: listed files."), tools=[])
    compacted = [system, {"role": "user", "content": CLAUDE_SUMMARY}, {"role": "user", "content": "now read a.py"}]
    fourth = sim.call(compacted, Turn(tool_calls=[("ls", {"path": "a.py"})]))
    sim.call(
        compacted + [sim.sent_back(fourth), {"role": "tool", "tool_call_id": "call_3_0", "content": "x = 1"}],
        Turn(content="a.py sets x."),
    )
    result = build_traces(sim.records, {}, "prefix_merging", decode=tiny_tokenizer().decode)
    assert [t.calls_merged for t in result.traces] == [2, 1, 2]
    assert result.report.total.breaks == {"compaction": 2}
    assert [t.break_cause for t in result.traces] == ["compaction", None, None]


GEMINI_PROMPT = (
    "You are a component that specializes in distilling chat history into a structured XML <state_snapshot>."
)


@pytest.mark.parametrize(
    "summary, cause",
    [("no snapshot format, just words from a small model", "compaction"), ("short", "rewritten_history")],
)
def test_a_summary_without_its_marker_is_known_by_the_compaction_calls_answer(summary, cause):
    """Gemini CLI's shape with a model that ignores the ``<state_snapshot>`` format: the history after the
    compaction call carries that call's answer as it came, which alone marks it as the summary (an answer too
    short to tell apart from chance text does not)."""
    from tests.build_helpers import AgentSim, Turn

    sim = AgentSim("compacting-unmarked")
    system = {"role": "system", "content": "You are a counting agent."}
    messages = [system, {"role": "user", "content": "count"}]
    first = sim.call(messages, Turn(content="1 2 3"))
    history = messages + [sim.sent_back(first)]
    sim.call(
        [{"role": "system", "content": GEMINI_PROMPT}, *history[1:], {"role": "user", "content": "Summarise."}],
        Turn(content=summary),
        tools=[],
    )
    compressed = [
        system,
        {"role": "user", "content": summary},
        {"role": "assistant", "content": "Got it."},
        {"role": "user", "content": "go on"},
    ]
    sim.call(compressed, Turn(content="4 5 6"))
    built = build_traces(sim.records, {}, "prefix_merging", decode=tiny_tokenizer().decode)
    assert [t.calls_merged for t in built.traces] == [1, 1, 1]
    assert built.report.total.breaks == ({"compaction": 2} if cause == "compaction" else {"compaction": 1, cause: 1})


# --- Codex through the forward proxy: it compacts remotely, through polar --------------------------

CODEX_TOOL_TURN = {
    "content": None,
    "tool_calls": [{"type": "function", "function": {"name": "exec_command", "arguments": {"cmd": "seq 1 50"}}}],
}


@pytest.mark.harness
def test_codex_default_provider_compacts_remotely_through_polar(tiny_model_dir, tmp_path):
    """Codex 0.171 on its default (OpenAI) provider, over the Responses WebSocket, with an auto-compact
    limit a few tool turns above its ~15k-token first prompt: it sends a compaction_trigger, polar has the
    engine write the summary and answers one compaction item, Codex carries on from it and exits 0."""
    from tests.support.harnesses import calls, harness, run

    codex = harness("codex")
    script = tmp_path / "script.json"
    script.write_bytes(
        orjson.dumps(
            {
                "model_dir": str(tiny_model_dir),
                "cycle": False,
                "turns": [CODEX_TOOL_TURN] * 8,
                "summary": "Goal: count. Done: seq ran several times.",
                "after_compaction": [{"content": "Counting is done."}],
            }
        )
    )
    out, home = tmp_path / "shards", tmp_path / "home"
    (home / ".codex").mkdir(parents=True)
    with run_mitmdump(
        f"scripted:{script}", out, options={"polar_shard_seconds": "0.5", "polar_keepalive": "600"}
    ) as proxy:
        env = {
            "CODEX_HOME": str(home / ".codex"),
            "RUST_LOG": "warn",
            "HTTPS_PROXY": proxy.proxy_url("codex-compact"),
            "CODEX_CA_CERTIFICATE": str(proxy.ca),
            "SSL_CERT_FILE": str(proxy.ca),
            "OPENAI_API_KEY": "sk-not-a-real-key",
        }
        # The first prompt is ~15.2k tokens of the tiny tokenizer; each tool turn adds ~120.
        result = run(
            [
                str(codex),
                "exec",
                "--skip-git-repo-check",
                "-m",
                "tiny",
                "-c",
                "model_auto_compact_token_limit=15400",
                "Count a few times.",
            ],
            env,
            home,
            timeout=240,
        )
        assert result.returncode == 0, result.stdout + result.stderr + proxy.logs()[-3000:]
        records = calls(out, "codex-compact")
    assert "Counting is done." in result.stdout
    assert all(r.status == "ok" for r in records), [r.error for r in records]
    asking = [r.seq for r in records if compaction_prompt(r.messages) == "polar"]
    assert_side_jobs(records, {seq: "polar compaction" for seq in asking})
    summarised = [r.seq for r in records if summarised_history(r.messages) == "polar"]
    assert len(asking) == 1 and summarised and min(summarised) == asking[0] + 1
    assert all(r.seq < asking[0] for r in records if r.seq not in summarised and r.seq != asking[0])
    # The compaction call extends the chain it summarises; the summarised history starts the next one.
    result = build_traces(records, {}, "prefix_merging", decode=tiny_tokenizer().decode)
    assert result.report.total.breaks == {"compaction": 1}
    first, second = result.traces
    assert first.break_cause == "compaction" and first.calls_merged == asking[0] + 1
    assert second.break_cause is None and second.calls_merged == len(summarised)


# --- Claude Code: auto-compaction through polar ---------------------------------------------------

GLOB_TURN = {
    "content": "Looking.",
    "tool_calls": [{"type": "function", "function": {"name": "Glob", "arguments": '{"pattern": "*.txt"}'}}],
}


def claude_run(tmp_path, script: dict, session: str, extra_env: dict[str, str], timeout: float = 240):
    """Claude Code with a short system prompt and one tool (a small prompt for a CPU forward pass)."""
    from tests.support.harnesses import calls, harness, run

    claude = harness("claude")
    path = tmp_path / "script.json"
    path.write_bytes(orjson.dumps(script))
    home, out = tmp_path / "home", tmp_path / "shards"
    home.mkdir()
    (home / "notes.txt").write_text("hello\n")
    env = {
        "ANTHROPIC_API_KEY": f"polar:session={session}",
        "ANTHROPIC_MODEL": "tiny",
        "ANTHROPIC_DEFAULT_HAIKU_MODEL": "tiny",
        "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1",
        "CLAUDE_CODE_MAX_RETRIES": "1",
        **extra_env,
    }
    with run_mitmdump(
        f"scripted:{path}", out, mode="reverse:https://api.anthropic.com", options={"polar_shard_seconds": "0.5"}
    ) as proxy:
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
            timeout=timeout,
        )
        records = calls(out, session, include_failed=True)
        logs = proxy.logs()[-3000:]
    return result, records, logs


@pytest.mark.harness
def test_claude_code_auto_compacts_through_polar(tiny_model_dir, tmp_path):
    """The served window told through CLAUDE_CODE_AUTO_COMPACT_WINDOW (floor 100k) and
    CLAUDE_AUTOCOMPACT_PCT_OVERRIDE=1 (compact past 1% = 1000 tokens, going by the usage polar reports):
    after four ~60-token tool turns on a ~600-token prompt Claude Code compacts with its own prompt,
    carries on from its summary and exits 0."""
    script = {
        "model_dir": str(tiny_model_dir),
        "cycle": False,
        "turns": [GLOB_TURN] * 8,
        "summary": "Goal: find text files. Found notes.txt.",
        # Claude Code keeps the turn in flight after its summary: the answer is the second turn.
        "after_compaction": [GLOB_TURN, {"content": "There is one text file: notes.txt."}],
    }
    result, records, logs = claude_run(
        tmp_path,
        script,
        "cc-compact",
        {"CLAUDE_CODE_AUTO_COMPACT_WINDOW": "100000", "CLAUDE_AUTOCOMPACT_PCT_OVERRIDE": "1"},
    )
    assert result.returncode == 0, result.stdout + result.stderr + logs
    assert orjson.loads(result.stdout)["result"] == "There is one text file: notes.txt."
    assert all(r.status == "ok" for r in records), [r.error for r in records]
    asking = [r.seq for r in records if compaction_prompt(r.messages) == "claude-code"]
    assert_side_jobs(records, {seq: "claude-code compaction" for seq in asking})
    summarised = [r.seq for r in records if summarised_history(r.messages) == "claude-code"]
    assert len(asking) == 1 and summarised == list(range(asking[0] + 1, len(records)))
    # The compaction call re-renders the earlier turns (Qwen's template drops their empty think blocks once
    # a new user message follows), so it cannot extend the chain: the chain breaks at it, and again at the
    # summarised history; both breaks are compactions.
    built = build_traces(records, {}, "prefix_merging", decode=tiny_tokenizer().decode)
    assert built.report.total.breaks == {"compaction": 2}
    assert [(t.calls_merged, t.break_cause) for t in built.traces] == [
        (asking[0], "compaction"),
        (1, None),
        (len(summarised), None),
    ]


# --- Qwen Code, Pi, Gemini CLI: their own compaction, with the window their rollout preset writes ----------


def preset_run(
    preset,
    tmp_path,
    script: dict,
    session: str,
    window: int,
    instruction: str,
    target: str,
    settings: tuple[str, dict] | None = None,
    extra_env: dict[str, str] | None = None,
    timeout: float = 240,
):
    """Run a harness as its rollout preset configures it (``context_window=window``) against the scripted
    engine behind a reverse proxy; ``settings`` = (a file under HOME, keys merged into what the preset wrote
    there, if anything), e.g. to trim its prompt for a CPU forward pass."""
    from tests.support.harnesses import calls, configured_session, run

    path = tmp_path / "script.json"
    path.write_bytes(orjson.dumps(script))
    home, out = tmp_path / "home", tmp_path / "shards"
    home.mkdir()
    with run_mitmdump(
        f"scripted:{path}",
        out,
        mode=f"reverse:{target}",
        options={"polar_shard_seconds": "0.5", "polar_keepalive": "600"},
    ) as proxy:
        ctx = configured_session(preset, proxy, home, session, window, settings)
        result = run(preset.command(instruction, ctx), {**preset.env(ctx), **(extra_env or {})}, home, timeout=timeout)
        records = calls(out, session, include_failed=True)
        logs = proxy.logs()[-3000:]
    return result, records, logs


def shell_turn(name: str, key: str, command: str) -> dict:
    return {
        "content": None,
        "tool_calls": [{"type": "function", "function": {"name": name, "arguments": {key: command}}}],
    }


QWEN_TURN = shell_turn("run_shell_command", "command", "seq 1 300")  # ~1,130 tokens a round
STATE_SNAPSHOT = (
    "<state_snapshot>\n<overall_goal>Count.</overall_goal>\n<key_knowledge>seq ran.</key_knowledge>\n</state_snapshot>"
)


@pytest.mark.harness
def test_qwen_code_compresses_through_polar(tiny_model_dir, tmp_path):
    """Qwen Code with the window its preset writes (``contextWindowSize``): past 70 % of it, before its next
    call, it asks for a ``<state_snapshot>`` with its own compression prompt (as the system prompt), replaces
    the older turns with the snapshot, carries on and exits 0. The trace breaks exactly there."""
    from polar_cli.rollout.harnesses.qwen_code import QwenCode

    script = {
        "model_dir": str(tiny_model_dir),
        "cycle": False,
        "turns": [QWEN_TURN] * 8,
        "summary": STATE_SNAPSHOT,
        "after_compaction": [{"content": "Counting is done."}] * 8,
    }
    system = tmp_path / "system.md"
    system.write_text("You are a counting agent. Run commands with run_shell_command.\n")
    # One tool and a short system prompt: the first prompt is ~10.3k tokens, each round adds ~1.1k; the window
    # is such that 70 % of it (12.2k) is passed after the third round.
    result, records, logs = preset_run(
        QwenCode(),
        tmp_path,
        script,
        "qwen-compact",
        17_400,
        "Count a few times.",
        "https://api.openai.com",
        settings=(
            ".qwen/settings.json",
            {
                "tools": {
                    "approvalMode": "yolo",
                    "core": ["run_shell_command"],
                    "exclude": ["tool_search", "agent", "task_stop", "send_message", "skill"],
                }
            },
        ),
        extra_env={"QWEN_SYSTEM_MD": str(system)},
    )
    assert result.returncode == 0, result.stdout + result.stderr + logs
    assert "Counting is done." in result.stdout
    assert all(r.status == "ok" for r in records), [r.error for r in records]
    asking = [r.seq for r in records if compaction_prompt(r.messages) == "qwen-code"]
    assert_side_jobs(records, {seq: "qwen-code compaction" for seq in asking})
    # The compression prompt itself shows the <state_snapshot> structure: only later calls carry a summary.
    summarised = [
        r.seq for r in records if summarised_history(r.messages) == "gemini-cli/qwen-code" and r.seq not in asking
    ]
    assert len(asking) == 1 and summarised == list(range(asking[0] + 1, len(records)))
    assert len(records[asking[0] - 1].prompt_ids) > 0.7 * 17_400 > len(records[asking[0] - 2].prompt_ids)
    built = build_traces(records, {}, "prefix_merging", decode=tiny_tokenizer().decode)
    # Its compression call has its own system prompt: it breaks the chain, and the summarised history starts another.
    assert built.report.total.breaks == {"compaction": 2}
    assert [(t.calls_merged, t.break_cause) for t in built.traces] == [
        (asking[0], "compaction"),
        (1, None),
        (len(summarised), None),
    ]


def gemini_turns(n: int) -> list[dict]:
    # Each command differs: the CLI stops a session that repeats one tool call (its loop detection).
    return [shell_turn("run_shell_command", "command", f"seq {i} {i + 299}") for i in range(n)]  # ~1,400 tokens a round


@pytest.mark.harness
def test_gemini_cli_does_not_compress_a_one_prompt_session(tiny_model_dir, tmp_path):
    """Gemini CLI checks its threshold (its preset: half the served window, as a share of the 1M tokens it assumes
    for an unknown model) before each call, but splits the history only at a user message that is not a tool
    result: a ``gemini -p`` session is one such message and then tool rounds, so there is nothing it may
    compress. Past the threshold it sends no compression call and carries on with the whole history (until the
    engine refuses it: then it exits 1, see the README)."""
    from polar_cli.rollout.harnesses.gemini_cli import GeminiCli

    script = {
        "model_dir": str(tiny_model_dir),
        "cycle": False,
        "turns": gemini_turns(5) + [{"content": "Counting is done."}],
        "summary": STATE_SNAPSHOT,
    }
    system = tmp_path / "system.md"
    system.write_text("You are a counting agent. Run commands with run_shell_command.\n")
    # First prompt ~1.5k tokens with one tool, ~1.4k more a round; half the window is 3.6k.
    result, records, logs = preset_run(
        GeminiCli(),
        tmp_path,
        script,
        "gemini-long",
        7_200,
        "Count a few times.",
        "https://generativelanguage.googleapis.com",
        settings=(".gemini/settings.json", {"tools": {"core": ["run_shell_command"]}}),
        extra_env={"GEMINI_SYSTEM_MD": str(system)},
    )
    assert result.returncode == 0, result.stdout + result.stderr[-1500:] + logs
    assert "Counting is done." in result.stdout
    assert all(r.status == "ok" for r in records), [r.error for r in records]
    assert len(records) == 6 and sum(len(r.prompt_ids) >= 3_600 for r in records) >= 3
    assert [compaction_prompt(r.messages) for r in records] == [None] * 6
    built = build_traces(records, {}, "prefix_merging", decode=tiny_tokenizer().decode)
    assert built.report.total.breaks == {} and [t.calls_merged for t in built.traces] == [6]


@pytest.mark.harness
def test_codex_custom_provider_compacts_through_polar(tiny_model_dir, tmp_path):
    """``codex:http`` (a custom provider: Responses over plain HTTP POSTs at the reverse proxy) with the window its
    preset writes (auto-compact at 80 % of it): Codex compacts *locally* for a provider that is not OpenAI's, with
    its own checkpoint prompt as a normal call, carries on from the summary and exits 0."""
    from polar_cli.rollout.harnesses.codex import Codex

    script = {
        "model_dir": str(tiny_model_dir),
        "cycle": False,
        "turns": [CODEX_TOOL_TURN] * 8,
        "summary": "Goal: count. Done: seq ran several times.",
        "after_compaction": [{"content": "Counting is done."}] * 4,
    }
    # The first prompt is ~15.2k tokens, each tool turn adds ~120: 80 % of 19,250 is 15,400.
    result, records, logs = preset_run(
        Codex(custom_provider=True),
        tmp_path,
        script,
        "codex-http-compact",
        19_250,
        "Count a few times.",
        "https://api.openai.com",
    )
    assert result.returncode == 0, result.stdout + result.stderr + logs
    assert "Counting is done." in result.stdout
    assert all(r.status == "ok" for r in records), [r.error for r in records]
    assert {r.api for r in records} == {"openai_responses"}
    asking = [r.seq for r in records if compaction_prompt(r.messages) == "codex"]
    assert_side_jobs(records, {seq: "codex compaction" for seq in asking})
    summarised = [r.seq for r in records if summarised_history(r.messages) == "codex" and r.seq not in asking]
    assert len(asking) == 1 and summarised == list(range(asking[0] + 1, len(records)))
    built = build_traces(records, {}, "prefix_merging", decode=tiny_tokenizer().decode)
    # As for Claude Code: the compaction call re-renders the earlier turns, so it breaks the chain, and the
    # summarised history starts another.
    assert built.report.total.breaks == {"compaction": 2}
    assert [(t.calls_merged, t.break_cause) for t in built.traces] == [
        (asking[0], "compaction"),
        (1, None),
        (len(summarised), None),
    ]


PI_TURN = shell_turn("bash", "command", "seq 1 300")  # ~1,070 tokens a round
PI_SUMMARY = "## Goal\nCount.\n## Progress\nseq ran three times."


@pytest.mark.harness
def test_pi_compacts_after_its_answer_in_print_mode(tiny_model_dir, tmp_path):
    """Pi checks its window (``contextWindow`` from its preset, less ``compaction.reserveTokens`` = 16,384) only
    when the agent stops: in print mode the threshold compaction comes after the answer, with its own
    checkpoint prompt, and Pi exits 0. (The summary is for a next prompt, which ``pi -p`` never sends.)"""
    from polar_cli.rollout.harnesses.pi import Pi

    script = {
        "model_dir": str(tiny_model_dir),
        "cycle": False,
        "turns": [PI_TURN] * 3 + [{"content": "Done counting."}],
        "summary": PI_SUMMARY,
    }
    # The last prompt is ~5.4k tokens, past 19,384 - 16,384 = 3,000.
    result, records, logs = preset_run(
        Pi(), tmp_path, script, "pi-compact", 19_384, "Count a few times.", "https://api.openai.com"
    )
    assert result.returncode == 0, result.stdout + result.stderr[-1500:] + logs
    assert result.stdout.strip() == "Done counting."
    assert all(r.status == "ok" for r in records), [r.error for r in records]
    assert [compaction_prompt(r.messages) for r in records] == [None] * 4 + ["pi"]
    assert_side_jobs(records, {4: "pi compaction"})
    built = build_traces(records, {}, "prefix_merging", decode=tiny_tokenizer().decode)
    assert built.report.total.breaks == {"compaction": 1}


@pytest.mark.harness
@pytest.mark.parametrize("name", ["qwen", "pi"])
def test_qwen_code_and_pi_recover_from_an_overflow(name, tiny_model_dir, tmp_path):
    """The engine refuses a prompt as too long (the scripted engine's ``max_len`` under the harness's window):
    Qwen Code reads the OpenAI ``context_length_exceeded`` error, compresses at once and retries; Pi recognises
    "maximum context length is N tokens", compacts (keeping ``compaction.keepRecentTokens``) and retries. Both
    exit 0 after a retry on the summary that succeeds (Pi's print mode does not print it); the refused call is
    recorded as failed."""
    from polar_cli.rollout.harnesses.pi import Pi
    from polar_cli.rollout.harnesses.qwen_code import QwenCode

    system = tmp_path / "system.md"
    system.write_text("You are a counting agent. Run commands with run_shell_command.\n")
    runs = {
        # Qwen: prompts of ~10.3k, 11.4k, 12.5k tokens, then 13.6k > 13,500.
        "qwen": (
            QwenCode(),
            "qwen-code",
            "gemini-cli/qwen-code",
            QWEN_TURN,
            STATE_SNAPSHOT,
            13_500,
            (
                ".qwen/settings.json",
                {
                    "tools": {
                        "approvalMode": "yolo",
                        "core": ["run_shell_command"],
                        "exclude": ["tool_search", "agent", "task_stop", "send_message", "skill"],
                    }
                },
            ),
            {"QWEN_SYSTEM_MD": str(system)},
        ),
        # Pi: prompts of ~2.2k, 3.3k, 4.4k tokens, then 5.4k > 5,000. It sizes what it keeps at 4 characters a
        # token (a round here is ~300 by that count, ~1,070 real tokens): keeping 100 keeps the last round.
        "pi": (
            Pi(),
            "pi",
            "pi",
            PI_TURN,
            PI_SUMMARY,
            5_000,
            (".pi/agent/settings.json", {"compaction": {"keepRecentTokens": 100}}),
            {},
        ),
    }
    preset, asks, summarises, turn, summary, max_len, settings, env = runs[name]
    script = {
        "model_dir": str(tiny_model_dir),
        "cycle": False,
        "max_len": max_len,
        "turns": [turn] * 8,
        "summary": summary,
        "after_compaction": [{"content": "Counting is done."}] * 8,
    }
    result, records, logs = preset_run(
        preset,
        tmp_path,
        script,
        f"{name}-overflow",
        1_000_000,
        "Count a few times.",
        "https://api.openai.com",
        settings=settings,
        extra_env=env,
    )
    for r in records:
        print(
            name,
            r.seq,
            r.status,
            len(r.prompt_ids),
            compaction_prompt(r.messages),
            summarised_history(r.messages),
            (r.error or "")[:80],
        )
    assert result.returncode == 0, result.stdout + result.stderr[-1500:] + logs
    failed = [r for r in records if r.status == "failed"]
    assert len(failed) == 1 and failed[0].error.startswith("400 context_length_exceeded: prompt_tokens=")
    assert f"window={max_len}" in failed[0].error
    after = records[failed[0].seq + 1 :]
    assert compaction_prompt(after[0].messages) == asks
    assert after[1:] and all(summarised_history(r.messages) == summarises and r.status == "ok" for r in after[1:])
    if name == "qwen":
        assert result.stdout.strip().endswith("Counting is done."), result.stdout
    else:
        # ``pi -p`` reads its answer when the first attempt ends; the compaction and the retry run after that, so
        # the retried answer ("Counting is done.") is captured but never printed.
        assert result.stdout.strip() == "", result.stdout


def _refused_as_too_long(records, max_len: int) -> list:
    """The session's calls, every one captured (the proxy numbers them as they arrive), with those the engine
    refused recorded failed with their prompt length and the window in the error text."""
    assert [r.seq for r in records] == list(range(len(records)))
    failed = [r for r in records if r.status == "failed"]
    assert failed and all(r.status == "ok" for r in records[: failed[0].seq]), [(r.status, r.error) for r in records]
    for r in failed:
        assert r.error.startswith("400 context_length_exceeded: prompt_tokens="), r.error
        assert int(r.error.split("prompt_tokens=")[1].split()[0]) > max_len and f"window={max_len}" in r.error
    return failed


@pytest.mark.harness
@pytest.mark.parametrize("name", ["claude-code", "codex", "gemini-cli"])
def test_claude_codex_and_gemini_end_cleanly_on_an_overflow(name, tiny_model_dir, tmp_path):
    """The engine refuses a prompt as too long mid-session (the scripted engine's ``max_len`` under the window the
    harness assumes): each harness recognises its provider's context error and ends with its own message within
    a bounded time, never hangs. Claude Code compacts reactively on ``prompt is too long``, its summary prompt
    overflows too, it drops the oldest messages and retries, then gives up with "Prompt is too long"; Codex (default
    provider, Responses WebSocket) reads ``response.failed`` / ``context_length_exceeded`` as "ran out of room";
    Gemini CLI has no reactive compression: the 400 ends the run."""
    from polar_addon.store.validate import validate_store
    from polar_cli.rollout.harnesses.gemini_cli import GeminiCli
    from tests.support.harnesses import calls, harness, run

    if name == "claude-code":
        # ~600-token prompts, ~60 more a Glob round: the fourth or fifth call passes 800.
        max_len = 800
        script = {
            "model_dir": str(tiny_model_dir),
            "cycle": False,
            "max_len": max_len,
            "turns": [GLOB_TURN] * 8,
            "summary": "Goal: find text files.",
        }
        result, records, logs = claude_run(tmp_path, script, "cc-overflow", {}, timeout=120)
        out = tmp_path / "shards"
    elif name == "codex":
        # The first prompt is ~15.2k tokens, a tool round adds ~120: the second call passes 15,300.
        max_len = 15_300
        codex = harness("codex")
        path, out, home = tmp_path / "script.json", tmp_path / "shards", tmp_path / "home"
        path.write_bytes(
            orjson.dumps(
                {"model_dir": str(tiny_model_dir), "cycle": False, "max_len": max_len, "turns": [CODEX_TOOL_TURN] * 8}
            )
        )
        (home / ".codex").mkdir(parents=True)
        with run_mitmdump(
            f"scripted:{path}", out, options={"polar_shard_seconds": "0.5", "polar_keepalive": "600"}
        ) as proxy:
            env = {
                "CODEX_HOME": str(home / ".codex"),
                "RUST_LOG": "warn",
                "HTTPS_PROXY": proxy.proxy_url("codex-overflow"),
                "CODEX_CA_CERTIFICATE": str(proxy.ca),
                "SSL_CERT_FILE": str(proxy.ca),
                "OPENAI_API_KEY": "sk-not-a-real-key",
            }
            result = run(
                [str(codex), "exec", "--skip-git-repo-check", "-m", "tiny", "Count a few times."],
                env,
                home,
                timeout=120,
            )
            records = calls(out, "codex-overflow", include_failed=True)
            logs = proxy.logs()[-3000:]
    else:
        # First prompt ~1.5k tokens with one tool, ~1.4k more a round: the third call passes 3,500.
        max_len = 3_500
        system = tmp_path / "system.md"
        system.write_text("You are a counting agent. Run commands with run_shell_command.\n")
        script = {"model_dir": str(tiny_model_dir), "cycle": False, "max_len": max_len, "turns": gemini_turns(6)}
        result, records, logs = preset_run(
            GeminiCli(),
            tmp_path,
            script,
            "gemini-overflow",
            1_000_000,
            "Count a few times.",
            "https://generativelanguage.googleapis.com",
            settings=(".gemini/settings.json", {"tools": {"core": ["run_shell_command"]}}),
            extra_env={"GEMINI_SYSTEM_MD": str(system)},
            timeout=120,
        )
        out = tmp_path / "shards"
    for r in records:
        print(name, r.seq, r.status, len(r.prompt_ids), compaction_prompt(r.messages), (r.error or "")[:90])
    # ``run`` raises TimeoutExpired past its bound: a harness that hung on the error fails here.
    assert result.returncode == 1, result.stdout + result.stderr[-1500:] + logs
    assert validate_store(str(out)) == []
    failed = _refused_as_too_long(records, max_len)
    first = failed[0]
    if name == "claude-code":
        # The first refusal is a normal turn; every call after it is Claude Code's own compaction prompt (its
        # summary request adds ~2.1k tokens, so it is refused too), and then it gives up with its own verdict.
        assert compaction_prompt(first.messages) is None
        assert records[first.seq + 1 :] and all(
            r.status == "failed" and compaction_prompt(r.messages) == "claude-code" for r in records[first.seq + 1 :]
        )
        answer = orjson.loads(result.stdout)
        assert (answer["is_error"], answer["result"], answer["terminal_reason"]) == (
            True,
            "Prompt is too long",
            "prompt_too_long",
        )
    else:
        # No reactive compaction: the refused call is the last one, and the run ends with the harness's message.
        assert failed == [records[-1]] and first.seq > 0
        if name == "codex":
            assert "ERROR: Codex ran out of room in the model's context window." in result.stderr, result.stderr[-1500:]
        else:
            prompt_tokens = first.error.split("prompt_tokens=")[1].split()[0]
            assert (
                f"The input token count ({prompt_tokens}) exceeds the maximum number of tokens allowed ({max_len})."
                in result.stderr
            ), result.stderr[-1500:]
            assert "An unexpected critical error occurred" in result.stderr, result.stderr[-1500:]
