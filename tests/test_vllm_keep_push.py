"""New weights pushed into a running vLLM while requests are in flight (``reload_vllm_in_place(keep=True)``, what
``polar loop --async --drain keep`` does): no request is lost, and every sampled token is labelled with the version
that sampled it and carries that version's logprob. Checked against plain transformers forward passes of both
models: the tokens the engine labels version 0 have the starting model's logprobs, those it labels 1 the
checkpoint's (the running requests are recomputed on the new weights, never sampled on KV of the old ones), so a
label off by one token fails. The model is the tiny one, untied (vLLM reloads only those in place)."""

from __future__ import annotations

import asyncio
import os
import time
from pathlib import Path

import httpx
import pytest
import torch

from polar_addon.canonical import CanonicalRequest, ContextLengthExceeded, SamplingParams, VersionSpan
from polar_addon.engines import make_engine
from polar_cli.serving import label_version, load_state, reload_engine, serve_vllm, stop_engine
from polar_cli.tiny_model import untie_embeddings
from tests.conftest import free_port
from tests.test_vllm_inplace_push import REPO, _perturbed

PROMPT = [1, 17, 250, 31, 9, 77, 402, 5, 66, 12, 300, 41]
# The agent of the keep loop test: one call per session, except in batch 1, whose sessions call the model until
# the engine log records the push, so the push lands while their calls run: long calls (seconds each), so that the
# pause, which comes a moment after the trainer publishes, finds them mid-answer rather than between calls.
KEEP_AGENT = """
import os, sys
from pathlib import Path
from openai import OpenAI

engines = Path(sys.argv[1])
client = OpenAI(max_retries=0, timeout=600)
pushed = lambda: any("requests kept" in p.read_text() for p in engines.glob("engine-*.log"))
# The session's identity (its group of batch 1 is "b001-...") travels in the harness's API key.
keep_going = any("b001-" in value for value in os.environ.values()) and not pushed()
for _ in range(400):
    client.chat.completions.create(
        model="policy", messages=[{"role": "user", "content": "count"}], max_tokens=1500, temperature=1.0
    )
    if not keep_going or pushed():
        break
Path("answer.txt").write_text("done")
"""


def _reference(model: Path, prompt: list[int], response: list[int]) -> list[float]:
    from transformers import AutoModelForCausalLM

    net = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32).eval()
    ids = prompt + response
    with torch.inference_mode():
        logits = net(input_ids=torch.tensor([ids])).logits[0]
    logprobs = torch.log_softmax(logits[len(prompt) - 1 : -1], dim=-1)
    return logprobs.gather(1, torch.tensor(response)[:, None])[:, 0].tolist()


@pytest.mark.vllm
def test_a_push_under_load_loses_no_call_and_labels_every_token_with_the_version_that_sampled_it(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    if not (REPO / ".venv-vllm" / "bin" / "python").exists():
        from tests.support.prereq import missing

        missing("vLLM CPU venv missing (.venv-vllm); run `make engine`")
    base = untie_embeddings(tiny_model_dir, tmp_path / "base")
    ckpt = _perturbed(base, tmp_path / "ckpt")
    state = tmp_path / "engines"
    server = serve_vllm(
        str(base), port=free_port(), served_model_name="policy", state_dir=state, push="in-place",
        # A budget that recomputes a running request whole after a push: vLLM 0.32's CPU backend dies on a seeded
        # request whose recompute is chunked ("CPU Generator does not use offset", _bookkeeping_sync).
        extra_args=["--enforce-eager", "--dtype=float32", "--max-model-len=2048", "--max-num-batched-tokens=4096",
                    "--max-num-seqs=1"],  # fmt: skip
    )  # fmt: skip
    try:
        assert "--enable-scale-out" in server.command
        label_version(server.url, "0")

        # What each version's weights are: the pushes alternate between the checkpoint and the starting model.
        models = {"0": base, "1": ckpt, "2": base, "3": ckpt}

        async def run() -> tuple[list, list[float]]:
            engine = make_engine(f"vllm:{server.url}?weight_version=0&versions=spans", timeout_s=300)
            calls = [
                CanonicalRequest(
                    api="openai_chat",
                    model="policy",
                    messages=[],
                    sampling=SamplingParams(temperature=1.0, max_tokens=700, seed=seed),
                )  # fmt: skip
                for seed in range(6)
            ]
            completions: list = []
            pushes: list[float] = []
            # The push must land while a request decodes. vLLM's API server hands out tokens behind its engine by a
            # varying lag (measured on the 2-core VM: the engine done with 700 tokens each while the clients had 40),
            # so the engine decodes one request at a time (--max-num-seqs 1) and the push follows the first answer:
            # the next request is decoding then and the others wait. A round whose push still found nothing running
            # is followed by another (up to three), every round's labels checked all the same.
            for version in ("1", "2", "3"):
                running = [asyncio.create_task(engine.complete_tokens(c, PROMPT)) for c in calls]
                await asyncio.wait(running, return_when=asyncio.FIRST_COMPLETED)
                started = time.monotonic()
                line = await asyncio.to_thread(
                    reload_engine, server.spec, models[version], state_dir=state, weight_version=version, keep=True
                )
                pushes.append(time.monotonic() - started)
                assert "in place" in line, line
                done = await asyncio.gather(*running)
                completions += done
                if any(len(c.weight_versions or []) == 2 for c in done):
                    break
            after = await engine.complete_tokens(calls[0], PROMPT)  # a call that starts after the push
            # Past the window, on both paths: the refusal the harness gets carries the prompt's real length.
            too_long = [1] + [17] * 2100
            with pytest.raises(ContextLengthExceeded) as tokens_err:
                await engine.complete_tokens(calls[0], too_long)
            chat = CanonicalRequest(
                api="openai_chat", model="policy", messages=[{"role": "user", "content": "hello " * 2100}],
                sampling=SamplingParams(max_tokens=8),
            )  # fmt: skip
            with pytest.raises(ContextLengthExceeded) as chat_err:
                await engine.complete(chat)
            assert tokens_err.value.prompt_tokens == len(too_long) and (chat_err.value.prompt_tokens or 0) > 2048
            assert tokens_err.value.window == 2048, tokens_err.value.message
            await engine.close()
            return [*completions, after], pushes

        completions, pushes = asyncio.run(run())
        last = str(len(pushes))
        print(f"pushes under load: {[f'{p:.2f} s' for p in pushes]}; spans {[c.weight_versions for c in completions]}")
        assert max(pushes) < 30, pushes
        mixed = [c for c in completions if c.weight_versions and len(c.weight_versions) == 2]
        assert mixed, "no request was running when the weights were pushed, in three rounds"
        assert completions[-1].weight_versions == [VersionSpan(last, 0, len(completions[-1].response_ids))]
        compared = {base: 0, ckpt: 0}
        for c in completions:
            assert c.finish_reason in ("length", "stop") and c.response_ids, c.finish_reason
            versions = [s.version for s in c.weight_versions or []]
            assert len(versions) in (1, 2) and [int(v) for v in versions] == list(
                range(int(versions[0]), int(versions[0]) + len(versions))
            ), versions  # one version, or two consecutive ones
            assert c.weight_version == c.weight_versions[0].version  # the oldest: what the staleness bound reads
            references = {m: _reference(m, PROMPT, c.response_ids) for m in (base, ckpt)}
            for span in c.weight_versions or []:
                model = models[span.version]
                got = c.logprobs[span.start : span.end]
                want = references[model][span.start : span.end]
                other = references[ckpt if model == base else base][span.start : span.end]
                assert max(abs(a - b) for a, b in zip(got, want, strict=True)) < 1e-3, (span, c.weight_versions)
                assert max(abs(a - b) for a, b in zip(got, other, strict=True)) > 1e-2  # the versions differ
                compared[model] += span.end - span.start
        assert compared[base] >= 30 and compared[ckpt] >= 100, compared  # tokens checked against each model
        managed = load_state(state, server.port)
        assert managed.weight_version == last and managed.model == str(models[last].resolve())
        assert httpx.get(f"{server.url}/health", timeout=10).status_code == 200  # resumed, serving
    finally:
        stop_engine(server.url, state_dir=state)


@pytest.mark.vllm
def test_an_async_loop_with_drain_keep_pushes_under_the_running_batch_and_labels_every_token(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    """`polar loop --async --drain keep --engine vllm`: the checkpoint lands in the running vLLM while a batch's
    sessions are sampling, no session of that batch is lost, its calls' tokens carry the version that sampled them
    (checked against both models token by token: calls before, after and, when the pause finds one mid-answer,
    across the push), the batch reports how much of it was sampled across the push, and the last batch is the last
    version's alone. The agent of batch 1 keeps calling the model until the engine's log
    says the push happened (so a push under the batch is certain, whatever the machine's speed); the other batches'
    agents make one call."""
    if not (REPO / ".venv-vllm" / "bin" / "python").exists():
        from tests.support.prereq import missing

        missing("vLLM CPU venv missing (.venv-vllm); run `make engine`")
    import json
    import subprocess
    import sys

    import orjson

    from polar_addon.store.reader import read_records

    model = untie_embeddings(tiny_model_dir, tmp_path / "untied")
    tasks = tmp_path / "tasks.jsonl"
    task = {"id": "t0", "instruction": "count", "reward_file": "reward.txt",
            "verify": "python3 -c 'import random; print(random.random())' > reward.txt"}  # fmt: skip
    tasks.write_text(json.dumps(task) + "\n")
    out = tmp_path / "loop"
    agent = tmp_path / "keep_agent.py"
    agent.write_text(KEEP_AGENT)
    cmd = [sys.executable, "-m", "polar_cli.app", "loop", str(tasks), "--harness",
           f"cmd:{sys.executable} {agent} {out / '.engines'}", "--model", str(model),
           "--engine", "vllm", "--vllm-arg=--enforce-eager", "--vllm-arg=--max-model-len=2048",
           "--vllm-arg=--dtype=float32", "--iterations", "3", "--out", str(out), "--samples", "4", "--no-progress",
           "--async", "--drain", "keep", "--lr", "5e-3", "--eot-token-id", "2", "--epsilon-high", "1.0",
           # Batch 1's sessions call until the push, which waits for the first training: on a loaded machine that
           # can outlast the tasks' 600 s agent timeout.
           "--timeout", "1800"]  # fmt: skip
    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) >= 2:  # the trainer not starved by the decoding batch (vLLM takes every core it is given)
        cmd += ["--rollout-cpus", str(cpus[0]), "--train-cpus", ",".join(map(str, cpus[1:]))]
    done = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=2400)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    state = json.loads((out / "loop.json").read_text())
    print(done.stdout[-1500:])
    # Two trainings: batch 1 is sampled while the first trains (the second step takes it), so version 1 lands under it.
    assert state["drain"] == "keep" and [s["status"] for s in state["steps"]] == ["trained", "trained"]
    push = state["pushes"][0]
    checkpoint = Path(state["steps"][0]["checkpoint"])
    assert push["version"] == 1 and push["checkpoint"] == str(checkpoint) and push["reload_s"] < 30
    under = push["during_batch"]
    assert under is not None, "the push did not land under a running batch"
    batch = next(b for b in state["batches"] if b["index"] == under)
    assert batch["version"] == 0 and batch["statuses"]["completed"] == 4, batch  # no session lost to the push
    log = "".join(p.read_text() for p in (out / ".engines").glob("engine-*.log"))
    assert "(in place, requests kept)" in log and log.count("Starting vLLM server") == 1

    seen: dict[str, int] = {"0": 0, "1": 0}
    mixed = 0
    for record in read_records(batch["shards"]):
        spans = orjson.loads(record.weight_versions_json or "null")
        assert spans and spans[-1]["end"] == len(record.response_ids), record.weight_versions_json
        assert record.weight_version == spans[0]["version"]
        prompt = list(record.prompt_ids)
        references = {"0": _reference(model, prompt, record.response_ids),
                      "1": _reference(checkpoint, prompt, record.response_ids)}  # fmt: skip
        for span in spans:
            got = record.logprobs[span["start"] : span["end"]]
            want = references[span["version"]][span["start"] : span["end"]]
            assert max(abs(a - b) for a, b in zip(got, want, strict=True)) < 1e-3, (span, spans)
            seen[span["version"]] += span["end"] - span["start"]
        mixed += len(spans) > 1
    # The push landed inside the batch: calls of both versions (and, unless the pause came between two calls, calls of
    # both at once; the engine test above makes those certain).
    assert seen["0"] > 0 and seen["1"] > 0, seen
    assert batch["versions"]["calls_mixed"] == mixed and batch["versions"]["tokens"] == sum(seen.values())

    # The trainer's view of the batch's calls: built into traces and scored as polar train's first step scores them,
    # each token's behaviour logprob is the one of the model that sampled it (ratio 1 against that model, within
    # 1e-3), so TIS corrects each token against its own sampler; a trace shifted by one token fails.
    from tests.support.tito_sessions import build  # noqa: PLC0415 (torch-heavy helpers, this test only)
    from tests.support.tito_vllm import trainer_logprobs  # noqa: PLC0415

    records, traces = build(Path(batch["shards"]))
    by_id = {r.record_id: r for r in records}
    scorers = {"0": trainer_logprobs(model), "1": trainer_logprobs(checkpoint)}
    checked = 0
    for trace in traces:
        record = by_id[trace.record_ids[0]]
        spans = orjson.loads(record.weight_versions_json or "[]")
        if len(trace.record_ids) != 1 or not spans or (checked >= 12 and len(spans) < 2):
            continue  # every call sampled across the push, and a dozen others
        assert trace.weight_versions == [span["version"] for span in spans]
        assert list(trace.completion_ids) == record.response_ids
        assert trace.behavior_logprobs == record.logprobs and all(trace.loss_mask)
        scores = {version: scorer(trace) for version, scorer in scorers.items()}
        for span in spans:
            for i in range(span["start"], span["end"]):
                assert abs(scores[span["version"]][i] - trace.behavior_logprobs[i]) < 1e-3, (i, span)
        checked += 1
    assert checked >= 2, "no trace of the batch's calls to score"
    final = state["batches"][-1]
    assert final["final"] and final["version"] == 2
    assert {r.weight_version for r in read_records(final["shards"])} == {"2"}
    print(f"drain keep: push {push['reload_s']:.2f} s under batch {under}; {batch['versions']}")
