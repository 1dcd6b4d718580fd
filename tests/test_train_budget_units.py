"""`polar train`'s memory arithmetic on small made-up shapes whose numbers are worked out by hand: parameter counts,
bytes per token, the token budget and checkpointing switch at and one past their limits, the exact line that says
why, the free memory read from CUDA, the host and its cgroup, and the step plan's counts and wording."""

from __future__ import annotations

import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from polar_cli.train import budget
from polar_cli.train.budget import (
    GIB,
    ModelShape,
    StepPlan,
    activation_bytes_per_token,
    available_memory,
    head_bytes,
    lora_trainable_params,
    plan_memory,
    plan_steps,
    static_bytes,
)


def text_config(**kw) -> SimpleNamespace:
    base = dict(
        hidden_size=8,
        intermediate_size=16,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        vocab_size=10,
        tie_word_embeddings=False,
    )
    return SimpleNamespace(**{**base, **kw})


# --- parameter counts ------------------------------------------------------------------------------------------------


def test_model_shape_counts_attention_mlp_norms_and_embeddings() -> None:
    # head_dim 8 / 2 = 4; attention q, o: 8 x 2 x 4 each, k, v: 8 x 1 x 4 each = 192; MLP 3 x 8 x 16 = 384; two norms
    # 16: 592 a layer. Embedding and untied head 80 each, the final norm 8.
    shape = ModelShape.from_config(text_config())
    assert shape == ModelShape(8, 16, 2, 10, 2 * 592 + 2 * 80 + 8, 2 * 592 + 2 * 80 + 8)
    # Tied: one embedding matrix; the trainable count is the caller's when given.
    tied = ModelShape.from_config(text_config(tie_word_embeddings=True), trainable_params=77)
    assert (tied.num_params, tied.trainable_params) == (2 * 592 + 80 + 8, 77)
    # An explicit head_dim (3): q, o 8 x 2 x 3, k, v 8 x 1 x 3 = 144.
    assert ModelShape.from_config(text_config(head_dim=3)).num_params == 2 * (144 + 400) + 168
    # No key/value head count: as many as attention heads (q, k, v, o all 8 x 2 x 4 = 256).
    assert ModelShape.from_config(text_config(num_key_value_heads=None)).num_params == 2 * (256 + 400) + 168


def test_model_shape_reads_a_multimodal_models_text_config() -> None:
    outer = SimpleNamespace(get_text_config=lambda: text_config(hidden_size=4, num_attention_heads=1))
    # head_dim 4; attention 4 x 1 x 4 x 4 = 64; MLP 3 x 4 x 16 = 192; norms 8: 264 a layer; embeddings 40 each.
    shape = ModelShape.from_config(outer)
    assert (shape.hidden_size, shape.num_params) == (4, 2 * 264 + 80 + 4)


def test_lora_counts_rank_times_in_plus_out_of_every_projection() -> None:
    shape = ModelShape(8, 16, 2, 10, 0, 0)
    # Per layer: q, k, v, o 4 x (8 + 8); gate, up, down 3 x (8 + 16).
    assert lora_trainable_params(shape, 4) == 2 * 4 * (64 + 72)


# --- bytes -----------------------------------------------------------------------------------------------------------

SHAPE = ModelShape(
    hidden_size=64, intermediate_size=128, num_layers=4, vocab_size=1000, num_params=1_000_000, trainable_params=500_000
)
PLAIN = 4 * 4 * (16 * 64 + 4 * 128)  # 24,576 bytes a token: every layer's activations
CKPT = 4 * 4 * 2 * 64 + 2 * 4 * (16 * 64 + 4 * 128)  # 14,336: each layer's input and two layers recomputed


def test_activation_bytes_per_token() -> None:
    assert activation_bytes_per_token(SHAPE, checkpointing=False) == PLAIN == 24_576
    assert activation_bytes_per_token(SHAPE, checkpointing=True) == CKPT == 14_336


def test_static_and_head_bytes() -> None:
    # fp32 weights, then gradients and two AdamW moments (12 bytes) of what trains.
    assert static_bytes(SHAPE) == GIB + 4_000_000 + 6_000_000
    assert static_bytes(SHAPE, reference_model=True) == GIB + 8_000_000 + 6_000_000
    assert head_bytes(SHAPE, 100) == 100 * 1000 * 4 * 4
    assert head_bytes(SHAPE, 4096) == head_bytes(SHAPE, 4097) == head_bytes(SHAPE) == 4096 * 1000 * 16
    wide = ModelShape(64, 128, 4, 151_936, 0, 0)
    assert head_bytes(wide, 10) == 10 * 32768 * 16  # one tile's width, not the whole vocabulary


# --- the plan --------------------------------------------------------------------------------------------------------

FIXED = GIB + 10_000_000 + 4096 * 1000 * 16  # static + the head's tiles at their largest
# Free memory whose usable part (60%, less FIXED) holds 3,000 tokens without checkpointing and 5,142 with it.
FREE = int((FIXED + 3000 * PLAIN + 3) / 0.6)


def need(tokens: int, ckpt: bool) -> int:
    return GIB + 10_000_000 + min(tokens, 4096) * 1000 * 16 + tokens * (CKPT if ckpt else PLAIN)


def test_the_budget_is_what_fits_and_checkpointing_starts_one_token_past_it() -> None:
    assert (int(FREE * 0.6) - FIXED) // PLAIN == 3000 and (int(FREE * 0.6) - FIXED) // CKPT == 5142
    free = f"{FREE / GIB:.1f} GiB free"
    assert free == "1.9 GiB free"
    at = plan_memory(SHAPE, 3000, available=FREE)
    assert at == budget.MemoryPlan(
        3000, False, "--token-budget 3000 (fits 1.9 GiB free); gradient checkpointing off", FREE, need(3000, False)
    )
    past = plan_memory(SHAPE, 3001, available=FREE)
    assert (past.token_budget, past.gradient_checkpointing) == (5142, True)
    assert past.why == (
        "--token-budget 5142 (fits 1.9 GiB free); gradient checkpointing on: the longest trace (3001 tokens) needs "
        f"~{need(3001, False) / GIB:.1f} GiB without it"
    )
    assert past.needed_bytes == need(5142, True) and past.available_bytes == FREE
    # A short longest trace: still the budget that fits.
    assert plan_memory(SHAPE, 10, available=FREE).token_budget == 3000


def test_a_longest_trace_past_what_fits_gets_its_own_forward_and_a_warning() -> None:
    at = plan_memory(SHAPE, 5142, available=FREE)
    assert at.token_budget == 5142 and at.needed_bytes <= FREE * 0.6 and "may not fit" not in at.why
    past = plan_memory(SHAPE, 5143, available=FREE)
    assert past.token_budget == 5143 and past.needed_bytes == need(5143, True)
    assert past.why.endswith(
        f"; the longest trace may not fit: ~{need(5143, True) / GIB:.1f} GiB estimated for a 5143-token forward "
        "(lower --max-length, or use LoRA)"
    )


def test_no_budget_below_the_minimum() -> None:
    little = int(FIXED / 0.6)  # nothing left for activations
    plan = plan_memory(SHAPE, 100, available=little)
    assert (plan.token_budget, plan.gradient_checkpointing) == (512, True)
    assert plan_memory(SHAPE, 700, available=little).token_budget == 700
    none_left = plan_memory(SHAPE, 100, available=1)  # less than the fixed part: no negative budget
    assert none_left.token_budget == 512 and "may not fit" in none_left.why


def test_checkpointing_as_asked() -> None:
    on = plan_memory(SHAPE, 100, gradient_checkpointing=True, available=FREE)
    assert on.token_budget == 5142 and on.gradient_checkpointing
    assert on.why == "--token-budget 5142 (fits 1.9 GiB free); gradient checkpointing on (as asked)"
    off = plan_memory(SHAPE, 4000, gradient_checkpointing=False, available=FREE)
    assert off.token_budget == 4000 and not off.gradient_checkpointing
    assert off.why.startswith("--token-budget 4000 (fits 1.9 GiB free); gradient checkpointing off; the longest")


def test_a_reference_model_takes_its_weights_from_the_budget() -> None:
    ref = plan_memory(SHAPE, 10, available=FREE, reference_model=True)
    assert ref.token_budget == (int(FREE * 0.6) - FIXED - 4_000_000) // PLAIN
    assert ref.needed_bytes == need(ref.token_budget, False) + 4_000_000


def test_unknown_free_memory_uses_a_fixed_budget() -> None:
    plan = plan_memory(SHAPE, 100)
    assert plan == budget.MemoryPlan(
        8192,
        True,
        "--token-budget 8192 (unknown free memory: a fixed default); gradient checkpointing on",
        None,
        need(8192, True),
    )
    long = plan_memory(SHAPE, 9000, gradient_checkpointing=False)
    assert (long.token_budget, long.gradient_checkpointing) == (9000, False)
    assert long.why.endswith("a fixed default); gradient checkpointing off") and long.needed_bytes == need(9000, False)


def test_a_given_budget_switches_checkpointing_on_only_when_its_forward_does_not_fit() -> None:
    fits = plan_memory(SHAPE, 100, token_budget=3000, available=FREE)
    assert fits == budget.MemoryPlan(3000, False, "--token-budget 3000", FREE, need(3000, False))
    # The forward's own head tiles are counted here (3,432 tokens still fit), not the largest tile.
    assert not plan_memory(SHAPE, 100, token_budget=3432, available=FREE).gradient_checkpointing
    over = plan_memory(SHAPE, 100, token_budget=3433, available=FREE)
    assert over.gradient_checkpointing and over.needed_bytes == need(3433, True)
    assert over.why == (
        "--token-budget 3433; gradient checkpointing on: a 3433-token forward needs "
        f"~{need(3433, False) / GIB:.1f} GiB without it (1.9 GiB free)"
    )
    # The widest forward is the longest row when it is past the budget.
    assert not plan_memory(SHAPE, 3432, token_budget=1000, available=FREE).gradient_checkpointing
    longer = plan_memory(SHAPE, 3433, token_budget=1000, available=FREE)
    assert longer.gradient_checkpointing and longer.token_budget == 1000 and longer.needed_bytes == need(3433, True)
    # Unknown memory: kept off; asked: kept as asked.
    assert plan_memory(SHAPE, 100, token_budget=50_000) == budget.MemoryPlan(
        50_000, False, "--token-budget 50000", None, need(50_000, False)
    )
    asked = plan_memory(SHAPE, 100, token_budget=50_000, gradient_checkpointing=True, available=FREE)
    assert asked.gradient_checkpointing and asked.needed_bytes == need(50_000, True)
    assert asked.why == "--token-budget 50000; gradient checkpointing on (as asked)"
    off = plan_memory(SHAPE, 100, token_budget=50_000, gradient_checkpointing=False, available=FREE)
    assert not off.gradient_checkpointing and off.why == "--token-budget 50000; gradient checkpointing off (as asked)"


# --- free memory -----------------------------------------------------------------------------------------------------


def test_available_memory_on_cuda(monkeypatch: pytest.MonkeyPatch) -> None:
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda *a: (5 * GIB, 80 * GIB))
    assert available_memory(processes=4) == 5 * GIB  # each process has its own device


def test_available_memory_on_the_host(monkeypatch: pytest.MonkeyPatch) -> None:
    import psutil
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(psutil, "virtual_memory", lambda: SimpleNamespace(available=12_000))
    monkeypatch.setattr(budget, "_cgroup_free", lambda: None)
    assert available_memory() == 12_000 and available_memory(3) == 4_000 and available_memory(0) == 12_000
    monkeypatch.setattr(budget, "_cgroup_free", lambda: 9_000)  # the container's limit is lower
    assert available_memory(2) == 4_500
    monkeypatch.setattr(budget, "_cgroup_free", lambda: 20_000)
    assert available_memory(2) == 6_000
    monkeypatch.setitem(sys.modules, "psutil", None)  # not installed: unknown
    assert available_memory() is None


def cgroup(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, files: dict[str, str]) -> int | None:
    for name, text in files.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    monkeypatch.setattr(budget, "Path", lambda path: tmp_path if path == "/sys/fs/cgroup" else Path(path))
    return budget._cgroup_free()


def test_cgroup_v2_limit_less_usage(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    assert cgroup(tmp_path, monkeypatch, {"memory.max": "1000\n", "memory.current": "300\n"}) == 700


def test_cgroup_usage_over_the_limit_is_nothing_free(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    assert cgroup(tmp_path, monkeypatch, {"memory.max": "1000", "memory.current": "1500"}) == 0


def test_cgroup_without_a_limit(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    files = {"memory.max": "max", "memory.current": "300", "memory/memory.limit_in_bytes": str(1 << 60)}
    assert cgroup(tmp_path, monkeypatch, files) is None


def test_cgroup_v1_limit_below_the_unlimited_mark(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # v2's file says no limit; v1's is read, with no usage file: the whole limit.
    files = {"memory.max": "max", "memory/memory.limit_in_bytes": str((1 << 60) - 1)}
    assert cgroup(tmp_path, monkeypatch, files) == (1 << 60) - 1


def test_cgroup_v2_unlimited_number_falls_through_to_v1(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    files = {"memory.max": str(1 << 60), "memory.current": "1", "memory/memory.limit_in_bytes": "5000"}
    assert cgroup(tmp_path, monkeypatch, files) == 5000


def test_cgroup_unreadable_files_are_skipped(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # A malformed v2 limit, then a v1 limit: the v1 one.
    files = {"memory.max": "lots", "memory.current": "1", "memory/memory.limit_in_bytes": "4000"}
    assert cgroup(tmp_path, monkeypatch, files) == 4000


def test_cgroup_nothing_readable(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    assert cgroup(tmp_path, monkeypatch, {}) is None
    # A v2 limit without its usage file is not a limit to trust.
    assert cgroup(tmp_path, monkeypatch, {"memory.max": "1000"}) is None


# --- the step plan ---------------------------------------------------------------------------------------------------


def test_step_plan_counts_each_step_as_the_trainer_splits_it() -> None:
    lengths = [100, 300, 50, 60, 200, 1000]
    trainable = [10, 30, 5, 6, 20, 1]
    steps = [[0, 1], [2, 3, 4], [5]]
    two = plan_steps(steps, lengths, trainable, micro_batches=2, token_budget=0, pad_waste=0.1)
    # Step 0: one row per micro-batch, 400 tokens in 2 forwards. Step 1: 200 alone; 60 and 50 share a forward
    # padded to 60 (waste 10 of 110 real). Step 2: one 1000-token row.
    assert two == StepPlan(3, (320, 573, 1000), (1, 24, 40), (1, 2, 2))
    one = plan_steps([[2, 3]], lengths, trainable, micro_batches=1, token_budget=120, pad_waste=0.1)
    assert one.forward_tokens == (120, 120, 120) and one.forwards == (1, 1, 1)
    split = plan_steps([[2, 3]], lengths, trainable, micro_batches=1, token_budget=119, pad_waste=0.1)
    assert split.forward_tokens == (110, 110, 110) and split.forwards == (2, 2, 2)
    assert plan_steps([], lengths, trainable, micro_batches=1, token_budget=0, pad_waste=0.1) == StepPlan(
        0, (0, 0, 0), (0, 0, 0), (0, 0, 0)
    )


def test_step_plan_describes_spans_and_the_time_a_step_takes() -> None:
    plan = StepPlan(3, (320, 573, 1000), (1, 24, 40), (1, 2, 2))
    assert plan.describe(4096, checkpointing=False) == (
        "each of 3 steps: 573 (min 320, max 1,000) forward tokens, 24 (min 1, max 40) trainable, "
        "in 2 (min 1, max 2) forwards of <= 4,096 tokens"
    )
    even = StepPlan(2, (5000, 5000, 5000), (7, 7, 7), (3, 3, 3))
    assert even.describe(2048, checkpointing=False, tokens_per_s=1000.0) == (
        "each of 2 steps: 5,000 forward tokens, 7 trainable, in 3 forwards of <= 2,048 tokens; ~15 s a step "
        "(scoring ran at 1,000 tokens/s)"
    )
    # Checkpointing recomputes the forward: 4 forwards' worth, 20 s.
    assert "; ~20 s a step (scoring ran at 1,000 tokens/s)" in even.describe(2048, True, 1000.0)
    # Minutes from 120 s on.
    assert "; ~119 s a step" in StepPlan(1, (119, 119, 119), (1, 1, 1), (1, 1, 1)).describe(9, True, 4.0)
    assert "; ~2.0 min a step" in StepPlan(1, (120, 120, 120), (1, 1, 1), (1, 1, 1)).describe(9, True, 4.0)
    assert "; ~2.5 min a step" in StepPlan(1, (150, 150, 150), (1, 1, 1), (1, 1, 1)).describe(9, True, 4.0)
    assert "~" not in even.describe(2048, False, tokens_per_s=None) and "~" not in even.describe(2048, False, 0.0)


# --- limits met exactly, missing config fields, and the estimates the messages quote --------------------------------


def test_model_shape_without_optional_config_fields() -> None:
    # No key/value head count and no tie flag at all (older configs): as many heads as attention, untied.
    text = text_config()
    del text.num_key_value_heads, text.tie_word_embeddings
    shape = ModelShape.from_config(text)
    assert shape.num_params == 2 * (256 + 400) + 168
    # An odd width: head_dim is the integer h // heads (10 // 4 = 2), the counts are ints.
    odd = ModelShape.from_config(text_config(hidden_size=10, num_attention_heads=4, num_key_value_heads=4))
    # q, k, v, o 10 x 4 x 2 each = 320; MLP 3 x 10 x 16 = 480; norms 20; embeddings 100 each, final norm 10.
    assert odd.num_params == 2 * (320 + 480 + 20) + 210 and isinstance(odd.num_params, int)


def test_host_memory_is_split_in_whole_bytes(monkeypatch: pytest.MonkeyPatch) -> None:
    import psutil
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(psutil, "virtual_memory", lambda: SimpleNamespace(available=12_001))
    monkeypatch.setattr(budget, "_cgroup_free", lambda: None)
    assert available_memory(2) == 6_000


def test_a_one_token_row_with_no_memory_left_still_checkpoints() -> None:
    plan = plan_memory(SHAPE, 1, available=int(FIXED / 0.6))  # room for 0 tokens without checkpointing
    assert plan.gradient_checkpointing and plan.token_budget == 512


def test_a_budget_of_one_token_is_the_users() -> None:
    plan = plan_memory(SHAPE, 100, token_budget=1, available=FREE)
    assert plan.token_budget == 1 and plan.why.startswith("--token-budget 1")


def test_a_given_budget_exactly_filling_the_memory_needs_no_checkpointing() -> None:
    free = 2_009_184_000  # int(free x 0.6) is exactly what a 3001-token forward needs without checkpointing
    assert int(free * 0.6) == need(3001, False)
    assert not plan_memory(SHAPE, 100, token_budget=3001, available=free).gradient_checkpointing
    assert plan_memory(SHAPE, 100, token_budget=3001, available=free - 1).gradient_checkpointing


def test_a_longest_trace_exactly_filling_the_memory_is_not_warned_about() -> None:
    free = 2_058_823_040  # free x 0.6 is exactly what the 6000-token forward needs with checkpointing
    assert free * 0.6 == need(6000, True)
    plan = plan_memory(SHAPE, 6000, available=free)
    assert plan.token_budget == 6000 and plan.gradient_checkpointing and "may not fit" not in plan.why
    assert "may not fit" in plan_memory(SHAPE, 6000, available=free - 1).why


def test_the_messages_quote_the_estimate_without_checkpointing() -> None:
    # 50,000 tokens: ~2.2 GiB without checkpointing, ~1.7 GiB with it.
    assert (f"{need(50_000, False) / GIB:.1f}", f"{need(50_000, True) / GIB:.1f}") == ("2.2", "1.7")
    given = plan_memory(SHAPE, 100, token_budget=50_000, available=FREE)
    assert given.why == (
        "--token-budget 50000; gradient checkpointing on: a 50000-token forward needs ~2.2 GiB without it "
        "(1.9 GiB free)"
    )
    auto = plan_memory(SHAPE, 50_000, available=FREE)
    assert "; gradient checkpointing on: the longest trace (50000 tokens) needs ~2.2 GiB without it;" in auto.why


def test_the_step_time_comes_from_the_mean_step() -> None:
    plan = StepPlan(2, (1000, 2000, 3000), (1, 1, 1), (1, 1, 1))
    assert "; ~6 s a step (scoring ran at 1,000 tokens/s)" in plan.describe(4096, False, 1000.0)
