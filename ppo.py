"""The RL step and the loop that drives it, and the PPO entry point.

    python ppo.py                        # PPO with a critic (GAE) on the built-in task
    python ppo.py --help                 # every field of config.Config
    python ppo.py --use-kl-in-reward --kl-ctrl-type adaptive --kl-coef 0.01 --kl-target 0.05   # KL in the reward
    python ppo.py --adv-estimator reinforce_plus_plus   # no critic: REINFORCE++ (also rloo, grpo, ..._baseline)
    torchrun --nproc_per_node=2 ppo.py   # every rank runs the loop on its shard of the prompts (TorchrunController)
    python grpo.py                       # GRPO: the same loop with grpo.py's defaults
    python ray_trainer.py                # the same step and loop from a Ray driver over worker groups

One RL step (rl_step), as verl (HybridFlow) does it:
    rollout (the actor streams its weights into vLLM and samples n responses per prompt) -> reward (the task's
    verifier) -> balance the ranks' work -> old / ref log-probs, values -> token rewards (- KL penalty) and
    advantages -> critic update, actor update on micro-batches
The step is written once, against the workers' methods (workers.py) and a controller (how the step's batch
relates to the data-parallel ranks). Under torchrun (`TorchrunController`) every rank runs the loop on its own
shard of the prompts; the single controller (ray_trainer.py's Driver) runs the same step and loop once, on the
whole batch, with worker groups in place of the workers. The algorithm math is in core_algos.py; PPO's own part is
the critic (GAE, the value loss), the clipped surrogate and the KL controller, chosen by Config's fields.
"""

import json
import os
import shutil
import sys
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import torch
import tyro
from tensordict import TensorDict
from tqdm import tqdm
from transformers import AutoConfig

from batching import balance_ranks, flops_workload, response_lengths
from comm import (Dist, Max, Min, Sum, all_max, all_sum_fn, barrier, broadcast_object, init_distributed, reduce_metrics,
                  shutdown, timer)
from config import START_HERE, Config, split_files, with_task_values
from core_algos import compute_advantages, kl_in_reward, on_last_token, overlong_penalty, rollout_mask, update_kl_coef
from data import RLDataset, load_reward_fn, load_tokenizer, score_responses, tokenize_prompt
from fileio import write_atomic
from rollout import sample_seed
from sharding import (begin_checkpoint, checkpoint_problem, commit_checkpoint, find_latest, prune_checkpoints,
                      readable_checkpoint)
from tracking import Tracking, batch_metrics, plot_curves, run_summary, step_warnings
from watchdog import watch_ranks
from workers import ActorWorker, CriticWorker, RewardWorker, batch_widths, pad_batch, repadded

# ---- The controller: how the step's batch relates to the data-parallel ranks ----------------------


class TorchrunController:
    """The torchrun controller: every rank runs the loop and holds one dp shard of each step's batch (prompts
    dp_rank * k .. dp_rank * k + k - 1 of the step's k * dp_size). Statistics of the whole batch are sums over
    the ranks; metrics are reduced over them; rank 0 writes the files. A single controller that holds the whole
    batch offers the same methods: dp_rank 0 and dp_size 1 for the data, all_sum None, reduce over worker groups."""

    def __init__(self, dist: Dist):
        self.dist, self.dp_rank, self.dp_size, self.is_main = dist, dist.dp_rank, dist.dp_size, dist.is_main
        self.all_sum = all_sum_fn(dist)  # core_algos' cross-shard sums (whitening, the in-reward KL's mean)

    def balance(self, batch: TensorDict, seqlens: torch.Tensor, workloads: torch.Tensor, unit: int):
        """Rows re-dealt across the ranks by workload, in units of `unit` rows (batching.balance_ranks)."""
        return balance_ranks(batch, seqlens, workloads, self.dist, unit)

    def reduce(self, metrics: dict) -> dict:
        """The same metrics on every rank, each reduced as its type declares (comm.reduce_metrics)."""
        return reduce_metrics(metrics, self.dist)

    def all_max(self, values: list[float]) -> list[float]:
        """Each value's largest over the ranks: what they must agree on (comm.all_max)."""
        return all_max(values, self.dist)

    def run_all(self, calls: dict, batch: TensorDict, metrics: dict) -> dict:
        """{key: method(batch)} for calls {key: (timer name, method)}, one after the other (each a collective over
        the ranks), each timed as timing_s/<timer name>."""
        out = {}
        for key, (name, method) in calls.items():
            with timer(name, metrics):
                out[key] = method(batch)
        return out

    def barrier(self) -> None:
        barrier(self.dist)


@dataclass
class Task:
    """A run's data, loaded and checked before any model or engine starts: the policy's tokenizer, the reward
    function, the train prompts and the held-out prompts (all of them; each controller takes its share)."""
    tokenizer: object  # the policy's (the driver tokenizes prompts and decodes responses for the verifier)
    reward_fn: object
    train_ds: RLDataset
    all_val_rows: list[dict]
    num_truncated: int  # prompts cut to max_prompt_length (truncate_prompts), train and val files together
    hidden_size: int  # for balance_by flops
    rm_tokenizer: object = None  # reward_model_path's tokenizer where it is not the policy's: re-tokenise for it
    rm_positions: int = 0  # the reward model's max_position_embeddings (a longer re-tokenised sequence is an error)


@dataclass
class Run:
    """What the step and the loop work with: the config, the task, the workers and the controller."""

    cfg: Config
    task: Task
    actor: ActorWorker
    critic: CriticWorker | None
    controller: TorchrunController  # or ray_trainer.Driver: the same methods, for a driver that holds the whole batch
    pool: object = None  # ray_trainer.RolloutPool: generation-only engines of their own (async); None: the actor's
    reward: object = None  # workers.RewardWorker (reward_model_path), or a Ray driver's reward group

    @property
    def val_rows(self) -> list[dict]:
        """This controller's share of the held-out prompts."""
        return self.task.all_val_rows[self.controller.dp_rank :: self.controller.dp_size]


def prompt_indices(step: int, cfg: Config, n_rows: int) -> list[int]:
    """The dataset rows of a step: a fresh seeded permutation per epoch, so a step alone decides them."""
    per_epoch = n_rows // cfg.train_batch_size
    epoch, pos = divmod(step - 1, per_epoch)
    perm = torch.randperm(n_rows, generator=torch.Generator().manual_seed(cfg.seed * 10_007 + epoch))
    return perm[pos * cfg.train_batch_size : (pos + 1) * cfg.train_batch_size].tolist()


def step_rows(step: int, run: Run) -> list[dict]:
    """The prompts of a step that this controller holds (its dp shard of prompt_indices)."""
    per_rank = run.cfg.train_batch_size // run.controller.dp_size
    indices = prompt_indices(step, run.cfg, len(run.task.train_ds))
    first = run.controller.dp_rank * per_rank
    return [run.task.train_ds[i] for i in indices[first : first + per_rank]]


def weights_version(step: int, cfg: Config) -> int:
    """The version of the weights that step `step` updates: the actor updates before it (the actor trains from
    step critic_warmup + 1 on). A sample's version is that of the weights that generated it."""
    return max(0, step - 1 - cfg.critic_warmup)


# ---- One RL step ----------------------------------------------------------------------------------


def rl_step(step: int, rows: list[dict], run: Run, kl_coef: float) -> tuple[dict, TensorDict, float]:
    """One RL step on `rows`, the prompts this controller holds (a rank's shard under torchrun; all of them under a
    single controller). Returns (the step's metrics, reduced over the ranks; the batch; the next in-reward KL
    coefficient)."""
    cfg, actor, critic, controller = run.cfg, run.actor, run.critic, run.controller
    metrics = {"step": step}
    with timer("step", metrics):
        # ==================== 1-2. rollout and reward: vLLM samples n per prompt, the task's verifier scores =====
        batch = rollout_and_score(step, rows, run, metrics)  # with dynamic_sampling: informative groups only
        # with a rollout pool, samples may come from older weights: at most async.staleness updates, never silently
        metrics.update(staleness(batch["version"], weights_version(step, cfg),
                                 cfg.async_.staleness if run.pool else 0))
        # ==================== 2a. a learned reward model scores each prompt + response (reward_model_path) ====
        poisoned = run.reward is not None and score_with_reward_model(batch, run, metrics)  # a NaN score: no update

        # ==================== 2b. balance the dp ranks' work (batching.py) ====================
        # Whole prompt groups move, before the log-prob passes: all three passes (old, ref, update) get even
        # work, and group advantages stay a computation within a rank.
        if cfg.balance_batch:
            with timer("balance", metrics):
                seqlens = batch["attention_mask"].sum(-1)  # [B]
                work = seqlens if cfg.balance_by == "tokens" else flops_workload(seqlens, run.task.hidden_size)
                batch, balance_metrics = controller.balance(batch, seqlens, work, unit=cfg.rollout_n)
            metrics.update(balance_metrics)
        batch["group"] = torch.arange(batch.batch_size[0] // cfg.rollout_n).repeat_interleave(cfg.rollout_n)  # [B]

        # ==================== 3. old (and reference) log-probs, values ====================
        # independent passes: a controller whose actor and critic live on separate devices runs them at once
        passes = {}  # batch key: (timer name, method)
        if cfg.old_log_probs_from == "recompute":  # else the engine's, or the update's own first forward (Config)
            passes["old_log_probs"] = ("old_log_prob", actor.log_probs)
        if cfg.use_reference:
            passes["ref_log_probs"] = ("ref", actor.ref_log_probs)
        if critic:
            passes["values"] = ("values", critic.values)
        batch.update(controller.run_all(passes, batch, metrics))  # [B, R] each

        # ==================== 4. token rewards, advantages ====================
        with timer("adv", metrics):
            # the verifier scores the whole response: its reward sits on the last token
            batch["token_level_rewards"] = on_last_token(batch["scores"], batch["response_mask"])  # [B, R]
            if cfg.use_kl_in_reward:
                # the old policy's log-probs: recomputed, or the engine's (old_log_probs rollout)
                old = batch["old_log_probs"] if "old_log_probs" in batch.keys() else batch["rollout_log_probs"]
                batch["token_level_rewards"], kl = kl_in_reward(
                    batch["token_level_rewards"], old, batch["ref_log_probs"],
                    batch["response_mask"], kl_coef, cfg.kl_penalty, controller.all_sum)  # [B, R]; kl: whole batch's
                metrics.update({"actor/reward_kl_penalty": kl, "actor/reward_kl_penalty_coeff": kl_coef})
                kl_coef = update_kl_coef(kl_coef, kl, cfg.train_batch_size * cfg.rollout_n, cfg.kl_ctrl_type,
                                         cfg.kl_target, cfg.kl_horizon)
            batch["advantages"], batch["returns"] = compute_advantages(
                cfg.adv_estimator, token_level_rewards=batch["token_level_rewards"],
                response_mask=batch["response_mask"], scores=batch["scores"], group=batch["group"],
                values=batch.get("values"), gamma=cfg.gamma, lam=cfg.lam, norm_adv_by_std=cfg.norm_adv_by_std,
                all_sum=controller.all_sum)  # [B, R] each

        # ==================== 4b. the policy loss's tokens: rollout correction, overlong filtering ====================
        if cfg.rollout_mask or cfg.mask_truncated or cfg.dynamic_sampling:
            eos = run.task.tokenizer.eos_token_id
            batch["loss_mask"], mask_metrics = policy_loss_mask(batch, cfg, eos)  # [B, R]
            metrics.update(mask_metrics)

        # ==================== 5. update the critic and the actor (after critic_warmup) ====================
        updates = {"critic": ("update_critic", critic.update)} if critic and not poisoned else {}
        if step > cfg.critic_warmup and not poisoned:
            updates["actor"] = ("update_actor", actor.update)
        for update_metrics in controller.run_all(updates, batch, metrics).values():
            metrics.update(update_metrics)

        # ==================== 6. a rollout pool of its own takes the new weights, starts the next batches ====
        if run.pool:
            feed_pool(step, run, metrics)

    # ==================== 7. what the step cost: memory per phase, MFU (in the updates' metrics), all-reduce probe
    for worker in filter(None, (actor, critic, run.reward)):
        metrics.update(worker.perf())  # a collective (the probe)
    metrics["perf/overhead_share"] = overhead_share(metrics, run.pool is not None)
    metrics.update(batch_metrics(batch, cfg.max_response_length))
    metrics["perf/throughput"] = batch["attention_mask"].sum().item() / metrics["timing_s/step"]  # per rank
    return {**controller.reduce(metrics), "step": step}, batch, kl_coef


def overhead_share(metrics: dict, pool: bool) -> float:
    """The share of the step outside its phases' timers: the loop's own work (padding, balancing's moves, the ranks'
    agreements, metrics) and, under Ray, moving the batch between driver and workers. Phases that run at once (Ray's
    split placement) count once each, so there it is a lower bound."""
    rollout = ("wait_rollout", "wait_rollout_pool", "sync_rollout_weights") if pool else ("gen", "reward")
    phases = rollout + ("old_log_prob", "ref", "values", "adv", "update_critic", "update_actor")
    inside = sum(metrics.get(f"timing_s/{name}", 0.0) for name in phases)
    return max(0.0, 1.0 - inside / metrics["timing_s/step"])


# ---- Rewards, evaluation, metrics -----------------------------------------------------------------


def seeds_of(step: int, rows: list[dict], cfg: Config, seed_offset: int = 0) -> list[int]:
    return [sample_seed(cfg.seed, step, r["index"] + seed_offset) for r in rows]


def feed_pool(step: int, run: Run, metrics: dict) -> None:
    """After step `step`'s update (0: before the first step): the rollout pool takes the weights that the next step
    trains, then starts every batch those weights may generate within async.staleness: steps step + 1 ..
    step + 1 + staleness (0: the next only, synchronous; 1: one-step-off)."""
    cfg = run.cfg
    metrics.update(run.pool.sync(weights_version(step + 1, cfg)))
    for t in range(step + 1, min(step + 1 + cfg.async_.staleness, cfg.total_steps) + 1):
        rows = step_rows(t, run)
        run.pool.prefetch(rows, seeds_of(t, rows, cfg))


def generate_and_score(step: int, rows: list[dict], run: Run, metrics: dict, seed_offset: int = 0) -> TensorDict:
    """n responses per row, each scored by the task's verifier, with DAPO's overlong shaping when configured: the
    batch with "index" (each response's dataset row), "scores" and "version". The actor's engine generates (it enters
    and leaves rollout mode), or a rollout pool (prefetched, or now), which scores each chunk as it finishes."""
    cfg = run.cfg
    seeds = seeds_of(step, rows, cfg, seed_offset)
    if run.pool:
        batch, round_metrics = run.pool.generate(rows, seeds)
    else:
        batch, round_metrics = run.actor.generate([r["prompt_ids"] for r in rows], seeds)
        with timer("reward", round_metrics):
            batch["scores"] = score(batch, [r for r in rows for _ in range(cfg.rollout_n)], run.task.tokenizer,
                                    run.task.reward_fn)  # [B]
    # each response's dataset row travels with it: whatever moves the rows, they are looked up by this
    batch["index"] = torch.tensor([r["index"] for r in rows]).repeat_interleave(cfg.rollout_n)  # [B]
    if cfg.overlong_buffer_len:  # DAPO: long responses lose reward softly before the hard limit
        penalty = overlong_penalty(response_lengths(batch), cfg.max_response_length, cfg.overlong_buffer_len,
                                   cfg.overlong_penalty_factor)  # [B]
        batch["acc"] = batch["scores"]  # [B] the verifier's, which dynamic sampling's filter reads
        batch["scores"] = batch["scores"] + penalty
        round_metrics["reward/overlong_penalty_mean"] = penalty.mean().item()
    for k, v in round_metrics.items():  # times add up over dynamic sampling's rounds; the rest is the last round's
        metrics[k] = metrics.get(k, 0.0) + v if k.startswith("timing_s/") else v
    return batch


def rollout_and_score(step: int, rows: list[dict], run: Run, metrics: dict) -> TensorDict:
    """The step's scored batch. With dynamic_sampling (DAPO) a group whose verifier scores are all equal carries no
    gradient: such groups are dropped and further prompts sampled, in rounds that every rank runs together, until
    every rank holds len(rows) informative groups or max_gen_rounds have run. Then dropped groups fill the rest to
    keep the batch's shape, marked "filler" [B] (1.0): the policy loss leaves them out (policy_loss_mask), so they
    neither train nor count in its token and sequence totals; dynamic/filled_groups counts them. A round's prompts
    and seeds follow (seed, step, round), so a resumed step replays them."""
    cfg, controller, n = run.cfg, run.controller, run.cfg.rollout_n
    batch = generate_and_score(step, rows, run, metrics)
    if not cfg.dynamic_sampling:
        return batch
    kept, dropped, rounds = [], [], 0
    while True:
        rounds += 1
        for g, good in enumerate(informative_groups(batch, n).tolist()):
            (kept if good else dropped).append(batch[g * n : (g + 1) * n])
        short = controller.all_max([max(0, len(rows) - len(kept))])[0]  # the rank that lacks the most groups
        if short == 0 or rounds == cfg.max_gen_rounds:
            break
        generator = torch.Generator().manual_seed(sample_seed(cfg.seed, step, -rounds))  # round r's prompts
        start = controller.dp_rank * len(rows)
        train_ds = run.task.train_ds
        picks = torch.randperm(len(train_ds), generator=generator)[start : start + len(rows)].tolist()
        batch = generate_and_score(step, [train_ds[i] for i in picks], run, metrics, rounds * len(train_ds))
    filled = max(0, len(rows) - len(kept))
    metrics.update({"dynamic/rounds": rounds, "dynamic/kept_groups": Sum(min(len(kept), len(rows))),
                    "dynamic/dropped_groups": Sum(len(dropped)), "dynamic/filled_groups": Sum(filled)})
    groups = kept[: len(rows)] + dropped[:filled]
    for i, group in enumerate(groups):
        group["filler"] = torch.full((n,), float(i >= len(rows) - filled))  # [n]
    return repad(groups, controller, run.task.tokenizer.pad_token_id)


def informative_groups(batch: TensorDict, n: int) -> torch.Tensor:
    """[groups] True where a group's verifier scores differ (DAPO's filter; verl's reads the accuracy): before the
    overlong shaping ("acc"), which alone would make an all-wrong group of differing lengths look informative."""
    acc = (batch["acc"] if "acc" in batch.keys() else batch["scores"]).view(-1, n)  # [groups, n]
    return acc.max(-1).values > acc.min(-1).values


def repad(groups: list[TensorDict], controller, pad_id: int) -> TensorDict:
    """Groups from several generate calls (each padded to its own widths) as one batch, padded to the widest prompt
    and response over every rank (the same shapes everywhere, as balancing needs)."""
    prompt = max(int(g["attention_mask"][:, : g["prompts"].shape[1]].sum(-1).max()) for g in groups)
    response = max(int(response_lengths(g).max()) for g in groups)
    widths = batch_widths(prompt, response, controller.all_max)
    return torch.cat([repadded(g, widths, pad_id) for g in groups])


def policy_loss_mask(batch: TensorDict, cfg: Config, eos_id: int) -> tuple[torch.Tensor, dict]:
    """The response tokens [B, R] the policy loss counts: without those rollout correction rejects
    (core_algos.rollout_mask), with mask_truncated without responses cut at max_response_length (no EOS), and
    without dynamic sampling's filler groups (rollout_and_score)."""
    mask, metrics = batch["response_mask"], {}
    if "filler" in batch.keys():
        mask = mask * (1 - batch["filler"]).unsqueeze(-1)  # [B, R]
    if cfg.rollout_mask:
        mask, metrics = rollout_mask(batch["old_log_probs"], batch["rollout_log_probs"], mask, cfg.rollout_mask,
                                     cfg.rollout_mask_low, cfg.rollout_mask_high)
    if cfg.mask_truncated:
        lengths = response_lengths(batch)  # [B]
        last = batch["responses"].gather(1, (lengths - 1).clamp(min=0).unsqueeze(1)).squeeze(1)  # [B]
        truncated = (lengths >= cfg.max_response_length) & (last != eos_id)  # [B]
        mask = mask * (~truncated).unsqueeze(-1)  # [B, R]
        metrics["response_length/truncated_masked"] = truncated.float().mean().item()
    return mask, metrics


def score_with_reward_model(batch: TensorDict, run: Run, metrics: dict) -> bool:
    """The reward model's scores (reward_model/score/*) replace the rule's, or add to them (reward_model_mode);
    batch["acc"] keeps the rule's, which dynamic sampling and the curves read. True where a score is not finite on
    any rank: the step then skips its updates, as a NaN loss does (reward_model/skipped_step). Collective."""
    cfg = run.cfg
    rm = run.controller.run_all({"rm": ("reward_model", run.reward.scores)}, reward_model_batch(batch, run.task),
                                metrics)["rm"]  # [B], timed as timing_s/reward_model
    bad = ~torch.isfinite(rm)  # [B]
    poisoned = run.controller.all_max([float(bad.any())])[0] > 0
    rm = rm.masked_fill(bad, 0.0)
    if "acc" not in batch.keys():
        batch["acc"] = batch["scores"]  # [B] the rule's
    batch["scores"] = rm if cfg.reward_model_mode == "replace" else batch["scores"] + cfg.reward_model_coef * rm
    metrics.update({"reward_model/score/mean": rm.mean().item(), "reward_model/score/max": Max(rm.max().item()),
                    "reward_model/score/min": Min(rm.min().item()), "reward_model/nan_scores": Sum(bad.sum().item()),
                    "reward_model/skipped_step": Max(float(poisoned)),
                    "reward_model/rule_score/mean": batch["acc"].mean().item()})  # the verifier's, beside it
    return poisoned


def reward_model_batch(batch: TensorDict, task: Task) -> TensorDict:
    """The prompts and responses in the reward model's tokens: the batch's own where it shares the policy's tokenizer;
    else verl's rule: each response decoded, put after its chat prompt as the assistant's turn, and the whole chat
    templated and tokenized by the reward model's tokenizer. A sequence over its positions is an error naming it."""
    keys = ("prompts", "responses", "input_ids", "attention_mask", "position_ids", "response_mask",
            "rollout_log_probs")
    if task.rm_tokenizer is None:
        return batch.select(*keys)
    rm_tok, prompts, responses = task.rm_tokenizer, [], []
    lengths = response_lengths(batch).tolist()  # [B]
    texts = task.tokenizer.batch_decode([ids[:k] for ids, k in zip(batch["responses"].tolist(), lengths)],
                                        skip_special_tokens=True)
    for index, text in zip(batch["index"].tolist(), texts):
        chat = task.train_ds[index]["messages"]
        prompt = tokenize_prompt(rm_tok, chat)
        whole = rm_tok.apply_chat_template(chat + [{"role": "assistant", "content": text}], tokenize=False)
        ids = list(rm_tok(whole, add_special_tokens=False)["input_ids"])
        if len(ids) > task.rm_positions:
            raise ValueError(f"{task.train_ds[index]['where']}: prompt + response are {len(ids)} tokens of the "
                             f"reward model's, over its max_position_embeddings={task.rm_positions} (no silent "
                             "truncation: lower max_response_length, or use a reward model with a longer context)")
        prompts.append(prompt)
        responses.append(ids[len(prompt):])
    return pad_batch(prompts, responses, [[] for _ in prompts], rm_tok.pad_token_id)


def score(batch: TensorDict | list[list[int]], rows: list[dict], tokenizer, reward_fn) -> torch.Tensor:
    """One scalar reward per response [B] from the task's verifier (the batch's responses, or their token lists);
    rows[b] is response b's prompt row. A reward that is not a finite number stops the run here, before any update
    (data.checked_score)."""
    if isinstance(batch, TensorDict):
        lengths = response_lengths(batch).tolist()  # [B]
        batch = [ids[:k] for ids, k in zip(batch["responses"].tolist(), lengths)]
    texts = tokenizer.batch_decode(batch, skip_special_tokens=True)
    return torch.tensor(score_responses(reward_fn, rows, texts))  # [B]


def staleness(versions: torch.Tensor, version: int, bound: int) -> dict:
    """How many updates behind the trained weights (version) each sample's weights are: metrics, or an error when
    a sample is more than bound behind (a scheduling bug: it would train on it silently)."""
    behind = version - versions  # [B]
    if behind.max() > bound:
        raise RuntimeError(f"{int((behind > bound).sum())} samples come from weights {int(behind.max())} updates "
                           f"behind the trainer's (version {version}), more than async.staleness={bound}")
    return {"async/staleness/mean": behind.float().mean().item(), "async/staleness/max": Max(behind.max().item()),
            "async/stale_share": (behind > 0).float().mean().item()}


def evaluate(run: Run) -> dict:
    """Greedy accuracy on the held-out prompts (one response each; every rank its share); with tools, also the share
    of responses that called one."""
    if run.pool:  # scored as they finish
        batch = run.pool.generate(run.val_rows, seeds=None, greedy=True)[0]
    else:
        batch, _ = run.actor.generate([r["prompt_ids"] for r in run.val_rows], seeds=None, greedy=True)
        batch["scores"] = score(batch, run.val_rows, run.task.tokenizer, run.task.reward_fn)  # [B]
    local = {"correct": Sum(batch["scores"].sum().item()), "n": Sum(len(run.val_rows))}
    if "tool_calls" in batch.keys():
        local["called"] = Sum((batch["tool_calls"] > 0).sum().item())
    total = run.controller.reduce(local)
    out = {"val/accuracy": total["correct"] / total["n"]}
    if "called" in total:
        out["val/tool_call_rate"] = total["called"] / total["n"]
    return out


# ---- Setup, checkpoints, the loop -----------------------------------------------------------------


def warm_start_and_task_files(cfg: Config, dist: Dist) -> tuple:
    """(model_path, train_files, val_files[, reward_model_path]): for what cfg leaves unset, the built-in task's files
    and the built-in policy warm-started on it (sft.py trains it on rank 0 the first time; later runs find it
    cached); for arith-rlhf without reward_model_path, also its learned reward model (cached the same way)."""
    from reward_model import builtin_reward_model
    from sft import SFTConfig, builtin_files, run as run_sft

    sft_task = "arith" if cfg.task == "arith-rlhf" else cfg.task
    paths = None
    if dist.is_main:  # rank 0 trains the warm start and writes the task files; the others receive the paths
        files = (cfg.train_files, cfg.val_files)
        if not all(files):
            builtin = builtin_files(SFTConfig(task=sft_task), os.path.join(cfg.out_dir, "data"))
            files = tuple(f or b for f, b in zip(files, builtin))
        paths = (cfg.model_path or run_sft(SFTConfig(task=sft_task)), *files)
        if cfg.task == "arith-rlhf" and not cfg.reward_model_path:  # its reward model, learned from the warm start
            paths += (builtin_reward_model(cfg.rlhf_reward),)
    return broadcast_object(paths, dist)


def load_task(cfg: Config, model_path: str, train_files: str, val_files: str, dp_size: int) -> Task:
    """The Task of a run: a malformed row, a prompt over budget or a missing reward file stops it here, in seconds."""
    tokenizer = load_tokenizer(model_path)
    train_ds = RLDataset(split_files(train_files), tokenizer, cfg.max_prompt_length, cfg.truncate_prompts)
    val_ds = RLDataset(split_files(val_files), tokenizer, cfg.max_prompt_length, cfg.truncate_prompts)
    val_rows = [val_ds[i] for i in range(min(cfg.val_size, len(val_ds)))]
    if len(train_ds) < cfg.train_batch_size:
        raise ValueError(f"train_files={train_files} hold {len(train_ds)} prompts < "
                         f"train_batch_size={cfg.train_batch_size}")
    if len(val_rows) < dp_size:
        raise ValueError(f"val_files={val_files}: {len(val_rows)} prompts (val_size={cfg.val_size}) for "
                         f"{dp_size} ranks")
    rm_tokenizer, rm_positions = None, 0
    if cfg.reward_model_path:  # its own tokenizer, unless it is the policy's (same vocabulary and chat template)
        rm_tokenizer = load_tokenizer(cfg.reward_model_path)
        if rm_tokenizer.get_vocab() == tokenizer.get_vocab() and rm_tokenizer.chat_template == tokenizer.chat_template:
            rm_tokenizer = None
        elif rm_tokenizer.pad_token_id is None or not rm_tokenizer.chat_template:  # re-tokenising needs both
            missing = "a pad or EOS token" if rm_tokenizer.pad_token_id is None else "a chat template"
            raise ValueError(f"reward_model_path={cfg.reward_model_path}: its tokenizer has no {missing}, which "
                             "re-tokenising the responses for it needs (set it in its tokenizer_config.json)")
        rm_positions = AutoConfig.from_pretrained(cfg.reward_model_path).max_position_embeddings
    return Task(tokenizer, load_reward_fn(cfg.reward_fn_path, cfg.reward_fn_name), train_ds, val_rows,
                train_ds.num_truncated + val_ds.num_truncated, AutoConfig.from_pretrained(model_path).hidden_size,
                rm_tokenizer, rm_positions)


def save_checkpoint(run: Run, step: int, state: dict) -> None:
    """out_dir/checkpoints/step_{step}/: the actor's and the critic's folders (each written by its own ranks) and
    the loop's state (step, records, KL coefficient), committed only once all are written."""
    ckpt_dir = os.path.join(run.cfg.out_dir, "checkpoints")
    tmp = os.path.join(ckpt_dir, f"step_{step}.tmp")
    if run.controller.is_main:
        begin_checkpoint(ckpt_dir, step)
    run.controller.barrier()
    try:
        run.actor.save_checkpoint(os.path.join(tmp, "actor"))
        if run.critic:
            run.critic.save_checkpoint(os.path.join(tmp, "critic"))
        if run.controller.is_main:
            torch.save(state, os.path.join(tmp, "trainer_state.pt"))
    except (OSError, RuntimeError) as error:  # e.g. a full disk (torch's writer says only "unexpected pos")
        shutil.rmtree(tmp, ignore_errors=True)  # the space it took; `latest` still names the previous checkpoint
        free = shutil.disk_usage(ckpt_dir).free / 2**20
        raise RuntimeError(f"writing checkpoint {tmp} failed ({error}); {free:.0f} MB free on the disk of "
                           f"{ckpt_dir}: free space (or fix its permissions) and run the same command to resume "
                           f"from {find_latest(ckpt_dir) or 'the start'}") from error
    if run.controller.is_main:
        commit_checkpoint(ckpt_dir, step)
        evaluated = [r for r in state["records"] if "val/accuracy" in r and os.path.isdir(
            os.path.join(ckpt_dir, f"step_{r['step']}"))]
        best = max(evaluated, key=lambda r: (r["val/accuracy"], r["step"]), default=None)
        prune_checkpoints(ckpt_dir, run.cfg.max_ckpt_to_keep, {best["step"]} if best else set())
    run.controller.barrier()


def resume(run: Run) -> tuple[int, list[dict], float]:
    """(first step to run, records so far, in-reward KL coefficient), restoring the workers from a checkpoint when
    there is one (resume auto: out_dir/checkpoints' latest; or a given step folder).

    Nothing else needs restoring: a step's prompts and sampling seeds are functions of the step alone.
    """
    cfg = run.cfg
    path = None if cfg.resume == "off" else cfg.resume
    if cfg.resume in ("auto", "latest"):
        path, problems = readable_checkpoint(os.path.join(cfg.out_dir, "checkpoints"))
        if problems and cfg.resume == "latest":
            raise RuntimeError(f"resume latest: the latest checkpoint cannot be read: {problems[0]}; the newest "
                               f"readable one is {path} (--resume auto falls back to it)")
        if problems and run.controller.is_main:
            print(f"WARNING: cannot resume from the latest checkpoint: {'; '.join(problems)}. Falling back to "
                  f"{path or 'the start'}", file=sys.stderr, flush=True)
    elif path is not None and (problem := checkpoint_problem(path)):
        raise RuntimeError(f"resume={path}: {problem}")
    if path is None:
        return 1, [], cfg.kl_coef
    run.actor.load_checkpoint(os.path.join(path, "actor"))  # the engine gets these weights at the next generate
    if run.critic:
        run.critic.load_checkpoint(os.path.join(path, "critic"))
    state = torch.load(os.path.join(path, "trainer_state.pt"), weights_only=False)
    if run.controller.is_main:
        print(f"resumed from {path} at step {state['step']}")
    kl_coef = state["kl_coef"] if cfg.kl_ctrl_type == "adaptive" else cfg.kl_coef
    return state["step"] + 1, state["records"], kl_coef


def loop(run: Run) -> list[dict]:
    """The steps from the latest checkpoint (or 1) to total_steps, with evaluation, metrics.jsonl, checkpoints,
    the final export, curves.png and summary.json; returns the records (what rank 0 logs)."""
    cfg, controller, began = run.cfg, run.controller, time.perf_counter()
    start, records, kl_coef = resume(run)
    log = tracker = None
    if controller.is_main:  # only the main process writes files
        with open(os.path.join(cfg.out_dir, "config.json"), "w") as f:
            json.dump(asdict(cfg), f, indent=1)
        path = os.path.join(cfg.out_dir, "metrics.jsonl")  # the checkpoint's records, then one line a step
        write_atomic(path, lambda tmp: Path(tmp).write_text("".join(json.dumps(r) + "\n" for r in records)))
        log = open(path, "a")
        tracker = Tracking(cfg.logger, cfg.out_dir, cfg.project_name,
                           cfg.experiment_name or os.path.basename(os.path.normpath(cfg.out_dir)), asdict(cfg))

    def emit(record: dict):
        records.append(record)
        if log:
            log.write(json.dumps(record) + "\n")
            log.flush()
            tracker.log(record, record["step"])

    if run.pool:  # the pool's engines take the trainer's weights (fresh or resumed) and start the first batches
        feed_pool(start - 1, run, {})
    if start == 1:
        emit({"step": 0, "prompt/num_truncated": run.task.num_truncated, **evaluate(run)})
    for step in (bar := tqdm(range(start, cfg.total_steps + 1), desc="rl", disable=not controller.is_main)):
        metrics, _, kl_coef = rl_step(step, step_rows(step, run), run, kl_coef)
        if step % cfg.eval_every == 0 or step == cfg.total_steps:
            with timer("testing", metrics):
                metrics.update(evaluate(run))
        emit(metrics)
        if cfg.checkpoint_every and step % cfg.checkpoint_every == 0:
            save_checkpoint(run, step, {"step": step, "records": records, "kl_coef": kl_coef})
        acc = next(r["val/accuracy"] for r in reversed(records) if "val/accuracy" in r)  # the latest evaluation's
        bar.set_postfix(reward=f"{metrics['critic/score/mean']:.3f}", acc=f"{acc:.3f}")
        for line in step_warnings(metrics, records[-2] if len(records) > 1 else {}) if controller.is_main else ():
            tqdm.write(line)  # above the bar

    run.actor.export(os.path.join(cfg.out_dir, "final"))
    if run.critic:  # a later run can start its critic here (critic_model_path)
        run.critic.export(os.path.join(cfg.out_dir, "critic"))
    if controller.is_main:
        plot_curves(records, os.path.join(cfg.out_dir, "curves.png"))
        log.close()
        tracker.close()
        summary = run_summary(records, cfg.out_dir, time.perf_counter() - began)
        write_atomic(os.path.join(cfg.out_dir, "summary.json"),
                     lambda tmp: Path(tmp).write_text(json.dumps(summary, indent=1)))
        shares = ", ".join(f"{k} {v:.0%}" for k, v in sorted(summary["phase_share"].items(), key=lambda kv: -kv[1])[:4])
        print(f"held-out greedy accuracy: {records[0]['val/accuracy']:.3f} -> {records[-1]['val/accuracy']:.3f} (best "
              f"{summary['best_val_accuracy']:.3f} at step {summary['best_step']}: {summary['best_checkpoint']}); "
              f"{summary['steps']} steps in {summary['wall_s']:.0f} s ({shares}; MFU "
              f"{', '.join(f'{k} {v:.1%}' for k, v in summary['mfu'].items())}); outputs and summary.json in "
              f"{cfg.out_dir}")
    return records


def check_out_dir(cfg: Config) -> None:
    """Refuse to start over in an out_dir whose metrics.jsonl holds a previous run's steps, unless told to
    (overwrite), so that no run destroys another's results; a run that resumes from a checkpoint keeps them."""
    path = os.path.join(cfg.out_dir, "metrics.jsonl")
    resumes = cfg.resume != "off" and (cfg.resume not in ("auto", "latest") or
                                       find_latest(os.path.join(cfg.out_dir, "checkpoints")))
    if not cfg.overwrite and not resumes and os.path.isfile(path) and os.path.getsize(path):
        with open(path) as f:
            steps = sum(1 for line in f if line.strip())
        raise FileExistsError(f"out_dir={cfg.out_dir} holds a previous run ({steps} lines in metrics.jsonl) and no "
                              "checkpoint to resume from: pass --overwrite to replace it, or another --out-dir")


def train(cfg: Config) -> list[dict]:
    """Run cfg.total_steps RL steps on every rank (TorchrunController: under torchrun or in one process); returns the
    records."""
    cfg = with_task_values(cfg, int(os.environ.get("RANK", "0")) == 0)
    check_out_dir(cfg)  # every rank reads the same folder, so all refuse together
    dist = init_distributed(cfg.dist_timeout_s, cfg.fsdp.tp_size, cfg.rollout_tp)
    if cfg.train_batch_size % dist.dp_size or cfg.ppo_mini_batch_size % dist.dp_size:
        raise ValueError(f"train_batch_size={cfg.train_batch_size} and ppo_mini_batch_size={cfg.ppo_mini_batch_size}"
                         f" must divide by the {dist.dp_size} data-parallel ranks")
    if cfg.rollout_backend == "hf" and dist.dp_size > 1:  # sharded generate stops at different steps per rank
        raise ValueError("rollout_backend='hf' runs in one process only; use 'vllm' with torchrun")
    if cfg.async_.rollout_workers:
        raise ValueError(f"async.rollout_workers={cfg.async_.rollout_workers}: a rollout pool of its own runs on the "
                         "Ray controller: python ray_trainer.py --async.rollout-workers N")
    os.makedirs(cfg.out_dir, exist_ok=True)
    with watch_ranks(dist):  # another rank's death or hang ends this rank with an error that names it
        model_path, train_files, val_files, *reward_model = warm_start_and_task_files(cfg, dist)
        if reward_model:  # --task arith-rlhf's learned reward model
            cfg = replace(cfg, reward_model_path=reward_model[0])
        task = load_task(cfg, model_path, train_files, val_files, dist.dp_size)  # bad data: named before the models
        actor = ActorWorker(cfg, model_path, dist)
        critic = CriticWorker(cfg, cfg.critic_model_path or model_path, dist) if cfg.adv_estimator == "gae" else None
        reward = RewardWorker(cfg, dist) if cfg.reward_model_path else None
        records = loop(Run(cfg, task, actor, critic, TorchrunController(dist), reward=reward))
        barrier(dist)  # the last collective: closing the engine destroys the default process group (vLLM's cleanup)
    actor.close()
    shutdown(dist)
    return records


if __name__ == "__main__":
    help_text = START_HERE.format(script="ppo.py", algo="PPO (GAE, a critic)", name="ppo")
    train(tyro.cli(Config, description=help_text))
