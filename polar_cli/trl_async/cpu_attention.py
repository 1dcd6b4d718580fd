"""A pure-torch stand-in for the FlashAttention-3 varlen kernel that TRL's ``AsyncGRPOTrainer`` packs its rows
with, so that trainer runs on a machine without a GPU (tests, the CPU example). On a GPU, leave TRL's kernel alone.

TRL's ``tree_attention`` gathers each segment's keys along its trie path and calls
``flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_q, max_k, softmax_scale, causal, window_size)``;
this computes the same thing segment by segment: FlashAttention's causal mask is aligned to the bottom right (query
``i`` of a segment with ``len_q`` queries and ``len_k`` keys sees keys ``<= i + len_k - len_q``), which is what lets
a segment attend to its whole prefix path.
"""

from __future__ import annotations

import math
from types import SimpleNamespace

import torch


def flash_attn_varlen_func(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    max_seqlen_q: int,
    max_seqlen_k: int,
    softmax_scale: float | None = None,
    causal: bool = False,
    window_size: tuple[int, int] = (-1, -1),
    softcap: float = 0.0,
) -> torch.Tensor:
    """``q``: (total_q, heads, dim); ``k``/``v``: (total_k, kv_heads, dim), kv_heads dividing heads (GQA)."""
    heads, dim = q.shape[1], q.shape[2]
    repeat = heads // k.shape[1]
    scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(dim)
    out = torch.empty_like(q)
    starts_q, starts_k = cu_seqlens_q.tolist(), cu_seqlens_k.tolist()
    for (q0, q1), (k0, k1) in zip(zip(starts_q, starts_q[1:]), zip(starts_k, starts_k[1:]), strict=True):
        if q1 == q0:
            continue
        qs = q[q0:q1].transpose(0, 1).float()  # (heads, len_q, dim)
        ks = k[k0:k1].repeat_interleave(repeat, dim=1).transpose(0, 1).float()
        vs = v[k0:k1].repeat_interleave(repeat, dim=1).transpose(0, 1).float()
        scores = torch.matmul(qs, ks.transpose(1, 2)) * scale
        if softcap:
            scores = softcap * torch.tanh(scores / softcap)
        len_q, len_k = q1 - q0, k1 - k0
        i = torch.arange(len_q).unsqueeze(1) + (len_k - len_q)
        j = torch.arange(len_k).unsqueeze(0)
        allowed = torch.ones(len_q, len_k, dtype=torch.bool)
        if causal:
            allowed &= j <= i
        if window_size[0] >= 0:
            allowed &= j >= i - window_size[0]
        scores = scores.masked_fill(~allowed, float("-inf"))
        out[q0:q1] = torch.matmul(torch.softmax(scores, dim=-1), vs).transpose(0, 1).to(q.dtype)
    return out


def run_trainer_on_cpu() -> None:
    """Route TRL's tree attention through :func:`flash_attn_varlen_func` instead of the Hub's FA3 kernel, and skip
    its MFU probe (it asks CUDA for the device's name). Call before building the trainer; a GPU run does not."""
    from trl.experimental.async_grpo import async_grpo_trainer, packing

    kernel = SimpleNamespace(flash_attn_varlen_func=flash_attn_varlen_func)
    packing._flash_attn = lambda: kernel
    async_grpo_trainer.get_peak_flops_per_device = lambda accelerator, dtype: None
