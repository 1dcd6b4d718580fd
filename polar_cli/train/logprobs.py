"""Log-probabilities at the trained positions only.

TRL's fused LM head (``trl.trainer.utils.add_fused_lm_head``) never materialises the (positions x vocabulary)
logits: it projects tiles through TRL's ``ChunkedLogProbFunction``. But off Triton devices (the CPU) it projects
*every* position, prompts included, so that a Neuron compiler sees fixed shapes. A trace's prompt is most of its
tokens (an agent's 1.4k-token prompt before a 250-token answer), and the head (hidden x 151,936 for Qwen) is a
third of a 0.5B model's forward: scoring the prompts too costs that compute, and the tiles' memory, for nothing.
This head is TRL's, with the positions always compacted to those whose label is set (the trainer sets labels
only where the loss mask is 1), on every device.
"""

from __future__ import annotations

import functools
import types
from typing import Any

import torch

# Scalings of the logits that TRL's head reads from other attribute names (Granite, Falcon-H1, ...): models that
# set them keep TRL's own head rather than a copy of its lookup table.
_OTHER_SCALINGS = ("output_multiplier", "lm_head_multiplier", "logits_scaling")
TOKEN_CHUNK = 32768  # vocabulary entries per tile, as TRL's _CHUNKED_LOGPROB_CHUNK_SIZE


def add_trained_positions_head(model: Any, temperature: float, outputs: tuple[str, ...] = ("log_probs",)) -> bool:
    """Patch ``model`` (a causal LM, not a PEFT wrapper) so that ``model(..., labels=L, fused_lm_head=True)`` returns
    TRL's ``FusedCausalLMOutput`` with log-probs (and ``outputs``) computed only where ``L != -100``.

    Returns False, leaving the model as it is, for models whose logits TRL scales in ways not handled here."""
    from trl.kernels import ChunkedLogProbFunction
    from trl.trainer.utils import FusedCausalLMOutput

    text = model.config.get_text_config()
    if any(getattr(text, name, None) is not None for name in _OTHER_SCALINGS):
        return False
    if getattr(text, "output_router_logits", False):  # MoE aux loss: TRL's head handles it
        return False
    softcap = getattr(text, "final_logit_softcapping", None)
    scale = getattr(text, "logit_scale", None)
    scale = 1.0 if scale is None else scale
    original = type(model).forward

    @functools.wraps(original)
    def forward(self, *args, fused_lm_head=False, labels=None, num_items_in_batch=None, **kwargs):
        if not fused_lm_head:
            if labels is not None:
                kwargs["labels"] = labels
            return original(self, *args, **kwargs)
        kwargs["use_cache"] = False
        hidden = self.base_model(*args, **kwargs).last_hidden_state[:, :-1]
        labels = labels[:, 1:]
        head = self.get_output_embeddings()
        hidden, labels = hidden.to(head.weight.device), labels.to(head.weight.device)
        mask = labels != -100
        per_token = ChunkedLogProbFunction.apply(
            hidden[mask], head.weight, head.bias, labels[mask], temperature, TOKEN_CHUNK, softcap, scale, outputs
        )
        # masked_scatter keeps an all-masked forward connected to the graph (a zero, not a backward error).
        log_probs, entropy, log_sum_sq, mean_logits, is_top1 = (
            None if x is None else x.new_zeros(mask.shape).masked_scatter(mask, x) for x in per_token
        )
        count = mask.sum().clamp(min=1) if num_items_in_batch is None else num_items_in_batch
        return FusedCausalLMOutput(
            loss=-log_probs.sum() / count,
            log_probs=log_probs,
            entropy=entropy,
            log_sum_sq_probs=log_sum_sq,
            mean_logits=mean_logits,
            is_top1=is_top1,
            label_mask=mask,
        )

    model.forward = types.MethodType(forward, model)
    return True


def trained_labels(input_ids: torch.Tensor, loss_mask: torch.Tensor) -> torch.Tensor:
    """Labels for the fused head: the token where ``loss_mask`` (the last ``loss_mask.shape[1]`` positions) is 1,
    -100 elsewhere (prompts, interstitial context, padding)."""
    keep = loss_mask.shape[1]
    labels = torch.full_like(input_ids, -100)
    window = input_ids[:, -keep:]
    labels[:, -keep:] = torch.where(loss_mask.to(window.device).bool(), window, torch.full_like(window, -100))
    return labels
