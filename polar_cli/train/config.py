"""Options of `polar train`, one dataclass (TRL's style): the Typer command's options are generated from its fields."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from polar_cli.build.rewards import TOOL_CALL_REWARD_HELP, check_tool_call_reward
from polar_cli.settings import option

# Only losses normalised by the whole step's trainable-token count: a step's traces vary in number
# and length, so per-micro-batch (bnpo), per-sequence (grpo) or per-padded-batch (dr_grpo)
# normalisers would make the gradient depend on how the step is split over processes and micro-batches.
LOSS_TYPES = ("dapo", "cispo")
DTYPES = ("auto", "float32", "bfloat16")


@dataclass
class TrainConfig:
    inputs: list[Path] = option(
        argument=True,
        help="A trace store (the proxy's polar_out: built on the fly) or a built trace dataset (`polar build`).",
    )
    model: str = option(flags=("--model", "-m"), help="Model directory to start from (the policy that sampled).")
    output: Path = option(flags=("--output", "-o"), help="Checkpoint directory to write (HF format, vLLM-ready).")
    strategy: str = option("prefix_merging", help="Builder for raw shards: prefix_merging or per_request.")
    broadcast_rewards: bool = option(
        False, flags=("--broadcast-rewards",), help="per_request: every call gets its session's reward."
    )
    eot_token_id: int | None = option(
        None, help="Raw shards: end-of-turn token id (default: detected from the calls, as `polar build`)."
    )
    retokenized: str = option(
        "break",
        help="Raw shards: break (the default) or merge chains at a re-tokenized sampled turn, as `polar build "
        "--retokenized`. break keeps the first step exactly on-policy; merge is off-policy from the re-tokenized "
        "turn on (the later turns were sampled after other token ids).",
    )
    roles: str = option(
        "agent",
        help="Raw shards: which calls to train, as `polar build --roles` (agent, auxiliary, discarded; "
        "comma-separated).",
    )
    tool_call_reward: float = option(0.0, help=TOOL_CALL_REWARD_HELP)
    learning_rate: float = option(1e-6, flags=("--lr", "--learning-rate"), help="Peak learning rate.")
    optim: str = option("adamw_torch", help="Optimizer (TrainingArguments name: adamw_torch, sgd, ...).")
    weight_decay: float = option(0.1)
    max_grad_norm: float = option(1.0)
    lr_scheduler: str = option("constant", help="constant, linear, cosine, ...")
    epochs: float = option(1.0, help="Passes over the traces.")
    max_steps: int = option(-1, help="Optimizer steps; > 0 overrides --epochs.")
    groups_per_step: int = option(4, help="GRPO groups (tasks) per optimizer step.")
    grad_accum: int = option(
        1, help="Micro-batches per step and process; each is split further into forwards by --token-budget."
    )
    # TRL's AsyncGRPOConfig.token_budget: tokens per forward, not rows per micro-batch.
    token_budget: int = option(
        0,
        help="Padded tokens per forward (each forward has its own backward, so this bounds activation memory); "
        "a longer trace gets a forward of its own. 0: the largest that fits the memory free at start.",
    )
    num_iterations: int = option(1, help="Optimizer steps on each step's batch (PPO mu).")
    clip_against: str = option(
        "start",
        help="pi_old of the PPO clip and TIS weight: start = the weights the run started from (one no-grad pass "
        "over the traces first, as verl/slime recompute old logprobs): the clip bounds the whole run's drift from "
        "the policy that sampled the traces; step = the weights at the start of each step (no bound across steps).",
    )
    epsilon_low: float = option(0.2, help="PPO clip: ratio >= 1 - eps_low.")
    epsilon_high: float = option(0.28, help="PPO clip: ratio <= 1 + eps_high (DAPO clip-higher).")
    tis_cap: float = option(2.0, help="Truncated importance sampling: token weight min(pi_old/pi_behavior, C).")
    cispo_cap: float = option(5.0, help="--loss-type cispo: cap on pi_theta/pi_old.")
    warmup_ratio: float = option(0.0, help="Linear LR warmup over this fraction of the steps.")
    current_weight_version: str | None = option(
        None, help="Version tag of --model (what `engine reload --weight-version` set): older traces are warned about."
    )
    max_staleness: int | None = option(
        None, help="Refuse traces more than this many weight versions behind --current-weight-version."
    )
    beta: float = option(0.0, help="KL coefficient to the starting model (0: no reference model).")
    loss_type: str = option("dapo", help=f"TRL loss: {', '.join(LOSS_TYPES)}.")
    scale_rewards: str = option("group", help="group: divide advantages by the group std; none.")
    # DAPO's dynamic sampling; the flag only turns it off.
    drop_zero_advantage: bool = option(
        True,
        flags=(" /--keep-zero-advantage",),
        help="Also forward traces whose advantage is 0 (they add no gradient).",
        show_default=False,
    )
    max_length: int = option(32768, help="Prompt + completion tokens; completions are clipped.")
    temperature: float | None = option(None, help="Must equal the capture temperature (read from traces).")
    lora_r: int = option(
        0,
        help="LoRA rank; 0 trains every weight. Merged into the checkpoint, and also saved alone in its adapter/ "
        "(what `polar engine serve --push adapter` loads in place).",
    )
    lora_init: Path | None = option(
        None,
        help="A saved LoRA adapter (a checkpoint's adapter/ directory) to go on training instead of a fresh one, "
        "over the --model it was trained on; --lora-r and --lora-alpha must be its own (polar loop --vllm-push "
        "adapter trains one adapter across iterations).",
    )
    lora_alpha: int = option(0, help="LoRA alpha (0: 2 x rank).")
    lora_dropout: float = option(0.0)
    lora_target_modules: list[str] = field(default_factory=lambda: ["all-linear"])
    # Parameters and optimizer state stay fp32, and the checkpoint is written in the starting model's own dtype
    # (what the engine serves).
    dtype: str = option(
        "auto",
        help=f"Compute dtype, {', '.join(DTYPES)} (auto: bf16 autocast on a capable GPU, else fp32); "
        "weights stay fp32.",
    )
    gradient_checkpointing: bool | None = option(
        None,
        flags=("--gradient-checkpointing/--no-gradient-checkpointing",),
        help="Recompute activations in the backward (~1/3 more compute, a fraction of the memory). "
        "Default: on only when the token budget needs it (said at start).",
        show_default=False,
    )
    seed: int = option(0)
    resume: Path | None = option(None, help="Resume from OUTPUT/checkpoint-N of an earlier run.")
    save_steps: int = option(0, help="Write OUTPUT/checkpoint-N every N steps (0: only the end).")
    save_total_limit: int = 2
    logging_steps: int = 1
    report_to: list[str] = option(
        default_factory=list,
        flags=("--report-to",),
        help="Experiment trackers TRL logs the training to: tensorboard, wandb, trackio, or none (repeatable, or a "
        "comma list, as TRL's report_to). Needs the pip extra trackers. All write locally under --logging-dir; "
        "wandb offline with WANDB_MODE=offline.",
    )
    run_name: str | None = option(None, help="--report-to: the run's name (default: the name of OUTPUT).")
    logging_dir: Path | None = option(
        None,
        help="--report-to: TensorBoard event files go to DIR/RUN_NAME, wandb's run to DIR/wandb, trackio's database "
        "to DIR/trackio (a WANDB_DIR or TRACKIO_DIR set in the environment wins). Default: OUTPUT/runs.",
    )
    project: str = option("polar", help="--report-to: the wandb / trackio project.")
    plot: bool = option(True, help="Write training_curves.png.")
    progress: bool = option(True, help="Rich progress bar.")

    @property
    def trackers(self) -> list[str]:
        """--report-to's trackers, parsed (none: [])."""
        from polar_cli.trackers import parse_report_to

        return parse_report_to(self.report_to)

    @property
    def tracker_run_name(self) -> str:
        return self.run_name or Path(self.output).name

    @property
    def tracker_dir(self) -> Path:
        return self.logging_dir if self.logging_dir is not None else Path(self.output) / "runs"

    def validate(self) -> None:
        self.trackers  # noqa: B018 (an unknown tracker, or none with another, is refused here)
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
        from polar_addon.call_roles import parse_roles

        parse_roles(self.roles)  # ValueError naming the unknown role
        check_tool_call_reward(self.tool_call_reward)
        if self.token_budget < 0:
            raise ValueError("--token-budget must be >= 0 (0: sized to the free memory)")
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
        if self.lora_init is not None and self.lora_r == 0:
            raise ValueError("--lora-init needs --lora-r (the adapter's rank)")
