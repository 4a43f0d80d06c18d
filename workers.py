"""The workers of one RL step: the actor (policy + rollout engine + frozen reference, in one process per device:
the hybrid engine) and the critic. Their methods are the whole contract between a worker and its controller.

    python -m pytest tests/test_ppo.py -q        # the workers on a real batch (HF rollout, no engine needed)

A controller (ppo.py's torchrun loop on every rank, or a Ray driver calling every rank of a worker group) calls:
    batch, metrics = actor.generate(prompts, seeds)    # enters rollout mode (weights into vLLM), samples, leaves it
    batch["old_log_probs"] = actor.log_probs(batch)    # [B, R]; also actor.ref_log_probs, critic.values
    metrics = critic.update(batch); metrics = actor.update(batch)
    actor.save_checkpoint(path); actor.load_checkpoint(path); actor.export(out_dir); actor.close()
Arguments and results are TensorDicts ([B, ...], a rank's shard) or plain Python, on the CPU: a worker moves each
micro-batch to its device (to_device, the one place) and returns CPU results (tests/test_device.py). Every
collective a method performs runs over the worker's own process group and is named in its docstring: every rank
of the group must make the same calls in the same order.

Batch layout (verl's): prompts left-padded [B, P], responses right-padded [B, R], input_ids = both [B, P + R],
attention_mask and position_ids [B, P + R], response_mask [B, R] (1 on the model's tokens, 0 on padding and on a
tool's output), rollout_log_probs [B, R] (the engine's); with tools also num_turns, tool_calls, tool_errors [B].
"""

import math
import random
import time
from contextlib import contextmanager, nullcontext

import torch
from tensordict import TensorDict
from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForTokenClassification

from agent import AgentLoop
from batching import micro_batches, pack, packing_works, pad, unpack
from comm import Dist, Max, Sum, all_max, all_sum_fn, broadcast, side_barrier, side_group, synchronize, timer
from config import Config, implicit_reward
from core_algos import agg_loss, head_log_probs, kl_penalty, lr_factor, policy_loss, tis_weights, value_loss
from data import load_tokenizer
from hybrid_engine import (HybridEngine, checksum, probe_tokens, raise_on_sync_errors, sync_errors, trainer_checksums,
                           trainer_probe)
from lora import adapters_off
from perf import (GB, OutOfMemory, allreduce_ms, is_oom, model_flops, model_shape, peak_flops, peak_memory,
                  reset_peak_memory)
from rollout import HFRollout, make_rollout
from sharding import (DTYPES, cast_dtype, clip_grad_norm, export_hf, full_weights, load_sharded, load_sharded_model,
                      placed, relocate, save_sharded, weight_buckets)


# the pi_old / pi_rollout weight's mean, max and truncated share, by Config.behaviour_weight's kind
WEIGHT_METRICS = {"tis": ("actor/tis_weight_mean", "actor/tis_weight_max", "actor/tis_clipfrac"),
                  "decoupled": ("async/is_weight/mean", "async/is_weight/max", "async/is_weight/clipfrac")}


# ---- The batch and the forward passes over it -----------------------------------------------------


def pad_batch(prompts: list[list[int]], responses: list[list[int]], rollout_logps: list[list[float]], pad_id: int,
              widths: tuple[int, int] | None = None, masks: list[list[int]] | None = None,
              counts: dict[str, list[int]] | None = None):
    """Left-pad prompts and right-pad responses into verl's batch layout (a TensorDict of [B, ...]).
    widths (P, R): pad to these instead of the longest prompt and response (they must be at least those).
    masks: multi-turn responses' masks (agent.py: 0 on a tool's tokens), the response_mask; the attention covers
    every token. counts: per-response values (num_turns, tool_calls, tool_errors), each a [B] key."""
    P, R = widths or (max(map(len, prompts)), max(1, max(map(len, responses))))
    prompt_ids, prompt_mask = pad(prompts, pad_id, P, left=True)  # [B, P] each
    response_ids, response_attention = pad(responses, pad_id, R)  # [B, R] each
    response_mask = response_attention.float() if masks is None else pad(masks, 0.0, R)[0].float()  # [B, R]
    batch = layout(prompt_ids, prompt_mask, response_ids, response_attention, response_mask,
                   pad(rollout_logps, 0.0, R)[0].float())
    for key, values in (counts or {}).items():
        batch[key] = torch.tensor(values)  # [B]
    return batch


def layout(prompt_ids, prompt_mask, response_ids, response_attention, response_mask, rollout_log_probs) -> TensorDict:
    """The batch from its padded prompts [B, P] and responses [B, R] (ids, attention, response_mask, log-probs)."""
    attention_mask = torch.cat([prompt_mask, response_attention], 1)  # [B, P + R]
    position_ids = (attention_mask.cumsum(1) - 1).clamp(min=0)  # [B, P + R], 0 at the first real token
    return TensorDict(prompts=prompt_ids, responses=response_ids, input_ids=torch.cat([prompt_ids, response_ids], 1),
                      attention_mask=attention_mask, position_ids=position_ids, response_mask=response_mask,
                      rollout_log_probs=rollout_log_probs, batch_size=[prompt_ids.shape[0]])


def repadded(batch: TensorDict, widths: tuple[int, int], pad_id: int) -> TensorDict:
    """batch laid out at widths (P, R): the prompts' left padding and the responses' right padding cut or extended
    (the widths must hold every real token); per-response keys [B] kept."""
    P, R = widths
    p = batch["prompts"].shape[1]

    def fit(x: torch.Tensor, width: int, left: bool, value=0) -> torch.Tensor:  # [B, width]
        if width <= x.shape[1]:
            return x[:, x.shape[1] - width :] if left else x[:, :width]
        return torch.nn.functional.pad(x, (width - x.shape[1], 0) if left else (0, width - x.shape[1]), value=value)

    out = layout(fit(batch["prompts"], P, True, pad_id), fit(batch["attention_mask"][:, :p], P, True),
                 fit(batch["responses"], R, False, pad_id), fit(batch["attention_mask"][:, p:], R, False),
                 fit(batch["response_mask"], R, False), fit(batch["rollout_log_probs"], R, False))
    for key in batch.keys():
        if batch[key].dim() == 1:
            out[key] = batch[key]
    return out


def batch_widths(longest_prompt: int, longest_response: int, all_max) -> tuple[int, int]:
    """The padded widths (P, R) that every rank's batch shares, so rows can move between ranks: the longest prompt
    and response over the ranks (all_max: comm.all_max over them; a controller holding the whole batch's identity)."""
    P, R = all_max([longest_prompt, max(1, longest_response)])
    return int(P), int(R)


def response_positions(batch: TensorDict, remove_padding: bool) -> tuple[dict, torch.Tensor, torch.Tensor]:
    """(the model's inputs, the output positions that predict response tokens, keep [B, R]: the response tokens those
    positions predict). Padded: [B, P + R] inputs and the last R + 1 .. 2 columns (keep = response_mask); packed
    (remove_padding, batching.pack): one row [1, N] and the n = keep.sum() packed positions of real response tokens."""
    R, T = batch["responses"].shape[1], batch["input_ids"].shape[1]
    if not remove_padding:
        inputs = {k: batch[k] for k in ("input_ids", "attention_mask", "position_ids")}
        columns = torch.arange(T - R - 1, T - 1, device=batch["input_ids"].device)  # [R]: position t predicts t + 1
        return inputs, columns, batch["response_mask"].bool()
    packed = pack(batch["input_ids"], batch["attention_mask"])  # [1, N]; use_cache=False, or no packing is detected
    predicting = packed.flat_index[:, -R - 1 : -1]  # [B, R]: the packed positions that predict the response tokens
    keep = (predicting >= 0) & batch["response_mask"].bool()  # [B, R]
    return dict(input_ids=packed.input_ids, position_ids=packed.position_ids), predicting[keep], keep


@contextmanager
def head_replaced(model, fn):
    """The model's LM head computes fn(hidden states) instead of logits within the block. Inside the model's own
    forward, where FSDP2 has gathered the head's weight, so no hidden-state tensor leaves the forward."""
    head = model.get_output_embeddings()
    head.forward = fn
    try:
        yield head
    finally:
        del head.forward  # the class's forward again


def response_log_probs(model, batch: TensorDict, temperature: float, with_entropy: bool = False,
                       remove_padding: bool = False, entropy_grad: bool = True):
    """Log-prob [B, R] (and entropy [B, R], else None) of each response token under model, at the sampling
    temperature; 0 at padding. Logits exist only for the positions that predict response tokens, a chunk at a time
    (core_algos.head_log_probs: never a [tokens, V] tensor). entropy_grad=False: the entropy is a metric only."""
    inputs, positions, keep = response_positions(batch, remove_padding)
    targets = batch["responses"][keep]  # [n]

    def log_probs_head(hidden):  # [B, R, H] padded, [1, n, H] packed: the hidden states at `positions`
        hidden = hidden[0] if remove_padding else hidden[keep]  # [n, H]
        logp, entropy = head_log_probs(hidden, head.weight, head.bias, targets, temperature, with_entropy,
                                       entropy_grad)  # [n] each
        return torch.stack([logp, entropy]) if with_entropy else logp[None]  # [1 or 2, n]

    with head_replaced(model, log_probs_head) as head:
        out = model(**inputs, logits_to_keep=positions, use_cache=False).logits  # [1 or 2, n]
    return tuple(unpack(x, keep) for x in out) if with_entropy else (unpack(out[0], keep), None)  # [B, R] each


def response_values(model, batch: TensorDict, remove_padding: bool = False) -> torch.Tensor:
    """The critic's value [B, R] of the state before each response token (0 at padding)."""
    inputs, positions, keep = response_positions(batch, remove_padding)
    values = model(**inputs, use_cache=False).logits.squeeze(-1).float()  # [B, P + R] or [1, N]: one value a token
    return unpack(values[0, positions], keep) if remove_padding else unpack(values[:, positions][keep], keep)


def response_scores(model, batch: TensorDict) -> torch.Tensor:
    """A reward model's score [B] of each prompt + response: its scalar head read at the response's last token (the
    EOS where the response finished; verl's and TRL's rule). The prompt's last token for an empty response."""
    P = batch["prompts"].shape[1]
    last = P + batch["attention_mask"][:, P:].sum(-1) - 1  # [B]
    inputs = {k: batch[k] for k in ("input_ids", "attention_mask", "position_ids")}
    values = model(**inputs, use_cache=False).logits.squeeze(-1).float()  # [B, P + R]: one score a token
    return values.gather(1, last[:, None]).squeeze(1)  # [B]


def implicit_scores(model, ref, batch: TensorDict, beta: float, token_mean: bool) -> torch.Tensor:
    """DPO's implicit reward [B] of each response (Rafailov et al. 2023; RewardBench scores DPO models so): beta * the
    sum over its tokens (IPO: the mean) of log pi - log pi_ref, at temperature 1, as dpo.py trained them."""
    mask = batch["response_mask"]  # [B, R]
    ratio = response_log_probs(model, batch, 1.0)[0] - response_log_probs(ref, batch, 1.0)[0]  # [B, R], 0 at padding
    total = (ratio * mask).sum(-1)  # [B]
    return beta * (total / mask.sum(-1).clamp(min=1) if token_mean else total)


# ---- What the actor and the critic share ----------------------------------------------------------


class Worker:
    """A trainable model (FSDP2 over the worker's dp ranks, the plain model in one process), its tokenizer and AdamW,
    micro-batches, the PPO update, checkpoints and export. Subclasses set role (the metrics' prefix) and give
    micro_batch_loss -> (loss, {"sum": .., "mean": .., "max": ..}): its metrics as 0-d tensors, each dict declaring how
    micro-batches combine (accumulate)."""

    role: str

    def __init__(self, cfg: Config, dist: Dist, model: torch.nn.Module, tokenizer, lr: float):
        self.cfg, self.dist, self.model, self.tokenizer, self.lr = cfg, dist, model, tokenizer, lr
        trainable = [p for p in model.parameters() if p.requires_grad]  # LoRA: the adapters only; a scorer: none
        self.opt = torch.optim.AdamW(trainable, lr=lr, weight_decay=cfg.weight_decay) if trainable else None
        # what waits in host memory between this role's phases (Config.offload)
        self.offload_params = getattr(cfg.offload, f"{self.role}_params")
        self.offload_optimizer = getattr(cfg.offload, f"{self.role}_optimizer", False)
        self.updates = 0  # update() calls so far: the learning-rate schedule's position (saved in checkpoints)
        self.remove_padding = cfg.use_remove_padding and packing_works(model)
        if cfg.use_remove_padding and not self.remove_padding and dist.is_main:
            print(f"use_remove_padding: the {model.config._attn_implementation} attention lets packed sequences "
                  f"see each other (batching.packing_works); {self.role}: running padded micro-batches instead")
        if self.offload_params:  # from now on the parameters come to the device for each phase (resident)
            relocate("cpu", [model])
        self.shape = model_shape(model)  # its FLOPs a token, for perf/mfu
        self.peak_flops = peak_flops(dist.device, DTYPES[cfg.fsdp.param_dtype])  # what MFU divides by
        self.measures = {}  # the phases' memory high-water marks since the controller last collected them (perf)
        self.limits = {}  # phase: the micro-batch limit that --oom-retry halved to (it stays for later steps)
        self.all_sum = all_sum_fn(dist)  # the update's token and sequence counts over the ranks
        self.at = None  # (micro-batch index, the phase's micro-batches, their batch): what an out-of-memory names

    def micro_batch_rows(self, batch: TensorDict, max_tokens: int | None, rows: int = 0) -> list[list[int]]:
        """Row indices of batch's micro-batches: within max_tokens (the no-grad passes always; the update with
        use_dynamic_bsz), else `rows` rows each. Collective with a token budget (batching.micro_batches: the ranks
        agree on the count)."""
        if max_tokens is not None:
            return micro_batches(batch["attention_mask"].sum(-1), max_tokens, self.dist)
        B = batch.batch_size[0]
        return [list(range(i, min(i + rows, B))) for i in range(0, B, rows)]

    def to_device(self, batch: TensorDict) -> TensorDict:
        """The one place a batch crosses to this worker's device: a micro-batch of the CPU batch the controller
        passed. Results go back with .cpu() (map_micro_batches, metrics as floats)."""
        return batch.to(self.dist.device, non_blocking=True)

    def resident(self, optimizer: bool = False):
        """A context in which this worker's parameters (and with optimizer, its AdamW state) are on its device:
        what Config.offload keeps in host memory comes in for the block and goes back after."""
        return placed(self.dist.device, "cpu", [self.model] if self.offload_params else [],
                      [self.opt] if optimizer and self.offload_optimizer else [])

    def map_micro_batches(self, fn, batch: TensorDict, phase: str) -> torch.Tensor:
        """fn on each token-budget micro-batch (log_prob_max_token_len_per_gpu) of the CPU batch, on this worker's
        device; the results [B, ...] on the CPU, in batch's row order. Out of memory: see oom_retry. Collective (the
        micro-batch count; FSDP2's gathers in fn)."""
        limit = self.limits.get(phase, self.cfg.log_prob_max_token_len_per_gpu)
        while True:
            micro_rows, outs = self.micro_batch_rows(batch, limit), []
            try:
                for i, rows in enumerate(micro_rows):
                    self.at = (i, micro_rows, batch)
                    outs.append(fn(self.to_device(batch[torch.tensor(rows)])).cpu())
                break
            except Exception as error:  # noqa: BLE001 (an out-of-memory is retried or named; the rest goes up)
                limit = self.oom_retry(error, phase, "log_prob_max_token_len_per_gpu", limit)
        order = torch.tensor([i for rows in micro_rows for i in rows])  # [B], the order the micro-batches ran in
        return torch.cat(outs)[order.argsort()]  # [B, ...]

    @contextmanager
    def measured(self, phase: str):
        """The block's memory high-water mark as perf/max_memory_gb/<phase> (allocated device memory on GPU, the
        process's RSS on CPU), kept for perf()."""
        reset_peak_memory(self.dist.device)
        yield
        self.measures[f"perf/max_memory_gb/{phase}"] = Max(peak_memory(self.dist.device) / GB)

    def perf(self) -> dict:
        """The phases' memory and out-of-memory retries since the last call, and perf/allreduce_ms: one 1 MB
        all-reduce over the worker's ranks (0 alone). Collective (the probe)."""
        out, self.measures = {f"perf/oom_retries/{self.role}": 0.0, **self.measures}, {}
        group = self.dist.mesh["dp"].get_group() if self.dist.mesh is not None else None
        out["perf/allreduce_ms"] = allreduce_ms(group, self.dist.device) if group is not None else 0.0
        return out

    def oom_retry(self, error: Exception, phase: str, knob: str, limit: int) -> int:
        """After `error` in micro-batch self.at of phase, under the micro-batch limit `limit` (knob's tokens, or
        ppo_micro_batch_size's rows): anything but an out-of-memory goes up as it is. An out-of-memory raises
        OutOfMemory naming the phase, the micro-batch, the limit and the knobs that lower it; with --oom-retry it
        returns half the limit instead (kept for this phase's later calls), to rerun the phase's micro-batches:
        the micro-batches of a token budget add up to the same gradient and log-probs, so nothing else changes.
        Every rank must meet the error at the same micro-batch (the next collective pairs them): true of a budget
        that every rank fills alike; an out-of-memory on one rank alone stalls the others until dist_timeout_s."""
        if not is_oom(error):
            raise error
        if self.opt is not None:  # a micro-batch's half-made gradient: the retry starts clean
            self.opt.zero_grad(set_to_none=True)
        if self.dist.device.type == "cuda":
            torch.cuda.empty_cache()
        i, micro_rows, batch = self.at
        seqlens = batch["attention_mask"].sum(-1)[torch.tensor(micro_rows[i])]  # [b]
        site = (f"{self.role} {phase}: micro-batch {i + 1} of {len(micro_rows)} ({len(micro_rows[i])} sequences, "
                f"{int(seqlens.sum())} tokens) under {knob}={limit}")
        if not self.cfg.oom_retry or max(map(len, micro_rows)) == 1:  # one sequence a micro-batch: nothing to halve
            raise OutOfMemory(f"out of memory in {site}. Lower --{knob.replace('_', '-')}"
                              f"{'' if self.cfg.oom_retry else ' (--oom-retry halves it and retries)'}, or turn on "
                              f"--gradient-checkpointing, --offload.{self.role}-params, --offload.{self.role}-optimizer"
                              f"{', --offload.ref-params' if self.role == 'actor' else ''}; a shorter "
                              f"--max-response-length or a smaller --ppo-mini-batch-size also helps") from error
        print(f"[oom-retry] out of memory in {site}: retrying with {knob}={max(1, limit // 2)}", flush=True)
        self.measures[f"perf/oom_retries/{self.role}"] = self.measures.get(f"perf/oom_retries/{self.role}", 0.0) + 1
        self.limits[phase] = max(1, limit // 2)
        return self.limits[phase]

    def update(self, batch: TensorDict) -> dict:
        """PPO epochs over mini-batches of this rank's shard; each mini-batch is one optimizer step over its
        micro-batches. Returns this rank's metrics (the controller reduces them over the ranks), perf/mfu/<role>
        among them. Collectives: the mini-batches' token and sequence counts (one all-reduce), per mini-batch the
        micro-batch count (use_dynamic_bsz), FSDP2's gathers and gradient reduce-scatters, and the grad norm."""
        with self.resident(optimizer=True), self.measured(f"update_{self.role}"):
            synchronize()
            start = time.perf_counter()
            out = self._update(batch)
            synchronize()
            seconds = time.perf_counter() - start
        flops = self.cfg.ppo_epochs * model_flops(batch["attention_mask"].sum(-1), self.shape, backward=True,
                                                  lora=bool(self.cfg.lora))
        out[f"perf/mfu/{self.role}"] = flops / seconds / self.peak_flops
        return out

    def _update(self, batch: TensorDict) -> dict:
        cfg, per_step = self.cfg, []
        warmup = cfg.lr_warmup_steps if cfg.lr_warmup_steps >= 0 else int(cfg.lr_warmup_steps_ratio * cfg.total_steps)
        for group in self.opt.param_groups:
            group["lr"] = self.lr * lr_factor(self.updates, cfg.total_steps, warmup, cfg.lr_scheduler, cfg.min_lr_ratio)
        self.updates += 1
        phase = f"update_{self.role}"
        knob = "ppo_max_token_len_per_gpu" if cfg.use_dynamic_bsz else "ppo_micro_batch_size"
        minis = batch.split(cfg.ppo_mini_batch_size // self.dist.dp_size * cfg.rollout_n)
        masks = [self.loss_mask(mb) for mb in minis]  # [b, R] each
        # Every micro-batch divides by its mini-batch's counts, so the summed gradients are the mini-batch's
        # gradient; loss metrics add up the same way, token ratios are weighted by token share. Counts over all dp
        # ranks (one sum for every mini-batch), times dp_size to undo FSDP's gradient averaging: every rank's loss is
        # its part of the global mini-batch's loss, whatever its token count. A fully masked response weighs nothing.
        totals = torch.tensor([[m.sum().item(), (m.sum(-1) > 0).sum().item()] for m in masks], dtype=torch.float64)
        totals = (totals if self.all_sum is None else self.all_sum(totals)).tolist()  # [mini-batches, 2]
        for epoch in range(cfg.ppo_epochs):
            for i, (mb, mask, (tokens, seqs)) in enumerate(zip(minis, masks, totals)):
                agg_kw = dict(n_tokens=tokens / self.dist.dp_size, n_seqs=seqs / self.dist.dp_size,
                              norm_len=cfg.max_response_length, dp_size=self.dist.dp_size)
                limit = self.limits.get(phase, getattr(cfg, knob))
                while True:  # once, unless an out-of-memory is retried with a smaller limit (oom_retry)
                    try:
                        step = self.accumulate(mb, mask, agg_kw, limit, first_mini_batch=epoch == 0 and i == 0)
                        break
                    except Exception as error:  # noqa: BLE001 (an out-of-memory is retried or named; the rest goes up)
                        limit = self.oom_retry(error, phase, knob, limit)
                grad_norm = clip_grad_norm(self.model, cfg.grad_clip)  # across shards
                if math.isfinite(grad_norm):  # a NaN/inf gradient would poison the weights: skip the step
                    self.opt.step()
                self.opt.zero_grad(set_to_none=True)
                step[f"{self.role}/grad_norm"] = grad_norm
                step[f"{self.role}/skipped_steps"] = float(not math.isfinite(grad_norm))
                per_step.append(step)
        out = {}
        for k in dict.fromkeys(k for s in per_step for k in s):  # some only on the first mini-batch
            values = [s[k] for s in per_step if k in s]
            out[k] = max(values) if isinstance(values[0], Max) else sum(values) / len(values)
        out[f"{self.role}/skipped_steps"] *= len(per_step)  # a count, not a mean
        out[f"{self.role}/lr"] = self.opt.param_groups[0]["lr"]
        over = (batch["attention_mask"].sum(-1) > cfg.ppo_max_token_len_per_gpu).sum() if cfg.use_dynamic_bsz else 0.0
        out[f"{self.role}/over_budget_seqs"] = Sum(float(over))
        return out

    def accumulate(self, mb: TensorDict, mask: torch.Tensor, agg_kw: dict, limit: int, first_mini_batch: bool) -> dict:
        """Forward and backward over the micro-batches of mini-batch mb within `limit` (tokens under use_dynamic_bsz,
        else sequences), their gradients summed into the parameters' .grad; returns their metrics. Collective (the
        micro-batch count under use_dynamic_bsz; FSDP2's gathers, and its reduce-scatters in the last micro-batch's
        backward only)."""
        micro_rows = self.micro_batch_rows(mb, limit if self.cfg.use_dynamic_bsz else None, rows=limit)
        sums, maxima = {}, {}  # 0-d device tensors: read once, after the last micro-batch (no host sync per one)
        gradient_sync = getattr(self.model, "set_requires_gradient_sync", None)  # FSDP2's (none in one process)
        for j, rows in enumerate(micro_rows):
            self.at = (j, micro_rows, mb)
            if gradient_sync is not None:  # the gradients summed locally, reduce-scattered once, after the last one
                gradient_sync(j == len(micro_rows) - 1)
            rows = torch.tensor(rows)
            loss, metrics = self.micro_batch_loss(self.to_device(mb[rows]), agg_kw, first_mini_batch=first_mini_batch)
            loss.backward()
            token_share = (mask[rows].sum() / mask.sum().clamp(min=1)).item()  # from the CPU batch
            for k, v in metrics["sum"].items():  # loss terms, already scaled by the mini-batch's counts
                sums[k] = sums.get(k, 0.0) + v.detach()
            for k, v in metrics["mean"].items():  # per-token means: weighted by the micro-batch's token share
                sums[k] = sums.get(k, 0.0) + v * token_share
            for k, v in metrics["max"].items():
                maxima[k] = torch.maximum(maxima.get(k, v), v)
        values = torch.stack([*sums.values(), *maxima.values()]).tolist()  # the one host sync
        return {f"{self.role}/num_micro_batches": len(micro_rows), **dict(zip(sums, values)),
                **{k: Max(v) for k, v in zip(maxima, values[len(sums) :])}}

    def loss_mask(self, batch: TensorDict) -> torch.Tensor:
        """The tokens [B, R] the loss counts: every response token (the actor's may drop some, see ActorWorker)."""
        return batch["response_mask"]

    def save_checkpoint(self, path: str) -> None:
        """Model and optimizer shards (DCP) and this rank's RNG states into the folder `path`. Collective (DCP)."""
        rng = {"torch": torch.get_rng_state(), "python": random.getstate(), "updates": self.updates}
        with self.resident(optimizer=True):
            save_sharded(path, self.model, self.opt, rng, self.dist)

    def load_checkpoint(self, path: str) -> None:
        """Restore what save_checkpoint wrote (any world size), and the schedule's position: the next update's
        learning rate is this run's lr times the schedule's factor there. Collective."""
        with self.resident(optimizer=True):
            rng = load_sharded(path, self.model, self.opt, self.dist)
        torch.set_rng_state(rng["torch"])
        random.setstate(rng["python"])
        self.updates = rng["updates"]

    def export(self, out_dir: str) -> None:
        """The full model and its tokenizer as a plain HF folder in export_dtype (rank 0 writes). Collective (the full
        weights)."""
        with self.resident():
            export_hf(self.model, self.tokenizer, out_dir, self.dist, DTYPES[self.cfg.export_dtype])


# ---- The actor and the critic ---------------------------------------------------------------------


class ActorWorker(Worker):
    """The colocated actor: generates with its rollout engine (fed by the hybrid engine), log-probs of the policy and
    of the frozen reference, the policy update."""

    role = "actor"

    def __init__(self, cfg: Config, model_path: str, dist: Dist):
        model = load_sharded_model(model_path, dist, cfg.fsdp, gradient_checkpointing=cfg.gradient_checkpointing,
                                   lora=cfg.lora)
        super().__init__(cfg, dist, model, load_tokenizer(model_path), cfg.lr)  # fp32 masters
        self.ref = load_sharded_model(model_path, dist, cfg.fsdp, trainable=False) \
            if cfg.use_reference and not cfg.lora else None  # LoRA: the policy with its adapters off, no second copy
        if self.ref is not None and cfg.offload.ref_params:
            relocate("cpu", [self.ref])
        self.sync_group = None  # rank 0's weight-sync group with a rollout pool (open_weight_sync)
        self.bucket_bytes = int(cfg.hybrid.bucket_mb * 2**20)  # 0: one decoder layer a bucket
        self.rollout = self.hybrid = self.sampler = None  # async.rollout_workers: the pool's engines generate
        if not cfg.async_.rollout_workers:
            self.rollout = make_rollout(cfg.rollout_backend, model_path=model_path, model=self.model,
                                        tokenizer=self.tokenizer, in_group=dist.mesh is not None, tp=cfg.rollout_tp,
                                        shared_prompts=dist.tp_size > 1, **engine_args(cfg, dist.device))
            self.hybrid = HybridEngine(self.model, self.rollout, dist, cfg.hybrid, DTYPES[cfg.fsdp.param_dtype])
            self.sampler = AgentLoop(self.rollout, self.tokenizer, cfg.agent) if cfg.agent.tools_path else self.rollout

    def generate(self, prompts: list[list[int]], seeds: list[int] | None,
                 greedy: bool = False) -> tuple[TensorDict, dict]:
        """n responses per prompt (prompt-major: rows i*n .. i*n+n-1 share prompt i; greedy: one each) -> (batch,
        metrics: timing_s/gen and the hybrid engine's reshard metrics). Enters rollout mode (the weights streamed
        into the engine) and leaves it before returning.
        Collectives: the weight sync (full_weights' all-gathers; verify_sync's checks), and one all-gather that
        agrees on the padded widths, so that every rank's batch has the same shape (rows can move between ranks)."""
        if self.rollout is None:
            raise RuntimeError("generate: this actor has no engine; its rollout pool generates (async.rollout_workers)")
        n, metrics = 1 if greedy else self.cfg.rollout_n, {}
        # the AdamW state stays where it is: on the host with offload.actor_optimizer, else on the device
        # vLLM holds its own weights: the trainer's come to the device for the sync only; HF generate runs the
        # trainer's own model, which stays for the whole of rollout mode
        sync_resident, resident = (nullcontext, self.resident()) if self.rollout.uses_trainer_model else \
            (self.resident, nullcontext())
        with self.measured("gen"), resident, self.hybrid.rollout_mode(metrics, sync_resident), timer("gen", metrics):
            try:
                out = self.sampler.generate(prompts, n=n, max_tokens=self.cfg.max_response_length, seeds=seeds,
                                            temperature=0.0 if greedy else self.cfg.temperature, top_p=self.cfg.top_p,
                                            ignore_eos=self.cfg.ignore_eos and not greedy)
            except Exception as error:
                if not is_oom(error):
                    raise
                raise OutOfMemory(f"out of memory in actor gen: {len(prompts)} prompts x {n} samples of up to "
                                  f"{self.cfg.max_response_length} tokens. Lower --gpu-memory-utilization (the "
                                  f"engine's share; the trainer's parameters stay beside it), --train-batch-size or "
                                  f"--rollout-n (the samples a rank generates), --max-response-length, or turn on "
                                  f"--offload.actor-params") from error
        metrics.update(self.rollout.kv_cache_stats())
        repeated = [p for p in prompts for _ in range(n)]
        widths = batch_widths(max(map(len, prompts)), max(map(len, out.responses)),
                              lambda values: all_max(values, self.dist))
        batch = pad_batch(repeated, out.responses, out.log_probs, self.tokenizer.pad_token_id, widths, out.masks,
                          out.counts)
        batch["version"] = torch.full((len(repeated),), self.updates)  # [B]: the weights that sampled
        return batch, metrics

    # ---- the weight sync into a rollout pool of its own (ray_trainer.RolloutPool) ----

    def open_weight_sync(self, address: tuple[str, int], size: int) -> None:
        """Join a new weight-sync group with a rollout pool's size - 1 engines: rank 0 sends, as rank 0 of that group
        (hosting its store at address); the other ranks only gather. The previous pool's group is aborted first."""
        self.abort_weight_sync()
        timeout = self.cfg.async_.sync_timeout_s
        self.sync_group = side_group(address, 0, size, self.dist.device, timeout) if self.dist.is_main else None

    def abort_weight_sync(self) -> None:
        """Abort the weight-sync group, if any: a collective of it in flight fails now (on NCCL, rather than the
        watchdog ending the process), and no later one is tried."""
        if self.sync_group is not None:
            self.sync_group.abort()
            self.sync_group = None

    def weights_plan(self) -> list[list[tuple[str, tuple, torch.dtype]]]:
        """What send_weights sends: buckets of (HF name, full shape, dtype), whole decoder layers each."""
        dtype = DTYPES[self.cfg.fsdp.param_dtype]
        return [[(name, tuple(t.shape), cast_dtype(t, dtype)) for name, t in bucket]
                for bucket in weight_buckets(self.model, self.bucket_bytes, dtype)]

    def send_weights(self) -> int:
        """The current weights to the rollout pool, bucket by bucket (weights_plan's): every rank gathers each bucket
        (full_weights), rank 0 broadcasts its tensors over the sync group, then waits for every engine to say it took
        them all (side_barrier). Returns the bytes sent to each engine. Collective (the gathers). A broadcast that
        fails (an engine died) or waits past async.sync_timeout_s (one hung) stops the sending, not the gathers, so
        the ranks stay in step; the group is aborted and the error raised after the last bucket."""
        nbytes, error, timeout = 0, None, self.cfg.async_.sync_timeout_s
        with self.resident():
            for bucket in full_weights(self.model, self.bucket_bytes, DTYPES[self.cfg.fsdp.param_dtype]):
                for _, tensor in bucket:
                    nbytes += tensor.numel() * tensor.element_size()
                    if self.sync_group is not None and error is None:
                        try:
                            broadcast(self.sync_group, tensor.contiguous(), timeout)
                        except RuntimeError as e:  # gloo/NCCL: a peer left, or the wait timed out
                            error = e
                del bucket
        if self.sync_group is not None and error is None:
            try:
                side_barrier(self.sync_group, self.dist.device, timeout)
            except RuntimeError as e:
                error = e
        if error is not None:
            self.abort_weight_sync()
            raise RuntimeError(f"weight sync to the rollout pool failed: {error}")
        return nbytes

    def sync_expectation(self) -> list:
        """The trainer's side of verify_sync: [checksums of its weights in the rollout dtype, its probe log-probs as
        lists]. Collective (the checksums' sum over shards)."""
        probe = probe_tokens(self.model.config.vocab_size, self.cfg.hybrid.probe_len)  # [N, T]
        with self.resident():
            probe_lp = trainer_probe(self.model, probe, self.dist.device).tolist()
            return [trainer_checksums(self.model, DTYPES[self.cfg.fsdp.param_dtype], self.dist.device), probe_lp]

    @torch.no_grad()
    def log_probs(self, batch: TensorDict) -> torch.Tensor:
        """Sampled-token log-probs [B, R] under the current policy. Collectives: FSDP2's gathers, micro-batch count."""
        with self.resident(), self.measured("old_log_prob"):
            return self._log_probs(self.model, batch, "old_log_prob")

    @torch.no_grad()
    def ref_log_probs(self, batch: TensorDict) -> torch.Tensor:
        """Sampled-token log-probs [B, R] under the frozen reference (use_kl_loss / use_kl_in_reward; with LoRA the
        base model). Collectives: as log_probs."""
        if self.cfg.lora:  # the base model: the policy with its adapters off
            with self.resident(), adapters_off(self.model), self.measured("ref"):
                return self._log_probs(self.model, batch, "ref")
        if self.ref is None:
            raise RuntimeError("ref_log_probs: no reference policy was loaded (use_kl_loss and use_kl_in_reward off)")
        with placed(self.dist.device, "cpu", models=[self.ref] if self.cfg.offload.ref_params else []), \
                self.measured("ref"):
            return self._log_probs(self.ref, batch, "ref")

    def _log_probs(self, model, batch: TensorDict, phase: str) -> torch.Tensor:
        return self.map_micro_batches(lambda mb: response_log_probs(model, mb, self.cfg.temperature,
                                                                    remove_padding=self.remove_padding)[0],
                                      batch, phase)

    def micro_batch_loss(self, micro: TensorDict, agg_kw: dict, first_mini_batch: bool) -> tuple[torch.Tensor, dict]:
        """Policy loss - entropy bonus (+ KL loss) of one micro-batch, scaled by its mini-batch's counts.
        first_mini_batch: no optimizer step yet, so logp is the sampling policy's (Config.old_log_probs)."""
        cfg, mask = self.cfg, self.loss_mask(micro)
        logp, entropy = response_log_probs(self.model, micro, cfg.temperature, with_entropy=True,  # [b, R] each
                                           remove_padding=self.remove_padding, entropy_grad=cfg.entropy_coeff != 0)
        mode = cfg.old_log_probs_from
        old = (micro["old_log_probs"] if mode == "recompute" else micro["rollout_log_probs"] if mode == "rollout"
               else logp.detach())  # [b, R]
        maxima, gap = {}, {}
        if first_mini_batch and mode != "recompute":  # the engine-trainer gap, which the recomputing pass reports
            real = micro["response_mask"]
            diff = (micro["rollout_log_probs"] - logp.detach()).abs() * real  # [b, R]
            maxima["rollout/logprob_diff_max"] = diff.max()
            gap = {"rollout/logprob_diff_mean": diff.sum() / real.sum().clamp(min=1)}
        tis, tis_metrics = None, {}
        if cfg.behaviour_weight is not None:  # tis_cap, or decoupled PPO's pi_prox / pi_behav for stale samples
            kind, cap = cfg.behaviour_weight
            tis, stats = tis_weights(old, micro["rollout_log_probs"], mask, cap, cfg.tis_level)
            mean, top, clipfrac = WEIGHT_METRICS[kind]
            tis_metrics = {mean: stats["weight_mean"], clipfrac: stats["clipfrac"]}
            maxima[top] = stats["weight_max"]
        pg_loss, means = policy_loss(logp, old, micro["advantages"], mask, cfg.clip_ratio_low,
                                     cfg.clip_ratio_high, cfg.clip_ratio_c, cfg.loss_agg_mode, tis, **agg_kw)
        ent = agg_loss(entropy, mask, cfg.loss_agg_mode, **agg_kw)
        loss = pg_loss - cfg.entropy_coeff * ent if cfg.entropy_coeff else pg_loss  # the bonus raises the entropy
        sums = {"actor/pg_loss": pg_loss, "actor/entropy": ent}
        if cfg.use_kl_loss:
            kl = agg_loss(kl_penalty(logp, micro["ref_log_probs"], cfg.kl_loss_type), mask, cfg.loss_agg_mode, **agg_kw)
            loss = loss + cfg.kl_loss_coef * kl
            sums["actor/kl_loss"] = kl
        return loss, {"sum": sums, "mean": {**means, **tis_metrics, **gap}, "max": maxima}

    def loss_mask(self, batch: TensorDict) -> torch.Tensor:
        """The policy loss's tokens [B, R]: the step's loss_mask (rollout correction, overlong filtering: ppo.rl_step)
        where it set one, else every response token."""
        return batch["loss_mask"] if "loss_mask" in batch.keys() else batch["response_mask"]

    def close(self) -> None:
        """Shut the rollout engine down, after the run's last collective (VLLMRollout.close says why)."""
        if self.rollout is not None:
            self.rollout.close()


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
                                       config=config, gradient_checkpointing=cfg.gradient_checkpointing)
        super().__init__(cfg, dist, model, load_tokenizer(model_path), cfg.critic_lr)

    @torch.no_grad()
    def values(self, batch: TensorDict) -> torch.Tensor:
        """The value [B, R] of the state before each response token, 0 at padding. Collectives: FSDP2's gathers (and
        the micro-batch count, whose budget is log_prob_max_token_len_per_gpu)."""
        with self.resident(), self.measured("values"):
            return self.map_micro_batches(lambda mb: response_values(self.model, mb, self.remove_padding), batch,
                                          "values")

    def micro_batch_loss(self, micro: TensorDict, agg_kw: dict, first_mini_batch: bool) -> tuple[torch.Tensor, dict]:
        """The clipped value loss of one micro-batch against the returns, scaled by its mini-batch's counts."""
        values = response_values(self.model, micro, self.remove_padding)  # [b, R]
        loss, means = value_loss(values, micro["values"], micro["returns"], micro["response_mask"],
                                 self.cfg.cliprange_value, self.cfg.loss_agg_mode, **agg_kw)
        return loss, {"sum": {"critic/vf_loss": loss}, "mean": means, "max": {}}

    def close(self) -> None:
        """Nothing to release (no engine)."""


class RewardWorker(Worker):
    """A learned reward model (Config.reward_model_path), frozen: a scalar head (reward_model.py's output, or any HF
    scalar-head model) read at the response's last token; or dpo.py's policy, scored by its implicit reward against
    the reference it started from. Sharded like the reference (FSDP2 over dp, TP_PLAN over tp, compute dtype), in
    host memory between its passes with offload.reward_params. Its batch is in its own tokens (ppo.reward_model_batch
    re-tokenises where they differ)."""

    role = "reward"

    def __init__(self, cfg: Config, dist: Dist):
        path = cfg.reward_model_path
        self.implicit = implicit_reward(path)  # (reference, beta, token mean) for a DPO policy, else None
        if self.implicit:
            model = load_sharded_model(path, dist, cfg.fsdp, trainable=False)
            self.ref = load_sharded_model(self.implicit[0], dist, cfg.fsdp, trainable=False)
        else:  # a *ForSequenceClassification folder's `score` head loads too
            model = load_sharded_model(path, dist, cfg.fsdp, trainable=False, config=AutoConfig.from_pretrained(path),
                                       model_class=AutoModelForTokenClassification)
            self.ref = None
        super().__init__(cfg, dist, model, load_tokenizer(path), 0.0)
        if self.offload_params and self.ref is not None:  # Worker.__init__ moved the model to host memory
            relocate("cpu", [self.ref])

    @torch.no_grad()
    def scores(self, batch: TensorDict) -> torch.Tensor:
        """The score [B] of each prompt + response: at the response's last token (response_scores), or the implicit
        reward (implicit_scores). Collectives: FSDP2's gathers and the micro-batch count (budget
        log_prob_max_token_len_per_gpu)."""
        score = (lambda mb: implicit_scores(self.model, self.ref, mb, *self.implicit[1:])) if self.implicit else \
            (lambda mb: response_scores(self.model, mb))
        models = [self.model] + ([self.ref] if self.ref is not None else [])
        with placed(self.dist.device, "cpu", models if self.offload_params else []), self.measured("reward_model"):
            return self.map_micro_batches(score, batch, "reward_model")

    def close(self) -> None:
        """Nothing to release (no engine)."""


# ---- A rollout pool's engine ----------------------------------------------------------------------


def engine_args(cfg: Config, device: torch.device) -> dict:
    """make_rollout's arguments that a run's Config decides."""
    return dict(device=device, max_model_len=cfg.max_prompt_length + cfg.max_response_length, seed=cfg.seed,
                dtype=cfg.fsdp.param_dtype,  # the engine computes in the trainer's compute dtype
                gpu_memory_utilization=cfg.gpu_memory_utilization, cuda_graphs=cfg.cuda_graphs, verbose=cfg.verbose)


class RolloutWorker:
    """A generation-only engine of a rollout pool (ray_trainer.RolloutPool), one a device: its own copy of the
    policy, loaded from model_path, then the trainer's weights by broadcast after each update (receive_weights),
    verified as the hybrid engine verifies; every sample records the version of the weights it came from."""

    def __init__(self, cfg: Config, model_path: str, dist: Dist):
        self.cfg, self.dist, self.tokenizer = cfg, dist, load_tokenizer(model_path)
        if cfg.rollout_backend == "hf":  # a copy of its own, which receive_weights overwrites
            model = AutoModelForCausalLM.from_pretrained(model_path, dtype=DTYPES[cfg.fsdp.param_dtype])
            self.rollout = HFRollout(model.to(dist.device), self.tokenizer, dist.device, own_model=True)
        else:
            self.rollout = make_rollout(cfg.rollout_backend, model_path=model_path, model=None,
                                        tokenizer=self.tokenizer, in_group=False, **engine_args(cfg, dist.device))
        self.sampler = AgentLoop(self.rollout, self.tokenizer, cfg.agent) if cfg.agent.tools_path else self.rollout
        self.version, self.received, self.sync_group = 0, {}, None
        self.probe = probe_tokens(AutoConfig.from_pretrained(model_path).vocab_size, cfg.hybrid.probe_len)  # [N, T]

    def open_weight_sync(self, address: tuple[str, int], rank: int, size: int) -> None:
        """Join the weight-sync group whose rank 0 is the trainer's rank 0."""
        self.sync_group = side_group(address, rank, size, self.dist.device, self.cfg.async_.sync_timeout_s)

    @torch.no_grad()
    def receive_weights(self, plan: list[list[tuple[str, tuple, torch.dtype]]], version: int) -> None:
        """The trainer's weights (ActorWorker.send_weights), one bucket at a time into the engine; from now on the
        samples carry `version`. With verify_sync each tensor is fingerprinted as it arrives (verify)."""
        self.received, timeout = {}, self.cfg.async_.sync_timeout_s
        for bucket in plan:
            tensors = [(name, torch.empty(shape, dtype=dt, device=self.dist.device)) for name, shape, dt in bucket]
            for name, tensor in tensors:
                broadcast(self.sync_group, tensor, timeout)
                if self.cfg.hybrid.verify_sync:
                    self.received[name] = checksum(tensor.reshape(-1), start=0).item()
            self.rollout.update_weights(iter(tensors))
            del tensors
        side_barrier(self.sync_group, self.dist.device, timeout)  # the trainer learns that this engine took them all
        self.version = version

    def verify(self, expected: dict[str, int], trainer_probe_lp: list) -> float:
        """What the engine received equals the trainer's weights (checksums) and it computes the trainer's log-probs
        on the probe (hybrid_engine.sync_errors); returns the probe's gap, or raises."""
        bad, gap = sync_errors(expected, self.received, self.rollout, self.probe, torch.tensor(trainer_probe_lp))
        raise_on_sync_errors(bad, gap, self.cfg.hybrid.verify_tol)
        return gap

    def generate(self, prompts: list[list[int]], seeds: list[int] | None, greedy: bool = False) -> tuple:
        """n responses per prompt (greedy: one) -> (a RolloutOutput, the weights' version, seconds)."""
        start, cfg = time.perf_counter(), self.cfg
        out = self.sampler.generate(prompts, n=1 if greedy else cfg.rollout_n, max_tokens=cfg.max_response_length,
                                    temperature=0.0 if greedy else cfg.temperature, top_p=cfg.top_p, seeds=seeds,
                                    ignore_eos=cfg.ignore_eos and not greedy)
        return out, self.version, time.perf_counter() - start

    def close(self) -> None:
        self.rollout.close()
