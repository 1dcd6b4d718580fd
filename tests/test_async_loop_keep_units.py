"""``--drain keep``'s pure parts: how much of a batch was sampled across a push (``version_mix``, from the calls'
per-token version spans), and where running requests cannot survive a push, a refusal that says why."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from polar_cli.rollout.async_loop import keep_refusal, version_mix


def _spans(*parts: tuple[str, int, int]) -> str:
    return json.dumps([{"version": v, "start": a, "end": b} for v, a, b in parts])


def test_the_mix_counts_calls_tokens_and_the_tokens_after_each_calls_first_version() -> None:
    calls = [
        _spans(("0", 0, 7)),  # one version: 7 tokens, none after a push
        _spans(("0", 0, 3), ("1", 3, 10)),  # 7 tokens after its first version
        _spans(("0", 0, 2), ("1", 2, 4), ("2", 4, 9)),  # two pushes: 7 after the first version
        None,  # no spans (an engine that reports none): a call, no tokens
        "",
        "[]",  # no tokens sampled
    ]
    assert version_mix(calls) == {"calls": 6, "calls_mixed": 2, "tokens": 26, "tokens_after_push": 14}
    assert version_mix([]) == {"calls": 0, "calls_mixed": 0, "tokens": 0, "tokens_after_push": 0}


def test_a_call_starting_after_the_push_is_not_mixed() -> None:
    assert version_mix([_spans(("1", 0, 5))]) == {"calls": 1, "calls_mixed": 0, "tokens": 5, "tokens_after_push": 0}


def _model(tmp_path: Path, tied: bool | None) -> Path:
    model = tmp_path / "m"
    model.mkdir()
    config = {} if tied is None else {"tie_word_embeddings": tied}
    (model / "config.json").write_text(json.dumps(config))
    return model


def test_keep_is_refused_where_running_requests_cannot_survive_a_push(tmp_path: Path) -> None:
    untied = _model(tmp_path, False)
    keep_refusal("vllm", "in-place", untied)  # the one that works: no exception
    for kind in ("local", "sglang"):
        with pytest.raises(ValueError, match=f"--drain keep needs --engine vllm .*; {kind} has neither here"):
            keep_refusal(kind, "in-place", untied)
    with pytest.raises(
        ValueError, match="^--drain keep needs --vllm-push in-place: a restart drops every running request$"
    ):
        keep_refusal("vllm", "restart", untied)


@pytest.mark.parametrize("tied", [True, None])  # transformers' default is tied
def test_keep_is_refused_for_a_model_vllm_cannot_reload_in_place(tmp_path: Path, tied: bool | None) -> None:
    model = _model(tmp_path, tied)
    with pytest.raises(ValueError, match=r"--drain keep: .* cannot be loaded in place \(tied embeddings"):
        keep_refusal("vllm", "in-place", model)
