"""`polar train --lora-r` saves the adapter alone beside the merged checkpoint (what `polar engine serve --push adapter`
loads in place), and `--lora-init` goes on training a saved adapter: the adapter over its base is exactly the merged
checkpoint, a continued adapter starts from the saved weights (not a fresh, zero one), and an adapter of another
shape is refused rather than half loaded."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

from polar_cli.serving import ADAPTER_DIR
from polar_cli.train.config import TrainConfig
from polar_cli.train.run import run_training
from tests.support.train_traces import TraceFactory, two_group_specs

os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")


@pytest.fixture(scope="module")
def traces(tiny_model_dir: Path):
    return TraceFactory(tiny_model_dir, temperature=0.7, seed=1).traces(two_group_specs())


def _config(model: Path, out: Path, **kw) -> TrainConfig:
    base = dict(inputs=[], model=str(model), output=out, learning_rate=5e-2, groups_per_step=2, max_steps=2,
                progress=False, dtype="float32", lora_r=4)  # fmt: skip
    return TrainConfig(**{**base, **kw})


def _logits(model, ids: list[int]) -> torch.Tensor:
    with torch.inference_mode():
        return model(input_ids=torch.tensor([ids])).logits[0].float()


@pytest.fixture(scope="module")
def trained(tiny_model_dir: Path, traces, tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("lora") / "ckpt"
    run_training(_config(tiny_model_dir, out), traces=traces)
    return out


def test_the_adapter_over_its_base_is_the_merged_checkpoint(tiny_model_dir: Path, trained: Path) -> None:
    from peft import PeftModel
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    adapter = trained / ADAPTER_DIR
    config = json.loads((adapter / "adapter_config.json").read_text())
    assert (config["r"], config["lora_alpha"]) == (4, 8)
    assert config["base_model_name_or_path"] == str(tiny_model_dir.resolve())  # what a server of adapters checks
    weights = load_file(adapter / "adapter_model.safetensors")
    assert weights and all(".lora_A." in k or ".lora_B." in k for k in weights)
    assert all(v.dtype == torch.float32 for v in weights.values())  # as trained; the engine casts
    assert any(v.abs().max() > 0 for k, v in weights.items() if ".lora_B." in k)  # trained, not the zero init
    ids = [1, 17, 250, 31, 9, 77, 402, 5, 66, 12, 300, 41]
    base = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    served = _logits(PeftModel.from_pretrained(base, adapter).eval(), ids)
    merged = _logits(AutoModelForCausalLM.from_pretrained(trained, dtype=torch.float32).eval(), ids)
    plain = _logits(AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval(), ids)
    # The merged checkpoint is rounded once to the model's own dtype; the adapter is not.
    tolerance = 2e-2 if json.loads((trained / "config.json").read_text()).get("dtype") == "bfloat16" else 1e-4
    assert (served - merged).abs().max() < tolerance
    assert (served - plain).abs().max() > 10 * tolerance  # the adapter changed the policy


def test_lora_init_goes_on_from_the_saved_adapter(tiny_model_dir: Path, trained: Path, traces, tmp_path: Path) -> None:
    from safetensors.torch import load_file

    # No update (lr 0): the continued adapter is the saved one exactly; a fresh adapter would have saved B = 0.
    out = tmp_path / "again"
    run_training(_config(tiny_model_dir, out, lora_init=trained / ADAPTER_DIR, learning_rate=0.0), traces=traces)
    before = load_file(trained / ADAPTER_DIR / "adapter_model.safetensors")
    after = load_file(out / ADAPTER_DIR / "adapter_model.safetensors")
    assert before.keys() == after.keys()
    assert all(torch.equal(before[k], after[k]) for k in before)
    merged_before, merged_after = load_file(trained / "model.safetensors"), load_file(out / "model.safetensors")
    assert all(torch.equal(merged_before[k], merged_after[k]) for k in merged_before)


def test_an_adapter_of_another_shape_is_refused(tiny_model_dir: Path, trained: Path, traces, tmp_path: Path) -> None:
    adapter = trained / ADAPTER_DIR
    with pytest.raises(ValueError, match=rf"^--lora-init {adapter}: its r is 4, this run's 8 \(pass --lora-r 4\)$"):
        run_training(_config(tiny_model_dir, tmp_path / "r8", lora_init=adapter, lora_r=8), traces=traces)
    with pytest.raises(ValueError, match=r"its lora_alpha is 8, this run's 3 \(pass --lora-alpha 8\)$"):
        run_training(_config(tiny_model_dir, tmp_path / "a3", lora_init=adapter, lora_alpha=3), traces=traces)
    with pytest.raises(ValueError, match="its weights do not fit this run's adapter"):
        run_training(
            _config(tiny_model_dir, tmp_path / "q", lora_init=adapter, lora_target_modules=["q_proj"]), traces=traces
        )
    with pytest.raises(ValueError, match="not a saved LoRA adapter"):
        run_training(_config(tiny_model_dir, tmp_path / "none", lora_init=tmp_path), traces=traces)
    with pytest.raises(ValueError, match=r"^--lora-init needs --lora-r \(the adapter's rank\)$"):
        _config(tiny_model_dir, tmp_path / "no", lora_init=adapter, lora_r=0).validate()
