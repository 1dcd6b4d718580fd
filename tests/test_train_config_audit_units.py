"""train.config's choices that are not the defaults (issue 29 audit): each accepted value of --clip-against and
--retokenized validates, and the token budget's refusal text and boundary."""

from __future__ import annotations

from pathlib import Path

import pytest

from polar_cli.train.config import TrainConfig


def config(**kw) -> TrainConfig:
    return TrainConfig(inputs=[Path("shards")], model="m", output=Path("out"), **kw)


@pytest.mark.parametrize("clip_against", ["step", "start"])
@pytest.mark.parametrize("retokenized", ["merge", "break"])
def test_every_documented_choice_validates(clip_against: str, retokenized: str) -> None:
    config(clip_against=clip_against, retokenized=retokenized).validate()


def test_a_token_budget_of_zero_is_sized_to_memory_and_below_zero_is_refused_by_name() -> None:
    config(token_budget=0).validate()
    with pytest.raises(ValueError) as caught:
        config(token_budget=-1).validate()
    assert str(caught.value) == "--token-budget must be >= 0 (0: sized to the free memory)"
