"""A verified GGUF file to a plain Hugging Face folder through transformers' GGUF loader, every tensor dequantized
(``GgufConfig(dequantize=True)``: a quantized module could not be trained or saved), in the dtype asked for.

A GGUF carries no ``generation_config.json``: the sampling defaults are the file's own ``general.sampling.*`` keys when
llama.cpp wrote them, then whatever the caller states (the upstream model's published defaults), each recorded with
where it came from, so a rollout that reads the folder's defaults samples as the model's authors meant.
"""

from __future__ import annotations

import json
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

# llama.cpp's sampling keys (gguf.Keys.General.SAMPLING_*) -> GenerationConfig fields.
GGUF_SAMPLING = {
    "general.sampling.temp": "temperature",
    "general.sampling.top_k": "top_k",
    "general.sampling.top_p": "top_p",
    "general.sampling.min_p": "min_p",
    "general.sampling.penalty_repeat": "repetition_penalty",
}
_SAMPLING = {"temperature", "top_k", "top_p", "min_p", "repetition_penalty"}
DTYPES = ("bfloat16", "float16", "float32")
_METADATA_KEYS = ("general.architecture", "general.name", "general.basename", "general.finetune", "general.size_label")


@dataclass(frozen=True)
class Converted:
    """What the conversion produced."""

    parameters: int
    tie_word_embeddings: bool
    generation_defaults: dict[str, Any]
    generation_defaults_from: dict[str, str]


def gguf_metadata(path: Path) -> dict[str, Any]:
    """The file's identity (architecture, name), its tensors' types, and its sampling keys, read from the header."""
    from gguf import GGUFReader

    reader = GGUFReader(str(path))
    out: dict[str, Any] = {}
    for key in (*_METADATA_KEYS, "general.file_type", *GGUF_SAMPLING):
        field = reader.fields.get(key)
        if field is not None:
            value = field.contents()
            out[key] = value.item() if hasattr(value, "item") else value
    out["tensors"] = len(reader.tensors)
    out["tensor_types"] = dict(sorted(Counter(t.tensor_type.name for t in reader.tensors).items()))
    return out


def parse_generation(pairs: list[str]) -> dict[str, Any]:
    """``KEY=VALUE`` pairs (the value read as JSON, else as text) as generation-config fields."""
    out: dict[str, Any] = {}
    for pair in pairs:
        key, sep, raw = pair.partition("=")
        if not sep or not key.strip():
            raise ValueError(f"{pair!r}: expected KEY=VALUE, e.g. temperature=0.7")
        try:
            out[key.strip()] = json.loads(raw)
        except ValueError:
            out[key.strip()] = raw
    return out


def generation_defaults(metadata: dict[str, Any], stated: dict[str, Any]) -> tuple[dict[str, Any], dict[str, str]]:
    """The sampling defaults to write and each one's origin: the GGUF's keys, overridden by the stated ones; any
    sampling parameter means sampling (``do_sample``), as a released generation_config says."""
    values: dict[str, Any] = {}
    origin: dict[str, str] = {}
    for key, name in GGUF_SAMPLING.items():
        if key in metadata:
            values[name], origin[name] = metadata[key], f"gguf {key}"
    for name, value in stated.items():
        values[name], origin[name] = value, "stated (--generation)"
    if _SAMPLING & set(values) and "do_sample" not in values:
        values["do_sample"], origin["do_sample"] = True, "implied by the sampling parameters"
    return values, origin


def convert(
    gguf_path: Path, out: Path, *, dtype: str, generation: dict[str, Any], metadata: dict[str, Any]
) -> Converted:
    """Load ``gguf_path`` dequantized in ``dtype`` and save model, tokenizer (with its chat template) and generation
    config into ``out``."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, GgufConfig

    if dtype not in DTYPES:
        raise ValueError(f"dtype {dtype!r}: use one of {', '.join(DTYPES)}")
    folder, name = str(gguf_path.parent), gguf_path.name
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    model = AutoModelForCausalLM.from_pretrained(
        folder, gguf_file=name, dtype=getattr(torch, dtype), quantization_config=GgufConfig(dequantize=True)
    )
    values, origin = generation_defaults(metadata, generation)
    for key, value in values.items():
        setattr(model.generation_config, key, value)
    if values:  # no longer derived from the model config: stated defaults must not be taken for legacy ones
        model.generation_config._from_model_config = False
    # The loader names the config after the file's general.name; the folder is its own name from here on.
    model.config.__dict__.pop("_model_name_or_path", None)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return Converted(
        parameters=sum(p.numel() for p in model.parameters()),
        tie_word_embeddings=bool(model.config.tie_word_embeddings),
        generation_defaults=values,
        generation_defaults_from=origin,
    )


def versions() -> dict[str, str]:
    """The libraries that did the conversion (a different transformers may dequantize or name things differently)."""
    from importlib.metadata import version

    return {name: version(name) for name in ("transformers", "gguf", "torch", "safetensors", "tokenizers")}
