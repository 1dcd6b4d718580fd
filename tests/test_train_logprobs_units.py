"""The trained-positions head (`logprobs.py`) on a toy causal LM whose logits are chosen by hand: each token's hidden
state is a row of LOGITS and the head is the identity, so the log-probs, entropies and loss the head returns can be
written out from log_softmax(logits / T). Positions whose label is -100 (prompts, interstitial context, padding) are
never scored: zero log-prob, zero entropy, left out of the loss's count."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch
from torch import nn

from polar_cli.train.logprobs import add_trained_positions_head, trained_labels

# Next-token logits after each token id (vocabulary of 3).
LOGITS = [[2.0, 0.0, 0.0], [0.0, 1.0, -1.0], [1.0, 1.0, 1.0]]
E, LOG3 = math.e, math.log(3.0)


class Toy(nn.Module):
    """A causal LM in the shape the head expects: ``base_model(...).last_hidden_state``, ``get_output_embeddings``,
    ``config.get_text_config()``; its own forward answers the non-fused calls."""

    def __init__(self, bias: list[float] | None = None, **text: object) -> None:
        super().__init__()
        self.embed = nn.Embedding(3, 3)
        self.head = nn.Linear(3, 3, bias=bias is not None)
        with torch.no_grad():
            self.embed.weight.copy_(torch.tensor(LOGITS))
            self.head.weight.copy_(torch.eye(3))
            if bias is not None:
                self.head.bias.copy_(torch.tensor(bias))
        self.config = SimpleNamespace(get_text_config=lambda: SimpleNamespace(**text))
        self.base_calls: list[dict] = []

    def base_model(self, input_ids: torch.Tensor, **kwargs: object) -> SimpleNamespace:
        self.base_calls.append(kwargs)
        return SimpleNamespace(last_hidden_state=self.embed(input_ids))

    def get_output_embeddings(self) -> nn.Linear:
        return self.head

    def forward(self, input_ids: torch.Tensor, **kwargs: object) -> tuple[str, dict]:
        return "plain forward", kwargs


def fused(model: Toy, ids: list[list[int]], labels: list[list[int]], **kw):
    return model(input_ids=torch.tensor(ids), labels=torch.tensor(labels), fused_lm_head=True, **kw)


def test_log_probs_entropy_and_loss_at_a_temperature() -> None:
    model = Toy()
    assert add_trained_positions_head(model, 2.0, outputs=("log_probs", "entropy"))
    # Labels at positions 1 and 3 (the token after id 0 is 1, after id 2 is 0); position 2 is context (-100).
    out = fused(model, [[0, 1, 2, 0]], [[-100, 1, -100, 0]])
    # After id 0: logits / 2 = [1, 0, 0], log Z = log(e + 2). After id 2: uniform.
    lp = [-math.log(E + 2), 0.0, -LOG3]
    assert out.log_probs.tolist() == [pytest.approx(lp)]
    assert out.entropy.tolist() == [pytest.approx([math.log(E + 2) - E / (E + 2), 0.0, LOG3])]
    assert out.label_mask.tolist() == [[True, False, True]]
    assert out.loss.item() == pytest.approx(-(lp[0] + lp[2]) / 2)
    # The caller's normaliser replaces the count.
    assert fused(model, [[0, 1, 2, 0]], [[-100, 1, -100, 0]], num_items_in_batch=4).loss.item() == pytest.approx(
        -(lp[0] + lp[2]) / 4
    )
    assert model.base_calls[0]["use_cache"] is False


def test_only_labelled_positions_are_scored_in_every_row() -> None:
    model = Toy()
    add_trained_positions_head(model, 1.0)
    # Row 0: only the last position; row 1: the first two (its tail is padding, label -100).
    out = fused(model, [[2, 2, 1, 0], [1, 2, 0, 0]], [[-100, -100, -100, 0], [-100, 2, 1, -100]])
    z1 = math.log(1 + E + 1 / E)  # log Z after id 1 at T = 1
    assert out.log_probs.tolist() == [
        [0.0, 0.0, pytest.approx(0.0 - z1)],
        [pytest.approx(-1.0 - z1), pytest.approx(-LOG3), 0.0],
    ]
    assert out.entropy is None  # not asked for
    assert out.loss.item() == pytest.approx((z1 + 1.0 + z1 + LOG3) / 3)


def test_one_trained_position_is_its_own_mean() -> None:
    model = Toy()
    add_trained_positions_head(model, 1.0)
    out = fused(model, [[0, 0]], [[-100, 0]])
    logp = 2.0 - math.log(E * E + 2)
    assert out.log_probs.tolist() == [[pytest.approx(logp)]]
    assert out.loss.item() == pytest.approx(-logp)


def test_a_forward_with_nothing_to_train_is_a_connected_zero() -> None:
    model = Toy()
    add_trained_positions_head(model, 1.0, outputs=("log_probs", "entropy"))
    out = fused(model, [[0, 1, 2]], [[-100, -100, -100]])
    assert out.log_probs.tolist() == [[0.0, 0.0]] and out.entropy.tolist() == [[0.0, 0.0]]
    assert out.loss.item() == 0.0  # divided by 1, not by a zero count
    out.loss.backward()
    assert model.head.weight.grad is not None and not model.head.weight.grad.any()


def test_gradient_reaches_the_head_only_from_trained_positions() -> None:
    model = Toy()
    add_trained_positions_head(model, 1.0)
    out = fused(model, [[0, 1, 2]], [[-100, 1, -100]])
    out.log_probs.sum().backward()
    # d logp(1 | after 0) / d W = (onehot(1) - softmax([2, 0, 0])) outer hidden [2, 0, 0]; position 2 adds nothing.
    p = [E * E / (E * E + 2), 1 / (E * E + 2), 1 / (E * E + 2)]
    expected = [[(float(v == 1) - p[v]) * h for h in LOGITS[0]] for v in range(3)]
    assert model.head.weight.grad.tolist() == [pytest.approx(r) for r in expected]


def test_the_models_logit_scale_softcap_and_bias_are_applied() -> None:
    scaled = Toy(logit_scale=2.0)
    add_trained_positions_head(scaled, 2.0)
    # scale 2 then T 2: the logits as they are; after id 0 predicting 1: -log(e^2 + 2).
    assert fused(scaled, [[0, 1]], [[-100, 1]]).log_probs.item() == pytest.approx(-math.log(E * E + 2))
    capped = Toy(final_logit_softcapping=1.0)
    add_trained_positions_head(capped, 1.0)
    t = math.tanh(2.0)  # tanh of [2, 0, 0]
    assert fused(capped, [[0, 1]], [[-100, 1]]).log_probs.item() == pytest.approx(-math.log(math.exp(t) + 2))
    biased = Toy(bias=[0.0, 0.0, 1.0])
    add_trained_positions_head(biased, 1.0)
    # After id 2: [1, 1, 2]; predicting 2.
    assert fused(biased, [[2, 2]], [[-100, 2]]).log_probs.item() == pytest.approx(2.0 - math.log(2 * E + E * E))
    # A None scale is 1.
    plain = Toy(logit_scale=None, final_logit_softcapping=None)
    assert add_trained_positions_head(plain, 1.0)
    assert fused(plain, [[0, 1]], [[-100, 1]]).log_probs.item() == pytest.approx(-math.log(E * E + 2))


def test_other_scalings_and_router_losses_keep_trls_head() -> None:
    for text in ({"output_multiplier": 0.5}, {"lm_head_multiplier": 1.0}, {"logits_scaling": 2.0}):
        model = Toy(**text)
        assert add_trained_positions_head(model, 1.0) is False
        assert "forward" not in model.__dict__  # left as it was
    assert add_trained_positions_head(Toy(output_router_logits=True), 1.0) is False
    # Unset (None) scalings and a False router flag are no reason to refuse.
    assert add_trained_positions_head(Toy(output_multiplier=None, output_router_logits=False), 1.0) is True


def test_plain_calls_reach_the_models_own_forward() -> None:
    model = Toy()
    add_trained_positions_head(model, 1.0)
    labels = torch.tensor([[1, 2]])
    name, kwargs = model(input_ids=torch.tensor([[0, 1]]), labels=labels, attention_mask=None)
    assert name == "plain forward" and kwargs["labels"] is labels and "attention_mask" in kwargs
    name, kwargs = model(input_ids=torch.tensor([[0, 1]]))
    assert name == "plain forward" and "labels" not in kwargs
    assert model.base_calls == []


def test_trained_labels_keep_the_masked_tokens_of_the_window() -> None:
    ids = torch.tensor([[5, 6, 7, 8, 9], [1, 2, 3, 4, 0]])
    mask = torch.tensor([[1.0, 0.0, 1.0], [0.0, 1.0, 1.0]])  # the last 3 positions
    assert trained_labels(ids, mask).tolist() == [[-100, -100, 7, -100, 9], [-100, -100, -100, 4, 0]]
    assert trained_labels(ids, torch.ones((2, 5))).tolist() == ids.tolist()
    assert trained_labels(ids, torch.zeros((2, 1))).tolist() == [[-100] * 5] * 2
    assert ids.tolist() == [[5, 6, 7, 8, 9], [1, 2, 3, 4, 0]]  # not changed in place
