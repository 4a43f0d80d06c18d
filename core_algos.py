"""The algorithm math of every estimator and loss, as pure tensor functions (verl's core_algos.py).

    python -m pytest tests/test_losses.py -q        # hand-checked values of every function below
    python -m pytest tests/test_core_algos.py -q    # one process on the whole batch == 2 torchrun ranks on halves

Nothing here knows about models, workers or process groups. Tensors are [B, R] over response tokens with a
response mask (1 on real tokens), or [B] per response. Where a number needs the whole batch (whitening, the
in-reward KL's mean), the function takes `all_sum`: a callable that sums a float64 tensor of statistics over
the data shards. Under torchrun each rank holds a shard and passes comm.all_sum_fn(dist); a process that holds
the whole batch (one process, the Ray driver) passes None. Both give the same numbers.

    adv, returns = compute_advantages("grpo", scores=s, group=g, response_mask=m, ...)   # [B, R] each
    loss, metrics = policy_loss(logp, old_logp, adv, mask, 0.2, 0.28, 3.0, "token-mean")
    loss = agg_loss(loss_mat, mask, "seq-mean-token-mean", n_tokens=..., n_seqs=...)     # the mini-batch's counts
"""

import math
from typing import Callable, Literal

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

AggMode = Literal["token-mean", "token-sum", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm"]
KLKind = Literal["k1", "k2", "k3", "low_var_kl", "mse", "abs", "k1+", "k3+", "low_var_kl+"]
AdvEstimator = Literal["gae", "grpo", "rloo", "reinforce_plus_plus", "reinforce_plus_plus_baseline"]
AllSum = Callable[[torch.Tensor], torch.Tensor] | None  # sums a tensor over the data shards; None: one holds all

# ---- Losses: all take [B, R] tensors over response tokens and a response mask ---------------------


def masked(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """x where mask is set, 0 elsewhere: a NaN or inf at a masked position cannot leak (x * mask would give NaN)."""
    return torch.where(mask.bool(), x, torch.zeros((), dtype=x.dtype, device=x.device))


def masked_mean(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return masked(x, mask).sum() / mask.sum().clamp(min=1)


def agg_loss(loss_mat, mask, mode: AggMode, n_tokens=None, n_seqs=None, norm_len=None, dp_size=1) -> torch.Tensor:
    """Reduce token losses [B, R] to a scalar.

    n_tokens / n_seqs are the counts of the whole mini-batch: when a mini-batch is split into micro-batches, each
    micro-batch divides by the mini-batch's counts, so the summed gradients equal the mini-batch's gradient in every
    mode. A sequence counts when it has a response token (a fully masked one, e.g. a truncated response with its loss
    masked, weighs nothing). norm_len is Dr.GRPO's constant length (default R). Masked positions never count, even
    holding a NaN or inf. token-sum (DAPO's variant without a normaliser) sums the tokens of the whole mini-batch: each
    of dp_size ranks returns its sum times dp_size, which FSDP's gradient averaging turns back into the sum over all
    ranks."""
    n_tokens = mask.sum() if n_tokens is None else n_tokens
    n_seqs = (mask.sum(-1) > 0).sum() if n_seqs is None else n_seqs
    norm_len = mask.shape[-1] if norm_len is None else norm_len
    token_sum = masked(loss_mat, mask).sum(-1)  # [B]
    if mode == "token-mean":  # every token weighs the same (DAPO)
        return token_sum.sum() / n_tokens
    if mode == "token-sum":  # every token weighs the same, and longer batches weigh more
        return token_sum.sum() * dp_size
    if mode == "seq-mean-token-sum":  # every sequence's summed loss weighs the same
        return token_sum.sum() / n_seqs
    if mode == "seq-mean-token-mean":  # every sequence weighs the same (original GRPO)
        return (token_sum / mask.sum(-1).clamp(min=1)).sum() / n_seqs
    if mode == "seq-mean-token-sum-norm":  # a constant normaliser, no length bias (Dr.GRPO)
        return token_sum.sum() / (n_seqs * norm_len)
    raise ValueError(f"unknown loss_agg_mode {mode!r}")


def policy_loss(logp, old_logp, adv, mask, clip_low, clip_high, clip_c, agg_mode, tis=None, **agg_kw):
    """PPO clipped surrogate with dual-clip; returns (loss, metrics of clipping and approximate KL: 0-d tensors, read
    once per mini-batch, so the update makes no host sync per micro-batch). logp, old_logp, adv, mask: [B, R].
    Clip-higher (DAPO) uses clip_high > clip_low. tis: per-token weights [B, R] (tis_weights) multiplying the token
    losses, or None."""
    # the data at masked positions is zeroed first: a NaN there would reach the gradient (NaN * 0 is NaN)
    old_logp, adv = masked(old_logp, mask), masked(adv, mask)  # [B, R] each
    log_ratio = (logp - old_logp).clamp(-20.0, 20.0)  # [B, R], clamped so exp cannot overflow
    ratio = log_ratio.exp()  # [B, R]
    loss_unclipped = -adv * ratio  # [B, R]
    loss_clipped = -adv * ratio.clamp(1.0 - clip_low, 1.0 + clip_high)  # [B, R]
    loss_ppo = torch.maximum(loss_unclipped, loss_clipped)  # [B, R], the pessimistic of the two
    # Dual-clip (Ye et al. 2020): for adv < 0, bound the loss by -adv * clip_c when the ratio explodes.
    loss_dual = torch.minimum(loss_ppo, -adv * clip_c)
    loss_mat = torch.where(adv < 0, loss_dual, loss_ppo)  # [B, R]
    if tis is not None:
        loss_mat = loss_mat * tis
    metrics = {"actor/pg_clipfrac": masked_mean((loss_clipped > loss_unclipped).float(), mask).detach(),
               "actor/pg_clipfrac_lower": masked_mean(((loss_ppo > -adv * clip_c) & (adv < 0)).float(), mask).detach(),
               "actor/ppo_kl": masked_mean(-log_ratio, mask).detach()}
    return agg_loss(loss_mat, mask, agg_mode, **agg_kw), metrics


def tis_weights(old_logp, rollout_logp, mask, cap: float, level: str = "token") -> tuple[torch.Tensor, dict]:
    """Truncated importance sampling (Yao et al. 2025): per-token weights [B, R] = min(pi_old / pi_rollout, cap), no
    gradient. The engine samples from slightly other probabilities than the trainer's (other kernels, dtype): this
    reweights its samples toward the trainer's old policy, truncated so that rare tokens cannot blow up the loss.
    level "sequence": one weight a response, min(prod over its tokens of pi_old / pi_rollout, cap), on each token.
    The same weight corrects stale samples (decoupled PPO, Fu et al. 2025 (AReaL)): pi_old is then the proximal policy
    (recomputed with the trainer's weights), pi_rollout the behaviour policy (older weights that sampled). Returns
    (weights, their mean and max and the share truncated, 0-d tensors: the caller names them)."""
    log_ratio = masked(old_logp - rollout_logp, mask)  # [B, R]
    if level == "sequence":
        log_ratio = log_ratio.sum(-1, keepdim=True).expand_as(log_ratio)  # [B, R]: the response's log-ratio
    ratio = log_ratio.clamp(max=20.0).exp()  # [B, R], clamped so exp cannot overflow
    weights = masked(ratio.clamp(max=cap), mask).detach()  # [B, R], 0 at padding
    return weights, {"weight_mean": masked_mean(weights, mask).detach(), "weight_max": weights.max(),
                     "clipfrac": masked_mean((ratio > cap).float(), mask).detach()}


def rollout_mask(old_logp, rollout_logp, mask, level: str, low: float, high: float) -> tuple[torch.Tensor, dict]:
    """The response mask [B, R] without what the engine sampled too far from the trainer's old policy: level "token"
    drops each token whose ratio pi_old / pi_rollout leaves [low, high] (IcePop); "sequence" drops whole responses
    whose geometric-mean ratio leaves it (rejection sampling). Returns (mask, the shares of tokens and responses
    dropped among the real ones, and verl's means of the two statistics: the tokens' log-ratio, k1, and the
    responses' mean k1)."""
    log_ratio = masked(old_logp - rollout_logp, mask)  # [B, R]
    real = mask.sum(-1) > 0  # [B]
    per_seq = log_ratio.sum(-1) / mask.sum(-1).clamp(min=1)  # [B]: log of the geometric-mean ratio
    stats = {"rollout_corr/rollout_rs_token_k1_mean": masked_mean(log_ratio, mask).item(),
             "rollout_corr/rollout_rs_seq_mean_k1_mean": (per_seq[real].mean() if real.any() else per_seq.sum()).item()}
    if level == "sequence":
        log_ratio = per_seq.unsqueeze(-1).expand_as(log_ratio)  # [B, R]
    keep = (log_ratio >= math.log(low)) & (log_ratio <= math.log(high))  # [B, R]
    kept = mask * keep  # [B, R]
    dropped_seqs = (real & (kept.sum(-1) < mask.sum(-1))).float().sum() / real.sum().clamp(min=1)
    return kept, {"rollout_corr/masked_tokens": (1 - kept.sum() / mask.sum().clamp(min=1)).item(),
                  "rollout_corr/masked_seqs": dropped_seqs.item(), **stats}


def overlong_penalty(lengths: torch.Tensor, max_len: int, buffer_len: int, factor: float) -> torch.Tensor:
    """DAPO's soft overlong punishment [B] of response lengths [B]: 0 up to max_len - buffer_len tokens, then falling
    linearly to -factor at max_len."""
    return -((lengths - (max_len - buffer_len)).clamp(min=0) / buffer_len * factor).clamp(max=factor)


def value_loss(values, old_values, returns, mask, clip, agg_mode, **agg_kw):
    """The critic's clipped regression loss 0.5 * max((V - G)^2, (V_clip - G)^2); returns (loss, metrics). values,
    old_values (at rollout), returns G, mask: [B, R]. V_clip stays within clip of the old value, so one batch cannot
    drag a value far (value clipping of OpenAI baselines' PPO2; Engstrom et al. 2020 study it)."""
    old_values, returns = masked(old_values, mask), masked(returns, mask)  # as in policy_loss
    clipped = old_values + (values - old_values).clamp(-clip, clip)  # [B, R]
    loss_unclipped, loss_clipped = (values - returns).square(), (clipped - returns).square()  # [B, R] each
    loss_mat = 0.5 * torch.maximum(loss_unclipped, loss_clipped)  # [B, R]
    metrics = {"critic/vf_clipfrac": masked_mean((loss_clipped > loss_unclipped).float(), mask).detach(),
               "critic/vpred_mean": masked_mean(values, mask).detach()}
    return agg_loss(loss_mat, mask, agg_mode, **agg_kw), metrics


def lr_factor(update: int, total: int, warmup: int, schedule: str, min_ratio: float) -> float:
    """The learning rate of update number `update` (0-based) as a share of the configured one: linear warmup over
    `warmup` updates, then constant or cosine from 1 down to min_ratio at update `total` (verl's schedules)."""
    if update < warmup:
        return (update + 1) / warmup
    if schedule == "constant":
        return 1.0
    progress = min(1.0, (update - warmup) / max(1, total - warmup))
    return min_ratio + (1.0 - min_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))


def kl_penalty(logp: torch.Tensor, ref_logp: torch.Tensor, kind: KLKind) -> torch.Tensor:
    """Per-token KL(policy || ref) estimate [B, R] from sampled-token log-probs (Schulman 2020). A kind ending in "+"
    (k1+, k3+, low_var_kl+) is straight-through, as verl's: the base kind's value with k2's gradient (the unbiased
    gradient of the KL in expectation, whatever estimator is reported)."""
    if kind.endswith("+"):
        k2 = 0.5 * (logp - ref_logp).square()  # [B, R]
        return kl_penalty(logp, ref_logp, kind[:-1]).detach() + k2 - k2.detach()
    log_ratio = logp - ref_logp
    if kind == "k1":
        return log_ratio
    if kind == "abs":
        return log_ratio.abs()
    if kind in ("k2", "mse"):
        return 0.5 * log_ratio.square()
    if kind in ("k3", "low_var_kl"):  # ratio - 1 - log ratio with ratio = ref / policy: unbiased, >= 0
        neg = (-log_ratio).clamp(-20.0, 20.0)  # as verl: a large gap must not overflow exp into inf, then NaN
        return (neg.exp() - 1.0 - neg).clamp(-10.0, 10.0)  # clamped as verl does, for stability
    raise ValueError(f"unknown kl_loss_type {kind!r}")


# ---- Preference losses: one pair a row, [P] scores of the chosen and the rejected response --------

PreferenceLoss = Literal["bt", "sigmoid", "ipo"]


def preference_loss(chosen: torch.Tensor, rejected: torch.Tensor, kind: PreferenceLoss, beta: float = 1.0,
                    margin: torch.Tensor | None = None) -> torch.Tensor:
    """The loss [P] of each preference pair.
    bt (Bradley-Terry, a reward model): chosen and rejected are the model's scalar rewards [P];
        -log sigmoid(r_c - r_r - margin), margin [P] (Llama 2's: how much better the chosen is) or 0.
    sigmoid (DPO, Rafailov 2023) and ipo (Azar 2023): chosen and rejected are log pi(y|x) - log pi_ref(y|x) [P];
        DPO: -log sigmoid(beta * (h_c - h_r)); IPO: (h_c - h_r - 1 / (2 beta))^2 (with TRL's token-mean log-probs)."""
    diff = chosen - rejected  # [P]
    if kind == "bt":
        return -F.logsigmoid(diff - (0.0 if margin is None else margin))
    if kind == "sigmoid":
        return -F.logsigmoid(beta * diff)
    if kind == "ipo":
        return (diff - 1.0 / (2.0 * beta)).square()
    raise ValueError(f"unknown preference loss {kind!r} (bt, sigmoid or ipo)")


# ---- Token log-probs and entropy: the one function that computes them from logits (trainer, HF rollout, probes) ----

LOGITS_CHUNK_BYTES = 128 << 20  # float32 logits of one chunk of rows in head_log_probs


def token_log_probs(logits: torch.Tensor, targets: torch.Tensor, temperature: float = 1.0,
                    with_entropy: bool = False, entropy_grad: bool = True):
    """(log-prob [...] of targets [...] under softmax(logits [..., V] / temperature), its entropy [...] or None). The
    log-prob makes one float32 [..., V] tensor (the scaled logits): it is the target's logit minus logsumexp, no
    log-softmax. The entropy, logsumexp - sum p * logit, adds the softmax. entropy_grad=False: the entropy is a metric,
    made without autograd, so backward keeps no softmax for it."""
    dtype = torch.promote_types(logits.dtype, torch.float32)  # bf16 up to fp32, fp64 stays
    if logits.dtype != dtype:  # the upcast is a tensor of our own: scale it in place
        logits = logits.to(dtype).div_(temperature)  # [..., V]
    elif temperature != 1.0:
        logits = logits / temperature  # [..., V]
    lse = torch.logsumexp(logits, -1)  # [...]
    logp = logits.gather(-1, targets.unsqueeze(-1)).squeeze(-1) - lse  # [...]
    if not with_entropy:
        return logp, None
    with torch.set_grad_enabled(torch.is_grad_enabled() and entropy_grad):
        entropy = lse - torch.einsum("...v,...v->...", logits.softmax(-1), logits)  # [...]
    return logp, entropy


def head_log_probs(hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, targets: torch.Tensor,
                   temperature: float, with_entropy: bool = False, entropy_grad: bool = True,
                   chunk_bytes: int = LOGITS_CHUNK_BYTES):
    """token_log_probs of the LM head's logits (hidden [n, H] @ weight [V, H].T + bias) for targets [n], a chunk of
    rows at a time, so that no [n, V] tensor exists (after verl's entropy_from_logits_with_chunking). Under autograd
    each chunk is checkpointed: backward recomputes its logits (one more head matmul) instead of keeping them.
    Returns ([n], [n] or None)."""
    def chunk(h, t):  # [c, H], [c]
        logits = F.linear(h, weight, bias)  # [c, V]
        return token_log_probs(logits, t, temperature, with_entropy, entropy_grad)

    rows = max(1, chunk_bytes // (4 * weight.shape[0]))
    # nothing random inside: no RNG state to save and replay
    out = [checkpoint(chunk, h, t, use_reentrant=False, preserve_rng_state=False) if torch.is_grad_enabled()
           else chunk(h, t) for h, t in zip(hidden.split(rows), targets.split(rows))]  # [(logp [c], entropy [c])]
    return torch.cat([logp for logp, _ in out]), torch.cat([e for _, e in out]) if with_entropy else None


# ---- Token rewards and the in-reward KL penalty ---------------------------------------------------


def _sum(stats: list[float], all_sum: AllSum) -> list[float]:
    """Python floats summed over the data shards (float64, so token counts stay exact)."""
    t = torch.tensor(stats, dtype=torch.float64)  # [K]
    return (t if all_sum is None else all_sum(t)).tolist()


def on_last_token(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """x [B] placed on each row's last token of mask [B, R] (the model's last, after any tool's span), 0 elsewhere."""
    ranks = mask.bool() * torch.arange(1, mask.shape[1] + 1, device=mask.device)  # [B, R]: 1 + position where kept
    out = torch.zeros_like(mask, dtype=x.dtype)  # [B, R]
    out[torch.arange(len(x)), ranks.argmax(-1)] = torch.where(ranks.amax(-1) > 0, x, 0.0)
    return out


def kl_in_reward(token_rewards, logp, ref_logp, mask, coef: float, kind: KLKind,
                 all_sum: AllSum = None) -> tuple[torch.Tensor, float]:
    """Token rewards [B, R] minus coef * the per-token KL(policy || ref) estimate, and the whole batch's mean KL per
    token (a response's mean, averaged over responses). The penalty of Ziegler et al. 2019, as in InstructGPT."""
    kl = kl_penalty(logp, ref_logp, kind) * mask  # [B, R]
    per_response = kl.sum(-1) / mask.sum(-1).clamp(min=1)  # [B]
    total, count = _sum([per_response.sum().item(), len(per_response)], all_sum)
    return token_rewards - coef * kl, total / max(count, 1.0)


def update_kl_coef(coef: float, kl: float, n_steps: int, ctrl_type: str, target: float, horizon: int) -> float:
    """The in-reward KL coefficient after a batch of n_steps responses with mean KL kl (fixed: coef itself). Adaptive
    (Ziegler et al. 2019): a proportional controller, error = kl / target - 1 clipped to +-0.2, so the coefficient moves
    by at most 20% per horizon responses."""
    if ctrl_type == "fixed":
        return coef
    error = min(max(kl / target - 1.0, -0.2), 0.2)
    return coef * (1.0 + error * n_steps / horizon)


# ---- Advantages: each estimator returns (advantages, returns) [B, R] ------------------------------


def masked_whiten(x: torch.Tensor, mask: torch.Tensor, all_sum: AllSum = None, eps: float = 1e-8) -> torch.Tensor:
    """(x - mean) / std over the real tokens of the whole batch (0 at padding): [B, R]; unbiased var. Two passes of
    summed statistics (count and sum, then squared deviations), so shards give the numbers of the whole batch."""
    n, total = _sum([mask.sum().item(), (x * mask).sum().item()], all_sum)
    mean = total / max(n, 1.0)
    (sq,) = _sum([((x - mean).square() * mask).sum().item()], all_sum)
    var = sq / max(n - 1.0, 1.0)
    return (x - mean) / math.sqrt(var + eps) * mask


def gae(rewards: torch.Tensor, values: torch.Tensor, mask: torch.Tensor, gamma: float, lam: float):
    """Generalized advantage estimation (Schulman et al. 2016) over response tokens: (advantages, returns) [B, R].

    rewards, values, mask: [B, R]. A_t = sum_k (gamma lam)^k delta_{t+k}, delta_t = r_t + gamma V_{t+1} - V_t over the
    tokens where mask is 1, returns = A + V; 0 where mask is 0. Those are padding (after a response's last token the
    episode ends: V = 0) and a multi-turn response's observation tokens, which the discount skips as verl's does: the
    model's token before a tool's output bootstraps from the model's first token after it (mask [1, 1, 0, 0, 1],
    rewards [0, 0, 0, 0, 2], V = 0, gamma 0.5, lam 1: returns [0.5, 1, 0, 0, 2])."""
    rewards, values = rewards * mask, values * mask  # [B, R]
    real = mask.bool()  # [B, R]
    advantages = torch.zeros_like(rewards)  # [B, R]
    running = torch.zeros_like(rewards[:, 0])  # [B], A at the next real token
    next_value = torch.zeros_like(running)  # [B], V at the next real token (0 past the last)
    for t in reversed(range(rewards.shape[1])):
        delta = rewards[:, t] + gamma * next_value - values[:, t]  # [B]
        running = torch.where(real[:, t], delta + gamma * lam * running, running)
        next_value = torch.where(real[:, t], values[:, t], next_value)
        advantages[:, t] = running
    advantages = advantages * mask
    return advantages, advantages + values


def gae_advantages(token_rewards, values, mask, gamma: float, lam: float, all_sum: AllSum = None):
    """PPO's estimator: GAE on the critic's values, advantages whitened over the whole batch; returns are the
    critic's targets."""
    advantages, returns = gae(token_rewards, values, mask, gamma, lam)
    return masked_whiten(advantages, mask, all_sum), returns


def group_advantages(scores: torch.Tensor, group: torch.Tensor, norm_by_std: bool, eps: float = 1e-6) -> torch.Tensor:
    """Per-response advantage [B] from rewards [B] and group ids [B] (GRPO, Shao et al. 2024; Dr.GRPO without std). A
    group whose rewards are all equal gets advantage 0 (nothing to prefer). A group of one response keeps its raw
    reward, as verl does (mean 0, std 1). A prompt's group never spans data shards."""
    zeros = torch.zeros(int(group.max()) + 1, dtype=scores.dtype)  # [G], in the scores' dtype (float64 too)
    count = zeros.index_add(0, group, torch.ones_like(scores))  # [G]
    mean = zeros.index_add(0, group, scores) / count  # [G]
    sq_dev = zeros.index_add(0, group, (scores - mean[group]).square())
    std = (sq_dev / (count - 1).clamp(min=1)).sqrt()  # [G], unbiased like torch.std
    # Equal rewards must give exactly 0: the float mean of 3 x 0.9 misses 0.9 by an ulp, and dividing
    # that by a std of the same size would turn it into a sizeable advantage.
    top = torch.full_like(zeros, -torch.inf).scatter_reduce(0, group, scores, "amax")  # [G]
    low = torch.full_like(zeros, torch.inf).scatter_reduce(0, group, scores, "amin")  # [G]
    single = count == 1
    centred = torch.where(single[group], scores, scores - mean[group])  # [B]
    centred = torch.where((top == low)[group] & ~single[group], 0.0, centred)
    return centred / (torch.where(single, 1.0, std)[group] + eps) if norm_by_std else centred


def grpo_advantages(scores, group, mask, norm_by_std: bool):
    """The group advantage broadcast over response tokens: (advantages, returns) [B, R], the two the same."""
    adv = group_advantages(scores, group, norm_by_std).unsqueeze(-1) * mask  # [B, R]
    return adv, adv


def rloo_advantages(scores, group, mask):
    """RLOO (Ahmadian et al. 2024): a response's reward minus the mean reward of the other n - 1 responses to its
    prompt, for every token: (advantages, returns) [B, R], the two the same. A group of one keeps its raw reward."""
    count = torch.zeros(int(group.max()) + 1, dtype=scores.dtype).index_add_(0, group, torch.ones_like(scores))  # [G]
    total = torch.zeros_like(count).index_add_(0, group, scores)  # [G]
    others = (total[group] - scores) / (count[group] - 1).clamp(min=1)  # [B], the leave-one-out baseline
    adv = (scores - others).unsqueeze(-1) * mask  # [B, R]
    return adv, adv


def reinforce_pp_advantages(token_rewards, mask, gamma: float, all_sum: AllSum = None, scores=None, group=None):
    """REINFORCE++ (Hu 2025): each token's discounted return of the token rewards (KL penalty included), whitened
    over the whole batch; no critic. With scores and group (REINFORCE++-baseline): each score minus its prompt
    group's mean first."""
    if group is not None:  # the last token's reward loses its group's mean score (a group of one keeps its score)
        centred = group_advantages(scores, group, norm_by_std=False)  # [B]
        token_rewards = token_rewards - on_last_token(scores - centred, mask)  # [B, R]
    returns = gae(token_rewards, torch.zeros_like(token_rewards), mask, gamma, 1.0)[0]  # V = 0, lam = 1: the return
    return masked_whiten(returns, mask, all_sum), returns


def compute_advantages(estimator: AdvEstimator, *, token_level_rewards, response_mask, scores, group, values=None,
                       gamma: float = 1.0, lam: float = 1.0, norm_adv_by_std: bool = True, all_sum: AllSum = None):
    """(advantages, returns) [B, R] by the named estimator; inputs as the step's batch holds them: token rewards and
    the critic's values [B, R], scores and group ids [B]."""
    if estimator == "gae":
        return gae_advantages(token_level_rewards, values, response_mask, gamma, lam, all_sum)
    if estimator == "grpo":
        return grpo_advantages(scores, group, response_mask, norm_adv_by_std)
    if estimator == "rloo":
        return rloo_advantages(scores, group, response_mask)
    if estimator == "reinforce_plus_plus":
        return reinforce_pp_advantages(token_level_rewards, response_mask, gamma, all_sum)
    if estimator == "reinforce_plus_plus_baseline":
        return reinforce_pp_advantages(token_level_rewards, response_mask, gamma, all_sum, scores, group)
    raise ValueError(f"unknown adv_estimator {estimator!r}")
