"""`polar train`'s own decisions, without training: which traces are too stale to train (counted, warned about or
refused), the LoRA merge that makes the checkpoint an engine serves, and the dtype it is saved in."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest
import torch

from polar_cli.trace import Trace
from polar_cli.train.run import StaleTraces, check_staleness, merge_lora_state_dict, serving_dtype


def _trace(versions: list[str], trainable: bool = True) -> Trace:
    return Trace("t", "s", [1], [2], [1], [-0.5], trainable=trainable, weight_versions=versions)


def test_a_trace_is_as_stale_as_its_oldest_call(caplog: pytest.LogCaptureFixture) -> None:
    traces = [_trace(["5"]), _trace(["4", "5"]), _trace(["2", "5"]), _trace(["5", "3"])]
    with caplog.at_level(logging.WARNING, logger="polar.train"):
        assert check_staleness(traces, "5", max_staleness=3) == 3
    assert caplog.messages == [
        "3 trainable traces were sampled by weights older than '5' (up to 3 versions behind): their importance "
        "weights correct for it only up to --tis-cap"
    ]
    assert [r.name for r in caplog.records] == ["polar.train"]  # `polar train --verbose` shows its logger


def test_the_bound_itself_is_allowed_and_one_past_it_refused() -> None:
    traces = [_trace(["3"]), _trace(["5"])]
    assert check_staleness(traces, "5", max_staleness=2) == 1
    with pytest.raises(StaleTraces) as refused:
        check_staleness(traces, "6", max_staleness=2)
    assert str(refused.value) == (
        "2 trainable traces were sampled by weights older than '6' (up to 3 versions behind): their importance "
        "weights correct for it only up to --tis-cap; --max-staleness is 2. Recapture or raise the bound."
    )
    assert check_staleness(traces, "6", max_staleness=None) == 2  # no bound: counted and warned about only


def test_untrainable_untagged_and_current_traces_are_not_stale(caplog: pytest.LogCaptureFixture) -> None:
    traces = [_trace(["1"], trainable=False), _trace([]), _trace(["7"]), _trace(["9"])]  # 9: newer, not stale
    with caplog.at_level(logging.WARNING, logger="polar.train"):
        assert check_staleness(traces, "7", max_staleness=0) == 0
    assert caplog.messages == []
    assert check_staleness([_trace(["0"])], None, max_staleness=0) == 0  # no current version: nothing to compare
    assert check_staleness([_trace(["1"], trainable=False), _trace([]), _trace(["1"])], "2", max_staleness=1) == 1


def test_versions_that_are_not_numbers_are_one_behind_unless_equal() -> None:
    assert check_staleness([_trace(["ckpt-a"])], "ckpt-a", max_staleness=0) == 0
    assert check_staleness([_trace(["ckpt-a"])], "ckpt-b", max_staleness=1) == 1
    with pytest.raises(StaleTraces, match=r"up to 1 versions behind"):
        check_staleness([_trace(["ckpt-a"])], "ckpt-b", max_staleness=0)
    assert check_staleness([_trace(["3"])], "ckpt-b", max_staleness=1) == 1  # one side a number: compared as text


def test_lora_merge_is_w_plus_scaled_b_a_in_fp32() -> None:
    g = torch.Generator().manual_seed(0)
    w = torch.randn(4, 3, generator=g).to(torch.bfloat16)
    a = torch.randn(2, 3, generator=g)
    b = torch.randn(4, 2, generator=g)
    other_a, other_b = torch.randn(2, 3, generator=g), torch.randn(4, 2, generator=g)
    bias = torch.randn(4, generator=g)
    norm = torch.ones(3)
    state = {
        "base_model.model.layers.0.q_proj.base_layer.weight": w,
        "base_model.model.layers.0.q_proj.base_layer.bias": bias,
        "base_model.model.layers.0.q_proj.lora_A.default.weight": a,
        "base_model.model.layers.0.q_proj.lora_B.default.weight": b,
        "base_model.model.layers.0.q_proj.lora_A.other.weight": other_a,
        "base_model.model.layers.0.q_proj.lora_B.other.weight": other_b,
        "base_model.model.layers.0.norm.weight": norm,
        "lm_head.weight": norm,  # a key without PEFT's prefix keeps its name
    }
    merged = merge_lora_state_dict(state, scaling=0.5)
    assert sorted(merged) == [
        "layers.0.norm.weight",
        "layers.0.q_proj.bias",
        "layers.0.q_proj.weight",
        "lm_head.weight",
    ]
    expected = w.float() + 0.5 * (b @ a)
    assert merged["layers.0.q_proj.weight"].dtype == torch.float32  # merged in fp32: cast once when saved
    assert torch.equal(merged["layers.0.q_proj.weight"], expected)
    assert merged["layers.0.q_proj.bias"] is bias and merged["layers.0.norm.weight"] is norm
    other = merge_lora_state_dict(state, scaling=2.0, adapter="other")
    assert torch.equal(other["layers.0.q_proj.weight"], w.float() + 2.0 * (other_b @ other_a))


def test_a_base_layer_without_its_adapter_is_kept_as_it_is() -> None:
    w = torch.randn(2, 2)
    merged = merge_lora_state_dict({"base_model.model.k.base_layer.weight": w}, scaling=1.0)
    assert merged == {"k.weight": w}


@pytest.mark.parametrize(("stored", "expected"), [("bfloat16", torch.bfloat16), ("float16", torch.float16)])
def test_serving_dtype_is_the_checkpoints(tmp_path: Path, stored: str, expected: torch.dtype) -> None:
    config = {"model_type": "qwen2", "hidden_size": 8, "num_attention_heads": 2, "num_hidden_layers": 1}
    (tmp_path / "config.json").write_text(json.dumps(config | {"torch_dtype": stored}))
    assert serving_dtype(str(tmp_path)) == expected
    (tmp_path / "config.json").write_text(json.dumps(config))
    assert serving_dtype(str(tmp_path)) == torch.float32  # none stored: what transformers loads
