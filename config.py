"""The one Config of every entry point (ppo.py, grpo.py): every knob of a run, with its docstring.

    python ppo.py --help        # these fields as flags (tyro), with PPO's defaults
    python grpo.py --help       # the same fields with GRPO's defaults

Invalid values and combinations are rejected here, naming the field, before anything heavy starts.
"""

import json
import os
from dataclasses import dataclass, field, fields, replace
from typing import Annotated, Literal

import tyro
from transformers import AutoConfig

from agent import AgentConfig
from core_algos import AdvEstimator, AggMode, KLKind
from data.calculator import AGENT
from hybrid_engine import HybridConfig
from sharding import DTYPES, FSDPConfig, OffloadConfig, check_tp
from tracking import Backend


START_HERE = """Where to start: `python {script}` runs {algo} on the built-in arithmetic task with a tiny model on CPU
(minutes; outputs in out/{name}). Your own task: --model-path (e.g. a warm start from sft.py), --train-files,
--val-files (verl's parquet schema) and --reward-fn-path (the README's "Your own data" shows the whole path).
A task that needs a tool (multi-turn): --task calculator; your tools: --agent.tools-path.
Most changed: --total-steps, --rollout-n, --lr, --max-response-length, --train-batch-size; --logger tensorboard;
--ckpt-every. Every field follows."""


@dataclass
class AsyncConfig:
    rollout_workers: int = 0
    """Generation-only engines in a rollout pool of their own (one a device), fed the trainer's weights after each
    update; 0: the actor's colocated engines generate (the hybrid engine). Ray controller only."""
    staleness: int = 1
    """With a rollout pool: a sample may come from weights at most this many updates behind the trainer's (AReaL's
    bound); 0: synchronous, 1: one-step-off (batch k+1 generates while the trainer updates on batch k)."""
    score_chunks: int = 4
    """With a rollout pool: each worker generates its share in this many calls, and each is scored (a Ray task)
    as soon as it finishes, while the next generates."""
    behav_imp_weight_cap: float | None = 2.0
    """With staleness >= 1, decoupled PPO (AReaL, Fu et al. 2025): the clipped ratio is taken against the proximal
    policy (the old log-probs, recomputed with the trainer's weights) and each token's loss is weighted by
    pi_prox / pi_behav (the weights that sampled it), truncated at this cap (AReaL's name; verl's rollout_is_threshold
    is 2); async/is_weight/mean|max report it. None: off. tis_cap, where set, takes its place."""
    sync_timeout_s: float = 300.0
    """With a rollout pool: seconds the weight sync's broadcast may wait for an engine; a dead or hung engine is then
    named and the pool replaced (its old sync group aborted first), while the trainer goes on."""

    def __post_init__(self):
        if self.rollout_workers < 0 or self.staleness < 0 or self.score_chunks < 1:
            raise ValueError(f"async.rollout_workers={self.rollout_workers} and async.staleness={self.staleness} must "
                             f"be >= 0, async.score_chunks={self.score_chunks} >= 1")
        if self.staleness > 1:  # the pool takes weights only once its queued requests are done (RolloutPool._sync)
            raise ValueError(f"async.staleness={self.staleness}: the rollout pool's engines take new weights only "
                             "between requests, after every batch already started, so a bound above 1 adds "
                             "staleness without more overlap; use 1 (one-step-off) or 0")
        if self.behav_imp_weight_cap is not None and self.behav_imp_weight_cap <= 0:
            raise ValueError(f"async.behav_imp_weight_cap={self.behav_imp_weight_cap} must be > 0 (None: off)")
        if self.sync_timeout_s <= 0:
            raise ValueError(f"async.sync_timeout_s={self.sync_timeout_s} must be > 0")


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
    reward_model_path: str | None = None
    """A learned reward model (verl's reward_model.model.path): reward_model.py's output or any HF scalar-head model
    (num_labels 1), scoring each prompt + response at its last token; or dpo.py's output, scoring by DPO's implicit
    reward against the model it started from (workers.RewardWorker)."""
    reward_model_mode: Literal["replace", "add"] = "replace"
    """How its score meets the rule reward: replace it, or add reward_model_coef * the score to it."""
    reward_model_coef: float = 1.0
    """The reward model's weight with reward_model_mode add."""
    rlhf_reward: Literal["dpo", "bt"] = "dpo"
    """--task arith-rlhf's learned reward model where reward_model_path is None, trained on its pairs the first time
    and cached: dpo (dpo.py's policy, scored by its implicit reward) or bt (reward_model.py's scalar head)."""
    max_prompt_length: int = 512
    """Prompt tokens; a longer prompt is an error naming its row, unless truncate_prompts."""
    truncate_prompts: bool = False
    """Keep the last max_prompt_length tokens of long prompts (counted) instead of raising."""
    max_response_length: int = 1024
    """Response tokens (the EOS included; with tools, their outputs too)."""
    task: Literal["arith", "calculator", "arith-rlhf"] = "arith"
    """The built-in task: its files where train_files / val_files are None, its warm start without model_path, its
    tools where agent.tools_path is None (calculator: products with a calculator tool, data/calculator.py).
    arith-rlhf: arith's, with a learned reward model in place of the verifier where reward_model_path is None
    (reward_model.builtin_reward_model: pairs of the warm start's own answers, 20% of the labels flipped; rlhf_reward
    says which model learns them; cached)."""
    # ---- rollout ----
    rollout_backend: Literal["vllm", "hf"] = "vllm"
    """In-process vLLM engine, or HF generate on the trainer's model (same interface)."""
    rollout_n: int = 8
    """Responses sampled per prompt (the group of GRPO)."""
    temperature: float = 1.0
    """Sampling temperature; the trainer divides logits by it too, so log-probs agree."""
    top_p: float = 1.0
    """Nucleus sampling threshold."""
    ignore_eos: bool = False
    """Sample every response to max_response_length, past EOS: fixed-length work, for benchmarks (bench/step.py)."""
    gpu_memory_utilization: float = 0.5
    """GPU: the share of device memory the vLLM engine takes (weights + KV cache) beside the trainer, which gets it
    back in train mode. CPU: unused (a 1 GiB KV cache)."""
    rollout_tp: int = 1
    """vLLM tensor parallelism (verl's tensor_model_parallel_size): groups of rollout_tp consecutive torchrun ranks
    each run one engine sharded over them, generating the prompts of all its ranks; each rank keeps its own."""
    cuda_graphs: bool = False
    """GPU: let vLLM capture CUDA graphs (enforce_eager off): faster decoding, valid only while each weight sync
    rewrites the weights in place (not yet shown on a GPU: check with --hybrid.verify-sync); off: eager."""
    # ---- algorithm ----
    adv_estimator: AdvEstimator = "gae"
    """gae: PPO with a critic (ppo.py's default); the others need none (grpo: grpo.py's default)."""
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
    """KL estimator: k1, abs, k2 (mse) or k3 (low_var_kl), after Schulman's 'Approximating KL divergence'; k1+, k3+,
    low_var_kl+: that value with k2's gradient (straight-through, verl's)."""
    entropy_coeff: float = 0.0
    """Entropy bonus coefficient (subtracted from the loss)."""
    tis_cap: float | None = None
    """Truncated importance sampling (Yao et al. 2025): each token's policy-gradient loss times min(exp(old_log_prob -
    rollout_log_prob), tis_cap), for the engine's slightly other probabilities (kernels, dtype). None: off; verl: 2."""
    tis_level: Literal["token", "sequence"] = "token"
    """tis_cap's weights: per token, or one a response (the product of its token ratios, truncated at tis_cap)."""
    rollout_mask: Literal["token", "sequence"] | None = None
    """Rollout correction by masking, on the ratio pi_old / pi_rollout: token drops each token whose ratio leaves
    [rollout_mask_low, rollout_mask_high] from the policy loss (IcePop); sequence drops whole responses whose
    geometric-mean ratio leaves it (rejection); None: off. Needs old_log_probs recompute (before the update)."""
    rollout_mask_low: float = 0.5
    """rollout_mask's lower ratio bound (< 1)."""
    rollout_mask_high: float = 2.0
    """rollout_mask's upper ratio bound (> 1)."""
    overlong_buffer_len: int = 0
    """DAPO's soft overlong punishment: a response longer than max_response_length - overlong_buffer_len tokens loses
    reward linearly, up to overlong_penalty_factor at max_response_length; 0: off."""
    overlong_penalty_factor: float = 1.0
    """The overlong punishment at max_response_length."""
    dynamic_sampling: bool = False
    """DAPO's dynamic sampling: drop prompt groups whose verifier scores are all equal (no gradient; before the
    overlong shaping) and sample more prompts, in rounds, until the step holds train_batch_size informative groups
    (or max_gen_rounds ran: then dropped groups fill the rest, left out of the policy loss and counted in
    dynamic/filled_groups)."""
    max_gen_rounds: int = 4
    """dynamic_sampling: generation rounds a step may take at most."""
    mask_truncated: bool = False
    """DAPO's overlong filtering: a response cut at max_response_length (no EOS) gets no policy loss."""
    old_log_probs: Literal["auto", "recompute", "rollout", "update"] = "auto"
    """Where the PPO ratio's old log-probs come from. recompute: a no-grad pass of the policy before the update
    (verl's default; with stale samples, AReaL's proximal policy). rollout: the engine's own, no pass (verl's bypass;
    the engine-trainer gap is still measured on the update's first mini-batch). update: that mini-batch's forward,
    detached: exact only for one optimizer step on the weights that sampled, with nothing needing them earlier
    (Config._update_is_inexact). auto: update where it is exact (TRL's behaviour), else recompute."""
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
    critic_lr: float = 1e-5
    """Critic AdamW learning rate (verl's; the built-in task's own is 1e-3, see BUILTIN_TASK)."""
    critic_warmup: int = 0
    """Steps at the start during which only the critic trains (the actor waits for useful values)."""
    cliprange_value: float = 0.5
    """The new value may move at most this far from the old one before its loss stops pulling (value clipping)."""
    # ---- optimisation ----
    lr: float = 1e-6
    """Actor AdamW learning rate (verl's; the built-in task's own is 2e-4, see BUILTIN_TASK)."""
    lr_warmup_steps: int = -1
    """Updates over which the learning rates (actor and critic) rise linearly to lr; -1: lr_warmup_steps_ratio of
    total_steps. One update is one RL step's update of that model (verl's lr_warmup_steps)."""
    lr_warmup_steps_ratio: float = 0.0
    """Warmup as a share of total_steps, used when lr_warmup_steps is -1."""
    lr_scheduler: Literal["constant", "cosine"] = "constant"
    """After warmup: constant, or cosine decay to min_lr_ratio * lr at total_steps (verl's warmup_style)."""
    min_lr_ratio: float = 0.0
    """The cosine schedule's floor, as a share of lr."""
    weight_decay: float = 0.0
    """AdamW weight decay."""
    grad_clip: float = 1.0
    """Max global grad norm; a non-finite norm skips the optimizer step."""
    train_batch_size: int = 1024
    """Prompts per RL step (each sampled n times)."""
    ppo_mini_batch_size: int = 256
    """Prompts per optimizer step; train_batch_size / ppo_mini_batch_size updates per epoch."""
    ppo_micro_batch_size: int = 16
    """Sequences per forward/backward pass of an update (gradient accumulation), actor and critic, per device."""
    use_dynamic_bsz: bool = False
    """Micro-batches by token budget (ppo_max_token_len_per_gpu) instead of ppo_micro_batch_size sequences;
    the same gradient, less padding (batching.py)."""
    ppo_max_token_len_per_gpu: int = 16384
    """use_dynamic_bsz: most real tokens (prompt + response) in one update micro-batch on one rank; a longer
    sequence gets a micro-batch of its own (actor/over_budget_seqs counts them)."""
    log_prob_max_token_len_per_gpu: int = 16384
    """Most real tokens in one micro-batch of the passes without gradients (old and reference log-probs, the critic's
    values), always by token budget: they keep no activations, and the logits exist a chunk at a time."""
    oom_retry: bool = False
    """An out-of-memory in a micro-batch halves that phase's micro-batch limit (token budget or ppo_micro_batch_size,
    for the rest of the run) and reruns its micro-batches: same result, counted in perf/oom_retries/<role>. Off: the
    error names the phase, micro-batch and knobs. Every rank must meet it at the same micro-batch (Worker.oom_retry)."""
    gradient_checkpointing: bool = False
    """Recompute each decoder layer's activations in backward instead of keeping them (actor and critic; verl's
    enable_gradient_checkpointing): the update's memory no longer grows with layers x tokens."""
    lora_rank: int = 0
    """LoRA adapters of this rank on the actor (lora.py, peft); 0: full fine-tuning. Only the adapters train; the
    reference is the same model with them off. RL wants a higher lr than full fine-tuning (TRL: ~10x)."""
    lora_alpha: float = 16.0
    """LoRA's scale numerator: the adapters' product is scaled by lora_alpha / lora_rank."""
    lora_target_modules: str = "all-linear"
    """The linears that get adapters: comma-separated module names (q_proj,v_proj), or all-linear (every linear
    layer but the LM head)."""
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
    param_dtype applies (the compute dtype, through torch.autocast; also the rollout engine's dtype)."""
    offload: OffloadConfig = field(default_factory=OffloadConfig)
    """What each role keeps in CPU memory while it is not computing (GPU; sharding.OffloadConfig)."""
    hybrid: HybridConfig = field(default_factory=HybridConfig)
    """The weight sync into the rollout engines (hybrid_engine.py, a RolloutPool's too): bucket size, verification."""
    agent: AgentConfig = field(default_factory=AgentConfig)
    """Multi-turn rollouts with tools (agent.py): the tools' file, the call and output format, turns, timeout."""
    async_: Annotated[AsyncConfig, tyro.conf.arg(name="async")] = field(default_factory=AsyncConfig)
    """A rollout pool of its own and one-step-off generation (ray_trainer.py only: RolloutPool)."""
    dist_timeout_s: int = 1800
    """Seconds a collective may wait before the run fails (torchrun and Ray's worker groups). Under torchrun a rank
    that dies is named by the others within seconds; one that hangs, when this has passed (watchdog.watch_ranks)."""
    # ---- run ----
    logger: tuple[Backend, ...] = ()
    """Where metrics go besides metrics.jsonl and curves.png (always written): console (a line a step),
    tensorboard (out_dir/tensorboard), wandb (offline in out_dir/wandb unless WANDB_API_KEY is set)."""
    verbose: bool = False
    """Print vLLM's INFO log lines too (by default only its warnings)."""
    project_name: str = "nanoverl"
    """wandb's project."""
    experiment_name: str | None = None
    """wandb's run name; None: the out_dir's last folder name."""
    eval_every: int = 25
    """Steps between greedy evaluations (also before the first step and at the end)."""
    out_dir: str = "out/ppo"
    """Where metrics.jsonl, curves.png and final/ go."""
    seed: int = 0
    """Seed of data order, sampling (per step and prompt) and initialisation."""
    max_ckpt_to_keep: int = 3
    """Checkpoints kept in out_dir/checkpoints: the newest this many, and always the best (the highest held-out
    accuracy among evaluated checkpoint steps) and the latest (verl's name)."""
    ckpt_every: int = -1
    """Steps between DCP checkpoints in out_dir/checkpoints (they resume at any world size); 0: none; -1: every
    max(1, total_steps // 10) steps, so that a crash loses at most a tenth of the run (the built-in task's own: 0)."""
    export_dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    """dtype of the exported HF folders (final/, critic/): the fp32 masters, or e.g. the compute dtype (half the
    bytes, what a bf16 engine loads anyway)."""
    resume: str = "auto"
    """auto: resume from out_dir/checkpoints' newest readable checkpoint (a damaged latest one, whose files differ from
    its manifest, is named and passed over); latest: that one or stop, naming it; off: start over; or a path."""
    overwrite: bool = False
    """Start over in an out_dir that holds a previous run's metrics.jsonl (replacing its files); else it is refused."""

    def __post_init__(self):
        for rule, ok, names in (
            (">= 1", lambda v: v >= 1, ("rollout_n", "train_batch_size", "ppo_mini_batch_size", "ppo_micro_batch_size",
                                        "ppo_epochs", "total_steps", "eval_every", "val_size", "max_prompt_length",
                                        "max_response_length", "max_gen_rounds", "max_ckpt_to_keep", "rollout_tp",
                                        "ppo_max_token_len_per_gpu", "log_prob_max_token_len_per_gpu", "kl_horizon")),
            ("> 0", lambda v: v > 0, ("lr", "critic_lr", "cliprange_value", "kl_target", "grad_clip", "temperature",
                                      "lora_alpha")),
            (">= 0", lambda v: v >= 0, ("lora_rank", "weight_decay", "kl_loss_coef")),
            (">= -1 (-1: a tenth of total_steps)", lambda v: v >= -1, ("ckpt_every",)),
            ("in [0, 1]", lambda v: 0 <= v <= 1, ("gamma", "lam", "lr_warmup_steps_ratio", "min_lr_ratio")),
            ("in (0, 1]", lambda v: 0 < v <= 1, ("top_p", "gpu_memory_utilization")),
            ("in (0, 1)", lambda v: 0 < v < 1, ("rollout_mask_low",)),
            ("> 1", lambda v: v > 1, ("clip_ratio_c", "rollout_mask_high")),
            (">= -1 (-1: lr_warmup_steps_ratio)", lambda v: v >= -1, ("lr_warmup_steps",)),
            ("> 0 (None: off)", lambda v: v is None or v > 0, ("tis_cap",)),
        ):
            for name in names:
                if not ok(getattr(self, name)):
                    raise ValueError(f"{name}={getattr(self, name)} must be {rule}")
        if self.export_dtype not in DTYPES:
            raise ValueError(f"export_dtype={self.export_dtype!r}: choose one of {sorted(DTYPES)}")
        if self.train_batch_size % self.ppo_mini_batch_size:
            raise ValueError(f"train_batch_size={self.train_batch_size} must be a multiple of "
                             f"ppo_mini_batch_size={self.ppo_mini_batch_size}")
        tp = self.fsdp.tp_size
        if tp > 1 and tp % self.rollout_tp:
            raise ValueError(f"rollout_tp={self.rollout_tp} with fsdp.tp_size={tp}: the engine's TP must equal the "
                             f"trainer's, divide it, or be 1 (each engine rank's slices then sit in one tp group)")
        if tp > 1 and self.lora_rank:
            raise ValueError(f"lora_rank={self.lora_rank} with fsdp.tp_size={tp}: LoRA adapters under training TP "
                             "are not supported; use fsdp.tp_size=1")
        if self.agent.tools_path and self.rollout_tp > 1:
            raise ValueError(f"agent.tools_path with rollout_tp={self.rollout_tp}: the agent loop's turns differ per "
                             "rank, and a TP group generates together; use rollout_tp=1")
        if self.old_log_probs == "rollout" and self.tis_cap is not None:
            raise ValueError("tis_cap corrects the gap between the engine's and the trainer's log-probs, which "
                             "old_log_probs='rollout' takes as zero: use 'recompute' or 'update'")
        wrong = self._update_is_inexact() if self.old_log_probs == "update" else []
        if wrong:
            raise ValueError(f"old_log_probs='update' takes them from one optimizer step on the sampling weights: "
                             f"{'; '.join(wrong)}; or use 'recompute' / 'rollout'")
        if self.rollout_mask and self.old_log_probs not in ("recompute", "auto"):
            raise ValueError(f"rollout_mask={self.rollout_mask!r} compares the old log-probs with the engine's before "
                             f"the update: it needs old_log_probs='recompute', not {self.old_log_probs!r}")
        if not 0 <= self.overlong_buffer_len <= self.max_response_length or self.overlong_penalty_factor < 0:
            raise ValueError(f"overlong_buffer_len={self.overlong_buffer_len} must be in [0, max_response_length="
                             f"{self.max_response_length}] and overlong_penalty_factor={self.overlong_penalty_factor} "
                             ">= 0")
        on_host = [f"offload.{k}" for k in ("actor_params", "ref_params", "critic_params", "reward_params")
                   if getattr(self.offload, k)]
        if on_host and self.fsdp.cpu_offload:
            raise ValueError(f"{', '.join(on_host)} with fsdp.cpu_offload=True: the parameters already live in CPU "
                             "memory")
        if not 0 <= self.critic_warmup < self.total_steps:
            raise ValueError(f"critic_warmup={self.critic_warmup} must be in [0, total_steps={self.total_steps}): "
                             "the actor trains only after it")
        context = self.max_prompt_length + self.max_response_length
        if self.hybrid.verify_sync and self.hybrid.probe_len >= context:
            raise ValueError(f"hybrid.probe_len={self.hybrid.probe_len} must be below the engine's context "
                             f"(max_prompt_length + max_response_length = {context})")
        if self.adv_estimator != "gae" and (self.critic_warmup or self.critic_model_path):
            raise ValueError(f"critic_warmup / critic_model_path need a critic: adv_estimator={self.adv_estimator!r} "
                             "has none (use gae)")
        if self.adv_estimator in ("grpo", "rloo") and self.use_kl_in_reward:
            raise ValueError(f"use_kl_in_reward: adv_estimator={self.adv_estimator!r} scores whole responses, not "
                             "tokens; use use_kl_loss")
        check_paths(self)
        if self.adv_estimator == "rloo" and self.rollout_n < 2:
            raise ValueError(f"rollout_n={self.rollout_n}: rloo's leave-one-out baseline needs >= 2 samples a prompt")

    def _update_is_inexact(self) -> list[str]:
        """Why the update's own first forward would not give the sampling policy's log-probs (empty: it would)."""
        wrong = [f"ppo_epochs={self.ppo_epochs} must be 1"] if self.ppo_epochs != 1 else []
        if self.ppo_mini_batch_size != self.train_batch_size:
            wrong.append(f"ppo_mini_batch_size={self.ppo_mini_batch_size} must equal "
                         f"train_batch_size={self.train_batch_size}")
        if self.use_kl_in_reward or self.rollout_mask:
            wrong.append("use_kl_in_reward and rollout_mask must be off (they need them before the update)")
        if self.async_.rollout_workers and self.async_.staleness:
            wrong.append(f"async.staleness={self.async_.staleness} must be 0 (a stale sample's policy is not the "
                         "trainer's)")
        return wrong

    @property
    def old_log_probs_from(self) -> str:
        """old_log_probs with auto resolved: update where that is exact, else recompute."""
        if self.old_log_probs != "auto":
            return self.old_log_probs
        return "recompute" if self._update_is_inexact() else "update"

    @property
    def behaviour_weight(self) -> tuple[str, float] | None:
        """(kind, cap) of the pi_old / pi_rollout weight on each token's policy loss: ("tis", tis_cap) where set (the
        engine-trainer gap); else, for samples that may come from older weights (a rollout pool with staleness >= 1,
        old log-probs recomputed: the proximal policy), ("decoupled", async.behav_imp_weight_cap); else None."""
        if self.tis_cap is not None:
            return "tis", self.tis_cap
        stale = self.async_.rollout_workers and self.async_.staleness and self.old_log_probs_from == "recompute"
        cap = self.async_.behav_imp_weight_cap
        return ("decoupled", cap) if stale and cap is not None else None

    @property
    def checkpoint_every(self) -> int:
        """ckpt_every with -1 resolved: a checkpoint every tenth of the run (0: none)."""
        return max(1, self.total_steps // 10) if self.ckpt_every == -1 else self.ckpt_every

    @property
    def lora(self) -> tuple[int, float, str] | None:
        """The actor's adapters (rank, alpha, target modules), or None (full fine-tuning)."""
        return (self.lora_rank, self.lora_alpha, self.lora_target_modules) if self.lora_rank else None

    @property
    def use_reference(self) -> bool:
        """A frozen reference policy is loaded for the KL loss or the in-reward KL penalty."""
        return self.use_kl_loss or self.use_kl_in_reward


# The built-in task's own values (a 1M-parameter policy, 2-digit sums, answers of a few tokens): a run without
# --model-path applies them to every field it leaves at Config's default (verl's, for a real model).
BUILTIN_TASK = dict(lr=2e-4, critic_lr=1e-3, max_prompt_length=32, max_response_length=8, train_batch_size=32,
                    ppo_mini_batch_size=8, ppo_micro_batch_size=64, log_prob_max_token_len_per_gpu=2048, ckpt_every=0)
TASK_VALUES = {"arith": BUILTIN_TASK, "calculator": dict(BUILTIN_TASK, max_response_length=32),
               "arith-rlhf": dict(BUILTIN_TASK, use_kl_in_reward=True, kl_coef=0.2)}  # PPO: the KL holds off hacking
PREF_RESULT = "preference_result.json"  # what reward_model.py / dpo.py write last into a model folder: the config
SFT_RESULT = "sft_result.json"  # what sft.py writes last into a model folder; "rl_values": the tiny policy's values


def recorded_values(model_path: str) -> dict | None:
    """The RL values that sft.py recorded in a folder it trained from the built-in tiny policy (its "rl_values");
    None for any other folder (a real model's, or one sft.py fine-tuned from a model you brought)."""
    path = os.path.join(model_path, SFT_RESULT)
    if not os.path.isfile(path):
        return None
    with open(path) as f:
        return json.load(f).get("rl_values")


def task_values(cfg: Config) -> tuple[str, dict]:
    """(where they come from, {field: value}) for the fields left at Config's default that a run takes from its
    task: without --model-path the built-in task's TASK_VALUES; with a folder sft.py trained from the built-in tiny
    policy, the values it recorded there; else none (verl's defaults stay)."""
    if cfg.model_path is None:
        source, values = f"built-in task {cfg.task} (no --model-path)", TASK_VALUES[cfg.task]
    else:
        source, values = f"model_path={cfg.model_path} (sft.py from the built-in tiny policy)", \
            recorded_values(cfg.model_path) or {}
    defaults = {f.name: f.default for f in fields(Config)}
    return source, {k: v for k, v in values.items() if getattr(cfg, k) == defaults[k]}


def with_task_values(cfg: Config, is_main: bool = True) -> Config:
    """The config a run uses: task_values for each field left at its default (printed once, is_main); the task's
    tools where agent.tools_path is None; out/grpo_calculator where out_dir is the default."""
    if cfg.task == "calculator" and cfg.agent.tools_path is None:
        cfg = replace(cfg, agent=replace(cfg.agent, **AGENT))
    if cfg.task != "arith" and cfg.out_dir in ("out/ppo", "out/grpo"):  # the entry points' own: a run of another
        cfg = replace(cfg, out_dir=f"{cfg.out_dir}_{cfg.task}")  # task does not meet the default run's folder
    source, applied = task_values(cfg)
    if applied and is_main:
        print(f"{source}: " + ", ".join(f"{k}={v}" for k, v in applied.items()) +
              " (its own values; a flag you pass wins)")
    return replace(cfg, **applied)


def check_paths(cfg) -> None:
    """The files and folders a config (Config or sft.SFTConfig) names must exist, found before anything starts."""
    for name in ("model_path", "critic_model_path", "reward_model_path"):
        path = getattr(cfg, name, None)
        if path is None:
            continue
        if not os.path.isfile(os.path.join(path, "config.json")):
            raise FileNotFoundError(f"{name}={path}: not an HF model folder (no config.json there); give a local "
                                    "folder that from_pretrained reads (this project downloads nothing)")
        with open(os.path.join(path, "config.json")) as f:
            positions = json.load(f).get("max_position_embeddings")
        if isinstance(cfg, Config) and positions is not None:  # RL configs: the lengths the run will use
            check_context(cfg, name, path, positions)
        if isinstance(cfg, Config) and cfg.fsdp.tp_size > 1:  # heads and MLP width against the TP size
            check_tp(AutoConfig.from_pretrained(path), cfg.fsdp.tp_size)
    if getattr(cfg, "reward_model_path", None):
        check_reward_model(cfg.reward_model_path)
    for name in ("train_files", "val_files"):
        for path in split_files(getattr(cfg, name)):
            if not os.path.isfile(path):
                raise FileNotFoundError(f"{name}: no such parquet file {path}")
    tools = getattr(getattr(cfg, "agent", None), "tools_path", None)
    for name, path in (("reward_fn_path", cfg.reward_fn_path), ("agent.tools_path", tools)):
        if path is not None and not os.path.isfile(path):
            raise FileNotFoundError(f"{name}={path}: no such file")


def implicit_reward(path: str) -> tuple[str, float, bool] | None:
    """(reference, beta, token mean) where path is dpo.py's output (its PREF_RESULT says loss sigmoid or ipo): the
    terms of DPO's implicit reward, beta * log pi / pi_ref, whose reference is the model_path the DPO run started
    from; None for any other folder."""
    record = os.path.join(path, PREF_RESULT)
    if not os.path.isfile(record):
        return None
    with open(record) as f:
        trained = json.load(f)["config"]
    return None if trained["loss"] == "bt" else (trained["model_path"], trained["beta"], trained["loss"] == "ipo")


def check_reward_model(path: str) -> None:
    """reward_model_path must hold a scalar-head model: a *ForTokenClassification or *ForSequenceClassification
    architecture with one label (else from_pretrained would put a random head on it, silently); or dpo.py's output,
    whose reference is still where the DPO run read it."""
    implicit = implicit_reward(path)
    if implicit:
        if not os.path.isfile(os.path.join(implicit[0], "config.json")):
            raise FileNotFoundError(f"reward_model_path={path}: its DPO reference model_path={implicit[0]} (in "
                                    f"{PREF_RESULT}) is not an HF model folder; the implicit reward needs it")
        return
    with open(os.path.join(path, "config.json")) as f:
        config = json.load(f)
    archs = config.get("architectures") or []
    labels = config.get("num_labels", len(config.get("id2label") or {0: 0, 1: 1}))  # HF's default: 2 labels
    if not any(a.endswith(("ForTokenClassification", "ForSequenceClassification")) for a in archs) or labels != 1:
        raise ValueError(f"reward_model_path={path}: not a scalar-head reward model (architectures={archs}, "
                         f"num_labels={labels}; it needs a *ForTokenClassification or *ForSequenceClassification with "
                         "num_labels 1, as reward_model.py writes, or dpo.py's output)")


def check_context(cfg: Config, name: str, path: str, positions: int) -> None:
    """The run's prompt + response budget (after task_values) must fit the positions of the model at path."""
    applied = task_values(cfg)[1]
    P, R = (applied.get(k, getattr(cfg, k)) for k in ("max_prompt_length", "max_response_length"))
    if P + R <= positions:
        return
    hint = f"pass --max-prompt-length and --max-response-length that add up to at most {positions}"
    if not applied and os.path.isfile(os.path.join(path, SFT_RESULT)):  # an sft.py folder with no record
        tiny = " ".join(f"--{k.replace('_', '-')} {v}" for k, v in BUILTIN_TASK.items())
        hint += (f"; if sft.py trained it from the built-in tiny policy before it recorded its values, run that sft.py "
                 f"command again, or pass the built-in task's: {tiny}")
    raise ValueError(f"max_prompt_length + max_response_length = {P + R} exceeds {name}'s "
                     f"max_position_embeddings={positions}: {hint}")


def split_files(files: str | None) -> list[str]:
    """A comma-separated file list as paths (None or "" -> [], empty items and spaces dropped)."""
    return [f.strip() for f in (files or "").split(",") if f.strip()]
