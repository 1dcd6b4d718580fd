"""The real 0.5B instruct model (Qwen2.5-Coder-0.5B-Instruct, `make real-model`) through polar: one short session
per API dialect with the official SDKs, through a real mitmdump, and the production-like engine (vLLM CPU, bf16).

What the tiny random model cannot show: a real tokenizer and chat template (151k vocabulary, `<|im_start|>` turns),
a model that answers in words, and a generation config with sampling defaults (T 0.7, top_p 0.8, top_k 20,
repetition_penalty 1.1) that an engine falls back to unless polar states every sampling parameter. Every call must
come back as the provider's own shape, and be recorded token-exact: the prompt is the template's rendering, the
reply the client got is the decoding of the sampled ids, and each captured logprob is what a trainer recomputes.

`make test-real` imports the model first (cached outside the checkout) and runs this file.
"""

from __future__ import annotations

import math
import os
import ssl
from collections.abc import Iterator
from pathlib import Path

import anthropic
import httpx
import openai
import pytest
import torch
from google import genai
from google.genai import types
from transformers import AutoModelForCausalLM, AutoTokenizer

from polar_addon.store import read_records
from tests.conftest import _vllm
from tests.support.prereq import missing
from tests.support.proxy import run_mitmdump
from tests.support.shards import session_records

pytestmark = pytest.mark.real

MODELS = Path(os.environ.get("POLAR_MODELS_DIR", Path.home() / ".cache/polar/models"))
QUESTION = "Write a Python function that returns the sum of two numbers. Only the code."
MAX_TOKENS = 24


@pytest.fixture(scope="module")
def real_model_dir() -> Path:
    path = MODELS / "qwen2.5-coder-0.5b-instruct"
    if not (path / "polar-provenance.json").is_file():
        missing(f"the real model is missing ({path}): run `make real-model`")
    return path


@pytest.fixture(scope="module")
def reference(real_model_dir: Path):
    """``fn(prompt_ids, response_ids, temperature, dtype) -> list[float]``: what `polar train` computes before its
    first update (fp32 master weights, the forward in fp32 or under bf16 autocast)."""
    model = AutoModelForCausalLM.from_pretrained(real_model_dir, dtype=torch.float32).eval()

    def compute(prompt: list[int], response: list[int], temperature: float, dtype=torch.float32) -> list[float]:
        ids = torch.tensor([prompt + response])
        with torch.inference_mode(), torch.autocast("cpu", dtype=dtype, enabled=dtype != torch.float32):
            logits = model(input_ids=ids).logits[0, len(prompt) - 1 : -1].float()
        logprobs = torch.log_softmax(logits / temperature, dim=-1)
        return logprobs.gather(1, torch.tensor(response)[:, None])[:, 0].tolist()

    return compute


@pytest.fixture(scope="module")
def local_proxy(real_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator:
    out = tmp_path_factory.mktemp("real") / "shards"
    with run_mitmdump(f"local:{real_model_dir}", out, options={"polar_shard_seconds": "0.2"}) as proxy:
        yield proxy


def http(proxy, session: str) -> httpx.Client:
    return httpx.Client(
        proxy=proxy.proxy_url(session), verify=ssl.create_default_context(cafile=str(proxy.ca)), timeout=300
    )


def ask_openai_chat(proxy, session: str) -> str:
    client = openai.OpenAI(api_key="x", http_client=http(proxy, session), max_retries=0)
    reply = client.chat.completions.create(
        model="policy", messages=[{"role": "user", "content": QUESTION}], max_tokens=MAX_TOKENS
    )
    return reply.choices[0].message.content or ""


def ask_openai_responses(proxy, session: str) -> str:
    client = openai.OpenAI(api_key="x", http_client=http(proxy, session), max_retries=0)
    stream = client.responses.create(model="policy", input=QUESTION, max_output_tokens=MAX_TOKENS, stream=True)
    return "".join(event.delta for event in stream if event.type == "response.output_text.delta")


def ask_anthropic(proxy, session: str) -> str:
    client = anthropic.Anthropic(api_key="x", http_client=http(proxy, session), max_retries=0)
    with client.messages.stream(
        model="policy", max_tokens=MAX_TOKENS, messages=[{"role": "user", "content": QUESTION}]
    ) as stream:
        return "".join(stream.text_stream)


def ask_gemini(proxy, session: str) -> str:
    client = genai.Client(api_key="x", http_options=types.HttpOptions(httpx_client=http(proxy, session)))
    reply = client.models.generate_content(
        model="policy", contents=QUESTION, config=types.GenerateContentConfig(max_output_tokens=MAX_TOKENS)
    )
    return reply.text or ""


DIALECTS = {
    "openai_chat": ask_openai_chat,
    "openai_responses": ask_openai_responses,
    "anthropic": ask_anthropic,
    "gemini": ask_gemini,
}


def check_exact(record, text: str, tokenizer, reference, dtype=torch.float32, tolerance: float = 2e-3) -> None:
    """The record is what was sampled: the chat template's prompt, the client's text decoded from the sampled ids,
    logprobs a trainer recomputes, and sampling it can recompute (no truncation from the model's defaults)."""
    assert record.status == "ok", record.error
    expected_prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": QUESTION}], add_generation_prompt=True, tokenize=True
    )
    if not isinstance(expected_prompt, list):
        expected_prompt = expected_prompt["input_ids"]
    prompt = list(record.prompt_ids)
    # The default system prompt of Qwen2.5's template comes first; the user's turn and the generation prompt end it.
    assert prompt == list(expected_prompt), tokenizer.decode(prompt)
    response = list(record.response_ids)
    assert 0 < len(response) <= MAX_TOKENS and len(record.logprobs) == len(response)
    assert tokenizer.decode(response, skip_special_tokens=True).strip() == text.strip()
    assert record.top_p in (None, 1.0) and not record.top_k and not record.min_p, (record.top_p, record.top_k)
    assert record.temperature and record.temperature > 0
    recomputed = reference(prompt, response, record.temperature, dtype)
    deltas = [abs(a - b) for a, b in zip(recomputed, record.logprobs, strict=True)]
    assert all(math.isfinite(x) and x <= 1e-3 for x in record.logprobs)
    assert sum(deltas) / len(deltas) < tolerance, deltas


@pytest.mark.parametrize("dialect", DIALECTS)
def test_one_session_per_dialect_is_recorded_token_exact(dialect, local_proxy, real_model_dir, reference) -> None:
    session = f"real-{dialect}"
    text = DIALECTS[dialect](local_proxy, session)
    assert text.strip(), "the real model answers in words"
    (record,) = session_records(local_proxy.out, session)
    check_exact(record, text, AutoTokenizer.from_pretrained(real_model_dir), reference)


@pytest.mark.vllm
@pytest.mark.parametrize(
    ("dtype", "reference_dtype", "tolerance"),
    [("bfloat16", torch.bfloat16, 0.05), ("float32", torch.float32, 2e-3)],
)
def test_vllm_serves_the_real_model_token_exact(
    dtype: str, reference_dtype: torch.dtype, tolerance: float, real_model_dir, reference, tmp_path
) -> None:
    """The production-like path: vLLM (its hermes parser, a generation config full of sampling defaults) behind
    polar, one session per API dialect. Logprobs agree with a recompute in the engine's precision (bf16: to bf16's
    precision, against bf16 autocast; fp32: far closer), and nothing sampled came from the folder's top_p / top_k /
    repetition penalty."""
    tokenizer = AutoTokenizer.from_pretrained(real_model_dir)
    extra = ["--dtype", dtype, "--max-model-len", "4096", "--enforce-eager", "--generation-config", "auto"]
    with _vllm(real_model_dir, tmp_path, extra, kv_cache_gib=1) as url:
        out = tmp_path / "shards"
        options = {"polar_shard_seconds": "0.2", "polar_tokenizer": str(real_model_dir)}
        with run_mitmdump(f"vllm:{url}", out, options=options) as proxy:
            texts = {dialect: ask(proxy, f"vllm-{dialect}") for dialect, ask in DIALECTS.items()}
    records = {r.session_id: r for r in read_records(str(out))}
    for dialect, text in texts.items():
        check_exact(records[f"vllm-{dialect}"], text, tokenizer, reference, reference_dtype, tolerance=tolerance)
