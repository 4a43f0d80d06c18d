"""Dynamic batching: balanced DP ranks, token-budget micro-batches, padding, remove-padding (packing) and back.

    OMP_NUM_THREADS=1 python -m pytest tests/test_batching.py -q     # packed == padded, gradients, budgets, balance
    OMP_NUM_THREADS=1 python bench/batching.py                       # padding and update time: fixed vs dynamic
    python grpo.py --use-dynamic-bsz --use-remove-padding --ppo-max-token-len-per-gpu 4096

This file splits, packs, unpacks and balances; it knows nothing about RL. The API (every function that takes
`dist` is a collective: call it on every dp rank, in the same order):

    subsets = karmarkar_karp(workloads, k, equal_size=True)    # k lists of indices with similar workload sums
    batch, metrics = balance_ranks(batch, seqlens, workloads, dist, unit=n)   # rows re-dealt across dp ranks
    batch, metrics = balance_whole(batch, seqlens, workloads, k, unit=n)      # the same, one process holding all
    micro_rows = micro_batches(seqlens, max_tokens, dist)       # index lists <= max_tokens, as many on every rank
    ids, mask = pad(token_lists, pad_id, left=True)             # [B, T] each: the one way a batch is padded
    lengths = response_lengths(batch)                           # [B]: from the attention, a tool's tokens included
    packed = pack(input_ids, attention_mask)                    # [b, T] -> one row [1, N], position_ids restart
    keep = (packed.flat_index[:, -R - 1 : -1] >= 0) & response_mask  # [b, R]: positions that predict response tokens
    values = unpack(per_token[packed.flat_index[keep]], keep)        # [N, ...] -> [b, R, ...], 0 at padding
    packing_works(model)                                        # does the attention keep packed sequences apart?

A sequence's tokens are its real (unpadded) tokens: the budget counts what a packed micro-batch computes.
"""

import bisect
import heapq
import math
from dataclasses import dataclass

import torch
import torch.distributed as tdist
from tensordict import TensorDict

from comm import Dist, all_max

# ---- Partitioning: Karmarkar-Karp and workloads ---------------------------------------------------


def karmarkar_karp(workloads: list[float], k: int, equal_size: bool) -> list[list[int]]:
    """Indices of workloads in k subsets whose sums are close (equal_size: every subset gets len/k items).
    Karmarkar & Karp 1982, "largest differencing method", k-way form (as in verl's get_seqlen_balanced_partitions):
    every state is k subsets; repeatedly take the two states with the largest spread (max sum - min sum) and merge
    them, the heaviest part of one with the lightest of the other, so their differences cancel."""
    if equal_size and len(workloads) % k:
        raise ValueError(f"{len(workloads)} items cannot go to {k} subsets of equal size")
    order = sorted(range(len(workloads)), key=lambda i: workloads[i])
    # equal size: states of k consecutive items (in sorted order), one per part; merges keep the counts equal.
    # otherwise: one state per item, the item in one part and k - 1 empty subsets.
    seeds = [order[i : i + k] for i in range(0, len(order), k)] if equal_size else [[i] for i in order]

    def state(tie: int, subsets: list) -> tuple:  # subsets sorted heaviest first; heapq is a min-heap: negated spread
        subsets = sorted(subsets, key=lambda p: -p[0])
        return -(subsets[0][0] - subsets[-1][0]), tie, subsets

    heap = [state(tie, [(workloads[i], [i]) for i in items] + [(0.0, []) for _ in range(k - len(items))])
            for tie, items in enumerate(seeds)]
    heapq.heapify(heap)
    tie = len(heap)
    while len(heap) > 1:
        (_, _, a), (_, _, b) = heapq.heappop(heap), heapq.heappop(heap)
        # a is sorted heaviest first, b lightest first (reversed): pair them up
        heapq.heappush(heap, state(tie, [(wa + wb, ia + ib) for (wa, ia), (wb, ib) in zip(a, reversed(b))]))
        tie += 1
    subsets = [items for _, items in heap[0][2]] if heap else [[] for _ in range(k)]
    return [sorted(p) for p in _swap_pass(workloads, subsets)]


def _swap_pass(workloads: list[float], subsets: list[list[int]]) -> list[list[int]]:
    """Local search after KK: the heaviest and the lightest part trade one item each while that narrows their gap. The
    equal-size KK above can leave one very long sequence's part too heavy (its seeds pair items of similar size); a swap
    of items h > l moves h - l, and any 0 < h - l < gap lowers the sum of squared part sums, so the pass ends. It keeps
    every part's count."""
    while True:
        sums = [sum(workloads[i] for i in p) for p in subsets]
        hi, lo = max(range(len(subsets)), key=sums.__getitem__), min(range(len(subsets)), key=sums.__getitem__)
        gap = sums[hi] - sums[lo]
        # the best pair moves half the gap: for each h, the l nearest to h - gap / 2 (bisect on sorted l)
        light = sorted(subsets[lo], key=workloads.__getitem__)
        light_w = [workloads[i] for i in light]
        best = None
        for h in subsets[hi]:
            j = bisect.bisect_left(light_w, workloads[h] - gap / 2)
            for l in light[max(0, j - 1) : j + 1]:
                moved = workloads[h] - workloads[l]
                if 0 < moved < gap and (best is None or abs(moved - gap / 2) < abs(best[2] - gap / 2)):
                    best = (h, l, moved)
        if best is None:
            return subsets
        h, l, _ = best
        subsets[hi] = [i for i in subsets[hi] if i != h] + [l]
        subsets[lo] = [i for i in subsets[lo] if i != l] + [h]


def flops_workload(seqlens: torch.Tensor, hidden_size: int) -> torch.Tensor:
    """A sequence's forward FLOPs up to a constant factor, from its length [B] -> [B]. A dense decoder layer spends
    ~24 h^2 FLOPs per token in its matmuls (12 h^2 parameters, 2 FLOPs each, Kaplan et al. 2020) and ~2 h L per token
    in causal attention (QK^T and AV over L/2 keys on average): per sequence 24 h^2 L + 2 h L^2, i.e. proportional to
    L (12 h + L)."""
    L = seqlens.double()
    return L * (12 * hidden_size + L)


# ---- Balanced DP ranks ----------------------------------------------------------------------------


def _all_gather(t: torch.Tensor, dist: Dist) -> torch.Tensor:
    """Every dp rank's t (the same shape on every rank), stacked along dim 0 in rank order; sent from dist.device
    (NCCL moves only GPU tensors) and returned where t was."""
    out = [torch.empty_like(t, device=dist.device) for _ in range(dist.dp_size)]
    tdist.all_gather(out, t.to(dist.device).contiguous(), group=dist.mesh["dp"].get_group())
    return torch.cat(out).to(t.device)


def _spread(prefix: str, sums: list[float]) -> dict:
    return {f"global_seqlen/{prefix}min": min(sums), f"global_seqlen/{prefix}max": max(sums),
            f"global_seqlen/{prefix}minmax_diff": max(sums) - min(sums)}


def balanced_units(workloads: torch.Tensor, seqlens: torch.Tensor, unit: int, k: int,
                   gather=lambda t: t) -> tuple[list[list[int]], dict]:
    """Units (`unit` consecutive rows that move together) of the whole batch, rank-major, dealt to k ranks by workload:
    (each rank's unit indices, sorted; verl's global_seqlen metrics of the contiguous split and of the balanced one).
    gather: this process's per-unit sums -> the whole batch's, rank-major (the identity: it holds the whole batch)."""
    unit_work, unit_len = (gather(x.double().view(-1, unit).sum(-1)) for x in (workloads, seqlens))  # [all units]
    rank_units = karmarkar_karp(unit_work.tolist(), k, equal_size=True)
    before = unit_len.view(k, -1).sum(-1).tolist()  # the contiguous split: what each rank held
    after = [unit_len[p].sum().item() for p in rank_units]
    return rank_units, {**_spread("", before), **_spread("balanced_", after)}


def _unit_rows(units: list[int], unit: int) -> torch.Tensor:
    return (torch.tensor(units, dtype=torch.long)[:, None] * unit + torch.arange(unit)).flatten()  # [units * unit]


def balance_ranks(batch: TensorDict, seqlens: torch.Tensor, workloads: torch.Tensor, dist: Dist,
                  unit: int = 1) -> tuple[TensorDict, dict]:
    """Re-deal the rows of all dp ranks so that every rank gets the same number of rows and similar work. batch holds
    this rank's rows (the same shapes on every rank); seqlens [B] and workloads [B] are per row. Rows move in units of
    `unit` consecutive rows (e.g. a prompt's n samples stay together and in order). Returns this rank's new rows, in
    their global order, and the global_seqlen metrics (tokens per rank). Collectives: two all-gathers of the units'
    sums, then _exchange (each row goes only to the rank that takes it). One process: the batch as it is."""
    B = batch.batch_size[0]
    if B % unit:
        raise ValueError(f"{B} rows do not split into units of {unit}")
    if dist.mesh is None:
        total = seqlens.sum().item()
        return batch, {**_spread("", [total]), **_spread("balanced_", [total])}
    ranks_units, metrics = balanced_units(workloads, seqlens, unit, dist.dp_size, lambda t: _all_gather(t, dist))
    mine = range(dist.dp_rank * (B // unit), (dist.dp_rank + 1) * (B // unit))  # my units' global indices
    outgoing = [[u - mine.start for u in units if u in mine] for units in ranks_units]  # my units, per destination
    receives = [sum(u // (B // unit) == src for u in ranks_units[dist.dp_rank]) * unit for src in range(dist.dp_size)]
    rows = _unit_rows(sum(outgoing, []), unit)  # [B]
    return _exchange(batch, rows, [len(units) * unit for units in outgoing], receives, dist), metrics


def _exchange(batch: TensorDict, rows: torch.Tensor, sends: list[int], receives: list[int], dist: Dist) -> TensorDict:
    """batch[rows] sent out in rank order (sends[r] rows to rank r) and receives[r] rows taken from each rank r, in
    rank order: one all_to_all_single per dtype, each key's values flattened into columns of one [rows, D] tensor."""
    out = {}
    for dtype in dict.fromkeys(batch[k].dtype for k in batch.keys()):
        keys = sorted(k for k in batch.keys() if batch[k].dtype == dtype)
        send = torch.cat([batch[k][rows].reshape(len(rows), -1) for k in keys], 1)  # [rows, D]
        got = send.new_empty(sum(receives), send.shape[1], device=dist.device)  # [received rows, D]
        tdist.all_to_all_single(got, send.to(dist.device).contiguous(), receives, sends,
                                group=dist.mesh["dp"].get_group())
        got, start = got.to(send.device), 0
        for k in keys:
            shape = batch[k].shape[1:]
            out[k] = got[:, start : start + shape.numel()].reshape(-1, *shape)
            start += shape.numel()
    return TensorDict(out, batch_size=[sum(receives)])


def balance_whole(batch: TensorDict, seqlens: torch.Tensor, workloads: torch.Tensor, k: int,
                  unit: int = 1) -> tuple[TensorDict, dict]:
    """balance_ranks for a process that holds the whole batch (a single controller): the rows reordered so that
    its contiguous split into k equal chunks gives each of k ranks what balance_ranks would give it."""
    rank_units, metrics = balanced_units(workloads, seqlens, unit, k)
    return batch[torch.cat([_unit_rows(units, unit) for units in rank_units])], metrics


# ---- Token-budget micro-batches -------------------------------------------------------------------


def split_by_tokens(seqlens: list[int], max_tokens: int, min_count: int = 1) -> list[list[int]]:
    """Index lists (at least min_count of them) whose token sums stay within max_tokens. A sequence longer than
    max_tokens gets a micro-batch of its own. Karmarkar-Karp into k micro_rows, k from the fewest that could hold the
    tokens upwards, until every part fits: balanced micro_rows, so the dp ranks that run micro-batch i at the same time
    (FSDP's collectives) wait little for each other."""
    if not 1 <= min_count <= max(1, len(seqlens)):
        raise ValueError(f"min_count={min_count} micro-batches for {len(seqlens)} sequences")
    k = max(min_count, math.ceil(sum(seqlens) / max_tokens))
    while True:
        # with k >= len(seqlens) every part holds one sequence, so this ends
        micro_rows = [p for p in karmarkar_karp(seqlens, min(k, len(seqlens)), equal_size=False) if p]
        if all(len(p) == 1 or sum(seqlens[i] for i in p) <= max_tokens for p in micro_rows):
            return micro_rows
        k += 1


def micro_batches(seqlens: torch.Tensor, max_tokens: int, dist: Dist) -> list[list[int]]:
    """Index lists of seqlens [B] within max_tokens each (a longer sequence alone), as many on every dp rank (FSDP's
    all-gathers run once per forward, on every rank): the ranks agree on the largest count, a rank below it splits
    further."""
    lengths = seqlens.tolist()
    micro_rows = split_by_tokens(lengths, max_tokens)
    while True:
        most, fewest = all_max([len(micro_rows), -len(micro_rows)], dist)
        if -fewest == most:
            return micro_rows
        micro_rows = split_by_tokens(lengths, max_tokens, min_count=int(most))


# ---- Padding, and removing it: packing and unpacking ----------------------------------------------


def pad(rows: list[list], value, width: int | None = None, left: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows of different lengths as one tensor [B, T] (T: width, else the longest row), filled with value on the right
    (left: on the left, as prompts are for generation), and the mask [B, T] of the real entries, made from the
    lengths (a pad id may also be a real token, e.g. EOS)."""
    T = max(map(len, rows), default=0) if width is None else width
    fill = [T - len(r) for r in rows]
    values = torch.tensor([[value] * f + list(r) if left else list(r) + [value] * f for r, f in zip(rows, fill)])
    mask = torch.tensor([[0] * f + [1] * len(r) if left else [1] * len(r) + [0] * f for r, f in zip(rows, fill)])
    return values.view(len(rows), T), mask.view(len(rows), T)  # [B, T] each (also when T is 0)


def response_lengths(batch: TensorDict) -> torch.Tensor:
    """Each response's length in tokens [B], a tool's included (response_mask counts the model's only)."""
    return batch["attention_mask"][:, -batch["responses"].shape[1] :].sum(-1)


@dataclass
class Packed:
    input_ids: torch.Tensor
    """[1, N]: the real tokens of every sequence, one sequence after the other."""
    position_ids: torch.Tensor
    """[1, N]: 0, 1, ... restarting at each sequence (how transformers tells the sequences apart)."""
    flat_index: torch.Tensor
    """[b, T]: the packed position of each padded-layout token, -1 at padding."""


def pack(input_ids: torch.Tensor, attention_mask: torch.Tensor) -> Packed:
    """Drop the padding of a [b, T] batch: one row of N = attention_mask.sum() tokens."""
    keep = attention_mask.bool()  # [b, T]
    flat_index = torch.full_like(input_ids, -1)  # [b, T]
    flat_index[keep] = torch.arange(int(keep.sum()), device=input_ids.device)
    position_ids = (attention_mask.cumsum(1) - 1)[keep]  # [N]: a sequence's real tokens count from 0
    return Packed(input_ids[keep][None], position_ids[None], flat_index)


def unpack(x: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
    """Per-token outputs [n, ...] of the positions where keep [b, t] is True back to a padded [b, t, ...] (0 elsewhere).
    The caller picks the packed rows first (x = out[packed.flat_index[keep]], as in the module docstring), so V-wide
    logits are computed for the kept positions only."""
    out = x.new_zeros(*keep.shape, *x.shape[1:])  # [b, t, ...]
    out[keep] = x
    return out


@torch.no_grad()
def packing_works(model) -> bool:
    """True when the model's attention keeps packed sequences apart (a block-diagonal causal mask). transformers 5.x
    builds that mask from position_ids that restart (masking_utils.find_packed_sequence_indices, for sdpa, eager and
    flex; flash-attention varlen reads cu_seqlens from them) but only with attention_mask=None and no KV cache; a custom
    attention function may ignore it. Found out, not assumed: a packed row [a, b] and one [a', b] must give the second
    sequence the very same logits."""
    g = torch.Generator().manual_seed(0)
    device = next(model.parameters()).device
    a, a2 = torch.randint(0, model.config.vocab_size, (2, 7), generator=g)
    b = torch.randint(0, model.config.vocab_size, (5,), generator=g)
    position_ids = torch.cat([torch.arange(7), torch.arange(5)])[None].to(device)  # [1, 12]
    logits = [model(input_ids=torch.cat([first, b])[None].to(device), position_ids=position_ids,
                    use_cache=False).logits[0, 7:].float() for first in (a, a2)]  # [5, V] each
    return (logits[0] - logits[1]).abs().max().item() <= 1e-4 * logits[0].abs().max().clamp(min=1).item()
