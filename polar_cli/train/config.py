"""Options of `polar train`, one dataclass (TRL's style); the Typer command only fills it in."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

# Only losses normalised by the whole step's trainable-token count: a step's traces vary in number
# and length, so per-micro-batch (bnpo), per-sequence (grpo) or per-padded-batch (dr_grpo)
# normalisers would make the gradient depend on how the step is split over processes and micro-batches.
LOSS_TYPES = ("dapo", "cispo")
DTYPES = ("auto", "float32", "bfloat16")


@dataclass
class TrainConfig:
    inputs: list[Path]  # raw capture shards or a built trace dataset (files or directories)
    model: str  # HF model directory to start from
    output: Path  # checkpoint directory written at the end (plus metrics.jsonl and the curves PNG)
    strategy: str = "prefix_merging"  # trajectory builder when `inputs` are raw capture shards
    broadcast_rewards: bool = False  # per_request: give every call its session's reward (polar build's flag)
    eot_token_id: int | None = None  # end-of-turn token for raw shards (polar build's flag); None: detected
    retokenized: str = "merge"  # raw shards: merge or break chains at a re-tokenized turn (polar build's flag)
    learning_rate: float = 1e-6
    optim: str = "adamw_torch"  # any TrainingArguments optimizer name (e.g. sgd)
    weight_decay: float = 0.1
    max_grad_norm: float = 1.0
    lr_scheduler: str = "constant"
    warmup_ratio: float = 0.0
    epochs: float = 1.0
    max_steps: int = -1  # > 0 overrides epochs
    groups_per_step: int = 4  # GRPO groups (tasks) whose traces make one optimizer step
    grad_accum: int = 1  # micro-batches per optimizer step and process
    num_iterations: int = 1  # optimizer steps taken on each step's batch (TRL's mu)
    # pi_old of the PPO clip and of TIS: the weights the run started from ("start": the clip bounds the whole run's
    # drift from the policy that sampled the traces, as verl/slime), or those at the start of each step ("step").
    clip_against: str = "start"
    epsilon_low: float = 0.2
    epsilon_high: float = 0.28
    tis_cap: float = 2.0  # C of truncated importance sampling: token weight min(pi_old / pi_behavior, C)
    cispo_cap: float = 5.0  # CISPO's cap on pi_theta / pi_old (TRL's suggested value)
    max_staleness: int | None = None  # refuse traces more than this many weight versions behind current_weight_version
    current_weight_version: str | None = None  # the version the starting weights carry (what reload tagged)
    beta: float = 0.0  # KL coefficient against the starting model
    loss_type: str = "dapo"
    scale_rewards: str = "group"  # "group": divide by the group's std; "none": raw LOO differences
    drop_zero_advantage: bool = True  # skip traces whose advantage is exactly 0 (DAPO dynamic sampling)
    max_length: int = 32768  # prompt + completion tokens; longer completions are clipped as a causal prefix
    temperature: float | None = None  # must equal the capture temperature when given
    lora_r: int = 0  # 0: full fine-tuning
    lora_alpha: int = 0  # 0: 2 * lora_r
    lora_dropout: float = 0.0
    lora_target_modules: list[str] = field(default_factory=lambda: ["all-linear"])
    # Compute dtype (autocast); parameters and optimizer state stay fp32, and the checkpoint is written
    # in the starting model's own dtype (what the engine serves). auto: bf16 on a capable GPU, else fp32.
    dtype: str = "auto"
    gradient_checkpointing: bool = False
    seed: int = 0
    resume: Path | None = None  # a checkpoint-N directory written by an earlier run
    save_steps: int = 0  # > 0: write output/checkpoint-N every N steps (what --resume reads)
    save_total_limit: int = 2
    logging_steps: int = 1
    plot: bool = True
    progress: bool = True

    def validate(self) -> None:
        if self.loss_type not in LOSS_TYPES:
            raise ValueError(f"--loss-type must be one of {', '.join(LOSS_TYPES)}, not {self.loss_type!r}")
        if self.dtype not in DTYPES:
            raise ValueError(f"--dtype must be one of {', '.join(DTYPES)}, not {self.dtype!r}")
        if self.scale_rewards not in ("group", "none"):
            raise ValueError(f"--scale-rewards must be 'group' or 'none', not {self.scale_rewards!r}")
        if self.strategy not in ("per_request", "prefix_merging"):
            raise ValueError(f"--strategy must be per_request or prefix_merging, not {self.strategy!r}")
        if self.clip_against not in ("step", "start"):
            raise ValueError(f"--clip-against must be step or start, not {self.clip_against!r}")
        if self.retokenized not in ("merge", "break"):
            raise ValueError(f"--retokenized must be merge or break, not {self.retokenized!r}")
        for name in ("groups_per_step", "grad_accum", "num_iterations", "max_length", "logging_steps"):
            if getattr(self, name) < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be >= 1")
        if not 0.0 <= self.epsilon_low < 1.0 or self.epsilon_high < 0.0:
            raise ValueError("clip epsilons must satisfy 0 <= epsilon_low < 1 and epsilon_high >= 0")
        if not self.tis_cap >= 1.0:
            raise ValueError(f"--tis-cap ({self.tis_cap}) must be >= 1: below 1 it would shrink on-policy tokens")
        if not self.cispo_cap > 1.0:
            raise ValueError(f"--cispo-cap ({self.cispo_cap}) must be > 1")
        if not 0.0 <= self.warmup_ratio < 1.0:
            raise ValueError("--warmup-ratio must be in [0, 1)")
        if self.max_staleness is not None and self.max_staleness < 0:
            raise ValueError("--max-staleness must be >= 0")
        if self.temperature is not None and self.temperature <= 0:
            raise ValueError("--temperature must be > 0")
        if self.lora_r < 0:
            raise ValueError("--lora-r must be >= 0")
