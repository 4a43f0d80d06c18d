"""The RL core of nanoverl and the PPO entry point: config, actor and critic workers, log-probs, values, GAE,
policy and value losses, KL, loss aggregation, the loop.

    python ppo.py                        # PPO with a critic (GAE) on the built-in task
    python ppo.py --help                 # every field of Config below
    python ppo.py --use-kl-in-reward --kl-ctrl-type adaptive --kl-coef 0.01 --kl-target 0.05   # KL in the reward
    python ppo.py --adv-estimator reinforce_plus_plus   # no critic: REINFORCE++ (also rloo, grpo, ..._baseline)
    python grpo.py                       # GRPO: the same loop with grpo.py's defaults

One RL step, as verl (HybridFlow) does it:
    rollout mode (stream the new weights into vLLM; generate n samples per prompt) -> reward (rule-based
    verifier) -> old / ref log-probs, values -> token rewards (- KL penalty) and advantages -> critic update,
    actor update on micro-batches
The loop is written against workers with plain methods (actor: generate, log_probs, update; critic: values,
update) and the hybrid engine's mode switch (worker.hybrid.rollout_mode, hybrid_engine.py): torchrun runs this
loop on every rank, on its shard (a Ray driver, not implemented yet, would call the same worker methods).
adv_estimator picks the estimator (ADVANTAGE_ESTIMATORS); the group ones live in grpo.py.
"""

import json
import math
import os
from dataclasses import asdict, dataclass, field
from functools import partial
from typing import Literal

import torch
import tyro
from tensordict import TensorDict
from tqdm import tqdm
from transformers import AutoConfig, AutoModelForTokenClassification, AutoTokenizer

from batching import balance_ranks, flops_workload, map_micro_batches, micro_batches, pack, packing_works, unpack
from comm import Dist, barrier, broadcast_object, init_distributed, reduce_metrics, shutdown, timer
from data import RLDataset, load_reward_fn
from grpo import group_advantages, grpo_advantages, rloo_advantages
from hybrid_engine import HybridConfig, HybridEngine
from rollout import make_rollout
from sharding import DTYPES, FSDPConfig, clip_grad_norm, export_hf, find_latest, load_checkpoint, load_sharded_model, \
    save_checkpoint

LOSS_METRICS = ("actor/pg_loss", "actor/entropy", "actor/kl_loss", "critic/vf_loss")  # summed over micro-batches
AggMode = Literal["token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm"]
KLKind = Literal["k1", "k2", "k3", "low_var_kl", "mse"]
AdvEstimator = Literal["gae", "grpo", "rloo", "reinforce_plus_plus", "reinforce_plus_plus_baseline"]


@dataclass
class Config:
    # ---- model and data ----
    model_path: str | None = None
    """HF model folder of the policy; None warm-starts the built-in tiny policy (sft.py, cached)."""
    train_files: str | None = None
    """RL parquet(s) in verl's schema, comma-separated; None writes the built-in arith task."""
    val_files: str | None = None
    """Held-out parquet(s) for greedy evaluation; None uses the built-in task's."""
    val_size: int = 200
    """Held-out prompts per evaluation (the first val_size rows)."""
    reward_fn_path: str | None = None
    """A .py file holding a custom reward function (verl's custom_reward_function.path); None: built-in."""
    reward_fn_name: str = "compute_score"
    """Name of the function in reward_fn_path: (data_source, solution_str, ground_truth, extra_info)."""
    max_prompt_length: int = 32
    """Prompt tokens; a longer prompt is an error naming its row, unless truncate_prompts."""
    truncate_prompts: bool = False
    """Keep the last max_prompt_length tokens of long prompts (counted) instead of raising."""
    max_response_length: int = 8
    """Generated tokens per response (the EOS included)."""
    # ---- rollout ----
    rollout_backend: Literal["vllm", "hf"] = "vllm"
    """In-process vLLM engine, or HF generate on the trainer's model (same interface)."""
    rollout_n: int = 8
    """Responses sampled per prompt (the group of GRPO)."""
    temperature: float = 1.0
    """Sampling temperature; the trainer divides logits by it too, so log-probs agree."""
    top_p: float = 1.0
    """Nucleus sampling threshold."""
    # ---- algorithm ----
    adv_estimator: AdvEstimator = "gae"
    """gae: PPO with a critic (python ppo.py's default); grpo (python grpo.py's), rloo, reinforce_plus_plus and
    reinforce_plus_plus_baseline need no critic."""
    gamma: float = 1.0
    """Discount of future token rewards (GAE, REINFORCE++)."""
    lam: float = 1.0
    """GAE's lambda: 1 gives the Monte-Carlo return minus the value; lower trusts the critic more."""
    norm_adv_by_std: bool = True
    """GRPO divides a group's centred rewards by their std; Dr.GRPO (False) does not."""
    clip_ratio_low: float = 0.2
    """PPO clip: ratio floor is 1 - clip_ratio_low."""
    clip_ratio_high: float = 0.2
    """PPO clip: ratio ceiling is 1 + clip_ratio_high (DAPO's clip-higher raises it, e.g. 0.28)."""
    clip_ratio_c: float = 3.0
    """Dual-clip bound for negative advantages (Ye et al. 2020); must exceed 1."""
    loss_agg_mode: AggMode = "token-mean"
    """How token losses become one number (see agg_loss)."""
    use_kl_loss: bool = False
    """Add beta * KL(policy || frozen reference) to the loss (GRPO's KL term)."""
    kl_loss_coef: float = 0.001
    """beta of the KL loss."""
    kl_loss_type: KLKind = "low_var_kl"
    """KL estimator: k1, k2 (mse) or k3 (low_var_kl), after Schulman's 'Approximating KL divergence'."""
    entropy_coeff: float = 0.0
    """Entropy bonus coefficient (subtracted from the loss)."""
    tis_cap: float | None = None
    """Truncated importance sampling (Yao et al. 2025): weight each token's policy-gradient loss by
    min(exp(old_log_prob - rollout_log_prob), tis_cap), correcting for the engine sampling from slightly other
    probabilities than the trainer computes (other kernels, dtype); None: off. verl's runs use 2."""
    use_kl_in_reward: bool = False
    """Subtract kl_coef * the per-token KL(policy || reference) from the token rewards (Ziegler et al. 2019)."""
    kl_penalty: KLKind = "k1"
    """KL estimator of the in-reward penalty (see kl_loss_type)."""
    kl_ctrl_type: Literal["fixed", "adaptive"] = "fixed"
    """In-reward KL coefficient: fixed at kl_coef, or adapted toward kl_target (Ziegler et al. 2019)."""
    kl_coef: float = 0.001
    """The in-reward KL coefficient (the adaptive controller's starting value)."""
    kl_target: float = 0.1
    """Adaptive controller: the KL per token it steers toward."""
    kl_horizon: int = 10000
    """Adaptive controller: responses over which the coefficient may move by up to 20%."""
    # ---- critic (adv_estimator gae) ----
    critic_model_path: str | None = None
    """HF model folder the critic starts from (its backbone; a new value head unless it has one); None: the
    policy's. It must share the policy's tokenizer."""
    critic_lr: float = 1e-3
    """Critic AdamW learning rate."""
    critic_warmup: int = 0
    """Steps at the start during which only the critic trains (the actor waits for useful values)."""
    cliprange_value: float = 0.5
    """The new value may move at most this far from the old one before its loss stops pulling (value clipping)."""
    # ---- optimisation ----
    lr: float = 2e-4
    """Actor AdamW learning rate."""
    weight_decay: float = 0.0
    """AdamW weight decay."""
    grad_clip: float = 1.0
    """Max global grad norm; a non-finite norm skips the optimizer step."""
    train_batch_size: int = 32
    """Prompts per RL step (each sampled n times)."""
    ppo_mini_batch_size: int = 8
    """Prompts per optimizer step; train_batch_size / ppo_mini_batch_size updates per epoch."""
    ppo_micro_batch_size: int = 64
    """Sequences per forward/backward pass (gradient accumulation), actor and critic; also the log-prob and
    value passes' size."""
    use_dynamic_bsz: bool = False
    """Micro-batches by token budget (ppo_max_token_len_per_gpu) instead of ppo_micro_batch_size sequences;
    the same gradient, less padding (batching.py)."""
    ppo_max_token_len_per_gpu: int = 16384
    """use_dynamic_bsz: most real tokens (prompt + response) in one update micro-batch on one rank; a longer
    sequence gets a micro-batch of its own (actor/over_budget_seqs counts them)."""
    log_prob_max_token_len_per_gpu: int | None = None
    """use_dynamic_bsz: the token budget of the log-prob passes (no activations kept, so it may be larger);
    None: ppo_max_token_len_per_gpu."""
    use_remove_padding: bool = False
    """Pack each micro-batch into one row without padding, position_ids restarting per sequence; falls back to
    padded micro-batches, with a message, where the model's attention would let the sequences see each other."""
    balance_batch: bool = True
    """Re-deal the step's prompt groups across dp ranks by workload (Karmarkar-Karp) before the log-prob passes;
    a no-op in one process (the global_seqlen metrics still report)."""
    balance_by: Literal["tokens", "flops"] = "tokens"
    """Workload of a sequence for balance_batch: its token count, or a FLOP estimate (long sequences weigh more)."""
    ppo_epochs: int = 1
    """Passes over each RL batch."""
    total_steps: int = 200
    """RL steps."""
    fsdp: FSDPConfig = field(default_factory=FSDPConfig)
    """FSDP2 sharding of actor, reference and critic over the data-parallel ranks (torchrun); in one process only
    param_dtype applies (the dtype of the rollout engine and of the weights streamed into it)."""
    hybrid: HybridConfig = field(default_factory=HybridConfig)
    """The weight sync into the rollout engine (hybrid_engine.py): bucket size, offload, verification."""
    dist_timeout_s: int = 1800
    """Seconds a collective may wait before the run fails (torchrun only)."""
    # ---- run ----
    eval_every: int = 25
    """Steps between greedy evaluations (also before the first step and at the end)."""
    out_dir: str = "out/ppo"
    """Where metrics.jsonl, curves.png and final/ go."""
    seed: int = 0
    """Seed of data order, sampling (per step and prompt) and initialisation."""
    ckpt_every: int = 0
    """Steps between DCP checkpoints in out_dir/checkpoints (0: none); they resume at any world size."""
    resume: str = "auto"
    """auto: continue from out_dir/checkpoints' latest if there is one; off: start over; or a checkpoint path."""

    def __post_init__(self):
        for name in ("rollout_n", "train_batch_size", "ppo_mini_batch_size", "ppo_micro_batch_size", "ppo_epochs",
                     "total_steps", "eval_every", "val_size", "max_prompt_length", "max_response_length"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}={getattr(self, name)} must be >= 1")
        if self.train_batch_size % self.ppo_mini_batch_size:
            raise ValueError(f"train_batch_size={self.train_batch_size} must be a multiple of "
                             f"ppo_mini_batch_size={self.ppo_mini_batch_size}")
        if self.clip_ratio_c <= 1.0:
            raise ValueError(f"clip_ratio_c={self.clip_ratio_c} must be > 1")
        if self.temperature <= 0:
            raise ValueError(f"temperature={self.temperature} must be > 0")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p={self.top_p} must be in (0, 1]")
        if self.ckpt_every < 0:
            raise ValueError(f"ckpt_every={self.ckpt_every} must be >= 0 (0: no checkpoints)")
        if self.ppo_max_token_len_per_gpu < 1:
            raise ValueError(f"ppo_max_token_len_per_gpu={self.ppo_max_token_len_per_gpu} must be >= 1")
        if not self.use_dynamic_bsz and self.log_prob_max_token_len_per_gpu is not None:
            raise ValueError("log_prob_max_token_len_per_gpu applies only with use_dynamic_bsz (turn it on, or drop it)")
        if self.use_dynamic_bsz and self.log_prob_max_token_len_per_gpu is None:
            self.log_prob_max_token_len_per_gpu = self.ppo_max_token_len_per_gpu
        if self.use_dynamic_bsz and self.log_prob_max_token_len_per_gpu < 1:
            raise ValueError(f"log_prob_max_token_len_per_gpu={self.log_prob_max_token_len_per_gpu} must be >= 1")
        if self.tis_cap is not None and self.tis_cap <= 0:
            raise ValueError(f"tis_cap={self.tis_cap} must be > 0 (None: off)")
        if self.hybrid.offload_params and self.fsdp.cpu_offload:
            raise ValueError("hybrid.offload_params=True with fsdp.cpu_offload=True: the parameters already live in "
                             "CPU memory")
        for name in ("gamma", "lam"):
            if not 0 <= getattr(self, name) <= 1:
                raise ValueError(f"{name}={getattr(self, name)} must be in [0, 1]")
        for name in ("critic_lr", "cliprange_value", "kl_target"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name}={getattr(self, name)} must be > 0")
        if self.kl_horizon < 1:
            raise ValueError(f"kl_horizon={self.kl_horizon} must be >= 1")
        if not 0 <= self.critic_warmup < self.total_steps:
            raise ValueError(f"critic_warmup={self.critic_warmup} must be in [0, total_steps={self.total_steps}): "
                             "the actor trains only after it")
        if self.hybrid.verify_sync and self.hybrid.probe_len >= self.max_prompt_length + self.max_response_length:
            context = self.max_prompt_length + self.max_response_length
            raise ValueError(f"hybrid.probe_len={self.hybrid.probe_len} must be below the engine's context "
                             f"(max_prompt_length + max_response_length = {context})")
        if self.adv_estimator != "gae" and (self.critic_warmup or self.critic_model_path):
            raise ValueError(f"critic_warmup / critic_model_path need a critic: adv_estimator={self.adv_estimator!r} "
                             "has none (use gae)")
        if self.adv_estimator in ("grpo", "rloo") and self.use_kl_in_reward:
            raise ValueError(f"use_kl_in_reward: adv_estimator={self.adv_estimator!r} scores whole responses, not "
                             "tokens; use use_kl_loss")
        if self.adv_estimator == "rloo" and self.rollout_n < 2:
            raise ValueError(f"rollout_n={self.rollout_n}: rloo's leave-one-out baseline needs >= 2 samples a prompt")

    @property
    def use_reference(self) -> bool:
        """A frozen reference policy is loaded for the KL loss or the in-reward KL penalty."""
        return self.use_kl_loss or self.use_kl_in_reward


# ---------------------------------------------------------------------------------------------------
# Losses: all take [B, R] tensors over response tokens and a response mask
# ---------------------------------------------------------------------------------------------------


def masked_mean(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return (x * mask).sum() / mask.sum().clamp(min=1)


def agg_loss(loss_mat, mask, mode: AggMode, n_tokens=None, n_seqs=None, norm_len=None) -> torch.Tensor:
    """Reduce token losses [B, R] to a scalar.

    n_tokens / n_seqs are the counts of the whole mini-batch: when a mini-batch is split into
    micro-batches, each micro-batch divides by the mini-batch's counts, so the summed gradients equal
    the mini-batch's gradient in every mode. norm_len is Dr.GRPO's constant length (default R).
    """
    n_tokens = mask.sum() if n_tokens is None else n_tokens
    n_seqs = mask.shape[0] if n_seqs is None else n_seqs
    norm_len = mask.shape[-1] if norm_len is None else norm_len
    token_sum = (loss_mat * mask).sum(-1)  # [B]
    if mode == "token-mean":  # every token weighs the same (DAPO)
        return token_sum.sum() / n_tokens
    if mode == "seq-mean-token-sum":  # every sequence's summed loss weighs the same
        return token_sum.sum() / n_seqs
    if mode == "seq-mean-token-mean":  # every sequence weighs the same (original GRPO)
        return (token_sum / mask.sum(-1).clamp(min=1)).sum() / n_seqs
    if mode == "seq-mean-token-sum-norm":  # a constant normaliser, no length bias (Dr.GRPO)
        return token_sum.sum() / (n_seqs * norm_len)
    raise ValueError(f"unknown loss_agg_mode {mode!r}")


def policy_loss(logp, old_logp, adv, mask, clip_low, clip_high, clip_c, agg_mode, tis=None, **agg_kw):
    """PPO clipped surrogate with dual-clip; returns (loss, metrics of clipping and approximate KL).

    logp, old_logp, adv, mask: [B, R]. Clip-higher (DAPO) uses clip_high > clip_low. tis: per-token weights
    [B, R] (tis_weights) multiplying the token losses, or None.
    """
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
    metrics = {
        "actor/pg_clipfrac": masked_mean((loss_clipped > loss_unclipped).float(), mask).item(),
        "actor/pg_clipfrac_lower": masked_mean(((loss_ppo > -adv * clip_c) & (adv < 0)).float(), mask).item(),
        "actor/ppo_kl": masked_mean(-log_ratio, mask).item(),
    }
    return agg_loss(loss_mat, mask, agg_mode, **agg_kw), metrics


def tis_weights(old_logp, rollout_logp, mask, cap: float) -> tuple[torch.Tensor, dict]:
    """Truncated importance sampling (Yao et al. 2025): per-token weights [B, R] = min(pi_old / pi_rollout, cap), no
    gradient. The engine samples from slightly other probabilities than the trainer's (other kernels, dtype): this
    reweights its samples toward the trainer's old policy, truncated so that rare tokens cannot blow up the loss."""
    ratio = (old_logp - rollout_logp).clamp(max=20.0).exp()  # [B, R], clamped so exp cannot overflow
    weights = ratio.clamp(max=cap).detach()  # [B, R]
    return weights, {"actor/tis_weight_mean": masked_mean(weights, mask).item(),
                     "actor/tis_clipfrac": masked_mean((ratio > cap).float(), mask).item()}


def value_loss(values, old_values, returns, mask, clip, agg_mode, **agg_kw):
    """The critic's clipped regression loss 0.5 * max((V - G)^2, (V_clip - G)^2); returns (loss, metrics).

    values, old_values (at rollout), returns G, mask: [B, R]. V_clip stays within clip of the old value, so one
    batch cannot drag a value far (value clipping of OpenAI baselines' PPO2; Engstrom et al. 2020 study it).
    """
    clipped = old_values + (values - old_values).clamp(-clip, clip)  # [B, R]
    loss_unclipped, loss_clipped = (values - returns).square(), (clipped - returns).square()  # [B, R] each
    loss_mat = 0.5 * torch.maximum(loss_unclipped, loss_clipped)  # [B, R]
    metrics = {"critic/vf_clipfrac": masked_mean((loss_clipped > loss_unclipped).float(), mask).item(),
               "critic/vpred_mean": masked_mean(values, mask).item()}
    return agg_loss(loss_mat, mask, agg_mode, **agg_kw), metrics


def kl_penalty(logp: torch.Tensor, ref_logp: torch.Tensor, kind: KLKind) -> torch.Tensor:
    """Per-token KL(policy || ref) estimate [B, R] from sampled-token log-probs (Schulman 2020)."""
    log_ratio = logp - ref_logp
    if kind == "k1":
        return log_ratio
    if kind in ("k2", "mse"):
        return 0.5 * log_ratio.square()
    if kind in ("k3", "low_var_kl"):  # ratio - 1 - log ratio with ratio = ref / policy: unbiased, >= 0
        neg = -log_ratio
        return (neg.exp() - 1.0 - neg).clamp(-10.0, 10.0)  # clamped as verl does, for stability
    raise ValueError(f"unknown kl_loss_type {kind!r}")


def entropy_from_logits(logits: torch.Tensor) -> torch.Tensor:
    """Entropy of softmax(logits) along the vocabulary: [..., V] -> [...]."""
    probs = logits.softmax(-1)
    return torch.logsumexp(logits, -1) - (probs * logits).sum(-1)


# ---------------------------------------------------------------------------------------------------
# Rewards per token and advantages: each estimator maps (batch, cfg, dist) to (advantages, returns) [B, R]
# ---------------------------------------------------------------------------------------------------


def last_token(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """x [B] placed on each row's last response token of mask [B, R] (right-padded), 0 elsewhere: [B, R]."""
    lengths = mask.sum(-1).long()  # [B]
    out = torch.zeros_like(mask, dtype=x.dtype)  # [B, R]
    out[torch.arange(len(x)), (lengths - 1).clamp(min=0)] = torch.where(lengths > 0, x, 0.0)
    return out


def kl_in_reward(batch: TensorDict, coef: float, kind: KLKind) -> tuple[torch.Tensor, float]:
    """Token rewards minus coef * the per-token KL(policy || ref) estimate [B, R], and the batch's mean KL per token
    (a response's mean, averaged over responses). The penalty of Ziegler et al. 2019, as in InstructGPT."""
    mask = batch["response_mask"]
    kl = kl_penalty(batch["old_log_probs"], batch["ref_log_probs"], kind) * mask  # [B, R]
    mean_kl = (kl.sum(-1) / mask.sum(-1).clamp(min=1)).mean().item()
    return batch["token_level_rewards"] - coef * kl, mean_kl


def update_kl_coef(coef: float, kl: float, n_steps: int, cfg: Config) -> float:
    """The in-reward KL coefficient after a batch of n_steps responses with mean KL kl (fixed: coef itself).

    Adaptive (Ziegler et al. 2019): a proportional controller, error = kl / kl_target - 1 clipped to +-0.2, so the
    coefficient moves by at most 20% per kl_horizon responses.
    """
    if cfg.kl_ctrl_type == "fixed":
        return coef
    error = min(max(kl / cfg.kl_target - 1.0, -0.2), 0.2)
    return coef * (1.0 + error * n_steps / cfg.kl_horizon)


def masked_whiten(x: torch.Tensor, mask: torch.Tensor, dist: Dist, eps: float = 1e-8) -> torch.Tensor:
    """(x - mean) / std over the real tokens of the whole batch, all dp ranks together (0 at padding): [B, R].

    Two passes of summed statistics (reduce_metrics), so torchrun gives the numbers of one process; unbiased var.
    """
    total = reduce_metrics({"n": mask.sum().item(), "sum": (x * mask).sum().item()}, dist, sum_keys=("n", "sum"))
    mean = total["sum"] / max(total["n"], 1.0)
    sq = reduce_metrics({"sq": ((x - mean).square() * mask).sum().item()}, dist, sum_keys=("sq",))["sq"]
    var = sq / max(total["n"] - 1.0, 1.0)
    return (x - mean) / math.sqrt(var + eps) * mask


def gae(rewards: torch.Tensor, values: torch.Tensor, mask: torch.Tensor, gamma: float, lam: float):
    """Generalized advantage estimation (Schulman et al. 2016) over response tokens: (advantages, returns) [B, R].

    rewards, values, mask: [B, R], responses right-padded: after a response's last token the value is 0 (the
    episode ends). A_t = sum_k (gamma lam)^k delta_{t+k}, delta_t = r_t + gamma V_{t+1} - V_t; returns = A + V.
    """
    rewards, values = rewards * mask, values * mask  # [B, R]: padding adds nothing and ends the episode
    advantages = torch.zeros_like(rewards)  # [B, R]
    running = torch.zeros_like(rewards[:, 0])  # [B], A_{t+1}
    for t in reversed(range(rewards.shape[1])):
        next_value = values[:, t + 1] if t + 1 < rewards.shape[1] else torch.zeros_like(running)  # [B]
        running = rewards[:, t] + gamma * next_value - values[:, t] + gamma * lam * running
        advantages[:, t] = running
    advantages = advantages * mask
    return advantages, advantages + values


def gae_advantages(batch: TensorDict, cfg: Config, dist: Dist):
    """PPO's estimator: GAE on the critic's values, advantages whitened over the batch; returns are the critic's
    targets."""
    advantages, returns = gae(batch["token_level_rewards"], batch["values"], batch["response_mask"], cfg.gamma, cfg.lam)
    return masked_whiten(advantages, batch["response_mask"], dist), returns


def reinforce_pp_advantages(batch: TensorDict, cfg: Config, dist: Dist, baseline: bool = False):
    """REINFORCE++ (Hu 2025): each token's discounted return of the token rewards (KL penalty included), whitened
    over the batch; no critic. baseline (REINFORCE++-baseline): each score minus its prompt group's mean first."""
    rewards, mask = batch["token_level_rewards"], batch["response_mask"]  # [B, R]
    if baseline:  # the last token's reward loses its group's mean score (a group of one keeps its score)
        centred = group_advantages(batch["scores"], batch["group"], norm_by_std=False)  # [B]
        rewards = rewards - last_token(batch["scores"] - centred, mask)  # [B, R]
    returns = gae(rewards, torch.zeros_like(rewards), mask, cfg.gamma, 1.0)[0]  # V = 0, lam = 1: the return itself
    return masked_whiten(returns, mask, dist), returns


ADVANTAGE_ESTIMATORS = {  # adv_estimator -> (batch, cfg, dist) -> (advantages, returns) [B, R]
    "gae": gae_advantages, "grpo": grpo_advantages, "rloo": rloo_advantages,
    "reinforce_plus_plus": reinforce_pp_advantages,
    "reinforce_plus_plus_baseline": partial(reinforce_pp_advantages, baseline=True),
}


# ---------------------------------------------------------------------------------------------------
# The workers: the actor (rollout engine + trainable policy + frozen reference, in one process) and the critic
# ---------------------------------------------------------------------------------------------------


def pad_batch(prompts: list[list[int]], responses: list[list[int]], rollout_logps: list[list[float]], pad_id: int,
              widths: tuple[int, int] | None = None):
    """Left-pad prompts and right-pad responses into verl's batch layout (a TensorDict of [B, ...]).

    widths (P, R): pad to these instead of the longest prompt and response (they must be at least those).
    """
    B, (P, R) = len(responses), widths or (max(map(len, prompts)), max(1, max(map(len, responses))))
    prompt_ids = torch.full((B, P), pad_id)  # [B, P]
    response_ids = torch.full((B, R), pad_id)  # [B, R]
    prompt_mask = torch.zeros(B, P, dtype=torch.long)
    response_mask = torch.zeros(B, R, dtype=torch.long)
    rollout_log_probs = torch.zeros(B, R)
    for b, (p, r, lp) in enumerate(zip(prompts, responses, rollout_logps)):
        prompt_ids[b, P - len(p) :], prompt_mask[b, P - len(p) :] = torch.tensor(p), 1
        response_ids[b, : len(r)], response_mask[b, : len(r)] = torch.tensor(r, dtype=torch.long), 1
        rollout_log_probs[b, : len(r)] = torch.tensor(lp)
    attention_mask = torch.cat([prompt_mask, response_mask], 1)  # [B, P + R]
    position_ids = (attention_mask.cumsum(1) - 1).clamp(min=0)  # [B, P + R], 0 at the first real token
    return TensorDict(
        prompts=prompt_ids, responses=response_ids, input_ids=torch.cat([prompt_ids, response_ids], 1),
        attention_mask=attention_mask, position_ids=position_ids, response_mask=response_mask.float(),
        rollout_log_probs=rollout_log_probs, batch_size=[B],
    )


def response_outputs(model, batch: TensorDict, remove_padding: bool = False):
    """model's outputs (.logits: V-wide for the actor, 1 for the critic) at the positions that predict the
    response tokens: ([B, R, ...], None), or packed ([n, ...], keep [B, R]) with n = keep.sum() real response tokens.

    remove_padding: the batch runs as one packed row (batching.pack); use_cache=False, or no packing is detected.
    """
    R = batch["responses"].shape[1]
    if remove_padding:
        packed = pack(batch["input_ids"], batch["attention_mask"])  # [1, N]
        out = model(input_ids=packed.input_ids, position_ids=packed.position_ids, use_cache=False).logits[0]  # [N, ...]
        where = packed.where[:, -R - 1 : -1]  # [B, R]: the packed positions that predict the response tokens
        keep = (where >= 0) & batch["response_mask"].bool()  # [B, R]
        return out[where[keep]], keep  # [n, ...]: never a [B, R, V] tensor
    out = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"],
                position_ids=batch["position_ids"], use_cache=False).logits  # [B, P + R, ...]
    return out[:, -R - 1 : -1], None  # [B, R, ...]: position t predicts token t + 1


def response_log_probs(model, batch: TensorDict, temperature: float, with_entropy: bool = False,
                       remove_padding: bool = False, entropy_grad: bool = True):
    """Log-prob [B, R] (and entropy [B, R]) of each response token under model, at the sampling temperature.
    entropy_grad=False: the entropy is a metric only, and backward keeps no [tokens, V] softmax for it."""
    logits, keep = response_outputs(model, batch, remove_padding)  # [B, R, V] or [n, V]
    targets = batch["responses"] if keep is None else batch["responses"][keep]  # [B, R] or [n]
    logits = logits.float() / temperature
    logp = torch.log_softmax(logits, -1).gather(-1, targets.unsqueeze(-1)).squeeze(-1)  # [B, R] or [n]
    entropy = entropy_from_logits(logits if entropy_grad else logits.detach()) if with_entropy else None
    if keep is not None:  # back to [B, R], 0 at padding
        logp, entropy = unpack(logp, keep), entropy if entropy is None else unpack(entropy, keep)
    return logp, entropy


def response_values(model, batch: TensorDict, remove_padding: bool = False) -> torch.Tensor:
    """The critic's value [B, R] of the state before each response token (0 at padding)."""
    values, keep = response_outputs(model, batch, remove_padding)  # [B, R, 1] or [n, 1]
    values = values.squeeze(-1).float()
    return values * batch["response_mask"] if keep is None else unpack(values, keep)


class Worker:
    """What the actor and the critic share: a trainable model (FSDP2 over the dp ranks, the plain model in one
    process), its AdamW, micro-batches and the PPO update. Subclasses set role (the metrics' prefix) and give
    micro_batch_loss."""

    role: str

    def __init__(self, cfg: Config, dist: Dist, model: torch.nn.Module, lr: float):
        self.cfg, self.dist, self.model = cfg, dist, model
        self.opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=cfg.weight_decay)
        self.remove_padding = cfg.use_remove_padding and packing_works(model)
        if cfg.use_remove_padding and not self.remove_padding and dist.is_main:
            print(f"use_remove_padding: the {model.config._attn_implementation} attention lets packed sequences "
                  f"see each other (batching.packing_works); {self.role}: running padded micro-batches instead")

    def micro_batch_parts(self, batch: TensorDict, max_tokens: int | None) -> list[list[int]]:
        """Row indices of batch's micro-batches: within max_tokens (use_dynamic_bsz), else ppo_micro_batch_size rows."""
        if self.cfg.use_dynamic_bsz:
            return micro_batches(batch["attention_mask"].sum(-1), max_tokens, self.dist)
        B, size = batch.batch_size[0], self.cfg.ppo_micro_batch_size
        return [list(range(i, min(i + size, B))) for i in range(0, B, size)]

    def update(self, batch: TensorDict) -> dict:
        """PPO epochs over mini-batches; each mini-batch is one optimizer step over its micro-batches."""
        cfg, per_step = self.cfg, []
        for _ in range(cfg.ppo_epochs):
            for mb in batch.split(cfg.ppo_mini_batch_size // self.dist.dp_size * cfg.rollout_n):  # this rank's share
                # Every micro-batch divides by the mini-batch's counts, so the summed gradients are the
                # mini-batch's gradient; loss metrics add up the same way, token ratios are weighted by token share.
                # Counts over all dp ranks, times dp_size to undo FSDP's gradient averaging: every rank's
                # loss is its part of the global mini-batch's loss, whatever its token count.
                total = reduce_metrics({"tokens": mb["response_mask"].sum().item(), "seqs": mb.batch_size[0]},
                                       self.dist, sum_keys=("tokens", "seqs"))
                counts = dict(n_tokens=total["tokens"] / self.dist.dp_size, n_seqs=total["seqs"] / self.dist.dp_size,
                              norm_len=cfg.max_response_length)
                parts = self.micro_batch_parts(mb, cfg.ppo_max_token_len_per_gpu)  # the same count on every rank
                step = {f"{self.role}/num_micro_batches": len(parts)}
                for part in parts:
                    micro = mb[torch.tensor(part)]
                    loss, metrics = self.micro_batch_loss(micro, counts)
                    loss.backward()
                    share = (micro["response_mask"].sum() / mb["response_mask"].sum().clamp(min=1)).item()
                    for k, v in metrics.items():
                        step[k] = step.get(k, 0.0) + (v if k in LOSS_METRICS else v * share)
                grad_norm = clip_grad_norm(self.model, cfg.grad_clip)  # across shards
                if math.isfinite(grad_norm):  # a NaN/inf gradient would poison the weights: skip the step
                    self.opt.step()
                self.opt.zero_grad(set_to_none=True)
                step[f"{self.role}/grad_norm"] = grad_norm
                step[f"{self.role}/skipped_steps"] = float(not math.isfinite(grad_norm))
                per_step.append(step)
        out = {k: sum(s[k] for s in per_step) / len(per_step) for k in per_step[0]}
        out[f"{self.role}/skipped_steps"] *= len(per_step)  # a count, not a mean
        out[f"{self.role}/lr"] = self.opt.param_groups[0]["lr"]
        seqlens = batch["attention_mask"].sum(-1)  # [B]
        over = float((seqlens > cfg.ppo_max_token_len_per_gpu).sum()) if cfg.use_dynamic_bsz else 0.0
        out[f"{self.role}/over_budget_seqs"] = over
        return out


class ActorWorker(Worker):
    """The colocated actor: generates with its rollout engine (fed by the hybrid engine), log-probs, updates."""

    role = "actor"

    def __init__(self, cfg: Config, model_path: str, dist: Dist):
        self.tokenizer = AutoTokenizer.from_pretrained(model_path)
        super().__init__(cfg, dist, load_sharded_model(model_path, dist, cfg.fsdp), cfg.lr)  # fp32 master weights
        self.ref = load_sharded_model(model_path, dist, cfg.fsdp, trainable=False) if cfg.use_reference else None
        self.rollout = make_rollout(cfg.rollout_backend, model_path=model_path, model=self.model,
                                    tokenizer=self.tokenizer,
                                    max_model_len=cfg.max_prompt_length + cfg.max_response_length, seed=cfg.seed,
                                    dtype=cfg.fsdp.param_dtype)  # the engine computes in the trainer's dtype
        # train mode <-> rollout mode, streaming the weights into the engine (the 3D-HybridEngine, hybrid_engine.py)
        self.hybrid = HybridEngine(self.model, self.opt, self.rollout, dist, cfg.hybrid, DTYPES[cfg.fsdp.param_dtype])

    def generate(self, prompts: list[list[int]], seeds: list[int], greedy: bool = False) -> TensorDict:
        """n responses per prompt (prompt-major: rows i*n .. i*n+n-1 share prompt i) -> batch."""
        n = 1 if greedy else self.cfg.rollout_n
        out = self.rollout.generate(prompts, n=n, max_tokens=self.cfg.max_response_length,
                                    temperature=0.0 if greedy else self.cfg.temperature,
                                    top_p=self.cfg.top_p, seeds=seeds)
        repeated = [p for p in prompts for _ in range(n)]
        widths = max(map(len, prompts)), max(1, max(map(len, out.responses)))
        if not greedy and self.cfg.balance_batch:  # balance() all-gathers the rows: the same widths on every rank
            agreed = reduce_metrics({"P/max": widths[0], "R/max": widths[1]}, self.dist)
            widths = int(agreed["P/max"]), int(agreed["R/max"])
        return pad_batch(repeated, out.responses, out.log_probs, self.tokenizer.pad_token_id, widths)

    def balance(self, batch: TensorDict) -> tuple[TensorDict, dict]:
        """Re-deal whole prompt groups across the dp ranks by workload; returns this rank's batch and metrics."""
        seqlens = batch["attention_mask"].sum(-1)  # [B]
        work = seqlens if self.cfg.balance_by == "tokens" else flops_workload(seqlens, self.model.config.hidden_size)
        return balance_ranks(batch, seqlens, work, self.dist, unit=self.cfg.rollout_n)

    @torch.no_grad()
    def log_probs(self, batch: TensorDict, ref: bool = False) -> torch.Tensor:
        """Sampled-token log-probs [B, R] under the current policy (or the frozen reference)."""
        model = self.ref if ref else self.model
        parts = self.micro_batch_parts(batch, self.cfg.log_prob_max_token_len_per_gpu)
        return map_micro_batches(lambda mb: response_log_probs(model, mb, self.cfg.temperature,
                                                               remove_padding=self.remove_padding)[0], batch, parts)

    def micro_batch_loss(self, micro: TensorDict, counts: dict) -> tuple[torch.Tensor, dict]:
        """Policy loss - entropy bonus (+ KL loss) of one micro-batch, scaled by its mini-batch's counts."""
        cfg, mask = self.cfg, micro["response_mask"]
        logp, entropy = response_log_probs(self.model, micro, cfg.temperature, with_entropy=True,
                                           remove_padding=self.remove_padding,
                                           entropy_grad=cfg.entropy_coeff != 0)  # [b, R] each
        tis, tis_metrics = None, {}
        if cfg.tis_cap is not None:
            tis, tis_metrics = tis_weights(micro["old_log_probs"], micro["rollout_log_probs"], mask, cfg.tis_cap)
        pg_loss, metrics = policy_loss(logp, micro["old_log_probs"], micro["advantages"], mask, cfg.clip_ratio_low,
                                       cfg.clip_ratio_high, cfg.clip_ratio_c, cfg.loss_agg_mode, tis, **counts)
        metrics.update(tis_metrics)
        ent = agg_loss(entropy, mask, cfg.loss_agg_mode, **counts)
        loss = pg_loss - cfg.entropy_coeff * ent if cfg.entropy_coeff else pg_loss
        metrics.update({"actor/pg_loss": pg_loss.item(), "actor/entropy": ent.item()})
        if cfg.use_kl_loss:
            kl = agg_loss(kl_penalty(logp, micro["ref_log_probs"], cfg.kl_loss_type), mask, cfg.loss_agg_mode, **counts)
            loss = loss + cfg.kl_loss_coef * kl
            metrics["actor/kl_loss"] = kl.item()
        return loss, metrics


class CriticWorker(Worker):
    """The critic: an LM backbone with a scalar value head (AutoModelForTokenClassification with one label),
    sharded like the actor, with its own AdamW (critic_lr): values and the clipped value-loss update."""

    role = "critic"

    def __init__(self, cfg: Config, model_path: str, dist: Dist):
        config = AutoConfig.from_pretrained(model_path, num_labels=1)
        config.classifier_dropout = 0.0  # the head's default dropout (0.1) would add noise to every value
        with torch.random.fork_rng(devices=[]):  # a new head's initialisation: seeded, the global RNG untouched
            torch.manual_seed(cfg.seed)
            model = load_sharded_model(model_path, dist, cfg.fsdp, model_class=AutoModelForTokenClassification,
                                       config=config)
        super().__init__(cfg, dist, model, cfg.critic_lr)

    @torch.no_grad()
    def values(self, batch: TensorDict) -> torch.Tensor:
        """The value [B, R] of the state before each response token, 0 at padding."""
        parts = self.micro_batch_parts(batch, self.cfg.log_prob_max_token_len_per_gpu)
        return map_micro_batches(lambda mb: response_values(self.model, mb, self.remove_padding), batch, parts)

    def micro_batch_loss(self, micro: TensorDict, counts: dict) -> tuple[torch.Tensor, dict]:
        """The clipped value loss of one micro-batch against the returns, scaled by its mini-batch's counts."""
        values = response_values(self.model, micro, self.remove_padding)  # [b, R]
        loss, metrics = value_loss(values, micro["values"], micro["returns"], micro["response_mask"],
                                   self.cfg.cliprange_value, self.cfg.loss_agg_mode, **counts)
        metrics["critic/vf_loss"] = loss.item()
        return loss, metrics


# ---------------------------------------------------------------------------------------------------
# Rewards, evaluation, logging
# ---------------------------------------------------------------------------------------------------


def score(batch: TensorDict, rows: list[dict], tokenizer, reward_fn) -> torch.Tensor:
    """One scalar reward per response [B] from the task's verifier; rows[b] is response b's prompt row."""
    texts = tokenizer.batch_decode(batch["responses"], skip_special_tokens=True)
    return torch.tensor([float(reward_fn(r["data_source"], t, r["ground_truth"], r["extra_info"]))
                         for r, t in zip(rows, texts)])


def evaluate(worker: ActorWorker, val_rows: list[dict], reward_fn) -> dict:
    """Greedy accuracy on held-out prompts (one response each); each dp rank takes its share."""
    rows = val_rows[worker.dist.dp_rank :: worker.dist.dp_size]
    with worker.hybrid.rollout_mode({}):  # a switch of its own (its metrics are not the step's)
        batch = worker.generate([r["prompt_ids"] for r in rows], seeds=None, greedy=True)
    scores = score(batch, rows, worker.tokenizer, reward_fn)
    total = reduce_metrics({"correct": scores.sum().item(), "n": len(rows)}, worker.dist, sum_keys=("correct", "n"))
    return {"val/accuracy": total["correct"] / total["n"]}


def plot_curves(records: list[dict], path: str):
    """curves.png: training reward and held-out accuracy against step."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 4))
    train = [r for r in records if "critic/score/mean" in r]
    ax1.plot([r["step"] for r in train], [r["critic/score/mean"] for r in train])
    ax1.set(xlabel="step", ylabel="mean reward", title="training reward")
    val = [r for r in records if "val/accuracy" in r]
    ax2.plot([r["step"] for r in val], [r["val/accuracy"] for r in val], marker="o")
    ax2.set(xlabel="step", ylabel="greedy accuracy", title="held-out accuracy", ylim=(0, 1))
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def prompt_indices(step: int, cfg: Config, n_rows: int) -> list[int]:
    """The dataset rows of a step: a fresh seeded permutation per epoch, so a step alone decides them."""
    per_epoch = n_rows // cfg.train_batch_size
    epoch, pos = divmod(step - 1, per_epoch)
    perm = torch.randperm(n_rows, generator=torch.Generator().manual_seed(cfg.seed * 10_007 + epoch))
    return perm[pos * cfg.train_batch_size : (pos + 1) * cfg.train_batch_size].tolist()


def sample_seed(cfg: Config, step: int, row: int) -> int:
    """The sampling seed of one prompt at one step: a replayed step samples the same responses."""
    return (cfg.seed * 1_000_003 + step * 100_003 + row) % (2**31 - 1)


def resolve_defaults(cfg: Config, dist: Dist) -> tuple[str, str, str]:
    """(model_path, train_files, val_files), warm-starting the built-in policy on the built-in task if unset."""
    from sft import SFTConfig, builtin_files, run as run_sft

    paths = None
    if dist.is_main:  # rank 0 trains the warm start and writes the task files; the others receive the paths
        files = (cfg.train_files, cfg.val_files)
        if not all(files):
            builtin = builtin_files(SFTConfig(), os.path.join(cfg.out_dir, "data"))
            files = tuple(f or b for f, b in zip(files, builtin))
        paths = (cfg.model_path or run_sft(SFTConfig()), *files)
    return broadcast_object(paths, dist)


def resume(cfg: Config, worker: ActorWorker, critic: CriticWorker | None,
           ckpt_dir: str) -> tuple[int, list[dict], float]:
    """(first step to run, records so far, in-reward KL coefficient), restoring the models and optimizers from a
    checkpoint when there is one.

    Nothing else needs restoring: a step's prompts and sampling seeds are functions of the step alone.
    """
    path = None if cfg.resume == "off" else find_latest(ckpt_dir) if cfg.resume == "auto" else cfg.resume
    if path is None:
        return 1, [], cfg.kl_coef
    extra = load_checkpoint(path, worker.model, worker.opt, worker.dist, critic_state(critic))
    for opt, lr in [(worker.opt, cfg.lr)] + ([(critic.opt, cfg.critic_lr)] if critic else []):
        for group in opt.param_groups:  # the optimizer state resumes; the learning rate is this run's
            group["lr"] = lr
    torch.set_rng_state(extra["rng"])  # the engine gets the loaded weights at the next switch to rollout mode
    if worker.dist.is_main:
        print(f"resumed from {path} at step {extra['step']}")
    kl_coef = extra.get("kl_coef", cfg.kl_coef) if cfg.kl_ctrl_type == "adaptive" else cfg.kl_coef
    return extra["step"] + 1, extra["records"], kl_coef


def critic_state(critic: CriticWorker | None) -> dict | None:
    """The critic's part of a checkpoint (sharding's `more`)."""
    return {"critic": (critic.model, critic.opt)} if critic else None


# ---------------------------------------------------------------------------------------------------
# The training loop
# ---------------------------------------------------------------------------------------------------

def train(cfg: Config) -> list[dict]:
    """Run cfg.total_steps RL steps on every rank (SPMD); returns the records rank 0 logs to metrics.jsonl."""
    dist = init_distributed(cfg.dist_timeout_s)
    if cfg.train_batch_size % dist.dp_size or cfg.ppo_mini_batch_size % dist.dp_size:
        raise ValueError(f"train_batch_size={cfg.train_batch_size} and ppo_mini_batch_size={cfg.ppo_mini_batch_size}"
                         f" must divide by the {dist.dp_size} data-parallel ranks")
    if cfg.rollout_backend == "hf" and dist.dp_size > 1:  # sharded generate stops at different steps per rank
        raise ValueError("rollout_backend='hf' runs in one process only; use 'vllm' with torchrun")
    os.makedirs(cfg.out_dir, exist_ok=True)
    model_path, train_files, val_files = resolve_defaults(cfg, dist)
    worker = ActorWorker(cfg, model_path, dist)
    critic = CriticWorker(cfg, cfg.critic_model_path or model_path, dist) if cfg.adv_estimator == "gae" else None
    reward_fn = load_reward_fn(cfg.reward_fn_path, cfg.reward_fn_name)
    train_ds = RLDataset(train_files.split(","), worker.tokenizer, cfg.max_prompt_length, cfg.truncate_prompts)
    val_ds = RLDataset(val_files.split(","), worker.tokenizer, cfg.max_prompt_length, cfg.truncate_prompts)
    val_rows = [val_ds[i] for i in range(min(cfg.val_size, len(val_ds)))]
    if len(train_ds) < cfg.train_batch_size:
        raise ValueError(f"train_files={train_files} hold {len(train_ds)} prompts < train_batch_size={cfg.train_batch_size}")
    if len(val_rows) < dist.dp_size:
        raise ValueError(f"val_files={val_files}: {len(val_rows)} prompts (val_size={cfg.val_size}) for {dist.dp_size} ranks")
    ckpt_dir = os.path.join(cfg.out_dir, "checkpoints")
    start, records, kl_coef = resume(cfg, worker, critic, ckpt_dir)
    log = None
    if dist.is_main:  # only rank 0 writes files
        with open(os.path.join(cfg.out_dir, "config.json"), "w") as f:
            json.dump(asdict(cfg), f, indent=1)
        log = open(os.path.join(cfg.out_dir, "metrics.jsonl"), "w")
        log.writelines(json.dumps(r) + "\n" for r in records)

    def emit(record: dict):
        records.append(record)
        if log:
            log.write(json.dumps(record) + "\n")
            log.flush()

    if start == 1:
        emit({"step": 0, "prompt/num_truncated": train_ds.num_truncated + val_ds.num_truncated,
              **evaluate(worker, val_rows, reward_fn)})
    per_rank = cfg.train_batch_size // dist.dp_size
    bar = tqdm(range(start, cfg.total_steps + 1), desc="rl", disable=not dist.is_main)
    for step in bar:
        metrics = {"step": step}
        with timer("step", metrics):
            indices = prompt_indices(step, cfg, len(train_ds))[dist.dp_rank * per_rank : (dist.dp_rank + 1) * per_rank]
            rows = [train_ds[i] for i in indices]  # this rank's prompts

            # ==================== 1. rollout mode: stream the new weights into vLLM, generate n per prompt ===
            with worker.hybrid.rollout_mode(metrics), timer("gen", metrics):  # leaving it: vLLM sleeps
                batch = worker.generate([r["prompt_ids"] for r in rows], [sample_seed(cfg, step, r["index"]) for r in rows])
            rows = [r for r in rows for _ in range(cfg.rollout_n)]

            # ==================== 2. reward: the task's verifier ====================
            with timer("reward", metrics):
                batch["scores"] = score(batch, rows, worker.tokenizer, reward_fn)  # [B]

            # ==================== 2b. balance the dp ranks' work (batching.py) ====================
            # Whole prompt groups move, before the log-prob passes: all three passes (old, ref, update) get even
            # work, and advantages stay a rank-local computation over whole groups (verl moves single sequences
            # because its driver computes advantages over the whole batch).
            if cfg.balance_batch:
                with timer("balance", metrics):
                    batch, balance_metrics = worker.balance(batch)
                metrics.update(balance_metrics)
            batch["group"] = torch.arange(per_rank).repeat_interleave(cfg.rollout_n)  # [B]: a prompt's n samples

            # ==================== 3. old (and reference) log-probs, values ====================
            with timer("old_log_prob", metrics):
                batch["old_log_probs"] = worker.log_probs(batch)  # [B, R]
            if cfg.use_reference:
                with timer("ref", metrics):
                    batch["ref_log_probs"] = worker.log_probs(batch, ref=True)  # [B, R]
            if critic:
                with timer("values", metrics):
                    batch["values"] = critic.values(batch)  # [B, R]

            # ==================== 4. token rewards, advantages ====================
            with timer("adv", metrics):
                # the verifier scores the whole response: its reward sits on the last token
                batch["token_level_rewards"] = last_token(batch["scores"], batch["response_mask"])  # [B, R]
                if cfg.use_kl_in_reward:
                    batch["token_level_rewards"], kl = kl_in_reward(batch, kl_coef, cfg.kl_penalty)  # [B, R]
                    kl = reduce_metrics({"kl": kl}, dist)["kl"]  # all ranks' mean: their controllers stay equal
                    metrics.update({"actor/reward_kl_penalty": kl, "actor/reward_kl_penalty_coeff": kl_coef})
                    kl_coef = update_kl_coef(kl_coef, kl, cfg.train_batch_size * cfg.rollout_n, cfg)
                batch["advantages"], batch["returns"] = ADVANTAGE_ESTIMATORS[cfg.adv_estimator](batch, cfg, dist)

            # ==================== 5. update the critic, then the actor (after critic_warmup) ====================
            if critic:
                with timer("update_critic", metrics):
                    metrics.update(critic.update(batch))
            if step > cfg.critic_warmup:
                with timer("update_actor", metrics):
                    metrics.update(worker.update(batch))

        # ==================== 6. metrics, evaluation, checkpoint ====================
        metrics.update(batch_metrics(batch, cfg.max_response_length))
        metrics["perf/throughput"] = batch["attention_mask"].sum().item() / metrics["timing_s/step"]  # per rank
        # mean over ranks; /max, /min keys by max, min; counts by sum
        sum_keys = ("actor/over_budget_seqs", "critic/over_budget_seqs")
        metrics = {**reduce_metrics(metrics, dist, sum_keys), "step": step}
        if step % cfg.eval_every == 0 or step == cfg.total_steps:
            with timer("testing", metrics):
                metrics.update(evaluate(worker, val_rows, reward_fn))
        emit(metrics)
        if cfg.ckpt_every and step % cfg.ckpt_every == 0:
            # the data position is the step itself (prompt_indices); RNG states for anything seeded globally
            extra = {"step": step, "records": records, "rng": torch.get_rng_state(), "kl_coef": kl_coef}
            save_checkpoint(ckpt_dir, step, worker.model, worker.opt, extra, dist, critic_state(critic))
        bar.set_postfix(reward=f"{metrics['critic/score/mean']:.3f}", acc=metrics.get("val/accuracy", ""))

    export_hf(worker.model, worker.tokenizer, os.path.join(cfg.out_dir, "final"), dist)
    if critic:  # a later run can start its critic here (critic_model_path)
        export_hf(critic.model, worker.tokenizer, os.path.join(cfg.out_dir, "critic"), dist)
    if dist.is_main:
        plot_curves(records, os.path.join(cfg.out_dir, "curves.png"))
        log.close()
        print(f"held-out greedy accuracy: {records[0]['val/accuracy']:.3f} -> {records[-1]['val/accuracy']:.3f}; "
              f"outputs in {cfg.out_dir}")
    barrier(dist)  # the last collective: closing the engine destroys the default process group (vLLM's cleanup)
    worker.rollout.close()
    shutdown(dist)
    return records


def stats(name: str, x: torch.Tensor) -> dict:
    """verl's name/mean, name/max, name/min of x."""
    return {f"{name}/mean": x.mean().item(), f"{name}/max": x.max().item(), f"{name}/min": x.min().item()}


def batch_metrics(batch: TensorDict, max_response_length: int) -> dict:
    """verl's data metrics of one step: rewards, advantages, returns, values, lengths, engine/trainer log-prob gap."""
    mask = batch["response_mask"]
    real = mask.bool()  # [B, R]
    lengths = mask.sum(-1)  # [B]
    gap = (batch["rollout_log_probs"] - batch["old_log_probs"]).abs() * mask  # [B, R]
    out = stats("critic/score", batch["scores"])  # [B]: one per response
    for name in ("advantages", "returns", "values"):  # [B, R]: over the real tokens
        if name in batch.keys():
            out.update(stats(f"critic/{name}", batch[name][real]))
    if "values" in batch.keys():  # the share of the returns' variance that the values explain (1: all of it)
        returns, values = batch["returns"][real], batch["values"][real]
        out["critic/vf_explained_var"] = (1 - (returns - values).var() / returns.var().clamp(min=1e-8)).item()
    return {
        **out,
        "response_length/mean": lengths.mean().item(),
        "response_length/max": lengths.max().item(),
        "response_length/clip_ratio": (lengths >= max_response_length).float().mean().item(),
        "prompt_length/mean": (batch["attention_mask"].sum(-1) - lengths).float().mean().item(),
        "rollout/logprob_diff_max": gap.max().item(),
        "rollout/logprob_diff_mean": (gap.sum() / mask.sum().clamp(min=1)).item(),
    }


if __name__ == "__main__":
    train(tyro.cli(Config))
