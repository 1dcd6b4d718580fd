"""`polar train` options: every refusal and its boundary (pure, no torch)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from polar_cli.train.config import TrainConfig


def config(**kw) -> TrainConfig:
    return TrainConfig(inputs=[Path("shards")], model="m", output=Path("out"), **kw)


def test_defaults_are_valid() -> None:
    config().validate()


@pytest.mark.parametrize(
    "field,bad,good,message",
    [
        ("loss_type", "grpo", "cispo", "--loss-type must be one of dapo, cispo"),
        ("dtype", "float16", "bfloat16", "--dtype must be one of auto, float32, bfloat16"),
        ("scale_rewards", "batch", "none", "--scale-rewards must be 'group' or 'none'"),
        ("strategy", "whole", "per_request", "--strategy must be per_request or prefix_merging"),
        ("retokenized", "drop", "break", "--retokenized must be merge or break"),
        ("clip_against", "run", "start", "--clip-against must be step or start, not 'run'"),
        ("groups_per_step", 0, 1, "--groups-per-step must be >= 1"),
        ("grad_accum", 0, 1, "--grad-accum must be >= 1"),
        ("num_iterations", 0, 1, "--num-iterations must be >= 1"),
        ("max_length", 0, 1, "--max-length must be >= 1"),
        ("logging_steps", 0, 1, "--logging-steps must be >= 1"),
        ("epsilon_low", 1.0, 0.0, "clip epsilons"),
        ("epsilon_low", -0.01, 0.99, "clip epsilons"),
        ("epsilon_high", -0.01, 0.0, "clip epsilons"),
        ("temperature", 0.0, 0.01, "--temperature must be > 0"),
        ("lora_r", -1, 0, "--lora-r must be >= 0"),
    ],
)
def test_each_bad_value_is_refused_and_its_boundary_accepted(field, bad, good, message) -> None:
    with pytest.raises(ValueError, match="^" + re.escape(message)):  # the message starts with the option
        config(**{field: bad}).validate()
    cfg = config(**{field: good})
    if field == "epsilon_high":
        cfg.tis_cap = 1.5
    cfg.validate()


def test_the_tis_and_cispo_caps_warmup_and_staleness_bounds() -> None:
    # the TIS cap weighs pi_old / pi_behaviour (issue 10 #2), independent of the PPO clip
    with pytest.raises(ValueError, match=r"^--tis-cap \(0.99\) must be >= 1"):
        config(tis_cap=0.99).validate()
    config(tis_cap=1.0, epsilon_high=0.28).validate()
    with pytest.raises(ValueError, match="^--cispo-cap"):
        config(cispo_cap=1.0).validate()
    config(cispo_cap=1.01).validate()
    with pytest.raises(ValueError, match="^--warmup-ratio"):
        config(warmup_ratio=1.0).validate()
    config(warmup_ratio=0.99).validate()
    with pytest.raises(ValueError, match="^--max-staleness"):
        config(max_staleness=-1).validate()
    config(max_staleness=0).validate()
