"""How many tokens one forward may hold, whether activations must be checkpointed, and what a step will cost.

A step's traces are split over micro-batches (``--grad-accum``) and each micro-batch over forwards whose padded
token count stays under ``--token-budget`` (TRL's ``AsyncGRPOConfig.token_budget``: tokens per forward, not rows),
each forward followed by its own backward, so peak activation memory is one forward's, whatever the step's size.

The default budget comes from the memory this machine has free and an estimate of what the model needs: its
weights (fp32 master copies), the gradients and AdamW state of what trains, and per forward token the
activations a backward keeps (calibrated on Qwen2 layers in fp32 on CPU: ~4 x (16 h + 4 i) bytes per token
and layer, h the hidden and i the MLP width; bf16 autocast keeps less, so the estimate stays on the safe side).
Without checkpointing that is all layers' activations; with it, each layer's input plus two layers being
recomputed. Checkpointing costs a second forward (~1/3 more compute), so it is switched on only when the
longest trace would not fit otherwise.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

GIB = 1024**3
# Of the memory free at start, what training may plan to use: the allocator's fragmentation, the tokenizer,
# the data, the fused log-prob head's tiles and other processes' growth take the rest.
USABLE_FRACTION = 0.6
# Python, torch and the trainer's own state before the model: RSS of a bare `polar train` process.
FRAMEWORK_BYTES = 1 * GIB
# TRL's fused head scores 4096 positions x 32768 vocabulary entries per tile, a few fp32 temporaries of that.
HEAD_TILE_TOKENS, HEAD_TILE_VOCAB, HEAD_TEMPORARIES = 4096, 32768, 4
# No budget below this: a forward of fewer tokens wastes the machine (the longest trace still gets its own).
MIN_BUDGET = 512


@dataclass(frozen=True)
class ModelShape:
    """What the memory estimate needs of a model: its config's sizes and its parameter counts."""

    hidden_size: int
    intermediate_size: int
    num_layers: int
    vocab_size: int
    num_params: int
    trainable_params: int

    @classmethod
    def from_config(cls, config, trainable_params: int | None = None) -> ModelShape:
        """From a transformers config; parameters counted from the shapes (no weights loaded)."""
        text = config.get_text_config() if hasattr(config, "get_text_config") else config
        h, i, n = text.hidden_size, text.intermediate_size, text.num_hidden_layers
        heads = text.num_attention_heads
        kv = getattr(text, "num_key_value_heads", None) or heads
        head_dim = getattr(text, "head_dim", None) or h // heads
        attention = h * heads * head_dim * 2 + h * kv * head_dim * 2
        layer = attention + 3 * h * i + 2 * h
        embed = text.vocab_size * h
        tied = getattr(text, "tie_word_embeddings", False)
        params = n * layer + embed * (1 if tied else 2) + h
        return cls(h, i, n, text.vocab_size, params, params if trainable_params is None else trainable_params)


def lora_trainable_params(shape: ModelShape, rank: int) -> int:
    """LoRA on every linear layer of the decoder (PEFT's all-linear): r x (in + out) per projection."""
    h, i = shape.hidden_size, shape.intermediate_size
    # q, k, v, o bounded by h x h each (GQA's k, v are smaller: an upper bound), gate, up, down.
    return shape.num_layers * rank * (4 * 2 * h + 3 * (h + i))


def activation_bytes_per_token(shape: ModelShape, checkpointing: bool) -> int:
    """Bytes a backward keeps per forward token (fp32)."""
    layer = 4 * (16 * shape.hidden_size + 4 * shape.intermediate_size)
    if checkpointing:
        return shape.num_layers * 4 * 2 * shape.hidden_size + 2 * layer
    return shape.num_layers * layer


def static_bytes(shape: ModelShape, reference_model: bool = False) -> int:
    """Weights (fp32 master copies), gradients and AdamW's two moments of what trains, a reference copy if any."""
    weights = 4 * shape.num_params * (2 if reference_model else 1)
    return FRAMEWORK_BYTES + weights + 12 * shape.trainable_params


def head_bytes(shape: ModelShape, tokens: int = HEAD_TILE_TOKENS) -> int:
    """The fused log-prob head's transient tiles for a forward scoring ``tokens`` positions (at most one tile)."""
    return min(tokens, HEAD_TILE_TOKENS) * min(shape.vocab_size, HEAD_TILE_VOCAB) * 4 * HEAD_TEMPORARIES


def available_memory(processes: int = 1) -> int | None:
    """Bytes free for this process: the accelerator's free memory, else the host's (MemAvailable, bounded by a
    cgroup limit when one is set) shared by the ``processes`` training on this host; None when unknown."""
    import torch

    if torch.cuda.is_available():
        free, _ = torch.cuda.mem_get_info()
        return int(free)
    try:
        import psutil

        free = int(psutil.virtual_memory().available)
    except Exception:  # noqa: BLE001 - no psutil or no /proc: unknown, not fatal
        return None
    limit = _cgroup_free()
    return (free if limit is None else min(free, limit)) // max(1, processes)


def _cgroup_free() -> int | None:
    base = Path("/sys/fs/cgroup")
    for limit_file, usage_file in (("memory.max", "memory.current"), ("memory/memory.limit_in_bytes", None)):
        try:
            raw = (base / limit_file).read_text().strip()
            if raw == "max" or int(raw) >= 1 << 60:
                continue
            used = int((base / usage_file).read_text()) if usage_file else 0
            return max(0, int(raw) - used)
        except (OSError, ValueError):
            continue
    return None


@dataclass(frozen=True)
class MemoryPlan:
    token_budget: int
    gradient_checkpointing: bool
    why: str  # one line: where the budget came from and why checkpointing is (not) on
    available_bytes: int | None
    needed_bytes: int  # the estimate for the largest forward of a step at this budget


def plan_memory(
    shape: ModelShape,
    longest_row: int,
    *,
    token_budget: int = 0,
    gradient_checkpointing: bool | None = None,
    available: int | None = None,
    reference_model: bool = False,
) -> MemoryPlan:
    """The token budget per forward and the checkpointing switch.

    ``token_budget`` > 0 and ``gradient_checkpointing`` not None are the user's and kept; otherwise the budget is the
    largest that fits ``available`` bytes (x ``USABLE_FRACTION``) without checkpointing, and checkpointing is turned
    on only when that budget would not hold the longest row. A forward always holds at least one row, so a row
    longer than the budget gets a forward of its own.
    """
    # The head's tiles are counted at their largest: trained positions are a fraction of a forward's tokens.
    fixed = static_bytes(shape, reference_model) + head_bytes(shape)
    usable = None if available is None else int(available * USABLE_FRACTION) - fixed

    def need(tokens: int, ckpt: bool) -> int:
        return (
            static_bytes(shape, reference_model)
            + head_bytes(shape, tokens)
            + tokens * activation_bytes_per_token(shape, ckpt)
        )

    def fits(tokens: int, ckpt: bool) -> int:
        return max(0, usable // activation_bytes_per_token(shape, ckpt)) if usable is not None else 0

    free = "unknown free memory" if available is None else f"{available / GIB:.1f} GiB free"
    if token_budget > 0:
        widest = max(token_budget, longest_row)
        if gradient_checkpointing is None:
            ckpt = usable is not None and need(widest, False) > fixed + usable
            why = f"--token-budget {token_budget}"
            if ckpt:
                why += (
                    f"; gradient checkpointing on: a {widest}-token forward needs ~{need(widest, False) / GIB:.1f} "
                    f"GiB without it ({free})"
                )
        else:
            ckpt = gradient_checkpointing
            why = f"--token-budget {token_budget}; gradient checkpointing {'on' if ckpt else 'off'} (as asked)"
        return MemoryPlan(token_budget, ckpt, why, available, need(widest, ckpt))

    if usable is None:
        # Nothing to size by: one 8k-token forward, ~the issue's 24 GB case with checkpointing on a 0.5B model.
        ckpt = True if gradient_checkpointing is None else gradient_checkpointing
        budget = max(8192, longest_row)
        why = f"--token-budget {budget} ({free}: a fixed default); gradient checkpointing {'on' if ckpt else 'off'}"
        return MemoryPlan(budget, ckpt, why, available, need(budget, ckpt))
    plain = fits(0, False)
    if gradient_checkpointing is None:
        ckpt = plain < longest_row
    else:
        ckpt = gradient_checkpointing
    budget = max(MIN_BUDGET, longest_row, fits(0, ckpt))
    why = f"--token-budget {budget} (fits {free})"
    if ckpt and gradient_checkpointing is None:
        why += (
            f"; gradient checkpointing on: the longest trace ({longest_row} tokens) needs "
            f"~{need(longest_row, False) / GIB:.1f} GiB without it"
        )
    else:
        why += f"; gradient checkpointing {'on' if ckpt else 'off'}{' (as asked)' if gradient_checkpointing else ''}"
    needed = need(max(budget, longest_row), ckpt)
    if needed > available * USABLE_FRACTION:
        why += (
            f"; the longest trace may not fit: ~{needed / GIB:.1f} GiB estimated for a "
            f"{max(budget, longest_row)}-token forward (lower --max-length, or use LoRA)"
        )
    return MemoryPlan(budget, ckpt, why, available, needed)


@dataclass(frozen=True)
class StepPlan:
    """What the steps of an epoch will forward: tokens (padded), trainable tokens and forwards per step."""

    steps: int
    forward_tokens: tuple[int, int, int]  # min, mean, max over steps
    trainable_tokens: tuple[int, int, int]
    forwards: tuple[int, int, int]

    def describe(self, budget: int, checkpointing: bool, tokens_per_s: float | None = None) -> str:
        def span(v: tuple[int, int, int]) -> str:
            return f"{v[1]:,}" if v[0] == v[2] else f"{v[1]:,} (min {v[0]:,}, max {v[2]:,})"

        text = (
            f"each of {self.steps} steps: {span(self.forward_tokens)} forward tokens, "
            f"{span(self.trainable_tokens)} trainable, in {span(self.forwards)} forwards of <= {budget:,} tokens"
        )
        if tokens_per_s:
            # A training forward + backward costs ~3 forwards (4 when checkpointing recomputes the forward).
            seconds = self.forward_tokens[1] * (4 if checkpointing else 3) / tokens_per_s
            text += f"; ~{_duration(seconds)} a step (scoring ran at {tokens_per_s:,.0f} tokens/s)"
        return text


def _duration(seconds: float) -> str:
    return f"{seconds:.0f} s" if seconds < 120 else f"{seconds / 60:.1f} min"


def _span(values: Sequence[int]) -> tuple[int, int, int]:
    return (min(values), round(sum(values) / len(values)), max(values)) if values else (0, 0, 0)


def plan_steps(
    steps: Sequence[Sequence[int]],
    row_tokens: Sequence[int],
    row_trainable: Sequence[int],
    *,
    micro_batches: int,
    token_budget: int,
    pad_waste: float,
) -> StepPlan:
    """Counts per step for the row indices of each step, split as the trainer splits them (one process)."""
    from polar_cli.train.dataset import length_buckets, partition_rows

    forward, trainable, forwards = [], [], []
    for step in steps:
        lengths = [row_tokens[i] for i in step]
        bins = partition_rows(lengths, micro_batches)
        padded = count = 0
        for b in bins:
            for group in length_buckets([lengths[i] for i in b], pad_waste, token_budget):
                padded += len(group) * max(lengths[b[j]] for j in group)
                count += 1
        forward.append(padded)
        trainable.append(sum(row_trainable[i] for i in step))
        forwards.append(count)
    return StepPlan(len(steps), _span(forward), _span(trainable), _span(forwards))
