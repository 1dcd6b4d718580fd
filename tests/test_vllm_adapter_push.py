"""LoRA adapters pushed into a running vLLM (CPU build) with the real commands: `polar engine serve --push adapter`,
`polar train --lora-r` (its adapter saved beside the merged checkpoint, `--lora-init` to go on training it), `polar
engine reload`, and `polar loop --vllm-push adapter`. The model is the tiny one with its tied embeddings, which a
whole-checkpoint in-place reload refuses: an adapter leaves the embeddings alone. What is served after each push is
checked against plain transformers + PEFT forward passes of base + adapter, token by token."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from polar_addon.canonical import CanonicalRequest, SamplingParams, VersionSpan
from polar_addon.engines import make_engine
from polar_cli.serving import ADAPTER_DIR, in_place_refusal, load_state, stop_engine
from polar_cli.train.config import TrainConfig
from polar_cli.train.run import run_training
from tests.conftest import free_port
from tests.support.train_traces import TraceFactory, two_group_specs

REPO = Path(__file__).resolve().parents[1]
PROMPT = [1, 17, 250, 31, 9, 77, 402, 5, 66, 12, 300, 41]
VLLM_ARGS = ["--vllm-arg=--enforce-eager", "--vllm-arg=--dtype=float32", "--vllm-arg=--max-model-len=2048"]


def _need_vllm() -> None:
    if not (REPO / ".venv-vllm" / "bin" / "python").exists():
        from tests.support.prereq import missing

        missing("vLLM CPU venv missing (.venv-vllm); run `make engine`")


def _policy_logprobs(base: Path, adapter: Path | None, response: list[int], temperature: float = 1.0) -> list[float]:
    """Each response token's logprob under base (+ adapter), fp32, as polar's trainer computes it."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    net = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    if adapter is not None:
        net = PeftModel.from_pretrained(net, adapter)
    ids = PROMPT + response
    with torch.inference_mode():
        logits = net.eval()(input_ids=torch.tensor([ids])).logits[0].float() / temperature
    logprobs = torch.log_softmax(logits[len(PROMPT) - 1 : -1], dim=-1)
    return logprobs.gather(1, torch.tensor(response)[:, None])[:, 0].tolist()


def _polar(*args: str, timeout: float = 900) -> str:
    done = subprocess.run(
        [sys.executable, "-m", "polar_cli.app", *args], cwd=REPO, capture_output=True, text=True, timeout=timeout
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return done.stdout


@pytest.mark.vllm
def test_adapters_pushed_in_place_are_served_token_for_token(tiny_model_dir: Path, tmp_path: Path) -> None:
    _need_vllm()
    assert in_place_refusal(tiny_model_dir) is not None  # tied: a whole checkpoint could not be loaded in place
    traces = TraceFactory(tiny_model_dir, temperature=0.7, seed=1).traces(two_group_specs())
    cfg = dict(inputs=[], model=str(tiny_model_dir), learning_rate=5e-2, groups_per_step=2, max_steps=2,
               progress=False, dtype="float32", lora_r=8)  # fmt: skip
    first, second = tmp_path / "first", tmp_path / "second"
    run_training(TrainConfig(**cfg, output=first), traces=traces)
    run_training(TrainConfig(**cfg, output=second, lora_init=first / ADAPTER_DIR), traces=traces)

    state, port = tmp_path / "engines", free_port()
    url = f"http://127.0.0.1:{port}"
    served = _polar("engine", "serve", str(tiny_model_dir), "--port", str(port), "--served-model-name", "policy",
                    "--push", "adapter", "--lora-rank", "8", "--state-dir", str(state), *VLLM_ARGS)  # fmt: skip
    assert served.strip().endswith(f"vllm:{url}"), served
    try:

        async def sample(spec: str) -> tuple[list[int], list[float], list[VersionSpan] | None]:
            engine = make_engine(spec, timeout_s=300)
            request = CanonicalRequest(
                api="openai_chat", model="anything", messages=[],
                sampling=SamplingParams(temperature=1.0, max_tokens=12, seed=3),
            )  # fmt: skip
            try:
                done = await engine.complete_tokens(request, PROMPT)
            finally:
                await engine.close()
            return done.response_ids, done.logprobs, done.weight_versions

        tokens, logprobs, _ = asyncio.run(sample(f"vllm:{url}"))
        want = _policy_logprobs(tiny_model_dir, None, tokens)
        assert max(abs(a - b) for a, b in zip(logprobs, want, strict=True)) < 1e-3
        for version, ckpt in (("1", first), ("2", second)):
            started = time.monotonic()
            line = _polar("engine", "reload", str(ckpt), "--engine", f"vllm:{url}", "--state-dir", str(state),
                          "--weight-version", version)  # fmt: skip
            seconds = time.monotonic() - started
            spec = f"vllm:{url}?model=policy-adapter&weight_version={version}"
            assert f"loaded {ckpt.resolve()}'s adapter in place as 'policy-adapter'" in line, line
            assert line.strip().endswith(f"proxies tag its calls with --engine '{spec}'"), line
            print(f"adapter push {version}: {seconds:.2f} s (the command, Python start included)")
            assert seconds < 30, seconds  # a restart of this server takes ~30-50 s on 2 cores
            # The per-token version path (what --drain keep samples on) asks for the adapter by name too.
            tokens, logprobs, spans = asyncio.run(sample(f"{spec}&versions=spans"))
            assert spans == [VersionSpan(version, 0, len(tokens))]
            want = _policy_logprobs(tiny_model_dir, ckpt / ADAPTER_DIR, tokens)
            base = _policy_logprobs(tiny_model_dir, None, tokens)
            assert max(abs(a - b) for a, b in zip(logprobs, want, strict=True)) < 1e-3, (version, logprobs, want)
            assert max(abs(a - b) for a, b in zip(logprobs, base, strict=True)) > 1e-2  # the adapter, not the base
        server = load_state(state, port)
        assert (server.adapter, server.model) == (str(second.resolve() / ADAPTER_DIR), str(second.resolve()))
        log = Path(server.log).read_text()
        assert log.count("Starting vLLM server") == 1 and log.count("(in place: its adapter)") == 2
    finally:
        stop_engine(url, state_dir=state)


@pytest.mark.vllm
def test_a_loop_trains_one_adapter_and_serves_each_push_of_it(tiny_model_dir: Path, tmp_path: Path) -> None:
    """`polar loop --engine vllm --vllm-push adapter -- --lora-r 8` on the tied tiny model: one vLLM start, the
    trained adapter pushed in place, and iteration 1's calls sampled by base + that adapter: their first-step
    importance ratios against it (what the next training computes) within 1e-3 of 1, far from the base's."""
    _need_vllm()
    toy = REPO / "examples" / "toy_task"
    tasks = tmp_path / "tasks.jsonl"
    tasks.write_text("".join((toy / "tasks.jsonl").read_text().splitlines(keepends=True)[1:3]))
    out = tmp_path / "loop"
    _polar("loop", str(tasks), "--harness", f"cmd:{sys.executable} {toy / 'agent.py'} {{instruction}}", "--model",
           str(tiny_model_dir), "--engine", "vllm", "--vllm-push", "adapter", *VLLM_ARGS, "--iterations", "2",
           "--out", str(out), "--samples", "4", "--concurrency", "8", "--no-progress", "--", "--lora-r", "8", "--lr",
           "5e-2", "--eot-token-id", "2", "--epsilon-high", "1.0", timeout=1500)  # fmt: skip
    iterations = json.loads((out / "loop.json").read_text())["iterations"]
    assert iterations[0]["train"]["status"] == "trained", iterations
    checkpoint = Path(iterations[0]["train"]["checkpoint"])
    assert iterations[1]["policy"] == str(checkpoint) and iterations[1]["push_s"] < 30, iterations[1]
    log = "".join(p.read_text() for p in (out / ".engines").glob("engine-*.log"))
    assert f"polar engine reload: {checkpoint.resolve()} (in place: its adapter)" in log
    assert log.count("Starting vLLM server") == 1
    from tests.support.tito_sessions import build  # noqa: PLC0415 (torch-heavy helpers, this test only)
    from tests.support.tito_vllm import first_step_ratios  # noqa: PLC0415

    records, traces = build(out / "iter-001" / "shards")
    assert {r.served_model for r in records} == {"policy-adapter"}, {r.served_model for r in records}
    first_records, _ = build(out / "iter-000" / "shards")
    assert {r.served_model for r in first_records} == {"policy"}  # iteration 0: the base, by its own name

    def logprobs(adapter: Path | None):
        return lambda trace: _trace_logprobs(tiny_model_dir, adapter, trace)

    served = first_step_ratios(traces, logprobs(checkpoint / ADAPTER_DIR))
    before = first_step_ratios(traces, logprobs(None))
    print(f"iteration 1 vs base + adapter: {served}; vs the base: {before}")
    assert served.tokens > 50 and served.max_abs_dev < 1e-3, served
    assert before.max_abs_dev > 100 * max(served.max_abs_dev, 1e-6), (served, before)


_NETS: dict[Path | None, object] = {}


def _trace_logprobs(base: Path, adapter: Path | None, trace) -> list[float]:
    from peft import PeftModel
    from transformers import AutoModelForCausalLM
    from trl.trainer.utils import selective_log_softmax

    if adapter not in _NETS:
        net = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
        _NETS[adapter] = (PeftModel.from_pretrained(net, adapter) if adapter else net).eval()
    ids = torch.tensor([list(trace.prompt_ids) + list(trace.completion_ids)])
    keep = len(trace.completion_ids)
    with torch.inference_mode():
        logits = _NETS[adapter](input_ids=ids).logits[:, -keep - 1 : -1, :].float() / trace.temperature
    return selective_log_softmax(logits, ids[:, -keep:])[0].tolist()
