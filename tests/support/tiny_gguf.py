"""A tiny Qwen2 checkpoint written as a real GGUF file with gguf-py's GGUFWriter, as llama.cpp's convert_hf_to_gguf
writes one: the architecture keys, a byte-level BPE vocabulary (tokens, token types, merges, special ids, chat
template), and every tensor under gguf-py's own Qwen2 name map (``get_tensor_name_map``, the table llama.cpp's
converter uses; Qwen2 needs no q/k permutation). 2-D weights are stored as F16, norms and biases as F32, as the
converter's ``--outtype f16`` does; a test can then compare against the source model's weights rounded to f16."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np

# gguf's token types (llama.cpp's llama_token_type): 1 normal, 3 control (a special token), 4 user-defined (added).
NORMAL, CONTROL, USER_DEFINED = 1, 3, 4


def tiny_qwen2(vocab_size: int, seed: int = 0) -> Any:
    """A random Qwen2ForCausalLM with the real model's traits (q/k/v biases, untied lm_head, GQA), small."""
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(seed)
    config = Qwen2Config(
        vocab_size=vocab_size,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        rope_theta=1_000_000.0,
        rms_norm_eps=1e-6,
        tie_word_embeddings=False,
    )
    model = Qwen2ForCausalLM(config).eval()
    with torch.no_grad():  # non-trivial norms and biases, so a misplaced tensor shows in the logits
        for name, param in model.named_parameters():
            if name.endswith("norm.weight") or name.endswith(".bias"):
                param.add_(torch.randn_like(param) * 0.1)
    return model


def _vocabulary(tokenizer: Any) -> tuple[list[str], list[int], list[str]]:
    """Tokens by id, their types and the merges, from a byte-level BPE fast tokenizer."""
    state = json.loads(tokenizer.backend_tokenizer.to_str())
    vocab = tokenizer.get_vocab()
    tokens = [""] * len(vocab)
    for token, index in vocab.items():
        tokens[index] = token
    added = {t["content"]: t for t in state["added_tokens"]}
    types = [
        (CONTROL if added[t]["special"] else USER_DEFINED) if t in added else NORMAL for t in tokens
    ]  # fmt: skip
    merges = [m if isinstance(m, str) else " ".join(m) for m in state["model"]["merges"]]
    return tokens, types, merges


def write_qwen2_gguf(model: Any, tokenizer: Any, path: Path, *, sampling_temp: float | None = None) -> Path:
    """``model`` and ``tokenizer`` as one GGUF file at ``path``."""
    import gguf

    config = model.config
    writer = gguf.GGUFWriter(str(path), "qwen2")
    writer.add_name("tiny qwen2 for polar's import test")
    writer.add_block_count(config.num_hidden_layers)
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    writer.add_rope_freq_base(config.rope_parameters["rope_theta"])
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_file_type(gguf.LlamaFileType.MOSTLY_F16)
    if sampling_temp is not None:
        writer.add_sampling_temp(sampling_temp)

    tokens, types, merges = _vocabulary(tokenizer)
    writer.add_tokenizer_model("gpt2")
    # Qwen2's split, as llama.cpp writes it for the architecture (transformers' Qwen2Tokenizer applies it anyway).
    writer.add_tokenizer_pre("qwen2")
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    writer.add_token_merges(merges)
    writer.add_eos_token_id(tokenizer.eos_token_id)
    writer.add_pad_token_id(tokenizer.pad_token_id)
    writer.add_add_bos_token(False)
    writer.add_chat_template(tokenizer.chat_template)

    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.QWEN2, config.num_hidden_layers)
    for hf_name, tensor in model.state_dict().items():
        name = names.get_name(hf_name, try_suffixes=(".weight", ".bias"))
        assert name is not None, hf_name
        data = tensor.detach().float().numpy()
        writer.add_tensor(name, data.astype(np.float16) if data.ndim == 2 else data)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def split(path: Path, pieces: int, out_dir: Path) -> list[Path]:
    """The file cut into ``pieces`` consecutive parts (as the PyPI uploads split theirs)."""
    data = path.read_bytes()
    step = -(-len(data) // pieces)
    out_dir.mkdir(parents=True, exist_ok=True)
    parts = []
    for i in range(pieces):
        part = out_dir / f"part{i + 1:02d}.bin"
        part.write_bytes(data[i * step : (i + 1) * step])
        parts.append(part)
    return parts
