"""The tiny model, made to end its turns: a test model that acts like a chat model where it matters for
token continuity (polar_addon.continuity.delta), i.e. its answers stop at ``<|im_end|>`` after a few tokens.

The tiny random model (polar_cli.tiny_model) almost never samples its end-of-turn token (1 in ~2000 per
step), so every answer is cut by length and a length-cut turn has no continuation delta. Qwen3 has no
lm_head bias, so this model makes one out of a hidden dimension: dimension ``BIAS_DIM`` of every token
embedding is a constant and no layer writes to it (its rows of ``o_proj`` and ``down_proj`` are zero), so
after the final RMSNorm it is a positive value at every position, and the untied lm_head reads it only
into the ``<|im_end|>`` logit. The rest of lm_head is the tied embedding scaled up, so the other tokens are
not near-uniform either (the importance ratios below then depend on the context). Same architecture
(Qwen3ForCausalLM, untied as Qwen3-8B is), same tokenizer, deterministic.

Its generation_config.json has Qwen3's sampling defaults (T=0.6, top_p 0.95, top_k 20) and its chat template is
Qwen3's own (history drops earlier think blocks): the engine must be sent every sampling parameter, and a
re-rendered history is not what the model sampled.
"""

from __future__ import annotations

import json
from pathlib import Path

from tests.support.tito_sessions import QWEN3_TEMPLATE

BIAS_DIM = -1  # the last hidden dimension carries the end-of-turn bias
EMBED_BIAS = 0.05  # that dimension's value in every token embedding (the others are ~N(0, 0.02))
# lm_head weight of <|im_end|> on it. Measured with transformers at T=0.6 (40 answers to a chat prompt):
# p(<|im_end|>) 0.12 per step on average (0.009-0.79), answers of 1-27 tokens, 7.8 on average.
EOT_WEIGHT = 4.5
LOGIT_SCALE = 4.0  # lm_head = embedding x this elsewhere: logits of std ~1.5 at T=0.6, top token p ~0.5


def build_ending_model(
    out_dir: str | Path, *, seed: int = 0, dtype: str = "float32", eot_weight: float = EOT_WEIGHT
) -> Path:
    """Write the model to ``out_dir`` (``dtype``: how the weights are stored, float32 or bfloat16)."""
    import torch
    from safetensors.torch import load_file, save_file

    from polar_cli.tiny_model import build_tiny_model

    out = build_tiny_model(out_dir, seed=seed, generation_defaults="qwen3", dtype="float32")
    config = json.loads((out / "config.json").read_text())
    eot = int(config["eos_token_id"])
    weights = load_file(str(out / "model.safetensors"))
    embed = weights["model.embed_tokens.weight"]
    head = embed.clone() * LOGIT_SCALE
    head[:, BIAS_DIM] = 0.0
    head[eot, BIAS_DIM] = eot_weight
    embed[:, BIAS_DIM] = EMBED_BIAS
    for name, tensor in weights.items():
        if name.endswith(("self_attn.o_proj.weight", "mlp.down_proj.weight")):
            tensor[BIAS_DIM, :] = 0.0  # no layer writes to the bias dimension
    weights["lm_head.weight"] = head
    stored = getattr(torch, dtype)
    save_file(
        {k: v.to(stored).contiguous() for k, v in weights.items()},
        str(out / "model.safetensors"),
        metadata={"format": "pt"},
    )
    config.update(tie_word_embeddings=False, dtype=dtype)
    (out / "config.json").write_text(json.dumps(config, indent=2))
    (out / "chat_template.jinja").write_text(QWEN3_TEMPLATE)
    return out
