"""Token continuity in the gateway, in-process: the real openai_chat provider, the scripted engine on Qwen3's
template, a real TraceStore. Calls that do not continue their chain are rendered fresh and say why; a new
Gateway (what a proxy restart is) falls back to a fresh render; the per-session memory is bounded."""

from __future__ import annotations

import asyncio
import copy
from pathlib import Path
from typing import Any

import orjson
import pytest

from polar_addon.canonical import AssistantMessage, CanonicalRequest
from polar_addon.capture import Identity
from polar_addon.continuity.chains import ChainTip, PromptPlan, TitoStore, judge, plan_prompt, tito_mode
from polar_addon.continuity.check import Continues, check_continuity
from polar_addon.continuity.delta import DeltaPrompt, NoDelta
from polar_addon.engines import EnginePool
from polar_addon.engines.scripted import ScriptedEngine
from polar_addon.gateway import Gateway, GatewayConfig, IncomingCall
from polar_addon.store import TraceStore, read_records
from polar_addon.tool_parsers import ParserChoice
from polar_cli.build import build_traces
from polar_cli.build.stats import top_reasons
from tests.support.tito_sessions import TOOLS, qwen3_model, write_script


@pytest.fixture(scope="module")
def script(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("tito-gw")
    return write_script(qwen3_model(tiny_model_dir, root), root / "script.json")


def chat_call(
    session: str, messages: list[dict[str, Any]], tools: list[dict[str, Any]] = TOOLS, **body: Any
) -> IncomingCall:
    payload = {"model": "tiny", "max_tokens": 64, "messages": messages, "tools": tools, **body}
    return IncomingCall(
        method="POST",
        path="/v1/chat/completions",
        headers={"user-agent": "OpenAI/Python 2.0"},
        body=orjson.dumps(payload),
        identity=Identity(session_id=session, source="header"),
    )


async def turn(gateway: Gateway, session: str, messages: list[dict[str, Any]], **body: Any) -> list[dict[str, Any]]:
    """One call; the history with the returned assistant message (and a tool result per call) appended."""
    reply = await gateway.handle(chat_call(session, messages, **body))
    assert reply.status == 200, reply.body
    message = orjson.loads(reply.body)["choices"][0]["message"]
    sent = {
        "role": "assistant",
        "content": message.get("content"),
        **({"tool_calls": message["tool_calls"]} if message.get("tool_calls") else {}),
    }
    results = [{"role": "tool", "tool_call_id": c["id"], "content": "ok"} for c in message.get("tool_calls") or []]
    return [*messages, sent, *results]


START = [{"role": "system", "content": "You are a file assistant."}, {"role": "user", "content": "What is here?"}]


def reasons(out: Path, session: str) -> list[tuple[str | None, str | None]]:
    return [(r.prompt_source, r.prompt_reason) for r in read_records(str(out)) if r.session_id == session]


def test_diverging_calls_are_fresh_with_their_reason(script: Path, tmp_path: Path) -> None:
    out = tmp_path / "shards"

    async def main() -> None:
        gateway = Gateway(EnginePool([ScriptedEngine(str(script))]), TraceStore(str(out)))
        history = await turn(gateway, "edit", START)
        edited = copy.deepcopy(history)
        edited[1]["content"] = "What is there?"
        await turn(gateway, "edit", edited)
        history = await turn(gateway, "system", START)
        await turn(gateway, "system", [{"role": "system", "content": "You are a sub-agent."}, *history[1:]])
        history = await turn(gateway, "tools", START)
        await turn(gateway, "tools", history, tools=TOOLS[:1])
        history = await turn(gateway, "sampling", START)
        await turn(gateway, "sampling", history, temperature=0.5)
        history = await turn(gateway, "retry", START)
        await turn(gateway, "retry", START)  # the same request again: another sample, not a continuation
        await gateway.close()

    asyncio.run(main())
    assert reasons(out, "edit") == [("fresh", "first_call"), ("fresh", "edited_history")]
    assert reasons(out, "system") == [("fresh", "first_call"), ("fresh", "new_system_prompt")]
    assert reasons(out, "tools") == [("fresh", "first_call"), ("fresh", "changed_tools")]
    assert reasons(out, "sampling") == [("fresh", "first_call"), ("fresh", "changed_sampling")]
    assert reasons(out, "retry") == [("fresh", "first_call"), ("fresh", "other")]
    # polar stats: prompt sources per harness, with the top reasons.
    report = build_traces(read_records(str(out)), {}).report
    assert report.total.prompt_sources == {"fresh": 10}
    assert top_reasons(report.total.fresh_reasons) == "first_call 5, changed_sampling 1, changed_tools 1"


def test_a_restarted_proxy_renders_fresh_and_starts_a_new_chain(script: Path, tmp_path: Path) -> None:
    out = tmp_path / "shards"

    async def main() -> None:
        engine = ScriptedEngine(str(script))
        gateway = Gateway(EnginePool([engine]), TraceStore(str(out)))
        history = await turn(gateway, "s", START)
        history = await turn(gateway, "s", history)
        await gateway.store.aclose()
        restarted = Gateway(EnginePool([engine]), TraceStore(str(out)))  # the token state is gone
        history = await turn(restarted, "s", history)  # the answer: a new user turn follows
        await turn(restarted, "s", [*history, {"role": "user", "content": "And now?"}])
        await restarted.close()

    asyncio.run(main())
    assert reasons(out, "s") == [
        ("fresh", "first_call"),
        ("continuity", "continues"),
        ("fresh", "state_lost"),
        ("continuity", "continues"),
    ]
    records = read_records(str(out))
    # The fresh render after the restart is the engine's own full render of the history, not a guess.
    assert records[2].prompt_ids[:1] == records[0].prompt_ids[:1]


def test_side_calls_do_not_end_the_main_chain(script: Path, tmp_path: Path) -> None:
    # Claude Code interleaves title and quota calls with their own system prompt in the same session.
    out = tmp_path / "shards"

    async def main() -> None:
        gateway = Gateway(EnginePool([ScriptedEngine(str(script))]), TraceStore(str(out)))
        history = await turn(gateway, "main", START)
        await turn(
            gateway, "main", [{"role": "system", "content": "Write a title."}, {"role": "user", "content": "hi"}]
        )
        await turn(gateway, "main", history)
        await gateway.close()

    asyncio.run(main())
    assert reasons(out, "main") == [
        ("fresh", "first_call"),
        ("fresh", "new_system_prompt"),
        ("continuity", "continues"),
    ]


def test_tito_off_renders_every_call_fresh(script: Path, tmp_path: Path) -> None:
    out = tmp_path / "shards"

    async def main() -> None:
        gateway = Gateway(EnginePool([ScriptedEngine(str(script))]), TraceStore(str(out)), GatewayConfig(tito="off"))
        await turn(gateway, "off", await turn(gateway, "off", START))
        await gateway.close()

    asyncio.run(main())
    assert reasons(out, "off") == [("fresh", "tito_off"), ("fresh", "tito_off")]


def test_the_store_is_bounded_and_keeps_a_few_chains_per_session() -> None:
    store = TitoStore(max_sessions=2, chains_per_session=2)
    chain = [
        ChainTip(CanonicalRequest("openai_chat", "m", []), AssistantMessage("x"), [1], [2], "stop", "e")
        for _ in range(3)
    ]
    for c in chain:
        store.remember("a", c)
    assert store.chains("a") == [chain[2], chain[1]]
    store.remember("a", chain[0], replaces=chain[1])
    assert store.chains("a") == [chain[0], chain[2]]
    store.remember("b", chain[0])
    store.remember("c", chain[0])
    assert len(store) == 2 and store.chains("a") == []


def test_a_session_on_another_engine_does_not_continue() -> None:
    request = CanonicalRequest("openai_chat", "m", [{"role": "user", "content": "hi"}])
    chain = ChainTip(request, AssistantMessage("x"), [1], [2], "stop", "engine-a")
    nxt = CanonicalRequest(
        "openai_chat",
        "m",
        [*request.messages, {"role": "assistant", "content": "x"}, {"role": "user", "content": "more"}],
    )
    plan = plan_prompt([chain], nxt, "engine-b", lambda **_: pytest.fail("no delta is computed"))
    assert (plan.prompt_ids, plan.source, plan.reason) == (None, "fresh", "engine_changed")


def test_the_continuation_is_told_how_the_chains_turn_ended() -> None:
    """A turn cut by length continues (the template closes it): plan_prompt hands the tip's finish reason on."""
    request = CanonicalRequest("openai_chat", "m", [{"role": "user", "content": "hi"}])
    seen: list[dict[str, Any]] = []

    def continuation(**kwargs: Any) -> DeltaPrompt:
        seen.append(kwargs)
        return DeltaPrompt([1, 2, 3, 4], [3, 4], closed_by_template=True)

    nxt = CanonicalRequest(
        "openai_chat",
        "m",
        [*request.messages, {"role": "assistant", "content": "x"}, {"role": "user", "content": "more"}],
    )
    for finish in ("length", "stop"):
        chain = ChainTip(request, AssistantMessage("x"), [1], [2], finish, "e")
        plan = plan_prompt([chain], nxt, "e", continuation)
        assert (plan.prompt_ids, plan.source, plan.continued) == ([1, 2, 3, 4], "continuity", chain)
        assert seen[-1]["finish_reason"] == finish and seen[-1]["sampled_ids"] == [2]


def test_judge_gives_each_chains_verdict_and_plan_prompt_uses_them() -> None:
    """judge (what the gateway asks on the event loop) says per chain what check_continuity says; a plan made from
    those verdicts is the plan made without them, and nothing to continue means no delta is computed at all."""
    hi = CanonicalRequest("openai_chat", "m", [{"role": "user", "content": "hi"}])
    other = CanonicalRequest("openai_chat", "m", [{"role": "user", "content": "a title please"}])
    nxt = CanonicalRequest(
        "openai_chat", "m", [*hi.messages, {"role": "assistant", "content": "x"}, {"role": "user", "content": "more"}]
    )
    chains = [
        ChainTip(other, AssistantMessage("t"), [5], [6], "stop", "e"),  # newest: a side call
        ChainTip(hi, AssistantMessage("x"), [1], [2], "stop", "e2"),  # another engine
        ChainTip(hi, AssistantMessage("x"), [1], [2], "stop", "e"),  # the one it continues
    ]
    verdicts = judge(chains, nxt, "e")
    assert verdicts[0] == check_continuity(other, AssistantMessage("t"), nxt).reason.value == "edited_history"
    assert verdicts[1] == "engine_changed" and isinstance(verdicts[2], Continues)
    assert verdicts[2] == check_continuity(hi, AssistantMessage("x"), nxt)

    def continuation(**kwargs: Any) -> DeltaPrompt:
        assert kwargs["prompt_ids"] == [1] and kwargs["new_messages"] == [{"role": "user", "content": "more"}]
        return DeltaPrompt([1, 2, 9], [9], closed_by_template=False)

    plan = plan_prompt(chains, nxt, "e", continuation, verdicts)
    assert plan == plan_prompt(chains, nxt, "e", continuation) and plan.continued is chains[2]
    assert (plan.prompt_ids, plan.source) == ([1, 2, 9], "continuity")
    fresh = plan_prompt(chains[:2], nxt, "e", lambda **_: pytest.fail("no delta"), judge(chains[:2], nxt, "e"))
    assert (fresh.source, fresh.reason) == ("fresh", "edited_history")  # the newest chain's reason


def test_a_requests_compaction_verdict_is_found_once_and_a_changed_request_finds_its_own() -> None:
    from dataclasses import replace

    from polar_addon.context_compaction import PROMPT_MARKERS

    asking = {"role": "user", "content": f"Now: {PROMPT_MARKERS['codex'][0]}, please."}
    request = CanonicalRequest("openai_chat", "m", [{"role": "user", "content": "hi"}, asking])
    assert request.compaction_prompt == "codex" and request.__dict__["compaction_prompt"] == "codex"
    plain = replace(request, messages=request.messages[:1])
    assert plain.compaction_prompt is None and request.compaction_prompt == "codex"
    assert "compaction_prompt" not in request.to_dict() and plain == CanonicalRequest.from_dict(plain.to_dict())


def test_a_session_without_chains_is_a_first_call_or_lost_state() -> None:
    first = CanonicalRequest("openai_chat", "m", ["not a message", {"role": "user", "content": "hi"}])  # type: ignore[list-item]
    assert plan_prompt([], first, "e", lambda **_: pytest.fail("no delta")) == PromptPlan(None, "fresh", "first_call")
    later = CanonicalRequest("openai_chat", "m", [*first.messages, {"role": "assistant", "content": "x"}])
    assert plan_prompt([], later, "e", lambda **_: pytest.fail("no delta")) == PromptPlan(None, "fresh", "state_lost")


def test_the_continuation_gets_exactly_the_chain_and_the_new_requests_parts() -> None:
    tools = [{"type": "function", "function": {"name": "bash", "parameters": {}}}]
    request = CanonicalRequest("openai_chat", "m", [{"role": "user", "content": "hi"}], tools=tools)
    returned = {"role": "assistant", "content": "x"}
    new = [{"role": "user", "content": "more"}]
    nxt = CanonicalRequest("openai_chat", "m", [*request.messages, returned, *new], tools=tools, enable_thinking=False)
    request.enable_thinking = False  # the thinking switch is part of the chain's identity
    chain = ChainTip(request, AssistantMessage("x"), [1, 2], [3], "stop", "e", matched_stop="</answer>")
    seen: list[dict[str, Any]] = []

    def continuation(**kwargs: Any) -> DeltaPrompt:
        seen.append(kwargs)
        return DeltaPrompt([1, 2, 3, 4], [4])

    assert plan_prompt([chain], nxt, "e", continuation) == PromptPlan([1, 2, 3, 4], "continuity", "continues", chain)
    assert seen == [
        {"prompt_ids": [1, 2], "sampled_ids": [3], "history": [*request.messages, returned], "new_messages": new,
         "tools": tools, "enable_thinking": False, "finish_reason": "stop", "matched_stop": "</answer>"}
    ]  # fmt: skip


def test_a_continuation_the_template_cannot_render_is_fresh_and_says_why() -> None:
    request = CanonicalRequest("openai_chat", "m", [{"role": "user", "content": "hi"}])
    nxt = CanonicalRequest(
        "openai_chat", "m", [*request.messages, {"role": "assistant", "content": "x"}, {"role": "user", "content": "+"}]
    )
    chains = [ChainTip(request, AssistantMessage("x"), [1], [2], "stop", "e") for _ in range(2)]
    plan = plan_prompt(chains, nxt, "e", lambda **_: NoDelta("the template re-rendered the turn"))
    assert plan == PromptPlan(None, "fresh", "no_delta: the template re-rendered the turn")


def test_the_store_keeps_newest_first_and_forgets() -> None:
    store = TitoStore(max_sessions=3, chains_per_session=3)
    tips = [ChainTip(CanonicalRequest("openai_chat", "m", []), AssistantMessage(f"{i}"), [i], [i], "stop", "e")
            for i in range(3)]  # fmt: skip
    for tip in tips:
        store.remember("a", tip)
    assert store.chains("a") == tips[::-1]
    store.remember("b", tips[0])
    store.forget("a")
    store.forget("never-seen")
    assert store.chains("a") == [] and store.chains("b") == [tips[0]] and len(store) == 1


def test_only_a_token_input_engine_with_tito_on_gets_chains(tiny_model_dir: Path, tmp_path: Path) -> None:
    from polar_addon.continuity.chains import token_input_engine
    from polar_addon.engines.openai_compat import HTTPEngine

    scripted = ScriptedEngine(str(write_script(tiny_model_dir, tmp_path / "s.json")))
    assert token_input_engine(scripted, "auto") is scripted and token_input_engine(scripted, "on") is scripted
    assert token_input_engine(scripted, "off") is None
    assert token_input_engine(HTTPEngine("http://127.0.0.1:9"), "on") is None  # no token prompt on this wire


def test_takes_token_input_agrees_with_the_protocol(tiny_model_dir: Path, tmp_path: Path) -> None:
    """The gate's cheap check says what ``isinstance(engine, TokenInputEngine)`` says, for every engine kind and for
    an engine whose token-input method is switched off on the instance."""
    from polar_addon.engines import TokenInputEngine, make_engine, takes_token_input
    from polar_addon.engines.openai_compat import HTTPEngine

    script = write_script(tiny_model_dir, tmp_path / "s.json")
    engines = [make_engine(spec, timeout_s=5) for spec in ("vllm:http://127.0.0.1:9", "sglang:http://127.0.0.1:9")]
    engines += [ScriptedEngine(str(script)), HTTPEngine("http://127.0.0.1:9")]
    off = ScriptedEngine(str(script))
    off.complete_tokens = None  # type: ignore[assignment,method-assign]
    got = [takes_token_input(e) for e in [*engines, off]]
    assert got == [isinstance(e, TokenInputEngine) for e in [*engines, off]] == [True, True, True, False, False]


def test_tito_mode_values() -> None:
    assert [tito_mode(v) for v in ("auto", " ON ", "off")] == ["auto", "on", "off"]
    with pytest.raises(ValueError, match="auto, on or off"):
        tito_mode("yes")


def test_the_tool_parser_option_picks_a_parser_per_served_model() -> None:
    choice = ParserChoice("qwen3_coder, coder-7b=hermes")
    assert (choice.name_for("other"), choice.name_for("coder-7b")) == ("qwen3_coder", "hermes")
    assert ParserChoice("").name_for("any") == "hermes"
    turn = choice.for_model("coder-7b")('<tool_call>{"name": "ls", "arguments": {"path": "."}}</tool_call>', TOOLS)
    assert [(c.name, c.arguments) for c in turn.message.tool_calls] == [("ls", '{"path":"."}')]
    broken = choice.for_model("coder-7b")('<tool_call>{"name": "ls", "arguments": </tool_call>', TOOLS)
    assert broken.parse_failed and "<tool_call>" in (broken.message.content or "")
    with pytest.raises(ValueError, match="unknown tool-call parser"):
        ParserChoice("m=nope")
