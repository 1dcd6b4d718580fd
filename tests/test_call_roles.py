"""Roles of calls: agent, auxiliary (a harness's side job) or discarded, in the record and in the build.

The policy is the adversary here: a call it can make look auxiliary leaves training, so it would escape the
reward of that turn. Every test of a marker has its counterpart where the same text reaches the prompt through
something the policy controls (a tool result, a file a harness quotes, its own turn, a memory file appended to
the system prompt), and there the call stays ``agent``.
"""

from __future__ import annotations

import asyncio
import re
from pathlib import Path

import orjson
import pyarrow.parquet as pq
import pytest
from build_helpers import TOOLS, AgentSim, Turn, check_trace, coding_turns, tool_loop, tool_result

from polar_addon.call_roles import (
    AUXILIARY_MARKERS,
    CLAUDE_CODE_IDENTITY,
    COMPACTION_SYSTEM_PREFIX,
    call_role,
    parse_roles,
    retried,
)
from polar_addon.canonical import AssistantMessage, CanonicalRequest, Completion
from polar_addon.capture import Identity, record_failed, record_ok
from polar_addon.context_compaction import PROMPT_MARKERS
from polar_addon.store import TraceStore, read_records
from polar_cli.build import SessionInfo, build_traces
from polar_cli.train.dataset import explain_nothing_to_train

SYSTEM = {"role": "system", "content": "You are a careful coding agent working in /repo."}
TASK = {"role": "user", "content": "The test test_parse fails. Fix it."}
CLAUDE_COMPACT = PROMPT_MARKERS["claude-code"][0] + ", paying close attention to the user's explicit requests."
GEMINI_COMPACT_SYSTEM = "You are the component that " + PROMPT_MARKERS["qwen-code"][0] + "."


def role(messages: list[dict], tools: list | None = None) -> tuple[str, str | None]:
    decision = call_role(messages, tools or [])
    return decision.role, decision.reason


# ---- the capture-time decision ---------------------------------------------------------------------------------


@pytest.mark.parametrize("harness", sorted(PROMPT_MARKERS))
def test_every_harness_compaction_prompt_makes_an_auxiliary_call(harness: str) -> None:
    for text in PROMPT_MARKERS[harness]:
        asked = [SYSTEM, TASK, {"role": "assistant", "content": "Looked."}, {"role": "user", "content": text + " ..."}]
        assert role(asked) == ("auxiliary", f"{harness} compaction")
        # A harness that opens the user message with its own reminder block first (Claude Code's system reminders).
        reminded = asked[:-1] + [{"role": "user", "content": "<system-reminder>x</system-reminder>\n\n" + text}]
        assert role(reminded) == ("auxiliary", f"{harness} compaction")


def test_a_compaction_system_prompt_makes_an_auxiliary_call() -> None:
    messages = [{"role": "system", "content": GEMINI_COMPACT_SYSTEM}, {"role": "user", "content": "history..."}]
    assert role(messages)[0] == "auxiliary"


def test_the_main_loop_is_agent() -> None:
    assert role([SYSTEM, TASK], TOOLS) == ("agent", None)
    assert role([SYSTEM, TASK, {"role": "assistant", "content": "ok"}, {"role": "user", "content": "go on"}]) == (
        "agent",
        None,
    )


@pytest.mark.parametrize(
    "messages",
    [
        # A tool result: the policy's command printed the harness's compaction prompt.
        [SYSTEM, TASK, {"role": "assistant", "content": None}, {"role": "tool", "content": CLAUDE_COMPACT}],
        # A harness quoting a file the policy wrote, inside its own tags.
        [
            SYSTEM,
            TASK,
            {"role": "user", "content": f"<system-reminder>\nnotes.md:\n{CLAUDE_COMPACT}\n</system-reminder>"},
        ],
        # The text inside a block, not at its start.
        [SYSTEM, TASK, {"role": "user", "content": f"Command output: {CLAUDE_COMPACT}"}],
        # The policy's own turn, then a plain continuation.
        [SYSTEM, TASK, {"role": "assistant", "content": CLAUDE_COMPACT}, {"role": "user", "content": "continue"}],
        # The policy's own last turn (no user message after it).
        [SYSTEM, {"role": "user", "content": CLAUDE_COMPACT}, {"role": "assistant", "content": "ok"}],
        # A memory file the harness appends to a long system prompt.
        [{"role": "system", "content": "x" * COMPACTION_SYSTEM_PREFIX + GEMINI_COMPACT_SYSTEM}, TASK],
    ],
    ids=["tool-result", "quoted-file", "mid-block", "own-turn", "last-is-assistant", "memory-file"],
)
def test_a_marker_the_policy_can_place_does_not_make_a_call_auxiliary(messages: list[dict]) -> None:
    assert role(messages) == ("agent", None)


def test_auxiliary_markers_are_harness_text_at_a_start() -> None:
    """Each marker opens the system prompt or a block of the last user message; one placed anywhere else (by a tool
    result or a quoted file) is agent; and a marker without ``with_tools`` never fires on a call declaring tools."""
    for marker in AUXILIARY_MARKERS:
        assert marker.where in ("system", "user") and (len(marker.text) >= 20 or marker.whole), marker
        text = marker.text if marker.whole else marker.text + " rest"
        opened = (
            [{"role": "system", "content": text}, {"role": "user", "content": "input"}]
            if marker.where == "system"
            else [SYSTEM, {"role": "user", "content": text}]
        )
        assert role(opened) == ("auxiliary", f"{marker.harness} {marker.kind}"), marker
        assert role(opened, TOOLS)[0] == ("auxiliary" if marker.with_tools else "agent"), marker
        buried = [SYSTEM, TASK, {"role": "tool", "content": marker.text}]
        assert role(buried) == ("agent", None), marker
        quoted = [SYSTEM, {"role": "user", "content": f"<file>{marker.text}</file>"}]
        assert role(quoted) == ("agent", None), marker
        if marker.whole:
            assert role([SYSTEM, {"role": "user", "content": marker.text + " exceeded: what now?"}]) == ("agent", None)


@pytest.mark.parametrize("identity", sorted(CLAUDE_CODE_IDENTITY))
def test_a_claude_code_side_job_opens_the_block_after_its_identity_line(identity: str) -> None:
    title = "Generate a concise, sentence-case title (3-7 words) that captures the main topic or goal of this coding"
    system = {"role": "system", "content": f"{identity}\n\n{title} session. Return JSON."}
    assert role([system, {"role": "user", "content": "<session>\nfix the bug"}]) == ("auxiliary", "claude-code title")
    # The main loop opens the same way; a title-like text further on (the user's CLAUDE.md, the environment) is not
    # the side job's opening.
    main = {"role": "system", "content": f"{identity}\n\nYou are an interactive CLI tool.\n\n{title}"}
    assert role([main, TASK], TOOLS) == role([main, TASK]) == ("agent", None)
    # Only Claude Code's identity lines move the opening: another harness's first block does not.
    other = {"role": "system", "content": f"You are Pi.\n\n{title}"}
    assert role([other, TASK]) == ("agent", None)


def test_retried_finds_the_next_identical_call() -> None:
    assert retried(["a", "b", "a", "c", "a"]) == {0: 2, 2: 4}
    assert retried(["a", "b", "c"]) == {}


def test_parse_roles() -> None:
    assert parse_roles("agent, auxiliary") == {"agent", "auxiliary"}
    with pytest.raises(ValueError) as bad:
        parse_roles("agent,bogus,titles")
    assert str(bad.value) == (
        "unknown role(s) bogus, titles: use a comma-separated subset of agent, auxiliary, discarded"
    )
    with pytest.raises(ValueError) as empty:
        parse_roles(" , ")
    assert str(empty.value).startswith("unknown role(s) (none given): use")


def request(messages: list[dict], tools: list | None = None) -> CanonicalRequest:
    return CanonicalRequest(api="openai_chat", model="m", messages=messages, tools=tools or [])


def completion() -> Completion:
    return Completion(AssistantMessage(content="Summary."), "stop", [1, 2], [3, 4], [-0.1, -0.2], "m", "scripted")


def test_records_carry_their_role() -> None:
    identity = Identity("s")
    kw = dict(identity=identity, seq=0, completion=completion(), harness="h", started_at=0.0, engine_latency_s=0.0)
    agent = record_ok(request=request([SYSTEM, TASK], TOOLS), **kw)
    side = record_ok(request=request([SYSTEM, TASK, {"role": "user", "content": CLAUDE_COMPACT}]), **kw)
    failed = record_failed(identity=identity, seq=1, api="openai_chat", request=None, error="x", harness="h",
                           started_at=0.0)  # fmt: skip
    assert (agent.role, agent.role_reason) == ("agent", None)
    assert (side.role, side.role_reason) == ("auxiliary", "claude-code compaction")
    assert (failed.role, failed.role_reason) == ("discarded", "failed")


def test_roles_round_trip_the_store_and_older_shards_read_them_as_null(tmp_path: Path) -> None:
    identity = Identity("s")
    sent = [
        record_ok(
            identity=identity,
            seq=i,
            request=request(messages),
            completion=completion(),
            harness="h",
            started_at=0.0,
            engine_latency_s=0.0,
        )  # fmt: skip
        for i, messages in enumerate([[SYSTEM, TASK], [SYSTEM, TASK, {"role": "user", "content": CLAUDE_COMPACT}]])
    ]

    async def main() -> None:
        async with TraceStore(str(tmp_path)) as store:
            for record in sent:
                await store.append(record)

    asyncio.run(main())
    stored = sorted(read_records(str(tmp_path)), key=lambda r: r.seq)
    assert [(r.role, r.role_reason) for r in stored] == [("agent", None), ("auxiliary", "claude-code compaction")]
    for path in (tmp_path / "calls").glob("*.parquet"):
        pq.write_table(pq.read_table(path).drop_columns(["role", "role_reason"]), path)
    assert [r.role for r in read_records(str(tmp_path))] == [None, None]


# ---- the build --------------------------------------------------------------------------------------------------


def build(records, **kw):
    sessions = {sid: SessionInfo(sid, reward=1.0) for sid in {r.session_id for r in records}}
    return build_traces(records, sessions, **kw)


def compacted_session() -> AgentSim:
    """An agent loop, a compaction call on its history, and the loop going on from the summary."""
    sim = AgentSim()
    messages = tool_loop(sim, [SYSTEM, TASK], coding_turns(3)[:2])
    sim.call(messages + [{"role": "user", "content": CLAUDE_COMPACT}], Turn(content="Summary: listed files."), tools=[])
    summary = {
        "role": "user",
        "content": "This session is being continued from a previous conversation that ran out of context. "
        "Summary: listed files.",
    }
    tool_loop(sim, [SYSTEM, summary], coding_turns(2))
    return sim


def test_a_compaction_chain_is_built_but_not_trained_unless_auxiliary_is_named() -> None:
    sim = compacted_session()
    result = build(sim.records)
    by_role = {t.role: t for t in result.traces}
    assert sorted(t.role for t in result.traces) == ["agent", "agent", "auxiliary"]
    side = by_role["auxiliary"]
    assert not side.trainable and side.reward == 1.0 and sum(side.loss_mask) > 0  # its mask stays for inspection
    assert all(t.trainable for t in result.traces if t.role == "agent")
    stats = result.report.total
    assert stats.roles == {"agent": 4, "auxiliary: claude-code compaction": 1}
    assert stats.reward_reasons == {"outcome reward": 2, "auxiliary calls not trained (--roles)": 1}
    with_side = build(sim.records, roles={"agent", "auxiliary"})
    assert all(t.trainable for t in with_side.traces)
    assert with_side.report.total.trainable_tokens == stats.trainable_tokens + sum(side.loss_mask)


def test_an_auxiliary_call_inside_an_agent_chain_keeps_its_context_but_leaves_the_loss() -> None:
    """A harness that continues from its side call's answer: one chain, the side call's tokens masked out."""
    sim = AgentSim()
    first = sim.call([SYSTEM, TASK], Turn(tool_calls=[("bash", {"cmd": "ls"})]))
    messages = [SYSTEM, TASK, sim.sent_back(first), tool_result(first, "a.py"),
                {"role": "user", "content": CLAUDE_COMPACT}]  # fmt: skip
    side = sim.call(messages, Turn(content="Summary: ls showed a.py."))
    last = sim.call(messages + [sim.sent_back(side), {"role": "user", "content": "Go on."}], Turn(content="Done."))
    result = build(sim.records)
    [trace] = result.traces
    assert trace.role == "agent" and trace.trainable and result.report.total.mixed_role_chains == 1
    sampled = [(r, len(r.response_ids)) for r in (first, side, last)]
    masked = sum(trace.loss_mask)
    assert masked == sampled[0][1] + sampled[2][1]
    start = trace.completion_ids.index(side.response_ids[0], len(first.response_ids))
    assert trace.completion_ids[start : start + len(side.response_ids)] == side.response_ids
    assert set(trace.loss_mask[start : start + len(side.response_ids)]) == {0}
    [both] = build(sim.records, roles={"agent", "auxiliary"}).traces
    check_trace(both, {r.record_id: r for r in sim.records})  # every sampled token in the loss again
    assert (both.completion_ids, both.behavior_logprobs) == (trace.completion_ids, trace.behavior_logprobs)
    assert sum(both.loss_mask) == sum(n for _, n in sampled)


def test_failed_and_retried_calls_are_counted_discarded() -> None:
    sim = AgentSim()
    sim.call([SYSTEM, TASK], Turn(content="x"), status="failed")
    sim.call([SYSTEM, TASK], Turn(tool_calls=[("bash", {"cmd": "ls"})]))
    tool_loop(sim, [SYSTEM, TASK], coding_turns(2))
    result = build(sim.records)
    assert result.report.total.roles == {"agent": 2, "discarded: failed": 1, "discarded: retried": 1}
    [trace] = result.traces
    assert trace.calls_merged == 2 and sim.records[1].record_id not in trace.record_ids


def test_the_same_prompt_sent_in_parallel_is_not_a_retry() -> None:
    """Pi summarises a history and a split turn's prefix at once; on vLLM the two prompts were the same tokens."""
    sim = AgentSim()
    first = sim.call([SYSTEM, TASK], Turn(content="a"))
    second = sim.call([SYSTEM, TASK], Turn(content="b"))
    first.started_at, first.finished_at = 10.0, 10.2
    second.started_at, second.finished_at = 10.1, 10.3  # sent before the first was answered
    assert build(sim.records).report.total.roles == {"agent": 2}
    second.started_at = 10.2  # sent once the first answer was made: a retry
    assert build(sim.records).report.total.roles == {"agent": 1, "discarded: retried": 1}


def test_a_retry_under_other_sampling_is_not_a_retry() -> None:
    sim = AgentSim()
    sim.call([SYSTEM, TASK], Turn(content="a"), temperature=0.7)
    sim.call([SYSTEM, TASK], Turn(content="b"))
    assert build(sim.records).report.total.roles == {"agent": 2}


def test_per_request_traces_carry_their_call_role() -> None:
    sim = compacted_session()
    result = build(sim.records, strategy="per_request", broadcast_rewards=True)
    roles = [t.role for t in sorted(result.traces, key=lambda t: t.chain_index)]
    assert roles == ["agent", "agent", "auxiliary", "agent", "agent"]
    assert [t.trainable for t in sorted(result.traces, key=lambda t: t.chain_index)] == [True, True, False, True, True]


def test_nothing_to_train_says_when_only_side_calls_were_captured() -> None:
    sim = AgentSim()
    sim.call([SYSTEM, {"role": "user", "content": CLAUDE_COMPACT}], Turn(content="Summary."), tools=[])
    result = build(sim.records)
    assert [t.trainable for t in result.traces] == [False]
    assert "only auxiliary or discarded calls" in explain_nothing_to_train(result.traces, {})
    assert "--roles agent,auxiliary" in explain_nothing_to_train(result.traces, {})


def test_roles_in_the_cli(tmp_path: Path) -> None:
    from typer.testing import CliRunner

    from polar_cli.app import app

    async def main() -> None:
        async with TraceStore(str(tmp_path / "store")) as store:
            for record in compacted_session().records:
                await store.append(record)
            await store.session_update("s1", status="completed")
            await store.add_reward("s1", 1.0)

    asyncio.run(main())
    store = str(tmp_path / "store")
    runner = CliRunner()
    stats = runner.invoke(app, ["stats", store, "--json"])
    assert stats.exit_code == 0, stats.output
    assert orjson.loads(stats.stdout)["total"]["roles"] == {"agent": 4, "auxiliary: claude-code compaction": 1}
    table = runner.invoke(app, ["stats", store])
    assert "calls by role" in table.stdout and "claude-code compaction 1" in table.stdout
    bad = runner.invoke(app, ["build", store, "-o", str(tmp_path / "out"), "--roles", "agent,titles"])
    assert bad.exit_code != 0 and "unknown role(s) titles" in bad.output
    built = runner.invoke(app, ["build", store, "-o", str(tmp_path / "out"), "--roles", "agent,auxiliary"])
    assert built.exit_code == 0, built.output
    rows = pq.read_table(tmp_path / "out").to_pylist()
    assert sorted((r["role"], r["trainable"]) for r in rows) == [("agent", True), ("agent", True), ("auxiliary", True)]


def test_atif_export_takes_the_agent_chain_as_the_trajectory_and_names_each_role() -> None:
    from polar_cli.export.atif import session_trajectory

    sim = AgentSim()
    sim.call([SYSTEM, TASK], Turn(tool_calls=[("bash", {"cmd": "ls"})]))
    # A longer side conversation (a summariser fed three times) than the one-call agent chain.
    messages = [SYSTEM, {"role": "user", "content": CLAUDE_COMPACT}]
    for i in range(3):
        side = sim.call(messages, Turn(content=f"Summary {i}."), tools=[])
        messages = messages + [sim.sent_back(side), {"role": "user", "content": CLAUDE_COMPACT}]
    sim.call([SYSTEM, TASK], Turn(content="again"))  # retries the first call: left out like the build leaves it
    trajectory = session_trajectory("s1", sim.records, SessionInfo("s1", reward=1.0))
    assert trajectory is not None
    assert trajectory["extra"]["polar"]["role"] == "agent" and trajectory["extra"]["polar"]["calls"] == 1
    [side_trajectory] = trajectory["subagent_trajectories"]
    assert side_trajectory["extra"]["polar"] == {**side_trajectory["extra"]["polar"], "role": "auxiliary", "calls": 3}
    assert trajectory["extra"]["polar"]["calls_unusable"] == {"discarded: retried": 1}


def test_marker_openings_around_whitespace_and_blocks() -> None:
    """The exact openings: a block led by blank lines, a whole-block marker with a trailing newline, a developer
    system message, a Claude Code side job whose own text runs on over more blocks, and no messages at all."""
    page = [SYSTEM, {"role": "user", "content": "\nWeb page content:\n---\n<html/>\n---\n\nSummarise it."}]
    assert role(page) == ("auxiliary", "claude-code web_fetch")
    reminded = [SYSTEM, {"role": "user", "content": "<system-reminder>x</system-reminder>\n\n\n" + CLAUDE_COMPACT}]
    assert role(reminded) == ("auxiliary", "claude-code compaction")
    assert role([{"role": "user", "content": "quota\n"}]) == ("auxiliary", "claude-code quota")
    judge = [{"role": "developer", "content": "You are judging one planned coding-agent action. Verdict?"}, TASK]
    assert role(judge) == ("auxiliary", "codex classifier")
    identity = "You are a Claude agent, built on Anthropic's Claude Agent SDK."
    bash = "Your task is to process Bash commands that an AI coding agent wants to run."
    system = {"role": "system", "content": f"{identity}\n\n\n{bash}\n\n<policy_spec>\n...\n\nCommand: ls"}
    assert role([system, {"role": "user", "content": "Command: ls"}]) == ("auxiliary", "claude-code classifier")
    assert role([]) == ("agent", None)
    loop = (
        "\nYou are a diagnostic agent that determines whether a conversational AI assistant is stuck in an unproductive"
    )
    assert role([{"role": "system", "content": loop + " loop."}, TASK]) == ("auxiliary", "gemini-cli loop_detection")


def test_the_captured_role_wins_and_older_records_get_theirs_from_the_request() -> None:
    sim = AgentSim()
    title = "Generate a concise, sentence-case title (3-7 words) that captures the main topic or goal of this coding"
    tagged = sim.call([SYSTEM, TASK], Turn(content="Fix parse"), tools=[])
    tagged.role, tagged.role_reason = "auxiliary", "claude-code title"  # as the proxy wrote it
    legacy = sim.call([{"role": "system", "content": title + " session."}, TASK], Turn(content="Fix"), tools=[])
    with_tools = sim.call([{"role": "system", "content": title + " session."}, TASK], Turn(content="x"))
    assert (legacy.role, with_tools.role) == (None, None)  # captured before roles
    result = build(sim.records)
    assert result.report.total.roles == {"agent": 1, "auxiliary: claude-code title": 2}
    assert [t.role for t in sorted(result.traces, key=lambda t: t.record_ids[0])] == ["auxiliary", "auxiliary", "agent"]


def test_a_reason_is_counted_by_its_kind() -> None:
    from polar_addon.call_roles import RoleDecision
    from polar_cli.build.roles import role_kind

    assert role_kind(RoleDecision("discarded", "retried: call 3: sent again")) == "discarded: retried"
    assert role_kind(RoleDecision("auxiliary", "claude-code title")) == "auxiliary: claude-code title"
    assert role_kind(RoleDecision("agent", None)) == "agent"


def test_polar_view_names_each_chains_role_and_why_a_side_job_is_not_trained() -> None:
    from polar_cli.build import build_session, detect_eot
    from polar_cli.view import render_session

    sim = compacted_session()
    info = SessionInfo("s1", reward=1.0)
    built = build_session("s1", sim.records, info, eot_token_id=detect_eot(sim.records))
    page = render_session(built, sim.records, info)
    roles = re.findall(r'<section class="chain"[^>]* data-role="(\w+)"', page)
    assert sorted(roles) == ["agent", "agent", "auxiliary"]
    assert "· auxiliary ·" in page and "not trainable (auxiliary calls not trained (--roles))" in page


def test_openai_jsonl_export_writes_the_chains_of_the_roles_asked_for(tmp_path: Path) -> None:
    from typer.testing import CliRunner

    from polar_cli.app import app

    async def main() -> None:
        async with TraceStore(str(tmp_path / "store")) as store:
            for record in compacted_session().records:
                await store.append(record)

    asyncio.run(main())
    runner = CliRunner()
    lines = {}
    for roles in ("agent,auxiliary", "agent"):
        out = tmp_path / f"{roles}.jsonl"
        done = runner.invoke(app, ["export", str(tmp_path / "store"), "--format", "openai-jsonl", "-o", str(out),
                                   "--roles", roles])  # fmt: skip
        assert done.exit_code == 0, done.output
        lines[roles] = [orjson.loads(line) for line in out.read_bytes().splitlines()]
    assert len(lines["agent,auxiliary"]) == 3 and len(lines["agent"]) == 2
    summary = [e for e in lines["agent,auxiliary"] if e not in lines["agent"]]
    assert [m["content"] for m in summary[0]["messages"] if m["role"] == "user"][-1] == CLAUDE_COMPACT
    bad = runner.invoke(app, ["export", str(tmp_path / "store"), "--format", "openai-jsonl", "-o",
                              str(tmp_path / "x.jsonl"), "--roles", "titles"])  # fmt: skip
    assert bad.exit_code != 0 and "unknown role(s) titles" in bad.output
