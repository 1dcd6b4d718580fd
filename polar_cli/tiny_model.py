"""A tiny, offline, deterministic Qwen3-architecture model for tests and the demo.

Nothing can be downloaded here, so the tokenizer is a byte-level BPE trained on local text (the
standard library's own sources) and the weights are random. head_dim is 64 because vLLM's CPU
attention rejects smaller heads. The chat template is ChatML and renders tools, assistant tool
calls as ``<tool_call>{json}</tool_call>`` (what vLLM's ``hermes`` and SGLang's ``qwen25`` parsers
read), reasoning as ``<think>`` blocks and tool results, identically in history and generation,
so consecutive prompts of an agent loop are token prefixes of each other.
"""

from __future__ import annotations

import json
import sysconfig
from pathlib import Path

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
# Added but not "special": tool-call parsers look for them in the decoded text.
MARKUP_TOKENS = ["<tool_call>", "</tool_call>", "<think>", "</think>", "<tool_response>", "</tool_response>"]

# Split by implicit concatenation only where a line is too long: the template's bytes are the tokenizer's.
CHAT_TEMPLATE = (
    r"""{%- if tools %}
{{- '<|im_start|>system\n' }}
{%- if messages[0].role == 'system' %}{{- messages[0].content + '\n\n' }}{%- endif %}
{{- '# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"""
    r"""You are provided with function signatures within <tools></tools> XML tags:\n<tools>' }}
{%- for tool in tools %}{{- '\n' + (tool | tojson) }}{%- endfor %}
{{- '\n</tools>\n\nFor each function call, return a json object with function name and arguments within """
    r"""<tool_call></tool_call> XML tags:\n<tool_call>\n{"name": <function-name>, "arguments": <args-json-object>}"""
    r"""\n</tool_call><|im_end|>\n' }}
{%- elif messages[0].role == 'system' %}
{{- '<|im_start|>system\n' + messages[0].content + '<|im_end|>\n' }}
{%- endif %}
{%- for message in messages %}
{%- if message.role == 'user' or (message.role == 'system' and not loop.first) %}
{{- '<|im_start|>' + message.role + '\n' + message.content + '<|im_end|>\n' }}
{%- elif message.role == 'assistant' %}
{{- '<|im_start|>assistant\n' }}
{%- if message.reasoning_content %}{{- '<think>\n' + message.reasoning_content + '\n</think>\n\n' }}{%- endif %}
{%- if message.content %}{{- message.content }}{%- endif %}
{%- if message.tool_calls %}
{%- for tool_call in message.tool_calls %}
{%- set fn = tool_call.function if tool_call.function else tool_call %}
{%- if (loop.first and message.content) or not loop.first %}{{- '\n' }}{%- endif %}
{{- '<tool_call>\n{"name": "' + fn.name + '", "arguments": ' }}
{%- if fn.arguments is string %}{{- fn.arguments }}{%- else %}{{- fn.arguments | tojson }}{%- endif %}
{{- '}\n</tool_call>' }}
{%- endfor %}
{%- endif %}
{{- '<|im_end|>\n' }}
{%- elif message.role == 'tool' %}
{%- if loop.first or messages[loop.index0 - 1].role != 'tool' %}{{- '<|im_start|>user' }}{%- endif %}
{{- '\n<tool_response>\n' + message.content + '\n</tool_response>' }}
{%- if loop.last or messages[loop.index0 + 1].role != 'tool' %}{{- '<|im_end|>\n' }}{%- endif %}
{%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}{{- '<|im_start|>assistant\n' }}{%- endif %}
"""
)


def _training_text(max_bytes: int = 3_000_000) -> list[str]:
    """Deterministic local corpus: the stdlib's .py files in sorted order, capped for speed."""
    root = Path(sysconfig.get_paths()["stdlib"])
    texts: list[str] = []
    total = 0
    for path in sorted(root.glob("*.py")):
        text = path.read_text(encoding="utf-8", errors="ignore")
        texts.append(text)
        total += len(text)
        if total >= max_bytes:
            break
    return texts


# Model shapes by name. "tiny" is the test/demo model; "small" is large enough that compute, not
# per-step overhead, dominates a CPU training step (bench/train.py); "0.5b" is Qwen3-0.6B's shape
# (~0.44B parameters with this vocabulary), for the GPU check (bench/gpu_check.sh).
SIZES: dict[str, dict[str, int]] = {
    "tiny": dict(hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=2,
                 num_key_value_heads=1, head_dim=64),
    "small": dict(hidden_size=384, intermediate_size=1024, num_hidden_layers=6, num_attention_heads=6,
                  num_key_value_heads=2, head_dim=64),
    "0.5b": dict(hidden_size=1024, intermediate_size=3072, num_hidden_layers=28, num_attention_heads=16,
                 num_key_value_heads=8, head_dim=128),
}  # fmt: skip


def build_tokenizer(vocab_size: int = 2000):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_training_text(), trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=None,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        unk_token=None,
        additional_special_tokens=[],
    )
    fast.add_tokens(MARKUP_TOKENS, special_tokens=False)
    fast.chat_template = CHAT_TEMPLATE
    return fast


# Qwen3's generation_config.json sampling defaults: what SGLang and vLLM (--generation-config auto, its
# default) sample with when a request leaves the parameters out.
QWEN3_SAMPLING = {"do_sample": True, "temperature": 0.6, "top_p": 0.95, "top_k": 20}
GENERATION_DEFAULTS = {"none": {}, "qwen3": QWEN3_SAMPLING}


def build_tiny_model(
    out_dir: str | Path,
    seed: int = 0,
    max_position_embeddings: int = 131072,
    generation_defaults: str = "none",
    dtype: str = "float32",
    size: str = "tiny",
) -> Path:
    """Write tokenizer + random-init Qwen3 weights to ``out_dir``; same seed, same bytes.

    ``generation_defaults``: "qwen3" writes Qwen3's sampling defaults into generation_config.json, so
    engines that fall back to them behave as with a real Qwen3 checkpoint; "none" writes none.
    ``dtype="bfloat16"`` stores the weights the way released checkpoints (Qwen3 included) are;
    ``size`` picks a shape from ``SIZES``.
    """
    if generation_defaults not in GENERATION_DEFAULTS:
        raise ValueError(
            f"generation_defaults must be one of {sorted(GENERATION_DEFAULTS)}, got {generation_defaults!r}"
        )
    if size not in SIZES:
        raise ValueError(f"size must be one of {sorted(SIZES)}, got {size!r}")
    import torch
    from transformers import GenerationConfig, Qwen3Config, Qwen3ForCausalLM

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = build_tokenizer()
    vocab = len(tokenizer)
    torch.manual_seed(seed)
    config = Qwen3Config(
        vocab_size=vocab,
        **SIZES[size],
        max_position_embeddings=max_position_embeddings,
        tie_word_embeddings=True,
        eos_token_id=tokenizer.convert_tokens_to_ids("<|im_end|>"),
        pad_token_id=tokenizer.convert_tokens_to_ids("<|endoftext|>"),
        bos_token_id=None,
        torch_dtype=dtype,
    )
    model = Qwen3ForCausalLM(config).to(getattr(torch, dtype))
    model.generation_config = GenerationConfig(
        eos_token_id=[config.eos_token_id, tokenizer.convert_tokens_to_ids("<|endoftext|>")],
        pad_token_id=config.pad_token_id,
        **GENERATION_DEFAULTS[generation_defaults],
    )
    model.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)
    # vLLM and SGLang read the template from tokenizer_config.json; a standalone copy helps humans.
    (out / "chat_template.jinja").write_text(CHAT_TEMPLATE)
    (out / "polar_tiny_model.json").write_text(json.dumps({"seed": seed, "vocab_size": vocab, "size": size}))
    return out


def untie_embeddings(model: Path, dest: Path) -> Path:
    """A copy of ``model`` with its own LM head (a copy of the input embedding): the same function, untied, as
    Qwen3-8B and the imported Qwen2.5-Coder-0.5B are (vLLM loads those in place; see serving.in_place_refusal)."""
    import shutil

    from safetensors.torch import load_file, save_file

    shutil.copytree(model, dest)
    config = json.loads((dest / "config.json").read_text())
    config["tie_word_embeddings"] = False
    (dest / "config.json").write_text(json.dumps(config, indent=2))
    weights = load_file(str(dest / "model.safetensors"))
    weights["lm_head.weight"] = weights["model.embed_tokens.weight"].clone()
    save_file(weights, str(dest / "model.safetensors"), metadata={"format": "pt"})
    return dest
