"""batching.py: packed == padded, the same gradient under dynamic micro-batches, budgets, balance, 2 ranks.

    OMP_NUM_THREADS=1 python -m pytest tests/test_batching.py -q
"""

import os
import subprocess
import sys
from typing import get_args

import pytest
import torch
from dist_batching import UPDATES, capture_gradients, config, global_batch, with_rl_fields
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward

import workers
from batching import karmarkar_karp, micro_batches, packing_works, pad, split_by_tokens
from comm import init_distributed
from core_algos import AggMode
from workers import ActorWorker, pad_batch, response_log_probs
from sft import SFTConfig
from tiny import build_tiny_qwen2

MODES = list(get_args(AggMode))
TINY = SFTConfig(hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2, intermediate_size=64)
WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "dist_batching.py")


@pytest.fixture(scope="module")
def model_path(tmp_path_factory, byte_tokenizer):
    path = tmp_path_factory.mktemp("policy")
    build_tiny_qwen2(byte_tokenizer, TINY).save_pretrained(path)
    byte_tokenizer.save_pretrained(path)
    return str(path)


def ragged_batch(vocab_size: int, pad_id: int, seed: int = 0):
    """Sequences of very different lengths (prompts 1-20 tokens, responses 0-40), as pad_batch lays them out."""
    g = torch.Generator().manual_seed(seed)
    prompt_lens, response_lens = [1, 20, 3, 9, 14, 2], [40, 1, 12, 0, 33, 7]
    prompts = [torch.randint(0, vocab_size, (n,), generator=g).tolist() for n in prompt_lens]
    responses = [torch.randint(0, vocab_size, (n,), generator=g).tolist() for n in response_lens]
    return pad_batch(prompts, responses, [[0.0] * len(r) for r in responses], pad_id)


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_packed_log_probs_equal_padded(byte_tokenizer, attn):
    model = build_tiny_qwen2(byte_tokenizer, TINY)
    model.config._attn_implementation = attn
    batch = ragged_batch(model.config.vocab_size, byte_tokenizer.pad_token_id)
    mask = batch["response_mask"].bool()
    padded = response_log_probs(model, batch, 0.7, with_entropy=True)
    packed = response_log_probs(model, batch, 0.7, with_entropy=True, remove_padding=True)
    for a, b in zip(padded, packed):  # log-probs, entropies: [B, R]
        torch.testing.assert_close(b[mask], a[mask], atol=1e-5, rtol=0)


def plain_causal(module, query, key, value, attention_mask, **kwargs):
    """An attention kernel that ignores the mask: one causal mask over the whole row (packed sequences leak)."""
    return sdpa_attention_forward(module, query, key, value, None, **kwargs)


def test_packing_works_tells_leaking_attention_apart(byte_tokenizer):
    AttentionInterface.register("plain_causal", plain_causal)
    model = build_tiny_qwen2(byte_tokenizer, TINY)
    assert packing_works(model)  # sdpa: transformers builds the block-diagonal mask from position_ids
    model.config._attn_implementation = "plain_causal"
    assert not packing_works(model)


def test_remove_padding_falls_back_with_a_message(model_path, monkeypatch, capsys):
    monkeypatch.setattr(workers, "packing_works", lambda model: False)
    worker = ActorWorker(config(model_path, use_remove_padding=True), model_path, init_distributed())
    assert not worker.remove_padding and "running padded micro-batches instead" in capsys.readouterr().out


def rl_batch(worker: ActorWorker):
    """A ragged batch with fixed old/ref log-probs and advantages (3 groups of 2: any values will do here)."""
    batch = ragged_batch(worker.model.config.vocab_size, worker.tokenizer.pad_token_id, seed=1)
    return with_rl_fields(batch, torch.Generator().manual_seed(1))


@pytest.mark.parametrize("remove_padding", [False, True])
@pytest.mark.parametrize("mode", MODES)
def test_dynamic_micro_batches_give_the_whole_batch_gradient(model_path, mode, remove_padding):
    """Token-budget micro-batches (several, one sequence over the budget) against one whole-batch pass."""
    dist = init_distributed()
    results = []
    for overrides in (dict(ppo_micro_batch_size=6),
                      dict(use_dynamic_bsz=True, ppo_max_token_len_per_gpu=40, use_remove_padding=remove_padding)):
        worker = ActorWorker(config(model_path, loss_agg_mode=mode, rollout_n=2, train_batch_size=3,
                                    ppo_mini_batch_size=3, **overrides), model_path, dist)
        batch = rl_batch(worker)
        grads = capture_gradients(worker)
        results.append((worker.log_probs(batch), worker.update(batch), grads[0]))
    (logp_whole, m_whole, g_whole), (logp_dyn, m_dyn, g_dyn) = results
    # 41 and 47 tokens run alone (over the budget of 40), the four others (21, 15, 9, 9) two by two
    assert m_dyn["actor/num_micro_batches"] == 4 and m_whole["actor/num_micro_batches"] == 1
    assert m_dyn["actor/over_budget_seqs"] == 2
    mask = batch["response_mask"].bool()
    torch.testing.assert_close(logp_dyn[mask], logp_whole[mask], atol=1e-5, rtol=0)
    for name in g_whole:
        torch.testing.assert_close(g_dyn[name], g_whole[name], atol=1e-5, rtol=1e-4, msg=lambda m: f"{name}: {m}")
    for k in ("actor/pg_loss", "actor/entropy", "actor/kl_loss", "actor/pg_clipfrac", "actor/ppo_kl"):
        assert m_dyn[k] == pytest.approx(m_whole[k], rel=1e-4, abs=1e-6), k


def test_no_micro_batch_over_the_budget():
    """Property: over many random skewed batches and budgets, the micro-batches partition the batch, none holds
    more tokens than the budget unless it is a single (too long) sequence, and a demanded count is met."""
    g = torch.Generator().manual_seed(0)
    dist = init_distributed()
    for trial in range(300):
        B = int(torch.randint(1, 80, (1,), generator=g))
        lengths = (torch.empty(B).log_normal_(4.0, 1.0, generator=g).long() + 1).clamp(max=4000)  # [B]
        budget = int(torch.randint(50, 1500, (1,), generator=g))
        parts = micro_batches(lengths, budget, dist)
        assert sorted(i for p in parts for i in p) == list(range(B)), trial
        for p in parts:
            assert len(p) == 1 or lengths[p].sum() <= budget, (trial, lengths[p].tolist(), budget)
        demanded = int(torch.randint(1, B + 1, (1,), generator=g))
        assert len(split_by_tokens(lengths.tolist(), budget, min_count=demanded)) >= demanded


def spread(workloads: torch.Tensor, parts) -> float:
    sums = [workloads[p].sum().item() for p in parts]
    return max(sums) - min(sums)


def test_karmarkar_karp_beats_the_contiguous_split():
    """On skewed (lognormal) lengths, KK's equal-count partition is never more uneven than contiguous chunks."""
    g = torch.Generator().manual_seed(0)
    for trial in range(300):
        k = int(torch.randint(2, 9, (1,), generator=g))
        per = int(torch.randint(1, 33, (1,), generator=g))
        lengths = torch.empty(k * per).log_normal_(5.0, 1.2, generator=g).round() + 1  # [k * per]
        parts = karmarkar_karp(lengths.tolist(), k, equal_size=True)
        assert sorted(i for p in parts for i in p) == list(range(k * per)) and {len(p) for p in parts} == {per}
        contiguous = [list(range(r * per, (r + 1) * per)) for r in range(k)]
        assert spread(lengths, parts) <= spread(lengths, contiguous), trial


def test_two_ranks(model_path, tmp_path):
    """2 ranks (gloo): rank 0 holds the long sequences, so it needs more micro-batches than rank 1; both run the
    same number, and the dynamic packed update, the fixed split (in the token-mean, token-sum and seq-mean-token-mean
    modes, and with gradient checkpointing) and one process on the whole batch give the same gradient, FSDP2
    reduce-scattering it once per mini-batch. Balancing moves whole groups, keeps every row once, and evens out the tokens."""
    env = dict(os.environ, OMP_NUM_THREADS="1")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", "--rdzv-backend=c10d",
           "--rdzv-endpoint=localhost:0", WORKER, model_path, str(tmp_path)]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    ranks = [torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in (0, 1)]

    one_process = {}  # loss_agg_mode: (log-probs, gradient) of one process on the whole batch
    for mode in ("token-mean", "token-sum", "seq-mean-token-mean"):
        worker = ActorWorker(config(model_path, ppo_micro_batch_size=8, loss_agg_mode=mode), model_path,
                             init_distributed())
        batch = global_batch(worker.model.config.vocab_size, worker.tokenizer.pad_token_id)
        logp = worker.log_probs(batch)
        grads = capture_gradients(worker)
        worker.update(batch)
        one_process[mode] = logp, grads[0]

    assert ranks[0]["own_count"] > ranks[1]["own_count"]
    counts = [r["dynamic_metrics"]["actor/num_micro_batches"] for r in ranks]
    assert counts[0] == counts[1] == ranks[0]["own_count"]
    mask = batch["response_mask"].bool()
    for name, overrides in UPDATES.items():
        logp, grads = one_process[overrides.get("loss_agg_mode", "token-mean")]
        torch.testing.assert_close(torch.cat([r[f"{name}_log_probs"] for r in ranks])[mask], logp[mask], atol=1e-5,
                                   rtol=0)
        for key in grads:
            for r in ranks:
                torch.testing.assert_close(r[f"{name}_grads"][key], grads[key], atol=1e-5, rtol=1e-4,
                                           msg=lambda m: f"{name} {key}: {m}")
        # the micro-batches' gradients summed locally: one reduce-scatter per FSDP2 group and mini-batch
        assert ranks[0][f"{name}_metrics"]["actor/num_micro_batches"] > 1
        assert [r[f"{name}_reduce_scatters"] for r in ranks] == [ranks[0]["fsdp_groups"]] * 2, name

    rows = [r["balanced_rows"] for r in ranks]
    assert sorted(torch.cat(rows).tolist()) == list(range(8)) and len(rows[0]) == len(rows[1])
    assert all(r["balanced_intact"] for r in ranks) and all(r.equal(r.sort().values) for r in rows)
    for r in rows:  # whole groups of 2 consecutive rows
        assert (r.view(-1, 2)[:, 1] - r.view(-1, 2)[:, 0] == 1).all() and (r.view(-1, 2)[:, 0] % 2 == 0).all()
    m = ranks[0]["balance_metrics"]
    tokens = [r["balanced_tokens"] for r in ranks]
    assert m["global_seqlen/balanced_minmax_diff"] == max(tokens) - min(tokens)
    # balance_by flops: whole groups again, and the ranks' FLOPs closer than in the split they started from
    rows = [r["flops_rows"] for r in ranks]
    assert sorted(torch.cat(rows).tolist()) == list(range(8)) and len(rows[0]) == len(rows[1])
    before, after = [r["flops_before"] for r in ranks], [r["flops_after"] for r in ranks]
    assert abs(after[0] - after[1]) < 0.5 * abs(before[0] - before[1]), (before, after)
    assert m["global_seqlen/balanced_minmax_diff"] < m["global_seqlen/minmax_diff"]


def test_pad_fills_from_the_lengths():
    """The one padding function: right or left, to the longest row or a given width, its mask from the lengths
    (a pad id that is also a real token stays real)."""
    ids, mask = pad([[5, 0], [7], []], 0)
    assert ids.tolist() == [[5, 0], [7, 0], [0, 0]] and mask.tolist() == [[1, 1], [1, 0], [0, 0]]
    ids, mask = pad([[5, 0], [7]], 9, width=3, left=True)
    assert ids.tolist() == [[9, 5, 0], [9, 9, 7]] and mask.tolist() == [[0, 1, 1], [0, 0, 1]]
    values, _ = pad([[0.5], []], 0.0)
    assert values.dtype == torch.float32 and values.tolist() == [[0.5], [0.0]]
    assert pad([[], []], 0)[0].shape == (2, 0)
