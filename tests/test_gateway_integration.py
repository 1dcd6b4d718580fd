"""The capture gateway end to end: a real mitmdump with the polar addon, the official SDKs as clients.

Regular mode (HTTPS_PROXY + mitmproxy's CA, session in the proxy credentials) and reverse mode
(base URL at mitmdump), streaming and not, with tools. The engine is the in-process ``local``
engine on the tiny model (greedy, so a streamed call and a plain call yield the same message).
"""

from __future__ import annotations

import json
import ssl

import anthropic
import httpx
import openai
import pytest
from openai.lib.streaming.chat import ChatCompletionStreamState
from transformers import AutoTokenizer

from polar_addon.store import read_records, read_sessions
from polar_addon.store.validate import validate_store
from tests.support.proxy import run_mitmdump
from tests.support.shards import wait_for_shards

TOOLS_OAI = [
    {
        "type": "function",
        "function": {
            "name": "add",
            "description": "Add two integers.",
            "parameters": {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}},
        },
    }
]
TOOLS_ANT = [
    {
        "name": "add",
        "description": "Add two integers.",
        "input_schema": {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}},
    }
]


@pytest.fixture(scope="module")
def proxy(tiny_model_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("gw") / "shards"
    with run_mitmdump(
        f"local:{tiny_model_dir}", out, options={"polar_shard_seconds": "0.2", "polar_keepalive": "1"}
    ) as p:
        yield p
    # Whatever the tests did (bad input included), the shards they leave are valid.
    assert validate_store(str(out)) == []


def oai(proxy, session: str) -> openai.OpenAI:
    http = httpx.Client(
        proxy=proxy.proxy_url(session), verify=ssl.create_default_context(cafile=str(proxy.ca)), timeout=120
    )
    return openai.OpenAI(api_key="sk-not-a-real-key", http_client=http, max_retries=0)


def ant(proxy, session: str) -> anthropic.Anthropic:
    http = httpx.Client(
        proxy=proxy.proxy_url(session), verify=ssl.create_default_context(cafile=str(proxy.ca)), timeout=120
    )
    return anthropic.Anthropic(api_key="sk-ant-not-real", http_client=http, max_retries=0)


def test_openai_stream_and_plain_agree(proxy):
    client = oai(proxy, "oai-1")
    kwargs = dict(
        model="tiny",
        messages=[{"role": "system", "content": "be brief"}, {"role": "user", "content": "add 2 and 3"}],
        tools=TOOLS_OAI,
        max_tokens=12,
        temperature=0,
    )
    plain = client.chat.completions.create(**kwargs)
    state = ChatCompletionStreamState()
    for chunk in client.chat.completions.create(**kwargs, stream=True, stream_options={"include_usage": True}):
        state.handle_chunk(chunk)
    final = state.current_completion_snapshot
    assert plain.choices[0].message.content == final.choices[0].message.content
    assert plain.choices[0].finish_reason == final.choices[0].finish_reason
    # Both against what the engine produced (the records), not just against each other.
    wait_for_shards(proxy.out)
    records = read_records(str(proxy.out), ["oai-1"])
    assert len(records) == 2 and records[0].response_ids == records[1].response_ids  # greedy
    for answer in (plain, final):
        assert answer.usage.prompt_tokens == len(records[0].prompt_ids)
        assert answer.usage.completion_tokens == len(records[0].response_ids)
        assert answer.choices[0].message.content == (records[0].response_message["content"] or "")
        assert answer.choices[0].finish_reason == records[0].finish_reason


def test_anthropic_stream_and_plain_agree(proxy):
    client = ant(proxy, "ant-1")
    kwargs = dict(
        model="tiny",
        max_tokens=12,
        temperature=0,
        system="x-anthropic-billing-header: cc_version=1; cch=abc\nbe brief",
        tools=TOOLS_ANT,
        messages=[{"role": "user", "content": "add 2 and 3"}],
    )
    plain = client.messages.create(**kwargs)
    with client.messages.stream(**kwargs) as stream:
        final = stream.get_final_message()
    assert [b.model_dump(exclude={"parsed_output"}) for b in plain.content] == [
        b.model_dump(exclude={"parsed_output"}) for b in final.content
    ]
    assert plain.stop_reason == final.stop_reason
    wait_for_shards(proxy.out)
    records = read_records(str(proxy.out), ["ant-1"])
    assert len(records) == 2 and records[0].response_ids == records[1].response_ids  # greedy
    text = records[0].response_message["content"] or ""
    for answer in (plain, final):
        assert answer.usage.input_tokens == len(records[0].prompt_ids)
        assert answer.usage.output_tokens == len(records[0].response_ids)
        assert "".join(b.text for b in answer.content if b.type == "text") == text
        assert answer.stop_reason == {"stop": "end_turn", "length": "max_tokens"}[records[0].finish_reason]
    count = client.messages.count_tokens(
        model="tiny", system="be brief", tools=TOOLS_ANT, messages=[{"role": "user", "content": "add 2 and 3"}]
    )
    assert count.input_tokens == plain.usage.input_tokens


def test_reverse_mode_with_base_url(tiny_model_dir, tmp_path):
    out = tmp_path / "shards"
    with run_mitmdump(f"local:{tiny_model_dir}", out, mode="reverse:https://api.anthropic.com") as p:
        client = anthropic.Anthropic(
            base_url=p.url, api_key="polar:session=rev-1;task=t1;group=g1;sample=2", max_retries=0
        )
        msg = client.messages.create(model="tiny", max_tokens=8, messages=[{"role": "user", "content": "hi"}])
        assert msg.usage.output_tokens > 0
        oclient = openai.OpenAI(base_url=p.url + "/v1", api_key="polar:rev-2", max_retries=0)
        chunks = list(
            oclient.chat.completions.create(
                model="tiny", max_tokens=8, stream=True, messages=[{"role": "user", "content": "hi"}]
            )
        )
        assert chunks[-1].choices[0].finish_reason in {"stop", "length"}
    assert validate_store(str(out)) == []
    records = read_records(str(out))
    by_session = {r.session_id: r for r in records}
    assert set(by_session) == {"rev-1", "rev-2"}
    r = by_session["rev-1"]
    assert (r.task_id, r.group_id, r.sample_index, r.api) == ("t1", "g1", 2, "anthropic_messages")


def test_records_are_token_exact_and_secret_free(proxy, tiny_model_dir):
    client = oai(proxy, "exact-1")
    messages = [
        {"role": "system", "content": "sys"},
        {"role": "developer", "content": "dev"},
        {"role": "user", "content": "hello there"},
    ]
    resp = client.chat.completions.create(
        model="tiny", messages=messages, tools=TOOLS_OAI, max_tokens=10, temperature=0.7, seed=1
    )
    wait_for_shards(proxy.out)
    records = [r for r in read_records(str(proxy.out)) if r.session_id == "exact-1"]
    assert len(records) == 1
    rec = records[0]
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    expected = tok.apply_chat_template(
        [{"role": "system", "content": "sys\n\ndev"}, {"role": "user", "content": "hello there"}],
        tools=TOOLS_OAI,
        add_generation_prompt=True,
        tokenize=True,
        return_dict=False,
    )
    assert rec.prompt_ids == list(expected)
    assert len(rec.response_ids) == len(rec.logprobs) == resp.usage.completion_tokens
    assert all(lp <= 0 for lp in rec.logprobs)
    assert rec.temperature == pytest.approx(0.7) and rec.max_tokens == 10 and rec.status == "ok"
    assert rec.harness and rec.harness.startswith("OpenAI/Python")
    dumped = json.dumps(rec.to_dict())
    assert "sk-not-a-real-key" not in dumped


def test_bad_input_gets_provider_shaped_errors_and_is_recorded(proxy):
    with pytest.raises(anthropic.BadRequestError) as ant_err:
        ant(proxy, "bad-1").messages.create(
            model="tiny", max_tokens=5, messages=[{"role": "user", "content": [{"type": "nonsense"}]}]
        )
    assert ant_err.value.body["type"] == "error" and ant_err.value.body["error"]["type"] == "invalid_request_error"
    http = httpx.Client(proxy=proxy.proxy_url("bad-2"), verify=ssl.create_default_context(cafile=str(proxy.ca)))
    r = http.post(
        "https://api.openai.com/v1/chat/completions", content=b"{not json", headers={"content-type": "application/json"}
    )
    assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error"
    # The proxy keeps serving after bad input.
    ok = oai(proxy, "bad-2").chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=3
    )
    assert ok.choices[0].finish_reason in {"stop", "length"}
    wait_for_shards(proxy.out)
    records = [r for r in read_records(str(proxy.out)) if r.session_id in {"bad-1", "bad-2"}]
    failed = [r for r in records if r.status == "failed"]
    assert len(failed) == 2 and all(r.prompt_ids == [] and r.error for r in failed)
    assert sorted(r.seq for r in records if r.session_id == "bad-2") == [0, 1]


def test_claude_code_side_calls_are_answered_locally(proxy):
    http = httpx.Client(proxy=proxy.proxy_url("cc"), verify=ssl.create_default_context(cafile=str(proxy.ca)))
    r = http.get("https://api.anthropic.com/api/claude_code/policy_limits")
    assert r.status_code == 200 and "restrictions" in r.json()
    assert http.get("https://api.anthropic.com/api/claude_code/settings").status_code == 200


def test_sessions_table_and_reward_endpoint(proxy):
    oai(proxy, "rw-1").chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=3)
    verifier = httpx.Client(proxy=proxy.url, headers=proxy.control_headers())
    r = verifier.post("http://polar.local/sessions/rw-1/reward", json={"value": 0.75})
    assert r.status_code == 200, r.text
    assert verifier.post("http://polar.local/sessions/rw-1/status", json={"status": "completed"}).status_code == 200
    assert verifier.post("http://polar.local/sessions/rw-1/reward", json={"valu": 1}).status_code == 400
    wait_for_shards(proxy.out)
    sessions = {s.session_id: s for s in read_sessions(str(proxy.out))}
    assert sessions["rw-1"].rewards.get("reward") == 0.75
    assert sessions["rw-1"].status == "completed"
