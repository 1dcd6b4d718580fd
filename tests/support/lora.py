"""A LoRA adapter with random weights over a model, saved as `polar train --lora-r` saves one in a checkpoint's
``adapter/`` (PEFT's format, its config naming the base by absolute path): what a server of adapters loads."""

from __future__ import annotations

from pathlib import Path

import torch


def random_adapter(base: Path, dest: Path, seed: int, rank: int = 8) -> Path:
    """``dest`` holding ``adapter/`` (every linear layer, B random so that it changes the policy) and the base's
    config.json (a checkpoint to `polar engine reload`)."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    net = get_peft_model(
        AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32),
        LoraConfig(r=rank, lora_alpha=2 * rank, target_modules="all-linear"),
    )
    generator = torch.Generator().manual_seed(seed)
    for name, param in net.named_parameters():
        if "lora_B" in name:
            param.data = 0.05 * torch.randn(param.shape, generator=generator)
    net.peft_config["default"].base_model_name_or_path = str(Path(base).resolve())
    net.save_pretrained(dest / "adapter")
    (dest / "config.json").write_text((Path(base) / "config.json").read_text())
    return dest
