"""The policy loss's VALUE and GRADIENT against hand-computed numbers (issue 29: the clip tests read metrics that are
computed without the clamped tensor, so two swapped bounds of the PPO clip passed them).

For each token: logp (pi_theta), old (pi_old) and behaviour (the engine's sampled logprob) are chosen so that the
ratio r = pi_theta / pi_old and the TIS weight w = min(pi_old / pi_behaviour, C) are round numbers; the loss and
d loss / d logp are written out by hand from the formulas (PPO-clip: -min(rA, clip(r, 1-eps_lo, 1+eps_hi)A) w;
CISPO: -sg(min(r, cap)) A logp w)."""

from __future__ import annotations

import math

import pytest
import torch

from polar_cli.train.trainer import policy_loss

EPS_LOW, EPS_HIGH, CISPO_CAP, TIS_CAP, CLAMP = 0.2, 0.28, 5.0, 2.0, 20.0
OLD = -1.0  # pi_old of every token; logp = OLD + log r


def _loss(
    ratios: list[float],
    adv: float,
    *,
    loss_type: str = "dapo",
    tis: list[float] | None = None,
    behavior: list[float] | None = None,
) -> tuple[list[float], list[float], list[float]]:
    logps = torch.tensor([[OLD + math.log(r) for r in ratios]], dtype=torch.float64, requires_grad=True)
    old = torch.full_like(logps, OLD).detach()
    if behavior is None:
        behavior = [OLD - math.log(w) for w in (tis or [1.0] * len(ratios))]
    behav = torch.tensor([behavior], dtype=torch.float64)
    per_token, ratio, log_is = policy_loss(
        logps,
        old,
        behav,
        torch.tensor([[adv]], dtype=torch.float64),
        loss_type=loss_type,
        epsilon_low=EPS_LOW,
        epsilon_high=EPS_HIGH,
        cispo_cap=CISPO_CAP,
        tis_cap=TIS_CAP,
        log_ratio_clamp=CLAMP,
    )
    per_token.sum().backward()
    return per_token[0].tolist(), logps.grad[0].tolist(), torch.exp(log_is)[0].tolist()


# r inside (1.1), above 1 + eps_high (1.5), between 1 + eps_low and 1 + eps_high (1.25: clipped only if the bounds
# were swapped), below 1 - eps_low (0.5), between 1 - eps_high and 1 - eps_low (0.75).
RATIOS = [1.1, 1.5, 1.25, 0.5, 0.75]


def test_ppo_clip_with_a_positive_advantage() -> None:
    loss, grad, _ = _loss(RATIOS, 2.0)
    # A > 0: the upper bound 1.28 caps the gain; below 1 nothing is clipped (min picks r A).
    assert loss == pytest.approx([-2.2, -2.56, -2.5, -1.0, -1.5])
    # d/dlogp of -r A is -r A where unclipped; a clipped token has no gradient.
    assert grad == pytest.approx([-2.2, 0.0, -2.5, -1.0, -1.5])


def test_ppo_clip_with_a_negative_advantage() -> None:
    loss, grad, _ = _loss(RATIOS, -2.0)
    # A < 0: the lower bound 0.8 caps how far a token is pushed down; above 1 nothing is clipped.
    assert loss == pytest.approx([2.2, 3.0, 2.5, 1.6, 1.6])
    assert grad == pytest.approx([2.2, 3.0, 2.5, 0.0, 0.0])


def test_tis_weights_the_loss_and_is_capped() -> None:
    # w = pi_old / pi_behaviour: 3 (capped to C = 2), 0.5, 1; and vLLM's -9999 sentinel gives C, not inf.
    loss, grad, weights = _loss(
        [1.1, 1.1, 1.1, 1.1], 1.0, behavior=[OLD - math.log(3.0), OLD - math.log(0.5), OLD, -9999.0]
    )
    assert weights == pytest.approx([2.0, 0.5, 1.0, 2.0])
    assert loss == pytest.approx([-2.2, -0.55, -1.1, -2.2])
    assert grad == pytest.approx([-2.2, -0.55, -1.1, -2.2])


def test_cispo_is_a_stopped_capped_ratio_times_the_logprob() -> None:
    ratios = [1.1, 7.0, 0.5]
    loss, grad, _ = _loss(ratios, 2.0, loss_type="cispo")
    logps = [OLD + math.log(r) for r in ratios]
    weights = [1.1, CISPO_CAP, 0.5]  # min(r, cap), no gradient through it
    assert loss == pytest.approx([-w * 2.0 * lp for w, lp in zip(weights, logps)])
    assert grad == pytest.approx([-w * 2.0 for w in weights])
    loss, grad, _ = _loss(ratios, -1.0, loss_type="cispo")
    assert grad == pytest.approx([w for w in weights])  # no lower clip for negative advantages in CISPO


def test_an_extreme_log_ratio_is_clamped_not_inf() -> None:
    loss, grad, _ = _loss([math.exp(50.0)], 1.0)
    assert all(math.isfinite(v) for v in loss + grad)
    assert loss == pytest.approx([-(1 + EPS_HIGH)])  # exp(clamp(50, 20)) is far above the clip: capped, no gradient


def test_both_log_ratios_are_clamped_at_both_ends() -> None:
    """r = exp(clamp(logp - old)) and log w = clamp(old - behaviour) at +-CLAMP: a sentinel at either end gives a
    bounded number, never exp(+-50) (the loss of such a token is ~0 or capped either way, so only the returned
    ratio and weight show a missing bound)."""
    logps = torch.tensor([[OLD + 50.0, OLD - 50.0]], dtype=torch.float64)
    old = torch.full_like(logps, OLD)
    behav = torch.tensor([[OLD, OLD + 50.0]], dtype=torch.float64)
    _, ratio, log_is = policy_loss(
        logps,
        old,
        behav,
        torch.tensor([[1.0]], dtype=torch.float64),
        loss_type="dapo",
        epsilon_low=EPS_LOW,
        epsilon_high=EPS_HIGH,
        cispo_cap=CISPO_CAP,
        tis_cap=TIS_CAP,
        log_ratio_clamp=CLAMP,
    )
    assert ratio[0].tolist() == pytest.approx([math.exp(CLAMP), math.exp(-CLAMP)], rel=1e-12)
    assert log_is[0].tolist() == pytest.approx([0.0, -CLAMP])
