"""Hand-checked tests of core_algos.py: masked_mean, agg_loss, policy_loss, tis_weights, value_loss, kl_penalty,
token_log_probs (entropy, chunked head), token rewards and the in-reward KL controller, GAE, REINFORCE++(-baseline),
whitening, group_advantages / grpo_advantages / rloo_advantages, compute_advantages; and Config's checks. Tiny
tensors, no models.
    python -m pytest tests/test_losses.py -q

Every expected value is written out by hand (literal numbers or scalar python with math), never by
calling another vectorised implementation of the same formula.
"""

import math
from typing import get_args

import pytest
import torch

from config import Config
from core_algos import (AggMode, agg_loss, compute_advantages, gae, gae_advantages,
                        group_advantages, grpo_advantages, kl_in_reward, kl_penalty, lr_factor, masked_mean, on_last_token,
                        overlong_penalty, preference_loss, rollout_mask,
                        masked_whiten, policy_loss, reinforce_pp_advantages, rloo_advantages, tis_weights,
                        head_log_probs, token_log_probs, update_kl_coef, value_loss)
from hybrid_engine import HybridConfig

MODES = list(get_args(AggMode))
EPS = 1e-6  # group_advantages' default eps


def approx(x, rel=1e-6, abs=1e-6):
    return pytest.approx(x, rel=rel, abs=abs)


# ---------------------------------------------------------------------------------------------------
# masked_mean / agg_loss
# ---------------------------------------------------------------------------------------------------

# B=3, R=4; rows hold 3, 2 and 4 real tokens. Padding carries 100 so any leak shows up.
LOSS = torch.tensor([[1.0, 2.0, 3.0, 100.0],
                     [4.0, 5.0, 100.0, 100.0],
                     [6.0, 7.0, 8.0, 9.0]], dtype=torch.float64)
MASK = torch.tensor([[1.0, 1.0, 1.0, 0.0],
                     [1.0, 1.0, 0.0, 0.0],
                     [1.0, 1.0, 1.0, 1.0]], dtype=torch.float64)
# Row sums 6, 9, 30 (total 45); 9 tokens; 3 sequences; R = 4.
HAND = {
    "token-mean": 45 / 9,  # 5.0
    "token-sum": 45.0,
    "seq-mean-token-sum": 45 / 3,  # 15.0
    "seq-mean-token-mean": (6 / 3 + 9 / 2 + 30 / 4) / 3,  # (2 + 4.5 + 7.5) / 3 = 14/3
    "seq-mean-token-sum-norm": 45 / (3 * 4),  # norm_len defaults to R = 4 -> 3.75
}


def test_masked_mean_ignores_padding_and_empty_mask_is_zero():
    assert masked_mean(LOSS, MASK).item() == approx(45 / 9)
    assert masked_mean(LOSS, torch.zeros_like(MASK)).item() == 0.0  # clamp(min=1): no 0/0


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
@pytest.mark.parametrize("mode", MODES)
def test_a_nan_or_inf_at_a_masked_position_never_counts(mode, bad):
    """In the loss and in its gradient: the mask selects, it does not multiply (NaN * 0 is NaN)."""
    poisoned = LOSS.clone()
    poisoned[MASK == 0] = bad
    x = poisoned.clone().requires_grad_()
    loss = agg_loss(x, MASK, mode)
    loss.backward()
    assert loss.item() == approx(HAND[mode])
    assert torch.isfinite(x.grad).all() and (x.grad[MASK == 0] == 0).all()
    assert masked_mean(poisoned, MASK).item() == approx(45 / 9)


@pytest.mark.parametrize("mode", MODES)
def test_seq_mean_modes_skip_sequences_without_response_tokens(mode):
    """A fourth, fully masked row (e.g. a truncated response whose loss is masked) changes no mode's value."""
    loss = torch.cat([LOSS, torch.full((1, 4), 50.0, dtype=torch.float64)])
    mask = torch.cat([MASK, torch.zeros(1, 4, dtype=torch.float64)])
    assert agg_loss(loss, mask, mode).item() == approx(HAND[mode])


@pytest.mark.parametrize("mode", MODES)
def test_agg_loss_modes_by_hand(mode):
    assert agg_loss(LOSS, MASK, mode).item() == approx(HAND[mode])


def test_agg_loss_seq_mean_token_sum_norm_explicit_norm_len():
    assert agg_loss(LOSS, MASK, "seq-mean-token-sum-norm", norm_len=8).item() == approx(45 / (3 * 8))  # 1.875
    assert agg_loss(LOSS, MASK, "seq-mean-token-sum-norm", norm_len=5).item() == approx(45 / (3 * 5))  # 3.0


def test_agg_loss_explicit_counts_override_the_batch_counts():
    assert agg_loss(LOSS, MASK, "token-mean", n_tokens=15).item() == approx(45 / 15)
    assert agg_loss(LOSS, MASK, "seq-mean-token-sum", n_seqs=5).item() == approx(45 / 5)
    assert agg_loss(LOSS, MASK, "seq-mean-token-mean", n_seqs=6).item() == approx(14 / 6)
    assert agg_loss(LOSS, MASK, "seq-mean-token-sum-norm", n_seqs=6, norm_len=2).item() == approx(45 / 12)


@pytest.mark.parametrize("norm_len", [None, 8])
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("split", [1, 2])  # uneven micro-batches: rows [0:1]+[1:3] and [0:2]+[2:3]
def test_agg_loss_micro_batches_sum_to_whole_batch(mode, norm_len, split):
    whole = agg_loss(LOSS, MASK, mode, norm_len=norm_len).item()
    expected = HAND[mode] if not (mode == "seq-mean-token-sum-norm" and norm_len == 8) else 45 / (3 * 8)
    assert whole == approx(expected)
    parts = [(LOSS[:split], MASK[:split]), (LOSS[split:], MASK[split:])]
    n_tokens = torch.tensor(9.0, dtype=torch.float64)  # as ActorWorker.update passes it: mask.sum()
    total = sum(agg_loss(l, m, mode, n_tokens=n_tokens, n_seqs=3, norm_len=norm_len).item() for l, m in parts)
    assert total == approx(expected)


def test_agg_loss_unknown_mode_raises_naming_it():
    with pytest.raises(ValueError, match="seq-sum-banana"):
        agg_loss(LOSS, MASK, "seq-sum-banana")


# ---------------------------------------------------------------------------------------------------
# policy_loss
# ---------------------------------------------------------------------------------------------------

CLIP_LOW, CLIP_HIGH, CLIP_C = 0.2, 0.28, 3.0  # asymmetric (clip-higher): ratio range [0.8, 1.28]


def _batch(rows, old_logps):
    """rows: per sequence a list of (adv, ratio, real?) -> logp, old_logp, adv, mask [B, R] (float64)."""
    old = torch.tensor(old_logps, dtype=torch.float64)
    logp = torch.tensor([[o + math.log(r) for o, (_, r, _) in zip(orow, row)] for orow, row in zip(old_logps, rows)],
                        dtype=torch.float64)
    adv = torch.tensor([[a for a, _, _ in row] for row in rows], dtype=torch.float64)
    mask = torch.tensor([[float(m) for _, _, m in row] for row in rows], dtype=torch.float64)
    return logp, old, adv, mask


# (adv, ratio, real token?)
PL_ROWS = [
    [(+1.0, 1.5, 1),    # pos adv above 1+clip_high: clipped to 1.28 -> loss -1.28       (clipfrac)
     (-1.0, 0.5, 1),    # neg adv below 1-clip_low: clipped to 0.8  -> loss 0.8          (clipfrac)
     (+2.0, 1.1, 1),    # inside the trust region -> -2.2
     (+5.0, 10.0, 0)],  # padding: would be clipped if it counted
    [(-2.0, 5.0, 1),    # neg adv, ratio > clip_c: dual-clip -> 2 * 3 = 6                (clipfrac_lower)
     (+1.0, 0.5, 1),    # pos adv, ratio low: pessimistic max keeps the unclipped -0.5
     (-1.0, 1.5, 1),    # neg adv, 1.28 < ratio < clip_c: unclipped 1.5 (not dual-clipped)
     (-3.0, 100.0, 0)], # padding: would be dual-clipped if it counted
]
PL_OLD = [[-0.5, -1.0, -2.0, -0.3], [-1.5, -0.7, -0.2, -4.0]]
PL_TOKEN_LOSSES = [[-1.28, 0.8, -2.2], [6.0, -0.5, 1.5]]  # real tokens only, by hand
# sum = -1.28 + 0.8 - 2.2 + 6.0 - 0.5 + 1.5 = 4.32 over 6 tokens; row sums -2.68 and 7.0


def test_policy_loss_token_mean_and_metrics_by_hand():
    logp, old, adv, mask = _batch(PL_ROWS, PL_OLD)
    loss, metrics = policy_loss(logp, old, adv, mask, CLIP_LOW, CLIP_HIGH, CLIP_C, "token-mean")
    assert loss.item() == approx(4.32 / 6)  # 0.72
    assert metrics["actor/pg_clipfrac"] == approx(2 / 6)  # row0 tokens 0 and 1
    assert metrics["actor/pg_clipfrac_lower"] == approx(1 / 6)  # row1 token 0
    # ppo_kl = mean(old_logp - logp) = mean(-log ratio) over real tokens
    kl = -(math.log(1.5) + math.log(0.5) + math.log(1.1) + math.log(5.0) + math.log(0.5) + math.log(1.5)) / 6
    assert metrics["actor/ppo_kl"] == approx(kl)


def test_policy_loss_passes_agg_mode_and_counts():
    logp, old, adv, mask = _batch(PL_ROWS, PL_OLD)
    args = (logp, old, adv, mask, CLIP_LOW, CLIP_HIGH, CLIP_C)
    assert policy_loss(*args, "seq-mean-token-sum")[0].item() == approx((-2.68 + 7.0) / 2)
    assert policy_loss(*args, "seq-mean-token-mean")[0].item() == approx((-2.68 / 3 + 7.0 / 3) / 2)
    assert policy_loss(*args, "token-mean", n_tokens=12)[0].item() == approx(4.32 / 12)
    assert policy_loss(*args, "seq-mean-token-sum-norm", n_seqs=4, norm_len=5)[0].item() == approx(4.32 / 20)


def test_policy_loss_padding_never_counts():
    logp, old, adv, mask = _batch(PL_ROWS, PL_OLD)
    base = policy_loss(logp, old, adv, mask, CLIP_LOW, CLIP_HIGH, CLIP_C, "token-mean")
    # scramble every padded position: loss and all metrics must stay put
    pad = mask == 0
    logp2, old2, adv2 = logp.clone(), old.clone(), adv.clone()
    logp2[pad], old2[pad], adv2[pad] = 7.0, -9.0, -50.0
    other = policy_loss(logp2, old2, adv2, mask, CLIP_LOW, CLIP_HIGH, CLIP_C, "token-mean")
    assert other[0].item() == approx(base[0].item())
    assert {k: v.item() for k, v in other[1].items()} == pytest.approx({k: v.item() for k, v in base[1].items()})


def test_policy_loss_nan_data_at_padding_reaches_neither_loss_nor_gradient():
    logp, old, adv, mask = _batch(PL_ROWS, PL_OLD)
    grads = []
    for poison in (False, True):
        o, a = old.clone(), adv.clone()
        if poison:
            o[mask == 0], a[mask == 0] = float("nan"), float("inf")
        lp = logp.clone().requires_grad_()
        loss, metrics = policy_loss(lp, o, a, mask, CLIP_LOW, CLIP_HIGH, CLIP_C, "token-mean")
        loss.backward()
        assert loss.item() == approx(4.32 / 6) and all(math.isfinite(v) for v in metrics.values())
        grads.append(lp.grad)
    assert torch.isfinite(grads[1]).all()
    torch.testing.assert_close(grads[1], grads[0])


@pytest.mark.parametrize("adv, ratio, expected, clipped", [
    (+1.0, 1.5, -1.28, True),   # positive advantage: ratio capped at 1 + clip_high
    (-1.0, 0.5, 0.8, True),     # negative advantage: ratio floored at 1 - clip_low
    (+1.0, 1.1, -1.1, False),   # inside [0.8, 1.28]: unclipped
    (-1.0, 0.9, 0.9, False),
    (+2.0, 0.85, -1.7, False),
])
def test_policy_loss_single_token(adv, ratio, expected, clipped):
    logp, old, a, mask = _batch([[(adv, ratio, 1)]], [[-1.0]])
    loss, metrics = policy_loss(logp, old, a, mask, CLIP_LOW, CLIP_HIGH, CLIP_C, "token-mean")
    assert loss.item() == approx(expected)
    assert metrics["actor/pg_clipfrac"] == (1.0 if clipped else 0.0)
    assert metrics["actor/pg_clipfrac_lower"] == 0.0
    assert metrics["actor/ppo_kl"] == approx(-math.log(ratio))


def test_policy_loss_clip_higher_is_asymmetric():
    # ratio 1.25 (adv +2) and 0.75 (adv -1) are both 0.25 from 1: with clip_low=0.2, clip_high=0.28 the first
    # is inside the range (unclipped, -2 * 1.25) and the second is clipped at the floor 0.8 (1 * 0.8).
    logp, old, adv, mask = _batch([[(+2.0, 1.25, 1), (-1.0, 0.75, 1)]], [[-0.4, -1.2]])
    loss, m = policy_loss(logp, old, adv, mask, 0.2, 0.28, CLIP_C, "seq-mean-token-sum")
    assert loss.item() == approx(-2.5 + 0.8)  # -1.7
    assert m["actor/pg_clipfrac"] == approx(1 / 2)
    # swapped (clip_low=0.28, clip_high=0.2): 1.25 is now capped at 1.2, 0.75 sits above the floor 0.72
    loss, m = policy_loss(logp, old, adv, mask, 0.28, 0.2, CLIP_C, "seq-mean-token-sum")
    assert loss.item() == approx(-2.4 + 0.75)  # -1.65
    assert m["actor/pg_clipfrac"] == approx(1 / 2)


@pytest.mark.parametrize("adv, ratio", [(-2.0, 5.0), (-1.0, 4.0), (-0.5, 1e6)])
def test_policy_loss_dual_clip_exact(adv, ratio):
    logp, old, a, mask = _batch([[(adv, ratio, 1)]], [[-1.0]])
    for dtype in (torch.float64, torch.float32):
        loss, m = policy_loss(logp.to(dtype), old.to(dtype), a.to(dtype), mask.to(dtype),
                              CLIP_LOW, CLIP_HIGH, CLIP_C, "token-mean")
        assert loss.item() == -adv * CLIP_C  # exactly, e.g. 2 * 3 = 6
        assert m["actor/pg_clipfrac_lower"] == 1.0
        assert m["actor/pg_clipfrac"] == 0.0  # the upper clip made the loss smaller, not larger


def test_policy_loss_dual_clip_only_for_negative_advantages():
    # positive advantage with a huge ratio: ordinary upper clip at 1.28, no dual clip
    logp, old, a, mask = _batch([[(+2.0, 5.0, 1)]], [[-1.0]])
    loss, m = policy_loss(logp, old, a, mask, CLIP_LOW, CLIP_HIGH, CLIP_C, "token-mean")
    assert loss.item() == approx(-2.0 * 1.28)
    assert m["actor/pg_clipfrac_lower"] == 0.0
    assert m["actor/pg_clipfrac"] == 1.0


# ---------------------------------------------------------------------------------------------------
# tis_weights (truncated importance sampling)
# ---------------------------------------------------------------------------------------------------

# old - rollout log-probs: [[ln 0.5, ln 3, 0, (pad) ln 10]]: ratios 0.5, 3 (above the cap of 2), 1, padding
TIS_OLD = torch.tensor([[-1.0, -0.5, -2.0, -0.1]], dtype=torch.float64)
TIS_ROLLOUT = TIS_OLD - torch.tensor([[math.log(0.5), math.log(3.0), 0.0, math.log(10.0)]], dtype=torch.float64)
TIS_MASK = torch.tensor([[1.0, 1.0, 1.0, 0.0]], dtype=torch.float64)


def test_tis_weights_are_zero_at_padding():
    old = torch.tensor([[-1.0, float("nan")], [-2.0, -0.5]])
    rollout = torch.tensor([[-1.5, 0.0], [-2.0, 30.0]])
    mask = torch.tensor([[1.0, 0.0], [1.0, 0.0]])
    weights, metrics = tis_weights(old, rollout, mask, cap=2.0)
    assert weights.tolist() == [[approx(math.exp(0.5)), 0.0], [1.0, 0.0]]
    assert metrics["clipfrac"] == 0.0


def test_tis_weights_by_hand():
    weights, metrics = tis_weights(TIS_OLD, TIS_ROLLOUT, TIS_MASK, cap=2.0)
    assert weights[0, :3].tolist() == approx([0.5, 2.0, 1.0])
    assert metrics["weight_mean"] == approx((0.5 + 2.0 + 1.0) / 3)  # padding (10 -> 2) left out
    assert metrics["weight_max"] == 2.0 and metrics["clipfrac"] == approx(1 / 3)


def test_tis_weights_multiply_token_losses():
    # one row of three real tokens, ratio 1 (no PPO clipping): token losses -adv = [-1, -2, 3]
    logp = old = torch.zeros(1, 3, dtype=torch.float64)
    adv = torch.tensor([[1.0, 2.0, -3.0]], dtype=torch.float64)
    mask = torch.ones(1, 3, dtype=torch.float64)
    weights = torch.tensor([[0.5, 2.0, 1.0]], dtype=torch.float64)
    loss, _ = policy_loss(logp, old, adv, mask, CLIP_LOW, CLIP_HIGH, CLIP_C, "token-mean", weights)
    assert loss.item() == approx((-1 * 0.5 - 2 * 2.0 + 3 * 1.0) / 3)  # -0.5


# ---------------------------------------------------------------------------------------------------
# kl_penalty
# ---------------------------------------------------------------------------------------------------

KL_LOGP = torch.tensor([[-1.0, -2.0, -0.5], [-0.25, -3.0, -1.5]], dtype=torch.float64)
KL_REF = torch.tensor([[-2.0, -1.0, -0.5], [-0.75, -1.0, -1.5]], dtype=torch.float64)
# log_ratio = logp - ref = [[1, -1, 0], [0.5, -2, 0]]


def test_kl_k1():
    assert kl_penalty(KL_LOGP, KL_REF, "k1").flatten().tolist() == approx([1.0, -1.0, 0.0, 0.5, -2.0, 0.0])


@pytest.mark.parametrize("kind", ["k2", "mse"])
def test_kl_k2_and_mse(kind):
    assert kl_penalty(KL_LOGP, KL_REF, kind).flatten().tolist() == approx([0.5, 0.5, 0.0, 0.125, 2.0, 0.0])


@pytest.mark.parametrize("kind", ["k3", "low_var_kl"])
def test_kl_k3_and_low_var_kl(kind):
    # k3 = r - 1 - log r with r = ref / policy = exp(ref - logp)
    expected = [
        math.exp(-1.0) - 1.0 + 1.0,   # ref - logp = -1
        math.exp(1.0) - 1.0 - 1.0,    # ref - logp = +1
        0.0,
        math.exp(-0.5) - 1.0 + 0.5,   # ref - logp = -0.5
        math.exp(2.0) - 1.0 - 2.0,    # ref - logp = +2
        0.0,
    ]
    assert kl_penalty(KL_LOGP, KL_REF, kind).flatten().tolist() == approx(expected)


def test_kl_k3_nonnegative_zero_when_equal_and_clamped():
    vals = [-6.0, -3.0, -1.0, -0.3, -0.01, 0.0]
    logp = torch.tensor([[a for a in vals for _ in vals]], dtype=torch.float64)
    ref = torch.tensor([[b for _ in vals for b in vals]], dtype=torch.float64)
    k3 = kl_penalty(logp, ref, "k3")
    assert (k3 >= 0).all()
    same = kl_penalty(ref, ref, "k3")
    assert (same == 0).all()
    assert (k3[logp == ref] == 0).all() and (k3[logp != ref] > 0).all()
    # ref - logp = 19: exp(19) - 20 is huge -> clamped at 10 (as verl does)
    assert kl_penalty(torch.tensor([-20.0]), torch.tensor([-1.0]), "k3").item() == 10.0


def test_kl_abs():
    assert kl_penalty(KL_LOGP, KL_REF, "abs").flatten().tolist() == approx([1.0, 1.0, 0.0, 0.5, 2.0, 0.0])


@pytest.mark.parametrize("kind", ["k1+", "k3+", "low_var_kl+"])
def test_straight_through_kl_has_the_base_value_and_k2s_gradient(kind):
    logp = KL_LOGP.clone().requires_grad_()
    kl = kl_penalty(logp, KL_REF, kind)
    assert kl.detach().flatten().tolist() == approx(kl_penalty(KL_LOGP, KL_REF, kind[:-1]).flatten().tolist())
    kl.sum().backward()
    # d/dlogp of 0.5 * (logp - ref)^2 is the log-ratio [[1, -1, 0], [0.5, -2, 0]]
    assert logp.grad.flatten().tolist() == approx([1.0, -1.0, 0.0, 0.5, -2.0, 0.0])


def test_kl_unknown_kind_raises():
    with pytest.raises(ValueError, match="k4"):
        kl_penalty(KL_LOGP, KL_REF, "k4")


# ---------------------------------------------------------------------------------------------------
# token_log_probs: entropy
# ---------------------------------------------------------------------------------------------------


def entropy_from_logits(logits: torch.Tensor) -> torch.Tensor:
    """The entropy token_log_probs gives beside any target's log-prob: [..., V] -> [...]."""
    return token_log_probs(logits, torch.zeros(logits.shape[:-1], dtype=torch.long), with_entropy=True)[1]


@pytest.mark.parametrize("V", [2, 5, 7])
def test_entropy_uniform_is_log_v(V):
    logits = torch.full((2, 3, V), 3.7)
    ent = entropy_from_logits(logits)
    assert ent.shape == (2, 3)
    assert ent.flatten().tolist() == approx([math.log(V)] * 6)


def test_entropy_peaked_distributions_by_hand():
    # [log 3, 0] -> p = (0.75, 0.25)
    two = -(0.75 * math.log(0.75) + 0.25 * math.log(0.25))
    # [10, 0, 0, 0] -> p0 = e^10 / (e^10 + 3), others 1 / (e^10 + 3)
    z = math.exp(10.0) + 3.0
    p0, p1 = math.exp(10.0) / z, 1.0 / z
    peaked = -(p0 * math.log(p0) + 3 * p1 * math.log(p1))
    assert entropy_from_logits(torch.tensor([math.log(3.0), 0.0], dtype=torch.float64)).item() == approx(two)
    assert entropy_from_logits(torch.tensor([10.0, 0.0, 0.0, 0.0], dtype=torch.float64)).item() == approx(peaked)
    # fully one-hot in float32 (huge logit): entropy 0, finite
    assert entropy_from_logits(torch.tensor([1000.0, 0.0, 0.0, 0.0])).item() == approx(0.0)


def test_token_log_probs_equal_log_softmax():
    """The target's logit minus logsumexp is log_softmax's entry, at any temperature; the entropy is -sum p log p."""
    g = torch.Generator().manual_seed(0)
    logits, targets = torch.randn(3, 4, 11, generator=g, dtype=torch.float64), torch.randint(0, 11, (3, 4), generator=g)
    logp, entropy = token_log_probs(logits, targets, temperature=0.7, with_entropy=True)
    reference = (logits / 0.7).log_softmax(-1)  # [3, 4, 11]
    torch.testing.assert_close(logp, reference.gather(-1, targets[..., None]).squeeze(-1))
    torch.testing.assert_close(entropy, -(reference.exp() * reference).sum(-1))


def test_token_log_probs_of_bf16_logits_upcast_in_place():
    """bf16 logits (autocast's) are upcast once and scaled in place: the values equal log_softmax's on the same logits
    in fp32, the gradient reaches the bf16 logits, and the caller's tensor is left as it was."""
    x = torch.randn(5, 11, generator=torch.Generator().manual_seed(2)).bfloat16().requires_grad_()
    before, targets = x.detach().clone(), torch.tensor([0, 3, 10, 7, 7])
    logp, _ = token_log_probs(x, targets, temperature=0.7)
    reference = (x.detach().float().requires_grad_() / 0.7).log_softmax(-1).gather(-1, targets[:, None]).squeeze(-1)
    torch.testing.assert_close(logp, reference)
    logp.sum().backward()
    assert torch.equal(x.detach(), before) and torch.isfinite(x.grad).all()


@pytest.mark.parametrize("chunk_bytes", [4 * 7 * 3, 1 << 20])  # 3 rows a chunk (V = 7), and all rows in one
def test_head_log_probs_in_chunks_equal_full_logits(chunk_bytes):
    """Chunked through the head (checkpointed under autograd): the log-probs, entropies and the gradients of hidden,
    weight and bias equal those of the full [n, V] logits."""
    g = torch.Generator().manual_seed(1)
    hidden = torch.randn(10, 5, generator=g, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(7, 5, generator=g, dtype=torch.float64, requires_grad=True)
    bias = torch.randn(7, generator=g, dtype=torch.float64, requires_grad=True)
    targets = torch.randint(0, 7, (10,), generator=g)
    results = []
    for chunk in (chunk_bytes, None):
        if chunk is None:  # the reference: one [n, V] logits tensor
            logp, entropy = token_log_probs(hidden @ weight.T + bias, targets, 1.3, with_entropy=True)
        else:
            logp, entropy = head_log_probs(hidden, weight, bias, targets, 1.3, with_entropy=True, chunk_bytes=chunk)
        grads = torch.autograd.grad((logp * torch.arange(10.0)).sum() + entropy.sum(), (hidden, weight, bias))
        results.append((logp, entropy, *grads))
    for a, b in zip(*results):
        torch.testing.assert_close(a, b)


def test_head_log_probs_entropy_without_grad():
    """entropy_grad=False: the entropy is a metric (no graph), the log-prob still has one."""
    hidden, weight = torch.randn(4, 3, requires_grad=True), torch.randn(5, 3)
    logp, entropy = head_log_probs(hidden, weight, None, torch.zeros(4, dtype=torch.long), 1.0, with_entropy=True,
                                   entropy_grad=False)
    assert logp.requires_grad and not entropy.requires_grad


def test_low_var_kl_of_a_huge_gap_has_a_finite_gradient():
    """k3 exponentiates the log-ratio: clamped to +-20 first (as verl), a gap of 100 gives the bound 10 and a zero
    gradient; unclamped, exp overflows to inf and the clamp's backward makes 0 * inf = NaN, which skips the step."""
    logp = torch.tensor([-100.0, 100.0, 0.5], requires_grad=True)
    kl = kl_penalty(logp, torch.zeros(3), "low_var_kl")
    kl.sum().backward()
    assert kl[:2].tolist() == [10.0, 10.0] and kl[2].item() == approx(math.exp(-0.5) - 1 + 0.5)
    assert torch.isfinite(logp.grad).all() and logp.grad[:2].tolist() == [0.0, 0.0]


# ---------------------------------------------------------------------------------------------------
# group_advantages / grpo_advantages
# ---------------------------------------------------------------------------------------------------


def _ga(scores, group, norm):
    return group_advantages(torch.tensor(scores, dtype=torch.float32), torch.tensor(group), norm).tolist()


def test_group_advantages_mixed_group_by_hand():
    # rewards [1, 0, 0, 0]: mean 0.25, deviations [0.75, -0.25, -0.25, -0.25],
    # squared sum 0.5625 + 3 * 0.0625 = 0.75, unbiased var 0.75 / 3 = 0.25 -> std 0.5 (biased would be 0.433)
    assert _ga([1.0, 0.0, 0.0, 0.0], [0, 0, 0, 0], False) == approx([0.75, -0.25, -0.25, -0.25])
    s = 0.5 + EPS
    assert _ga([1.0, 0.0, 0.0, 0.0], [0, 0, 0, 0], True) == approx([0.75 / s, -0.25 / s, -0.25 / s, -0.25 / s])
    # rewards [2, 0.5, -1]: mean 0.5, deviations [1.5, 0, -1.5], var 4.5 / 2 = 2.25 -> std 1.5
    assert _ga([2.0, 0.5, -1.0], [0, 0, 0], False) == approx([1.5, 0.0, -1.5])
    assert _ga([2.0, 0.5, -1.0], [0, 0, 0], True) == approx([1.5 / (1.5 + EPS), 0.0, -1.5 / (1.5 + EPS)])


@pytest.mark.parametrize("norm", [True, False])
@pytest.mark.parametrize("value, n", [(1.0, 4), (0.0, 3), (0.5, 8), (-2.0, 2)])
def test_group_advantages_equal_rewards_give_exactly_zero(value, n, norm):
    assert _ga([value] * n, [0] * n, norm) == [0.0] * n


@pytest.mark.parametrize("norm", [True, False])
@pytest.mark.parametrize("value, n", [(0.9, 3), (0.7, 8)])
def test_group_advantages_equal_non_dyadic_rewards_give_exactly_zero(value, n, norm):
    # the docstring promises 0 for any all-equal group, e.g. a partial-credit reward of 0.9 given to all n
    assert _ga([value] * n, [0] * n, norm) == [0.0] * n


def test_group_advantages_singleton_group_keeps_raw_reward():
    # group 1 has one response (0.7): mean 0, std 1 -> 0.7 raw, 0.7 / (1 + eps) normalised;
    # group 0 ([1, 0]: mean 0.5, std sqrt(0.5)) sits beside it so the two cases must be told apart per group.
    scores, group = [1.0, 0.7, 0.0], [0, 1, 0]
    raw = _ga(scores, group, False)
    assert raw == approx([0.5, 0.7, -0.5])
    assert raw[1] == torch.tensor(0.7).item()  # exactly the float32 reward
    sd = math.sqrt(0.5)
    assert _ga(scores, group, True) == approx([0.5 / (sd + EPS), 0.7 / (1 + EPS), -0.5 / (sd + EPS)])


def test_group_advantages_interleaved_groups():
    # batch order: group ids 2, 0, 1, 0, 2, 0, 1, 0, 1
    #   group 0 at rows 1, 3, 5, 7: [1, 0, 0, 0] -> dev [0.75, -0.25, -0.25, -0.25], std 0.5
    #   group 1 at rows 2, 6, 8:    [2, 0.5, -1] -> dev [1.5, 0, -1.5], std 1.5
    #   group 2 at rows 0, 4:       [3, 3]       -> 0
    scores = [3.0, 1.0, 2.0, 0.0, 3.0, 0.0, 0.5, 0.0, -1.0]
    group = [2, 0, 1, 0, 2, 0, 1, 0, 1]
    assert _ga(scores, group, False) == approx([0.0, 0.75, 1.5, -0.25, 0.0, -0.25, 0.0, -0.25, -1.5])
    a, b = 0.5 + EPS, 1.5 + EPS
    assert _ga(scores, group, True) == approx(
        [0.0, 0.75 / a, 1.5 / b, -0.25 / a, 0.0, -0.25 / a, 0.0, -0.25 / a, -1.5 / b])


@pytest.mark.parametrize("norm", [True, False])
def test_grpo_advantages_broadcast_and_zero_padding(norm):
    # two groups of two: [1, 0] (mean 0.5, std sqrt(0.5)) and [0.5, 2.5] (mean 1.5, std sqrt(2))
    mask = torch.tensor([[1.0, 1.0, 1.0, 0.0],
                         [1.0, 0.0, 0.0, 0.0],
                         [1.0, 1.0, 1.0, 1.0],
                         [1.0, 1.0, 0.0, 0.0]])
    adv, returns = grpo_advantages(torch.tensor([1.0, 0.0, 0.5, 2.5]), torch.tensor([0, 0, 1, 1]), mask, norm)
    assert returns is adv  # no critic: verl's returns are the advantages
    assert adv.shape == (4, 4)
    s0, s1 = (math.sqrt(0.5) + EPS, math.sqrt(2.0) + EPS) if norm else (1.0, 1.0)
    a = [0.5 / s0, -0.5 / s0, -1.0 / s1, 1.0 / s1]
    expected = [[a[0], a[0], a[0], 0.0],
                [a[1], 0.0, 0.0, 0.0],
                [a[2], a[2], a[2], a[2]],
                [a[3], a[3], 0.0, 0.0]]
    for got_row, exp_row in zip(adv.tolist(), expected):
        assert got_row == approx(exp_row)
    assert (adv[mask == 0] == 0).all()


def test_grpo_advantages_default_config_normalises_by_std():
    s = math.sqrt(0.5) + EPS
    adv = compute_advantages("grpo", token_level_rewards=None, response_mask=torch.ones(2, 2),
                             scores=torch.tensor([1.0, 0.0]), group=torch.tensor([0, 0]),
                             norm_adv_by_std=Config().norm_adv_by_std)[0]
    assert adv.flatten().tolist() == approx([0.5 / s, 0.5 / s, -0.5 / s, -0.5 / s])


def close(t: torch.Tensor, expected: list):
    """t equals the hand-written nested list (padding included) within float rounding."""
    torch.testing.assert_close(t, torch.tensor(expected, dtype=t.dtype), atol=1e-6, rtol=1e-6)


# ---------------------------------------------------------------------------------------------------
# value_loss
# ---------------------------------------------------------------------------------------------------

# (value, old value, return, real?) with cliprange_value 0.2
VL_ROWS = [
    [(0.9, 0.5, 1.0, 1),    # clipped to 0.7: (0.7 - 1)^2 = 0.09 > (0.9 - 1)^2 = 0.01 -> 0.5 * 0.09 = 0.045   (clipfrac)
     (0.6, 0.5, 0.0, 1),    # inside the range: 0.5 * 0.36 = 0.18
     (-0.3, 0.2, -0.5, 1),  # clipped to 0.0: (0.5)^2 = 0.25 > (0.2)^2 = 0.04 -> 0.125                  (clipfrac)
     (9.0, 0.0, -9.0, 0)],  # padding
    [(1.0, 0.0, 0.1, 1),    # clipped to 0.2 is nearer the return (0.01 < 0.81): the max keeps 0.5 * 0.81 = 0.405
     (1.0, 0.0, 2.0, 1),    # clipped to 0.2: (1.8)^2 = 3.24 > 1 -> 1.62                                  (clipfrac)
     (5.0, 0.0, -5.0, 0),
     (5.0, 0.0, -5.0, 0)],
]
VL_TOKEN_LOSSES = [[0.045, 0.18, 0.125], [0.405, 1.62]]  # sum 2.375 over 5 tokens; row sums 0.35 and 2.025


def _vl(rows):
    v, old, ret, mask = (torch.tensor([[tok[i] for tok in row] for row in rows], dtype=torch.float64) for i in range(4))
    return v, old, ret, mask


def test_value_loss_clips_around_the_old_values_by_hand():
    v, old, ret, mask = _vl(VL_ROWS)
    loss, m = value_loss(v, old, ret, mask, 0.2, "token-mean")
    assert loss.item() == approx(2.375 / 5)
    assert m["critic/vf_clipfrac"] == approx(3 / 5)
    assert m["critic/vpred_mean"] == approx((0.9 + 0.6 - 0.3 + 1.0 + 1.0) / 5)
    assert value_loss(v, old, ret, mask, 0.2, "seq-mean-token-sum")[0].item() == approx((0.35 + 2.025) / 2)
    assert value_loss(v, old, ret, mask, 0.2, "token-mean", n_tokens=10)[0].item() == approx(2.375 / 10)


def test_value_loss_wide_clip_is_half_the_squared_error():
    v, old, ret, mask = _vl(VL_ROWS)
    loss, m = value_loss(v, old, ret, mask, 100.0, "token-mean")
    assert loss.item() == approx(0.5 * (0.01 + 0.36 + 0.04 + 0.81 + 1.0) / 5)
    assert m["critic/vf_clipfrac"] == 0.0


# ---------------------------------------------------------------------------------------------------
# token rewards, the in-reward KL penalty and its controller
# ---------------------------------------------------------------------------------------------------

# rows of 3, 2 and 4 real tokens (R = 4)
ADV_MASK = torch.tensor([[1.0, 1.0, 1.0, 0.0],
                         [1.0, 1.0, 0.0, 0.0],
                         [1.0, 1.0, 1.0, 1.0]], dtype=torch.float64)


def test_last_token_places_the_score_on_each_rows_last_real_token():
    out = on_last_token(torch.tensor([1.0, 0.5, 2.0], dtype=torch.float64), ADV_MASK)
    assert out.tolist() == [[0.0, 0.0, 1.0, 0.0], [0.0, 0.5, 0.0, 0.0], [0.0, 0.0, 0.0, 2.0]]
    empty = torch.tensor([[1.0, 0.0], [0.0, 0.0]])  # a row without response tokens gets no reward
    assert on_last_token(torch.tensor([3.0, 4.0]), empty).tolist() == [[3.0, 0.0], [0.0, 0.0]]
    turns = torch.tensor([[1.0, 1.0, 0.0, 0.0, 1.0, 0.0], [1.0, 0.0, 0.0, 0.0, 0.0, 0.0]])  # tool spans (mask 0)
    assert on_last_token(torch.tensor([5.0, 6.0]), turns).tolist() == [[0.0] * 4 + [5.0, 0.0], [6.0] + [0.0] * 5]


def test_kl_in_reward_by_hand():
    mask = ADV_MASK[:2]
    logp = torch.tensor([[-1.0, -2.0, -0.5, -9.0], [-0.25, -3.0, -9.0, -9.0]], dtype=torch.float64)
    ref = torch.tensor([[-2.0, -1.0, -0.5, 0.0], [-0.75, -1.0, 0.0, 0.0]], dtype=torch.float64)
    # k1 = logp - ref: [[1, -1, 0, pad], [0.5, -2, pad, pad]]; per-response means 0 and -0.75
    token_rewards = on_last_token(torch.tensor([1.0, 0.0], dtype=torch.float64), mask)
    rewards, mean_kl = kl_in_reward(token_rewards, logp, ref, mask, 0.1, "k1")
    close(rewards, [[-0.1, 0.1, 1.0, 0.0], [-0.05, 0.2, 0.0, 0.0]])
    assert mean_kl == approx((0.0 - 0.75) / 2)


@pytest.mark.parametrize("kl, expected", [
    (0.15, 0.2 * (1 + 0.2 * 256 / 1024)),   # error 0.5 clipped to +0.2 -> 0.21
    (0.11, 0.2 * (1 + 0.1 * 256 / 1024)),   # error 0.1 -> 0.205
    (0.10, 0.2),                            # on target: unchanged
    (0.0, 0.2 * (1 - 0.2 * 256 / 1024)),    # error -1 clipped to -0.2 -> 0.19
])
def test_adaptive_kl_coefficient_after_one_update(kl, expected):
    assert update_kl_coef(0.2, kl, 256, "adaptive", 0.1, 1024) == approx(expected)
    assert update_kl_coef(0.2, kl, 256, "fixed", 0.1, 1024) == 0.2


# ---------------------------------------------------------------------------------------------------
# GAE, whitening, REINFORCE++
# ---------------------------------------------------------------------------------------------------

# rows of 3 and 2 real tokens; padding carries garbage that must not leak
GAE_MASK = ADV_MASK[:2]
GAE_REWARDS = torch.tensor([[0.0, 0.0, 1.0, 7.0], [0.0, 0.5, 7.0, 7.0]], dtype=torch.float64)
GAE_VALUES = torch.tensor([[0.2, 0.4, 0.6, 5.0], [0.1, 0.3, 5.0, 5.0]], dtype=torch.float64)


def test_gae_with_gamma_lambda_one_is_reward_to_go_minus_value():
    adv, ret = gae(GAE_REWARDS, GAE_VALUES, GAE_MASK, 1.0, 1.0)
    # reward-to-go: [1, 1, 1] and [0.5, 0.5]
    close(adv, [[0.8, 0.6, 0.4, 0.0], [0.4, 0.2, 0.0, 0.0]])
    close(ret, [[1.0, 1.0, 1.0, 0.0], [0.5, 0.5, 0.0, 0.0]])


def test_gae_discounted_by_hand():
    # row 0, gamma 0.9, lambda 0.8: deltas d2 = 1 - 0.6 = 0.4, d1 = 0.9 * 0.6 - 0.4 = 0.14, d0 = 0.9 * 0.4 - 0.2 = 0.16
    # A2 = 0.4, A1 = 0.14 + 0.72 * 0.4 = 0.428, A0 = 0.16 + 0.72 * 0.428 = 0.46816
    # row 1: d1 = 0.5 - 0.3 = 0.2, d0 = 0.9 * 0.3 - 0.1 = 0.17; A1 = 0.2, A0 = 0.17 + 0.72 * 0.2 = 0.314
    adv, ret = gae(GAE_REWARDS, GAE_VALUES, GAE_MASK, 0.9, 0.8)
    close(adv, [[0.46816, 0.428, 0.4, 0.0], [0.314, 0.2, 0.0, 0.0]])
    close(ret, [[0.66816, 0.828, 1.0, 0.0], [0.414, 0.5, 0.0, 0.0]])
    # lambda 0: one-step TD errors
    close(gae(GAE_REWARDS, GAE_VALUES, GAE_MASK, 0.9, 0.0)[0], [[0.16, 0.14, 0.4, 0.0], [0.17, 0.2, 0.0, 0.0]])


# a multi-turn response: model tokens, a tool's output (mask 0), the model again, padding
OBS_MASK = torch.tensor([[1.0, 1.0, 0.0, 0.0, 1.0, 0.0]], dtype=torch.float64)


def test_gae_skips_observation_spans():
    # verl's multi-turn convention: mask [1, 1, 0, 0, 1], rewards [0, 0, 0, 0, 2], gamma 0.5, V = 0, lambda 1 gives
    # returns [0.5, 1, 0, 0, 2] (discounting through the span would give [0.125, 0.25, ...])
    rewards = torch.tensor([[0.0, 0.0, 9.0, 9.0, 2.0, 9.0]], dtype=torch.float64)
    adv, ret = gae(rewards, torch.zeros_like(rewards), OBS_MASK, 0.5, 1.0)
    close(ret, [[0.5, 1.0, 0.0, 0.0, 2.0, 0.0]])
    # with values: token 1 bootstraps from token 4's value. gamma 0.5, lambda 0.5, V = [0.1, 0.2, 7, 7, 0.4, 7]:
    # d4 = 2 - 0.4 = 1.6; d1 = 0.5 * 0.4 - 0.2 = 0; d0 = 0.5 * 0.2 - 0.1 = 0
    # A4 = 1.6, A1 = 0 + 0.25 * 1.6 = 0.4, A0 = 0 + 0.25 * 0.4 = 0.1
    values = torch.tensor([[0.1, 0.2, 7.0, 7.0, 0.4, 7.0]], dtype=torch.float64)
    adv, ret = gae(rewards, values, OBS_MASK, 0.5, 0.5)
    close(adv, [[0.1, 0.4, 0.0, 0.0, 1.6, 0.0]])
    close(ret, [[0.2, 0.6, 0.0, 0.0, 2.0, 0.0]])


def test_reinforce_pp_skips_observation_spans():
    rewards = torch.tensor([[0.0, 0.0, 0.0, 0.0, 2.0, 0.0]], dtype=torch.float64)
    ret = reinforce_pp_advantages(rewards, OBS_MASK, gamma=0.5)[1]
    close(ret, [[0.5, 1.0, 0.0, 0.0, 2.0, 0.0]])


def test_advantages_take_float64_scores():
    scores, group = torch.tensor([1.0, 0.0, 0.5, 0.5], dtype=torch.float64), torch.tensor([0, 0, 1, 1])
    mask = torch.ones(4, 2, dtype=torch.float64)
    assert group_advantages(scores, group, norm_by_std=False).tolist() == approx([0.5, -0.5, 0.0, 0.0])
    assert rloo_advantages(scores, group, mask)[0][:, 0].tolist() == approx([1.0, -1.0, 0.0, 0.0])
    adv = compute_advantages("grpo", token_level_rewards=None, response_mask=mask, scores=scores, group=group)[0]
    # group 0: centred +-0.5 over its unbiased std sqrt(0.5); group 1's equal scores give exactly 0
    assert adv.dtype == torch.float64
    assert adv[:, 0].tolist() == approx([math.sqrt(0.5), -math.sqrt(0.5), 0.0, 0.0], rel=1e-5)


def _whiten_by_hand(xs):
    mean = sum(xs) / len(xs)
    std = math.sqrt(sum((x - mean) ** 2 for x in xs) / (len(xs) - 1) + 1e-8)  # unbiased, as torch.var
    return [(x - mean) / std for x in xs]


def test_masked_whiten_over_real_tokens_only():
    x = torch.tensor([[1.0, 2.0, 3.0, 100.0], [4.0, 5.0, -100.0, 100.0]], dtype=torch.float64)
    out = masked_whiten(x, GAE_MASK)
    w = _whiten_by_hand([1.0, 2.0, 3.0, 4.0, 5.0])  # mean 3, var 10 / 4 = 2.5
    close(out, [[w[0], w[1], w[2], 0.0], [w[3], w[4], 0.0, 0.0]])


def test_gae_advantages_whitened_and_returns_raw():
    adv, ret = gae_advantages(GAE_REWARDS, GAE_VALUES, GAE_MASK, gamma=1.0, lam=1.0)
    w = _whiten_by_hand([0.8, 0.6, 0.4, 0.4, 0.2])
    close(adv, [[w[0], w[1], w[2], 0.0], [w[3], w[4], 0.0, 0.0]])
    close(ret, [[1.0, 1.0, 1.0, 0.0], [0.5, 0.5, 0.0, 0.0]])


def test_reinforce_pp_discounted_return_of_token_rewards():
    # token rewards with a KL penalty on each token: row 0 [-0.1, -0.2, 1 - 0.1], row 1 [0.05, 0.5 - 0.05]
    rewards = torch.tensor([[-0.1, -0.2, 0.9, 7.0], [0.05, 0.45, 7.0, 7.0]], dtype=torch.float64)
    adv, ret = reinforce_pp_advantages(rewards, GAE_MASK, gamma=1.0)
    close(ret, [[0.6, 0.7, 0.9, 0.0], [0.5, 0.45, 0.0, 0.0]])
    w = _whiten_by_hand([0.6, 0.7, 0.9, 0.5, 0.45])
    close(adv, [[w[0], w[1], w[2], 0.0], [w[3], w[4], 0.0, 0.0]])
    # gamma 0.5: G2 = 0.9, G1 = -0.2 + 0.45 = 0.25, G0 = -0.1 + 0.125 = 0.025; G1 = 0.45, G0 = 0.05 + 0.225 = 0.275
    ret = reinforce_pp_advantages(rewards, GAE_MASK, gamma=0.5)[1]
    close(ret, [[0.025, 0.25, 0.9, 0.0], [0.275, 0.45, 0.0, 0.0]])


def test_reinforce_pp_baseline_subtracts_the_group_mean_score():
    # groups {0, 1} with scores 1, 0 (mean 0.5) and {2, 3} with 0.5, 0.3 (mean 0.4); row 0 and 3 carry a KL penalty
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 0.0, 0.0], [1.0, 1.0, 1.0], [1.0, 1.0, 0.0]], dtype=torch.float64)
    rewards = torch.tensor([[-0.1, 1.0, 0.0], [0.0, 0.0, 0.0], [0.0, 0.0, 0.5], [-0.2, 0.3, 0.0]], dtype=torch.float64)
    adv, ret = compute_advantages("reinforce_plus_plus_baseline", token_level_rewards=rewards, response_mask=mask,
                                  scores=torch.tensor([1.0, 0.0, 0.5, 0.3]), group=torch.tensor([0, 0, 1, 1]),
                                  gamma=1.0)
    # centred scores 0.5, -0.5, 0.1, -0.1 replace the last-token scores; returns are the rewards-to-go
    expected = [[0.4, 0.5], [-0.5], [0.1, 0.1, 0.1], [-0.3, -0.1]]
    assert [r[: len(e)] for r, e in zip(ret.tolist(), expected)] == [approx(e) for e in expected]
    w = iter(_whiten_by_hand([x for e in expected for x in e]))
    assert [r[: len(e)] for r, e in zip(adv.tolist(), expected)] == [approx([next(w) for _ in e]) for e in expected]
    assert (adv[mask == 0] == 0).all() and (ret[mask == 0] == 0).all()


# ---------------------------------------------------------------------------------------------------
# rloo_advantages
# ---------------------------------------------------------------------------------------------------


def test_rloo_leave_one_out_baseline_by_hand():
    # interleaved groups: group 0 at rows 0, 2, 4, 6 with rewards [1, 0, 0, 1]; group 1 at rows 1, 3, 5 with
    # [0.5, 2, -1]. A reward of 1 in group 0 faces the others' mean (0 + 0 + 1) / 3 = 1/3 -> 2/3; a 0 faces
    # 2/3 -> -2/3. Group 1: 0.5 faces (2 - 1) / 2 = 0.5 -> 0; 2 faces (0.5 - 1) / 2 = -0.25 -> 2.25; -1 faces
    # (0.5 + 2) / 2 = 1.25 -> -2.25.
    scores = torch.tensor([1.0, 0.5, 0.0, 2.0, 0.0, -1.0, 1.0])
    group = torch.tensor([0, 1, 0, 1, 0, 1, 0])
    mask = torch.tensor([[1.0, 1.0, 0.0]] * 7)
    adv, ret = rloo_advantages(scores, group, mask)
    expected = [2 / 3, 0.0, -2 / 3, 2.25, -2 / 3, -2.25, 2 / 3]
    assert adv[:, 0].tolist() == approx(expected) and adv[:, 1].tolist() == approx(expected)
    assert (adv[:, 2] == 0).all() and ret is adv


# ---------------------------------------------------------------------------------------------------
# Config checks of the new fields
# ---------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("kwargs, field", [
    (dict(adv_estimator="grpo", use_kl_in_reward=True), "use_kl_in_reward"),
    (dict(adv_estimator="rloo", use_kl_in_reward=True), "use_kl_in_reward"),
    (dict(adv_estimator="grpo", critic_warmup=3), "critic_warmup"),
    (dict(adv_estimator="rloo", rollout_n=1), "rollout_n"),
    (dict(gamma=1.5), "gamma"),
    (dict(lam=-0.1), "lam"),
    (dict(cliprange_value=0.0), "cliprange_value"),
    (dict(kl_horizon=0), "kl_horizon"),
    (dict(critic_warmup=-1), "critic_warmup"),
    (dict(critic_warmup=10, total_steps=10), "critic_warmup"),  # the actor would never train
    (dict(hybrid=HybridConfig(verify_sync=True, probe_len=40), max_prompt_length=32, max_response_length=8),
     "hybrid.probe_len"),  # 32 + 8 tokens of context
    (dict(rollout_tp=0), "rollout_tp"),
    (dict(log_prob_max_token_len_per_gpu=0), "log_prob_max_token_len_per_gpu"),
])
def test_config_rejects_bad_combinations_naming_the_field(kwargs, field):
    with pytest.raises(ValueError, match=field):
        Config(**kwargs)


# ---------------------------------------------------------------------------------------------------
# learning-rate schedules
# ---------------------------------------------------------------------------------------------------


def test_lr_factor_warmup_then_constant_or_cosine_by_hand():
    assert [lr_factor(u, 14, 4, "constant", 0.0) for u in range(6)] == [0.25, 0.5, 0.75, 1.0, 1.0, 1.0]
    cosine = [lr_factor(u, 14, 4, "cosine", 0.1) for u in (3, 4, 9, 14, 20)]
    # after warmup: 0.1 + 0.9 * (1 + cos(pi * (u - 4) / 10)) / 2
    assert cosine == [approx(1.0), approx(1.0), approx(0.55), approx(0.1), approx(0.1)]
    assert lr_factor(0, 10, 0, "cosine", 0.0) == 1.0  # no warmup: the first update runs at lr


# ---------------------------------------------------------------------------------------------------
# DAPO and rollout correction
# ---------------------------------------------------------------------------------------------------


def test_token_sum_is_the_mini_batch_sum_times_the_ranks():
    assert agg_loss(LOSS, MASK, "token-sum").item() == 45.0
    assert agg_loss(LOSS, MASK, "token-sum", dp_size=2).item() == 90.0  # FSDP halves it back


def test_overlong_penalty_by_hand():
    lengths = torch.tensor([5.0, 6.0, 7.0, 8.0, 10.0])  # max 10, buffer 4: free up to 6 tokens
    assert overlong_penalty(lengths, 10, 4, 1.0).tolist() == [0.0, 0.0, -0.25, -0.5, -1.0]
    assert overlong_penalty(lengths, 10, 4, 0.5).tolist() == [0.0, 0.0, -0.125, -0.25, -0.5]


# log-ratios old - rollout: row 0 has one token far out (ln 3 > ln 2); row 1 is mildly off everywhere (geometric
# mean e^-0.8 < 0.5); row 2 is close; the last column is padding holding a wild value
RC_MASK = torch.tensor([[1.0, 1.0, 1.0, 0.0], [1.0, 1.0, 0.0, 0.0], [1.0, 1.0, 1.0, 0.0]])
RC_LOG_RATIO = torch.tensor([[0.1, math.log(3.0), 0.0, 50.0], [-0.6, -1.0, 9.0, 9.0], [0.2, -0.2, 0.1, -50.0]])


def test_rollout_mask_token_level_drops_single_tokens():
    kept, metrics = rollout_mask(RC_LOG_RATIO, torch.zeros(3, 4), RC_MASK, "token", 0.5, 2.0)
    # dropped: row 0's ln 3 token, row 1's -1.0 token (e^-1 < 0.5); -0.6 stays (e^-0.6 = 0.55)
    assert kept.tolist() == [[1, 0, 1, 0], [1, 0, 0, 0], [1, 1, 1, 0]]
    assert metrics["rollout_corr/masked_tokens"] == approx(2 / 8)
    assert metrics["rollout_corr/masked_seqs"] == approx(2 / 3)
    # verl's statistics: the mean token log-ratio, and the mean over responses of each response's mean log-ratio
    tokens = [0.1, math.log(3.0), 0.0, -0.6, -1.0, 0.2, -0.2, 0.1]
    per_seq = [(0.1 + math.log(3.0)) / 3, -0.8, 0.1 / 3]
    assert metrics["rollout_corr/rollout_rs_token_k1_mean"] == approx(sum(tokens) / 8)
    assert metrics["rollout_corr/rollout_rs_seq_mean_k1_mean"] == approx(sum(per_seq) / 3)


def test_rollout_mask_sequence_level_rejects_whole_responses():
    kept, metrics = rollout_mask(RC_LOG_RATIO, torch.zeros(3, 4), RC_MASK, "sequence", 0.5, 2.0)
    # geometric means: row 0 e^(ln3 + 0.1)/3 = e^0.40 (kept), row 1 e^-0.8 (rejected), row 2 e^0.033 (kept)
    assert kept.tolist() == [[1, 1, 1, 0], [0, 0, 0, 0], [1, 1, 1, 0]]
    assert metrics["rollout_corr/masked_seqs"] == approx(1 / 3)
    assert metrics["rollout_corr/masked_tokens"] == approx(2 / 8)


def test_tis_weights_sequence_level_by_hand():
    weights, _ = tis_weights(RC_LOG_RATIO, torch.zeros(3, 4), RC_MASK, cap=2.0, level="sequence")
    # one weight a response: min(exp(sum of its log-ratios), 2), 0 at padding
    expected = [min(math.exp(0.1 + math.log(3.0)), 2.0), math.exp(-1.6), math.exp(0.1)]
    for b, w in enumerate(expected):
        assert weights[b, : int(RC_MASK[b].sum())].tolist() == [approx(w)] * int(RC_MASK[b].sum())
    assert (weights[RC_MASK == 0] == 0).all()


def test_preference_losses_by_hand():
    """Bradley-Terry with and without a margin, DPO's sigmoid and IPO, against hand values."""
    chosen, rejected = torch.tensor([2.0, 0.0, -1.0]), torch.tensor([1.0, 0.0, 1.0])  # differences 1, 0, -2
    bt = [math.log(1 + math.exp(-d)) for d in (1.0, 0.0, -2.0)]  # -log sigmoid(d)
    assert preference_loss(chosen, rejected, "bt").tolist() == approx(bt)
    margin = torch.tensor([0.5, 0.0, 1.0])
    assert preference_loss(chosen, rejected, "bt", margin=margin).tolist() == approx(
        [math.log(1 + math.exp(-d)) for d in (0.5, 0.0, -3.0)])
    assert preference_loss(chosen, rejected, "sigmoid", beta=0.1).tolist() == approx(
        [math.log(1 + math.exp(-0.1 * d)) for d in (1.0, 0.0, -2.0)])
    assert preference_loss(chosen, rejected, "ipo", beta=0.1).tolist() == approx([16.0, 25.0, 49.0])  # (d - 5)^2
    with pytest.raises(ValueError, match="unknown preference loss 'hinge'"):
        preference_loss(chosen, rejected, "hinge")
