"""FSDP2 sharding of an HF model (a causal LM, or a critic), full-weight streaming, DCP checkpoints and HF export.

    OMP_NUM_THREADS=1 python -m pytest tests/test_sharding.py -q     # 2-rank torchrun tests against one process
    python bench/fsdp.py --hidden-size 256 --num-layers 4            # memory/step time, 1 rank vs 2 ranks

API (every function is called by every rank, in the same order; with no process group, plain single-process code):
    dist = comm.init_distributed()
    model = load_sharded_model(path, dist, FSDPConfig(param_dtype="bfloat16"))     # actor: fp32 masters, bf16 compute
    ref = load_sharded_model(path, dist, FSDPConfig(), trainable=False)             # frozen reference (eval mode)
    critic = load_sharded_model(path, dist, model_class=AutoModelForTokenClassification, config=c)  # c.num_labels=1
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5)   # after sharding: it holds the local shards
    loss.backward(); norm = clip_grad_norm(model, 1.0)            # skip optimizer.step() when norm is not finite
    for bucket in full_weights(model, 1 << 28, torch.bfloat16):   # [(HF name, full tensor)], whole decoder layers
        engine.load(bucket)
    tmp = begin_checkpoint(ckpt_dir, step)                         # one process: ckpt_dir/step_N.tmp/
    save_sharded(f"{tmp}/actor", model, optimizer, {"rng": torch.get_rng_state()}, dist)   # each model, a folder
    commit_checkpoint(ckpt_dir, step)                              # one process: rename, then point `latest` at it
    path = find_latest(ckpt_dir)                                   # None when the run has no checkpoint yet
    extra = load_sharded(f"{path}/actor", model, optimizer, dist)  # any world size: DCP reshards on load
    export_hf(model, tokenizer, out_dir, dist)                     # a plain HF folder (from_pretrained, vLLM)

Sharding: each decoder layer (the model's _no_split_modules classes) is one FSDP2 group, the root (embeddings,
final norm, lm_head) another; parameters are sharded over the mesh's "dp" dimension. Rank 0 reads the HF weights,
the other ranks build the model on the meta device and receive their shards from rank 0, so only one full copy
is ever read from disk. With a single process (no process group) the model is returned unsharded, and
torch.autocast stands in for the MixedPrecisionPolicy (compute_in).

Checkpoint layout (a shared filesystem, as on one node): ckpt_dir/step_{N}/ holds one folder per model (the
caller names them: actor/, critic/), each with DCP's .metadata and shards of {"model", "optim"} keyed by parameter
name, so any world size can read it, plus extra_rank{r}.pt (each rank's `extra`: per-rank RNG states survive a
same-size resume; a rank with no file of its own reads rank 0's). The models of one checkpoint may belong to
different process groups (the Ray controller's split placement): each saves its own folder. ckpt_dir/latest
names the newest complete step folder.
"""

import json
import math
import os
import shutil
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import torch
import torch.distributed as tdist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict, get_state_dict,
                                                     set_model_state_dict, set_state_dict)
from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
from transformers import AutoConfig, AutoModelForCausalLM, PreTrainedConfig

from comm import Dist, barrier
from fileio import sha256, write_atomic
from lora import add_adapters, export_adapter, freeze_base, is_adapter

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass
class FSDPConfig:
    tp_size: int = 1
    """Tensor parallelism inside each decoder layer (verl's fsdp_config.tp_size): groups of tp_size consecutive ranks
    share a shard of the data and split q/k/v, o, gate/up and down (sharding.parallelize); FSDP2 shards over the
    world / tp_size groups. For a model whose layers, gradients and AdamW state do not fit a device, or whose
    activations at long responses do not. 1: data parallelism only."""
    param_dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    """dtype that forward/backward compute in (MixedPrecisionPolicy casts the gathered parameters; in one process,
    without FSDP, torch.autocast); masters keep the load dtype."""
    reduce_dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    """dtype of the gradient reduce-scatter; fp32 with bf16 params keeps gradient sums accurate."""
    reshard_after_forward: bool = True
    """Free each layer's gathered parameters after forward and gather again in backward (ZeRO-3); False keeps
    them (ZeRO-2: more memory, one all-gather fewer)."""
    forward_prefetch: bool = False
    """All-gather layer i+1 while layer i computes (explicit prefetch); one more gathered layer in memory."""
    cpu_offload: bool = False
    """Keep sharded parameters, gradients and optimizer state in CPU memory (CPUOffloadPolicy): the optimizer steps
    on the CPU, each layer is copied in for its forward and backward. For models whose state does not fit at all."""

    def __post_init__(self):
        if self.tp_size < 1:
            raise ValueError(f"fsdp.tp_size={self.tp_size} must be >= 1")
        if self.tp_size > 1 and self.cpu_offload:
            raise ValueError(f"fsdp.tp_size={self.tp_size} with fsdp.cpu_offload: FSDP2's CPU offload of "
                             "tensor-parallel shards is not supported here; use --offload.* instead")
        for field in ("param_dtype", "reduce_dtype"):
            if getattr(self, field) not in DTYPES:
                raise ValueError(f"{field}={getattr(self, field)!r}: choose one of {sorted(DTYPES)}")


@dataclass
class OffloadConfig:
    """Per role, what waits in CPU memory while the role is not computing (verl's param_offload and
    optimizer_offload). GPU only: the moves go to pinned host memory and back, non-blocking; on CPU nothing moves."""

    actor_params: bool = False
    """The actor's parameter shards live in CPU memory, and come to the device for its log-prob pass, update,
    checkpoints and export (the weight sync gathers them from the host, so generation runs without them)."""
    actor_optimizer: bool = False
    """The actor's AdamW state lives in CPU memory except during its update and checkpoints (so it is away while the
    engine generates); off: it stays on the device (AdamW's state of a 7B model on 8 ranks is ~7.6 GB each, which
    would otherwise cross twice a step)."""
    ref_params: bool = False
    """The reference policy's parameter shards live in CPU memory except during its log-prob pass."""
    critic_params: bool = False
    """The critic's parameter shards live in CPU memory except during its value pass, update and checkpoints."""
    critic_optimizer: bool = False
    """The critic's AdamW state lives in CPU memory except during its update and checkpoints."""
    reward_params: bool = False
    """The reward model's parameter shards live in CPU memory except during its scoring pass."""


def move_model(model: torch.nn.Module, device: torch.device | str) -> None:
    """Parameters and buffers to device, non-blocking (a GPU -> CPU copy lands in pinned memory, which the copy back
    reads asynchronously), each Parameter object kept: the optimizer holds them, and a tied weight stays tied. A
    plain tensor keeps its object through `.data =`; a DTensor (FSDP2's shards) would keep its old local tensor that
    way, so nn.Module swaps the moved tensor into the old object instead (FSDP2's _apply then re-registers it)."""
    swap = torch.__future__.get_swap_module_params_on_conversion()
    torch.__future__.set_swap_module_params_on_conversion(any(isinstance(p, DTensor) for p in model.parameters()))
    try:
        model.to(device, non_blocking=True)
    finally:
        torch.__future__.set_swap_module_params_on_conversion(swap)


def move_optimizer(optimizer: torch.optim.Optimizer, device: torch.device | str) -> None:
    """The optimizer's per-parameter state (AdamW's moments) to device, non-blocking; the step counts (0-dim) stay
    where AdamW keeps them."""
    for state in optimizer.state.values():
        for key, value in state.items():
            if torch.is_tensor(value) and value.dim() > 0:
                state[key] = value.to(device, non_blocking=True)


def relocate(device: torch.device | str, models=(), optimizers=()) -> None:
    """models' parameters and optimizers' state to device. After a move to the host, the freed GPU blocks go back
    to the driver (where vLLM, or another role, allocates: its free-memory check at start-up counts them)."""
    for model in models:
        move_model(model, device)
    for optimizer in optimizers:
        move_optimizer(optimizer, device)
    if torch.device(device).type == "cpu" and torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.empty_cache()  # waits for the queued copies first


@contextmanager
def placed(inside: torch.device | str, after: torch.device | str, models=(), optimizers=()):
    """models' parameters and optimizers' state moved to `inside` for the block, and to `after` when it ends
    (relocate)."""
    same = torch.device(inside) == torch.device(after) or not (models or optimizers)  # CPU-only: nothing moves
    if not same:
        relocate(inside, models, optimizers)
    try:
        yield
    finally:
        if not same:
            relocate(after, models, optimizers)


# ---- Loading and sharding -------------------------------------------------------------------------


def adapted(model: torch.nn.Module, lora: tuple[int, float, str] | None) -> torch.nn.Module:
    """The model with LoRA adapters (rank, alpha, targets) added, or as it is (None)."""
    return add_adapters(model, *lora) if lora else model


def _set_trainable(model: torch.nn.Module, trainable: bool, gradient_checkpointing: bool,
                   lora: tuple | None = None) -> torch.nn.Module:
    model.requires_grad_(trainable)
    if trainable and lora:
        freeze_base(model)
    if trainable and gradient_checkpointing:  # HF applies it in train mode only
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    return model.train(trainable)


def decoder_layers(model: torch.nn.Module) -> list[tuple[str, torch.nn.Module]]:
    """(name, module) of the model's decoder layers: its _no_split_modules classes. fully_shard swaps a module's
    class for a subclass (FSDPQwen2DecoderLayer), hence the look through the class's bases."""
    classes = set(model._no_split_modules or ())
    return [(name, m) for name, m in model.named_modules() if any(c.__name__ in classes for c in type(m).__mro__)]


# The tensor-parallel plan of one decoder layer (Megatron's split, Shoeybi et al. 2019): q, k, v and gate, up
# column-wise (each rank its heads, its MLP columns), o and down row-wise (their partial sums all-reduced), so a layer
# communicates twice a pass. Norms, the embedding and the LM head stay whole on every tp rank (FSDP still shards them
# over "dp"): the log-prob pass's logits are then the one-process run's, a chunk at a time (head_log_probs), and the
# vLLM engine's vocabulary split needs no matching layout.
TP_PLAN = {"self_attn.q_proj": ColwiseParallel, "self_attn.k_proj": ColwiseParallel,
           "self_attn.v_proj": ColwiseParallel, "self_attn.o_proj": RowwiseParallel,
           "mlp.gate_proj": ColwiseParallel, "mlp.up_proj": ColwiseParallel, "mlp.down_proj": RowwiseParallel}
TP_DIM = {name.split(".")[-1]: 0 if style is ColwiseParallel else 1 for name, style in TP_PLAN.items()}  # weight dim


def check_tp(config, tp: int, model_class: str = "") -> None:
    """Refuse a tensor-parallel size the model cannot take, naming the numbers: heads and kv heads must divide by it
    (each rank holds whole heads), and so must the MLP's width."""
    for name in ("num_attention_heads", "num_key_value_heads", "intermediate_size"):
        value = getattr(config, name, None)
        if value is not None and value % tp:
            raise ValueError(f"fsdp.tp_size={tp}: the model's {name}={value} does not divide by it")


def parallelize(model: torch.nn.Module, dist: Dist, cfg: FSDPConfig) -> None:
    """The whole plan of a decoder on the ("dp", "tp") mesh, torchtitan's shape: TP_PLAN inside every decoder layer
    over "tp" (torch's parallelize_module; HF's attention views its q/k/v as (-1, head_dim), so it runs on its local
    heads, heads / tp, as they are), then FSDP2 over "dp" (_shard)."""
    tp = dist.mesh["tp"]
    if tp.size() > 1:
        check_tp(model.config, tp.size())
        for name, layer in decoder_layers(model):
            missing = [n for n in TP_PLAN if not isinstance(_submodule(layer, n), torch.nn.Linear)]
            if missing:
                raise ValueError(f"fsdp.tp_size={tp.size()}: {type(model).__name__} has no tensor-parallel plan "
                                 f"(sharding.TP_PLAN: its layer {name} lacks the linears {missing})")
            # src_data_rank None: each rank cuts its slices from its own copy (meta on ranks > 0: set_model_state_dict
            # fills them from rank 0 afterwards, as without TP)
            parallelize_module(layer, tp, {n: style() for n, style in TP_PLAN.items()}, src_data_rank=None)
    _shard(model, dist, cfg)


def _submodule(module: torch.nn.Module, name: str):
    try:
        return module.get_submodule(name)
    except AttributeError:
        return None


def _shard(model: torch.nn.Module, dist: Dist, cfg: FSDPConfig) -> None:
    """fully_shard every decoder layer, then the root (which takes the remaining parameters), over "dp"."""
    layers = [m for _, m in decoder_layers(model)]
    if not layers:
        raise ValueError(f"{type(model).__name__}: no module of a _no_split_modules class {model._no_split_modules}")
    kwargs = dict(
        mesh=dist.mesh["dp"], reshard_after_forward=cfg.reshard_after_forward,
        mp_policy=MixedPrecisionPolicy(param_dtype=DTYPES[cfg.param_dtype], reduce_dtype=DTYPES[cfg.reduce_dtype]),
        # pinned memory needs an accelerator
        offload_policy=CPUOffloadPolicy(pin_memory=torch.cuda.is_available()) if cfg.cpu_offload else OffloadPolicy(),
    )
    for layer in layers:
        fully_shard(layer, **kwargs)
    fully_shard(model, **kwargs)
    if cfg.forward_prefetch:
        for layer, next_layer in zip(layers, layers[1:]):
            layer.set_modules_to_forward_prefetch([next_layer])


def compute_in(model: torch.nn.Module, dtype: torch.dtype) -> None:
    """One process: the model's forward computes in dtype (torch.autocast; the weights stay in theirs), as FSDP's
    MixedPrecisionPolicy does under torchrun. No cast cache: a no-grad pass would otherwise hold a second copy of
    every weight until the forward ends (backward keeps the casts it needs anyway)."""
    if dtype != torch.float32:
        device = next(model.parameters()).device.type
        model.forward = torch.autocast(device, dtype=dtype, cache_enabled=False)(model.forward)


def load_sharded_model(model_path: str, dist: Dist, cfg: FSDPConfig | None = None, trainable: bool = True,
                       model_class=AutoModelForCausalLM, config: PreTrainedConfig | None = None,
                       gradient_checkpointing: bool = False, lora: tuple[int, float, str] | None = None
                       ) -> torch.nn.Module:
    """The HF model at model_path, FSDP2-sharded over dist.mesh["dp"] (plain on dist.device without a group), with
    fp32 master weights (FSDPConfig.param_dtype sets the compute dtype). trainable=False gives a frozen reference:
    no gradients, eval mode, its weights in the compute dtype (FSDPConfig.param_dtype: no fp32 copy of a model that
    never steps). model_class and config (None: the folder's) pick another head, e.g. a critic:
    AutoModelForTokenClassification with config.num_labels = 1; weights the folder lacks (the new head) are
    initialised on rank 0 and reach the other ranks with the rest. gradient_checkpointing: each decoder layer
    recomputes its activations in backward (HF's, non-reentrant). lora (rank, alpha, target modules): LoRA
    adapters (lora.py), added before sharding; only they train."""
    cfg = cfg or FSDPConfig()
    config = config or AutoConfig.from_pretrained(model_path)
    dtype = torch.float32 if trainable else DTYPES[cfg.param_dtype]  # fp32 masters; a frozen model computes only
    if dist.mesh is None or dist.rank == 0:  # the adapters' initial values come from rank 0 too
        model = adapted(model_class.from_pretrained(model_path, config=config, dtype=dtype), lora)
    else:
        with torch.device("meta"):  # no memory, no init: the weights come from rank 0
            model = adapted(model_class.from_config(config, dtype=dtype), lora)
    if dist.mesh is None:
        compute_in(model.to(dist.device), DTYPES[cfg.param_dtype])
        return _set_trainable(model, trainable, gradient_checkpointing, lora)
    full_state = model.state_dict() if dist.rank == 0 else {}  # full tensors, kept past fully_shard's swap to shards
    parallelize(model, dist, cfg)  # the shards on the mesh's device, or (cpu_offload) in host memory
    if dist.rank != 0:  # shards where fully_shard would have put them; buffers, which FSDP leaves alone, on the device
        model.to_empty(device="cpu" if cfg.cpu_offload else dist.device)
        for buffer in model.buffers():
            buffer.data = buffer.data.to(dist.device)
    set_model_state_dict(model, full_state, options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True))
    del full_state
    # Non-persistent buffers (rotary inv_freq) are in no state dict: meta ranks hold uninitialised memory.
    # Rank 0 computed them in the model's own __init__, so copying its values works for any architecture.
    for buffer in model.buffers():
        tdist.broadcast(buffer, src=0)
    return _set_trainable(model, trainable, gradient_checkpointing, lora)


def clip_grad_norm(model: torch.nn.Module, max_norm: float) -> float:
    """Scale gradients to a global L2 norm of at most max_norm; the norm before clipping, as a float. Collective
    over every rank: each gradient's local block counts once, divided by its copies (a shard replicated over "tp",
    as the norms' and the embedding's are, lives on tp ranks alike), so the gradients of several meshes (FSDP2's
    over "dp", the tensor-parallel layers' over ("dp", "tp")) sum into one norm."""
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    squares = torch.zeros((), dtype=torch.float64, device=grads[0].device if grads else "cpu")
    for g in grads:
        local, copies = (g.to_local(), holders(g)) if isinstance(g, DTensor) else (g, 1)
        squares += local.double().square().sum() / copies
    if tdist.is_initialized() and any(isinstance(g, DTensor) for g in grads):
        tdist.all_reduce(squares)  # the default group: every rank
    norm = squares.sqrt().item()
    if norm > max_norm:  # as clip_grad_norm_: scale by max_norm / (norm + 1e-6)
        for g in grads:
            g.mul_(max_norm / (norm + 1e-6))
    return norm


def holders(t: DTensor) -> int:
    """How many ranks hold the same local block of t: the world over the sizes of the mesh dims that shard it
    (Shard, and FSDP2's _StridedShard over "dp" of a column-wise slice, whose is_shard() says False)."""
    sharded = math.prod(t.device_mesh.size(i) for i, p in enumerate(t.placements) if hasattr(p, "dim"))
    return tdist.get_world_size() // sharded


# ---- Full weights, bucket by bucket (the hybrid engine's weight sync) -----------------------------


def cast_dtype(tensor: torch.Tensor, dtype: torch.dtype | None) -> torch.dtype:
    """The dtype a weight travels in: dtype for floating-point tensors (None: their own), integers keep theirs."""
    return dtype if dtype is not None and tensor.is_floating_point() else tensor.dtype


@dataclass
class Merged:
    """A LoRA-adapted linear's weight as the engine computes with it, base + scale * B @ A (lora.py): the three
    parameters (local tensors or DTensor shards), merged when gathered (full_tensor)."""
    base: torch.Tensor  # [out, in]
    a: torch.Tensor  # [r, in]
    b: torch.Tensor  # [out, r]
    scale: float

    shape = property(lambda self: self.base.shape)
    dtype = property(lambda self: self.base.dtype)

    def numel(self) -> int:
        return self.base.numel()

    def is_floating_point(self) -> bool:
        return True


def full_tensor(tensor: torch.Tensor | Merged, dtype: torch.dtype | None) -> torch.Tensor:
    """The full tensor in dtype (None: its own) of a local tensor, a DTensor shard (gathered: collective) or a
    Merged weight (its three parts gathered in the master dtype, merged, then cast)."""
    if isinstance(tensor, Merged):
        base, a, b = (full_tensor(t, None) for t in (tensor.base, tensor.a, tensor.b))
        return torch.addmm(base, b, a, alpha=tensor.scale).to(cast_dtype(base, dtype))  # [out, in]
    tensor = tensor.detach().to(cast_dtype(tensor, dtype))  # before the gather: it moves rollout-dtype bytes
    if not isinstance(tensor, DTensor):
        return tensor
    if tensor.device.type != tensor.device_mesh.device_type:  # CPU-offloaded shard: gather on the mesh's device
        tensor = tensor.to(tensor.device_mesh.device_type)
    return tensor.full_tensor()


def weight_groups(model: torch.nn.Module) -> list[list[tuple[str, torch.Tensor]]]:
    """The model's weights (engine_weights: parameters + persistent buffers, HF names, a tied weight once),
    as groups that never split a decoder layer: one group per layer (a _no_split_modules module), one per other
    tensor. vLLM fuses q/k/v and gate/up inside a layer, and its loader rebuilds a fused module from the weights
    of one load call only (the parts left out come out as uninitialised memory: wrong or NaN log-probs), so a layer
    must reach it whole."""
    layers = [name + "." for name, _ in decoder_layers(model)]
    seen, groups, current = set(), [], None
    for name, tensor in engine_weights(model):
        if id(tensor) in seen:  # lm_head.weight is embed_tokens.weight in a tied model
            continue
        seen.add(id(tensor))
        layer = next((prefix for prefix in layers if name.startswith(prefix)), None)
        if layer is None or layer != current:
            groups.append([])
        current = layer
        groups[-1].append((name, tensor))  # FSDP2 keeps the HF names
    return groups


def engine_weights(model: torch.nn.Module) -> list[tuple[str, torch.Tensor | Merged]]:
    """The model's parameters and persistent buffers in state-dict order, under the names of the plain HF model: an
    adapted linear (X.base_layer.weight, X.lora_A/B) is one Merged weight X.weight, its bias X.bias."""
    state = model.state_dict(keep_vars=True)
    out = []
    for name, tensor in state.items():
        if is_adapter(name):
            continue
        if name.endswith(".base_layer.weight"):
            module = name[: -len(".base_layer.weight")]
            a, b = (state[f"{module}.lora_{ab}.default.weight"] for ab in "AB")
            tensor = Merged(tensor, a, b, model.get_submodule(module).scaling["default"])
        out.append((name.replace(".base_layer.", "."), tensor))
    return out


def weight_buckets(model: torch.nn.Module, bucket_bytes: int, dtype: torch.dtype | None = None,
                   adapted_only: bool = False):
    """The model's weights as buckets of (HF name, local tensor or DTensor): whole weight_groups, at most
    bucket_bytes in all in dtype (a group larger than bucket_bytes comes alone, whole). adapted_only: the groups
    that hold a LoRA-adapted weight only (the rest is frozen). No communication."""
    buckets, size = [[]], 0
    for group in weight_groups(model):
        if adapted_only and not any(isinstance(t, Merged) for _, t in group):
            continue
        # the full size: DTensor.numel() is global
        nbytes = sum(t.numel() * cast_dtype(t, dtype).itemsize for _, t in group)
        if buckets[-1] and size + nbytes > bucket_bytes:
            buckets.append([])
            size = 0
        buckets[-1] += group
        size += nbytes
    return [b for b in buckets if b]


def full_weights(model: torch.nn.Module, bucket_bytes: int, dtype: torch.dtype | None = None,
                 adapted_only: bool = False, layout: "EngineLayout | None" = None):
    """Yield lists of (HF name, full tensor in dtype): weight_buckets, each gathered when it is yielded. Collective:
    every rank iterates, every rank gets the full tensors. This generator keeps no reference to a bucket, so once
    the caller drops it no second full copy of the model exists. layout: the tensor-parallel weights come as this
    rank's engine Block instead (engine_block: HybridFlow's zero-redundancy resharding)."""
    for bucket in weight_buckets(model, bucket_bytes, dtype, adapted_only):
        yield [(n, full_tensor(t, dtype) if layout is None else engine_block(t, dtype, layout)) for n, t in bucket]


def _gather_dp(tensor: DTensor, rows: int) -> torch.Tensor:
    """This rank's tensor-parallel slice of a weight (rows along dim 0), whole: FSDP2's dim-0 shards of it gathered
    over "dp" (the shards follow torch.chunk: ceil(rows / dp) rows each, the last ones shorter or empty).
    DTensor's own redistribute of FSDP2's _StridedShard placement put the rows out of order (torch 2.13)."""
    group, local = tensor.device_mesh.get_group("dp"), tensor.to_local()
    dp = tdist.get_world_size(group)
    chunk = math.ceil(rows / dp)
    sizes = [max(0, min(chunk, rows - d * chunk)) for d in range(dp)]
    padded = torch.zeros((chunk, *local.shape[1:]), dtype=local.dtype, device=local.device)
    padded[: local.shape[0]] = local
    parts = [torch.empty_like(padded) for _ in range(dp)]
    tdist.all_gather(parts, padded, group=group)
    return torch.cat([part[:size] for part, size in zip(parts, sizes)])


@dataclass
class EngineLayout:
    """What one rollout-engine rank holds of each tensor-parallel weight (the trainer's tp 2 or more): the engine's
    TP size, this rank's place in it, and the process group of the trainer tp ranks whose slices make its block
    (comm.tp_layout puts them on the ranks of this engine rank; None: the rank's own slice is the block)."""
    rollout_tp: int
    engine_rank: int
    group: object


@dataclass
class Block:
    """An engine rank's block of a weight: tensor [...], the part at start along dim of a weight of full_shape."""
    tensor: torch.Tensor
    dim: int
    start: int
    full_shape: tuple


def engine_layout(dist: Dist, rollout_tp: int) -> EngineLayout | None:
    """The slice sync's layout for an engine of rollout_tp ranks beside a trainer of dist.tp_size (which rollout_tp
    divides); None without training TP (every engine rank then takes full tensors). Collective (the groups)."""
    tp = dist.tp_size
    if tp == 1:
        return None
    g = tp // rollout_tp  # trainer slices in one engine block
    groups = [[base + j * rollout_tp + e for j in range(g)] for base in range(0, dist.world_size, tp)
              for e in range(rollout_tp)]
    group = tdist.new_subgroups_by_enumeration(groups, backend="gloo" if dist.device.type == "cpu" else None)[0] \
        if g > 1 else None
    return EngineLayout(rollout_tp, dist.rank % rollout_tp, group)


def engine_block(tensor: torch.Tensor, dtype: torch.dtype | None, layout: EngineLayout) -> torch.Tensor | Block:
    """This engine rank's part of a weight in dtype: a tensor-parallel weight gathered over "dp" (its trainer tp
    slice), then over the tp ranks in layout.group (the slices its block lacks), as a Block (the full tensor when
    the engine has one rank); any other weight whole (full_tensor: the engine splits the vocabulary itself).
    Collective: over "dp", and over layout.group."""
    tensor = tensor.detach().to(cast_dtype(tensor, dtype))
    names = getattr(getattr(tensor, "device_mesh", None), "mesh_dim_names", None) or ()
    if "tp" not in names or not tensor.placements[names.index("tp")].is_shard():
        return full_tensor(tensor, None)
    dim = tensor.placements[names.index("tp")].dim
    local = _gather_dp(tensor, rows=tensor.shape[0] // (tensor.device_mesh["tp"].size() if dim == 0 else 1))
    if layout.group is not None:
        parts = [torch.empty_like(local) for _ in range(tdist.get_world_size(layout.group))]
        tdist.all_gather(parts, local.contiguous(), group=layout.group)
        local = torch.cat(parts, dim)
    if layout.rollout_tp == 1:
        return local
    return Block(local, dim, layout.engine_rank * local.shape[dim], tuple(tensor.shape))


# ---- Checkpoints (DCP: sharded, resharding on load) and HF export ---------------------------------


TRAINED = StateDictOptions(ignore_frozen_params=True, strict=False)  # frozen weights: not in a checkpoint


def _state(model, optimizer) -> dict:
    """The DCP state of a model and its optimizer (None: the model only), keyed by parameter name (DTensor shards);
    with an optimizer, its trained parameters only (LoRA: the adapters, the base weights being the model folder's).
    get_state_dict creates AdamW's state (a zero-lr step) when none exists yet, so a load has a target to fill."""
    if optimizer is None:
        return {"model": get_model_state_dict(model)}
    model_state, optim_state = get_state_dict(model, optimizer, options=TRAINED)
    return {"model": model_state, "optim": optim_state}


def begin_checkpoint(ckpt_dir: str, step: int) -> str:
    """A fresh ckpt_dir/step_{step}.tmp/ for the parts of one checkpoint (clearing what a crashed save left there);
    returns it. One process calls it (rank 0, or the Ray driver), before the parts are written."""
    tmp = os.path.join(ckpt_dir, f"step_{step}.tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    os.makedirs(tmp)
    return tmp


MANIFEST = "manifest.json"  # the last file of a checkpoint: every other file's size and sha256


def _files(folder: str) -> list[str]:
    return sorted(os.path.relpath(os.path.join(root, name), folder) for root, _, names in os.walk(folder)
                  for name in names if name != MANIFEST)


def checkpoint_problem(folder: str) -> str | None:
    """Why a committed checkpoint cannot be read (its manifest missing, a file missing, truncated or changed), naming
    the file; None when every file is as it was written."""
    path = os.path.join(folder, MANIFEST)
    if not os.path.isfile(path):
        return f"{path} is missing (a checkpoint from before manifests, or a damaged one)"
    with open(path) as f:
        manifest = json.load(f)
    for name, (size, sha) in manifest.items():
        file = os.path.join(folder, name)
        if not os.path.isfile(file):
            return f"{file} is missing"
        if os.path.getsize(file) != size:
            return f"{file} has {os.path.getsize(file)} bytes, {size} were written"
        if sha256([file]) != sha:
            return f"{file} changed since it was written (sha256)"
    return None


def commit_checkpoint(ckpt_dir: str, step: int) -> str:
    """Write the manifest of step_{step}.tmp (each file's size and sha256) as its last file, rename it to
    step_{step} and point ckpt_dir/latest at it; returns the folder. A crash at any point leaves `latest` on the
    previous complete checkpoint. One process calls it, once every part is written."""
    tmp = os.path.join(ckpt_dir, f"step_{step}.tmp")
    manifest = {name: [os.path.getsize(os.path.join(tmp, name)), sha256([os.path.join(tmp, name)])]
                for name in _files(tmp)}
    write_atomic(os.path.join(tmp, MANIFEST), lambda out: Path(out).write_text(json.dumps(manifest, indent=1)))
    final = os.path.join(ckpt_dir, f"step_{step}")
    shutil.rmtree(final, ignore_errors=True)  # the same step saved again (a resumed run) replaces it
    os.replace(final + ".tmp", final)
    write_atomic(os.path.join(ckpt_dir, "latest"), lambda tmp: Path(tmp).write_text(os.path.basename(final)))
    return final


def prune_checkpoints(ckpt_dir: str, keep: int, protect: set[int]) -> list[int]:
    """Delete the committed step_N folders beyond the newest `keep`, except the steps in `protect` and the one
    `latest` names; returns the steps deleted. One process calls it, after commit_checkpoint."""
    latest = find_latest(ckpt_dir)
    steps = sorted((int(name[5:]) for name in os.listdir(ckpt_dir)
                    if name.startswith("step_") and name[5:].isdigit()), reverse=True)
    doomed = [s for s in steps[keep:] if s not in protect and os.path.join(ckpt_dir, f"step_{s}") != latest]
    for step in doomed:
        shutil.rmtree(os.path.join(ckpt_dir, f"step_{step}"))
    return doomed


def save_sharded(path: str, model, optimizer, extra: dict, dist: Dist) -> None:
    """One model's part of a checkpoint: DCP shards of {"model", "optim"} in the folder `path`, plus each rank's
    `extra` (extra_rank{r}.pt). Collective over the model's ranks."""
    os.makedirs(path, exist_ok=True)
    dcp.save(_state(model, optimizer), checkpoint_id=path)
    torch.save(extra, os.path.join(path, f"extra_rank{dist.rank}.pt"))
    barrier(dist)


def readable_checkpoint(ckpt_dir: str) -> tuple[str | None, list[str]]:
    """(the newest committed checkpoint whose files match its manifest, or None; why each newer one was passed
    over). Starts from the one `latest` names; none when there is no `latest` (a fresh run)."""
    latest = find_latest(ckpt_dir)
    if latest is None:
        return None, []
    newest = int(os.path.basename(latest)[5:])
    steps = sorted((int(name[5:]) for name in os.listdir(ckpt_dir) if name.startswith("step_") and name[5:].isdigit()
                    and int(name[5:]) <= newest), reverse=True)
    problems = []
    for step in steps:
        folder = os.path.join(ckpt_dir, f"step_{step}")
        problem = checkpoint_problem(folder)
        if problem is None:
            return folder, problems
        problems.append(problem)
    return None, problems


def find_latest(ckpt_dir: str) -> str | None:
    """The folder that ckpt_dir/latest names, or None when there is no `latest` (a fresh run). Only `latest`
    counts: a step_*.tmp folder left by a crashed save is never picked."""
    pointer = os.path.join(ckpt_dir, "latest")
    if not os.path.isfile(pointer):
        return None
    with open(pointer) as f:
        return os.path.join(ckpt_dir, f.read().strip())


def load_sharded(path: str, model, optimizer, dist: Dist) -> dict:
    """Load a folder that save_sharded wrote into model and optimizer (None: the model only); returns this rank's
    `extra` (rank 0's when this rank has no file: the world size changed). Works whatever world size saved it:
    DCP reads each rank's slice of every named tensor."""
    if not os.path.isdir(path):
        raise FileNotFoundError(f"no checkpoint at {path}")
    if not os.path.isfile(os.path.join(path, ".metadata")):
        raise RuntimeError(f"checkpoint {path} is incomplete or corrupt: it has no .metadata")
    state = _state(model, optimizer)
    try:
        dcp.load(state, checkpoint_id=path)
    except (Exception, dcp.CheckpointException) as e:  # DCP's own error is a BaseException; it collects every
        # rank's read errors, so all ranks raise together
        raise RuntimeError(f"cannot read checkpoint {path}: {e}") from e
    if optimizer is None:
        set_model_state_dict(model, state["model"])
    else:
        set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"],
                       options=TRAINED)
    own = os.path.join(path, f"extra_rank{dist.rank}.pt")
    # our own file; weights_only=False because extra may hold numpy RNG states
    return torch.load(own if os.path.isfile(own) else os.path.join(path, "extra_rank0.pt"), weights_only=False)


def export_hf(model, tokenizer, out_dir: str, dist: Dist, dtype: torch.dtype | None = None) -> None:
    """Gather the full weights to rank 0's CPU memory and save_pretrained them (and the tokenizer) to out_dir, in
    dtype (None: the masters'; the config.json says which). With LoRA: the merged weights under the plain model's
    names, and the adapter alone in out_dir/adapter (peft's layout). Collective (the gathers)."""
    adapters = {n: full_tensor(p, None).cpu() for n, p in model.named_parameters() if is_adapter(n)}
    state = ({name: full_tensor(t, None).cpu() for name, t in engine_weights(model)} if adapters
             else get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True)))
    if dist.is_main:
        tmp = out_dir.rstrip("/") + ".tmp"
        shutil.rmtree(tmp, ignore_errors=True)
        if dtype is not None:
            state = {k: v.to(cast_dtype(v, dtype)) for k, v in state.items()}
        model.save_pretrained(tmp, state_dict=state)
        if dtype is not None:  # save_pretrained writes the parameters' dtype (the masters') into config.json
            config = json.loads(Path(tmp, "config.json").read_text())
            Path(tmp, "config.json").write_text(json.dumps({**config, "dtype": str(dtype).split(".")[-1]}, indent=2))
        if adapters:
            export_adapter(model, adapters, os.path.join(tmp, "adapter"))
        if tokenizer is not None:
            tokenizer.save_pretrained(tmp)
        shutil.rmtree(out_dir, ignore_errors=True)
        os.replace(tmp, out_dir)
    barrier(dist)
