"""`polar export`: ATIF trajectories checked against Harbor's own pydantic models (vendored in
tests/support/harbor_atif from harbor 0.26.0), and OpenAI chat JSONL checked against the openai SDK's types."""

from __future__ import annotations

import asyncio
from pathlib import Path

import orjson
import pytest
from build_helpers import AgentSim, Turn, coding_turns, tool_loop
from openai.types.chat import ChatCompletionMessageParam, ChatCompletionToolParam
from pydantic import TypeAdapter
from typer.testing import CliRunner

from polar_addon.capture import CaptureRecord, Identity
from polar_addon.engines import EnginePool
from polar_addon.engines.scripted import ScriptedEngine
from polar_addon.gateway import FullReply, Gateway, IncomingCall
from polar_addon.store import TraceStore, read_records
from polar_cli.app import app
from polar_cli.export import ATIF_VERSION, chain_example, session_trajectory
from polar_cli.export.atif import chain_steps, trajectory_file_name
from tests.support.atif import check_atif_export
from tests.support.harbor_atif import Trajectory

SYSTEM = {"role": "system", "content": "You are a coding agent."}
runner = CliRunner()
MESSAGES = TypeAdapter(list[ChatCompletionMessageParam])
TOOLS = TypeAdapter(list[ChatCompletionToolParam])


def _tool_session() -> tuple[AgentSim, list[dict]]:
    """A multi-turn tool loop with reasoning, one turn calling two tools at once, then a second user turn."""
    sim = AgentSim("tools", harness="claude-cli/2.1.197 (external, cli)")
    turns = coding_turns(3, reasoning=True)
    turns.insert(1, Turn(content="Both at once.", tool_calls=[("bash", {"cmd": "ls"}), ("read_file", {"path": "a"})]))
    messages = tool_loop(sim, [SYSTEM, {"role": "user", "content": "fix the bug"}], turns)
    messages = tool_loop(sim, messages + [{"role": "user", "content": "and the docs"}], coding_turns(2))
    return sim, messages  # the final answer included (tool_loop sends every turn back)


def _side_session() -> AgentSim:
    """A resumed conversation (its history holds an assistant turn no call sampled) plus a title call: two chains."""
    sim = AgentSim("side/1", harness="codex_exec/0.171.0")
    history = [SYSTEM, {"role": "user", "content": "hi"}, {"role": "assistant", "content": "Hello."}]
    tool_loop(sim, history + [{"role": "user", "content": "list files"}], coding_turns(3))
    sim.call([{"role": "user", "content": "Title for: list files"}], Turn(content="Listing files"), tools=[])
    return sim


@pytest.fixture(scope="module")
def store(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[dict]]:
    root = tmp_path_factory.mktemp("store")
    tools, conversation = _tool_session()
    failed = AgentSim("failed")
    failed.call([{"role": "user", "content": "x"}], Turn(content="x"), status="failed")

    async def write() -> None:
        async with TraceStore(str(root), shard_max_records=4) as trace_store:
            for sim in (tools, _side_session(), failed):
                for record in sim.records:
                    await trace_store.append(record)
            await trace_store.session_update(
                "tools", status="completed", task_id="t0", group_id="g0", sample_index=3, harness="claude-code"
            )
            await trace_store.add_reward("tools", 1.0)

    asyncio.run(write())
    return root, conversation


def _export(root: Path, out: Path, fmt: str, *extra: str) -> str:
    result = runner.invoke(app, ["export", str(root), "--format", fmt, "--out", str(out), *extra])
    assert result.exit_code == 0, result.output
    return result.output


def _atif(root: Path, tmp_path: Path) -> dict[str, dict]:
    out = tmp_path / "atif"
    assert "2 ATIF trajectories" in _export(root, out, "atif")
    assert "1 sessions without a usable call" in _export(root, out, "atif", "--overwrite")
    return {p.name: orjson.loads(p.read_bytes()) for p in sorted(out.iterdir())}


def test_every_trajectory_validates_against_harbors_models(store, tmp_path: Path) -> None:
    root, _ = store
    files = _atif(root, tmp_path)
    assert set(files) == {"tools.json", trajectory_file_name("side/1")}
    for data in files.values():
        model = Trajectory.model_validate(data)
        assert model.schema_version == ATIF_VERSION
        # Harbor's own serialization gives back exactly what polar wrote: no field it does not know, none lost.
        assert model.to_json_dict() == data
        for sub in model.subagent_trajectories or []:
            assert sub.to_json_dict() == Trajectory.model_validate(sub.to_json_dict()).to_json_dict()


def test_a_tool_session_round_trips_in_order_with_its_tokens(store, tmp_path: Path) -> None:
    root, conversation = store
    data = _atif(root, tmp_path)["tools.json"]
    records = [r for r in read_records(str(root)) if r.session_id == "tools"]
    assert data["session_id"] == "tools" and "subagent_trajectories" not in data
    # The preset names the agent; the version is the client's own, from its User-Agent.
    assert data["agent"]["name"] == "claude-code" and data["agent"]["version"] == "2.1.197"
    assert data["agent"]["model_name"] == "tiny"
    assert data["agent"]["tool_definitions"] == records[-1].tools
    assert data["final_metrics"]["extra"] == {"reward": 1.0, "status": "completed"}
    assert (data["extra"]["task_id"], data["extra"]["group_id"], data["extra"]["sample_index"]) == ("t0", "g0", 3)
    assert data["final_metrics"]["total_completion_tokens"] == sum(len(r.response_ids) for r in records)

    steps = data["steps"]
    assert [s["step_id"] for s in steps] == list(range(1, len(steps) + 1))
    agent = [s for s in steps if s["source"] == "agent"]
    assert len(agent) == len(records)  # one agent step per call, in seq order, none copied
    for step, record in zip(agent, records):
        sampled = record.response_message
        assert step["extra"]["record_id"] == record.record_id and "is_copied_context" not in step
        assert step["metrics"]["prompt_token_ids"] == record.prompt_ids
        assert step["metrics"]["completion_token_ids"] == record.response_ids
        assert step["metrics"]["logprobs"] == record.logprobs
        assert step["message"] == (sampled["content"] or "")
        assert step.get("reasoning_content") == sampled["reasoning"]
        calls = [(c["tool_call_id"], c["function_name"], c["arguments"]) for c in step.get("tool_calls", [])]
        assert calls == [(c["id"], c["name"], orjson.loads(c["arguments"])) for c in sampled["tool_calls"]]
        results = [(r["source_call_id"], r["content"]) for r in step.get("observation", {}).get("results", [])]
        assert results == [(c["id"], f"output of {c['name']} #{record.seq}") for c in sampled["tool_calls"]]
    # The harness's messages, in the order it sent them: every user and system message a step of its own.
    said = [(s["source"], s["message"]) for s in steps if s["source"] != "agent"]
    assert said == [("system", SYSTEM["content"]), ("user", "fix the bug"), ("user", "and the docs")]
    assert [s["source"] for s in steps].index("user") < [s["source"] for s in steps].index("agent")
    assert sum(m["role"] == "assistant" for m in conversation) == len(agent)


def test_history_no_call_sampled_is_copied_context_and_side_chains_are_embedded(store, tmp_path: Path) -> None:
    root, _ = store
    data = _atif(root, tmp_path)[trajectory_file_name("side/1")]
    assert data["session_id"] == "side/1" and data["agent"]["name"] == "codex_exec"
    assert data["final_metrics"]["extra"] == {"reward": None, "status": "completed"}  # no status reported: completed
    copied = [s for s in data["steps"] if s.get("is_copied_context")]
    assert [(s["source"], s["message"], "metrics" in s) for s in copied] == [("agent", "Hello.", False)]
    assert data["extra"]["polar"]["chains"] == 2
    (title,) = data["subagent_trajectories"]
    assert title["trajectory_id"] != data["trajectory_id"]
    assert [(s["source"], s["message"]) for s in title["steps"]] == [
        ("user", "Title for: list files"),
        ("agent", "Listing files"),
    ]
    assert "tool_definitions" not in title["agent"]


def test_arguments_that_are_no_json_object_keep_their_text() -> None:
    record = CaptureRecord(
        record_id="r0",
        session_id="s",
        seq=0,
        api="openai_chat",
        status="ok",
        prompt_ids=[1, 2],
        response_ids=[3],
        logprobs=[-0.5],
        messages_json=orjson.dumps([{"role": "user", "content": "go"}]).decode(),
        response_json=orjson.dumps(
            {"content": None, "reasoning": None, "tool_calls": [{"id": "c1", "name": "bash", "arguments": '{"cmd": '}]}
        ).decode(),
    )
    steps = chain_steps([record])
    assert steps[1]["tool_calls"] == [
        {"tool_call_id": "c1", "function_name": "bash", "arguments": {}, "extra": {"arguments_text": '{"cmd": '}}
    ]
    trajectory = session_trajectory("s", [record])
    assert trajectory is not None and Trajectory.model_validate(trajectory).steps[1].message == ""
    record.logprobs = [float("nan")]
    bad = session_trajectory("s", [record])
    assert bad is not None and "logprobs" not in bad["steps"][1]["metrics"]
    assert "not finite" in bad["steps"][1]["metrics"]["extra"]["logprobs_missing"]
    Trajectory.model_validate(orjson.loads(orjson.dumps(bad)))


def test_openai_jsonl_is_the_sampled_conversation_in_the_sdks_types(store, tmp_path: Path) -> None:
    root, conversation = store
    out = tmp_path / "sft" / "train.jsonl"
    assert "3 chat examples" in _export(root, out, "openai-jsonl")
    lines = [orjson.loads(line) for line in out.read_bytes().splitlines()]
    for line in lines:
        assert set(line) == {"messages", "tools"}
        MESSAGES.validate_python(line["messages"])
        TOOLS.validate_python(line["tools"])
    side, title, tools = lines  # sessions in id order ("side/1" < "tools"), chains in order
    assert tools["messages"] == conversation  # every sampled turn as sampled, reasoning included
    assert any("reasoning_content" in m for m in tools["messages"])
    assert title == {
        "messages": [
            {"role": "user", "content": "Title for: list files"},
            {"role": "assistant", "content": "Listing files"},
        ],
        "tools": [],
    }
    assert side["messages"][2] == {"role": "assistant", "content": "Hello."}


def test_export_refuses_an_unknown_format_and_an_existing_out(store, tmp_path: Path) -> None:
    root, _ = store
    result = runner.invoke(app, ["export", str(root), "--format", "parquet", "--out", str(tmp_path / "x")])
    assert result.exit_code == 2 and "Invalid value for --format: use one of atif, openai-jsonl" in result.output
    out = tmp_path / "one.jsonl"
    out.write_text("keep\n")
    result = runner.invoke(app, ["export", str(root), "--format", "openai-jsonl", "--out", str(out)])
    assert result.exit_code == 2 and "--overwrite" in result.output and out.read_text() == "keep\n"
    _export(root, out, "openai-jsonl", "--overwrite", "--session", "tools")
    assert len(out.read_bytes().splitlines()) == 1


# --- every API dialect, through the real gateway (real providers, the scripted engine, a real TraceStore) ---

LS = {
    "name": "ls",
    "description": "List files.",
    "parameters": {"type": "object", "properties": {"path": {"type": "string"}}},
}


def _call(path: str, session: str, agent: str, payload: dict) -> IncomingCall:
    return IncomingCall(
        method="POST",
        path=path,
        headers={"user-agent": agent},
        body=orjson.dumps(payload),
        identity=Identity(session_id=session, source="header"),
    )


async def _answer(gateway: Gateway, call: IncomingCall) -> dict:
    reply = await gateway.handle(call)
    assert isinstance(reply, FullReply) and reply.status == 200, reply.body
    return orjson.loads(reply.body)


async def _openai_chat(gateway: Gateway) -> None:
    body = {"model": "tiny", "tools": [{"type": "function", "function": LS}]}
    messages: list[dict] = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is here?"}]
    first = await _answer(
        gateway, _call("/v1/chat/completions", "d-chat", "opencode/1.2.3", {**body, "messages": messages})
    )
    message = first["choices"][0]["message"]
    messages += [message, {"role": "tool", "tool_call_id": message["tool_calls"][0]["id"], "content": "a.txt"}]
    await _answer(gateway, _call("/v1/chat/completions", "d-chat", "opencode/1.2.3", {**body, "messages": messages}))


async def _anthropic(gateway: Gateway) -> None:
    tool = {"name": LS["name"], "description": LS["description"], "input_schema": LS["parameters"]}
    body = {"model": "tiny", "max_tokens": 64, "system": "Be brief.", "tools": [tool]}
    messages: list[dict] = [{"role": "user", "content": "What is here?"}]
    path, agent = "/v1/messages?beta=true", "claude-cli/2.1.197 (external, cli)"
    first = await _answer(gateway, _call(path, "d-anthropic", agent, {**body, "messages": messages}))
    use = next(b for b in first["content"] if b["type"] == "tool_use")
    messages += [
        {"role": "assistant", "content": first["content"]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use["id"], "content": "a.txt"}]},
    ]
    await _answer(gateway, _call(path, "d-anthropic", agent, {**body, "messages": messages}))


async def _responses(gateway: Gateway) -> None:
    body = {"model": "tiny", "instructions": "Be brief.", "tools": [{"type": "function", **LS}], "store": False}
    items: list[dict] = [{"role": "user", "content": "What is here?"}]
    first = await _answer(
        gateway, _call("/v1/responses", "d-responses", "codex_exec/0.171.0", {**body, "input": items})
    )
    call = next(o for o in first["output"] if o["type"] == "function_call")
    items += [*first["output"], {"type": "function_call_output", "call_id": call["call_id"], "output": "a.txt"}]
    await _answer(gateway, _call("/v1/responses", "d-responses", "codex_exec/0.171.0", {**body, "input": items}))


async def _gemini(gateway: Gateway) -> None:
    body = {"systemInstruction": {"parts": [{"text": "Be brief."}]}, "tools": [{"functionDeclarations": [LS]}]}
    contents: list[dict] = [{"role": "user", "parts": [{"text": "What is here?"}]}]
    path, agent = "/v1beta/models/tiny:generateContent", "GeminiCLI/0.30.0 (linux; x64)"
    first = await _answer(gateway, _call(path, "d-gemini", agent, {**body, "contents": contents}))
    content = first["candidates"][0]["content"]
    called = next(p["functionCall"] for p in content["parts"] if "functionCall" in p)
    response = {"functionResponse": {"name": called["name"], "response": {"output": "a.txt"}}}
    contents += [content, {"role": "user", "parts": [response]}]
    await _answer(gateway, _call(path, "d-gemini", agent, {**body, "contents": contents}))


DIALECTS = {"d-chat": _openai_chat, "d-anthropic": _anthropic, "d-responses": _responses, "d-gemini": _gemini}


def test_every_api_dialects_sessions_validate_and_pair_each_call_with_its_result(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    script = tmp_path / "script.json"
    turns = [
        {
            "content": "Let me look.",
            "tool_calls": [{"type": "function", "function": {"name": "ls", "arguments": '{"path": "."}'}}],
        },
        {"content": "There is one file."},
    ]
    script.write_bytes(orjson.dumps({"model_dir": str(tiny_model_dir), "cycle": True, "turns": turns}))
    root = tmp_path / "store"

    async def main() -> None:
        gateway = Gateway(EnginePool([ScriptedEngine(str(script))]), TraceStore(str(root)))
        for run in DIALECTS.values():
            await run(gateway)
        await gateway.close()

    asyncio.run(main())
    records = read_records(str(root))
    assert set(check_atif_export(str(root))) == set(DIALECTS)
    assert sorted({r.api for r in records}) == ["anthropic_messages", "gemini", "openai_chat", "openai_responses"]
    for session_id in DIALECTS:
        calls = [r for r in records if r.session_id == session_id]
        assert [r.status for r in calls] == ["ok", "ok"], session_id
        data = orjson.loads(orjson.dumps(session_trajectory(session_id, calls)))
        model = Trajectory.model_validate(data)
        assert model.to_json_dict() == data
        assert [(s.source, s.message) for s in model.steps] == [
            ("system", "Be brief."),
            ("user", "What is here?"),
            ("agent", "Let me look."),
            ("agent", "There is one file."),
        ], session_id
        look = model.steps[2]
        assert [(c.function_name, c.arguments) for c in look.tool_calls] == [("ls", {"path": "."})]
        assert look.observation is not None
        # Gemini's functionResponse is an object: its canonical tool result is that object's JSON text.
        result = '{"output":"a.txt"}' if session_id == "d-gemini" else "a.txt"
        assert [(r.source_call_id, r.content) for r in look.observation.results] == [
            (look.tool_calls[0].tool_call_id, result)
        ]
        # The id the harness saw and answered (Anthropic's wire id is toolu_ + the engine's), not the engine's own.
        assert look.tool_calls[0].tool_call_id == calls[1].messages[2]["tool_calls"][0]["id"]
        assert [s.metrics.completion_token_ids for s in model.steps[2:]] == [r.response_ids for r in calls]
        messages = chain_example(calls)["messages"]
        MESSAGES.validate_python(messages)
        assert messages[2]["tool_calls"][0]["id"] == messages[3]["tool_call_id"]
