"""The hybrid engine on 2 torchrun ranks (gloo, one vLLM engine per rank), tiny Qwen2s with tied and untied
embeddings in fp32, and the tied one in bf16:

    OMP_NUM_THREADS=1 python -m pytest tests/test_hybrid_engine.py -q

One torchrun launch (tests/dist_hybrid.py) serves every test here. Every sync in it runs with verify_sync, which
raises when a checksum differs or the probe's log-probs differ by more than 1e-4 (bf16: BF16_TOL): the worker
finishing proves that they matched.
"""

import os
import subprocess
import sys

import pytest
import torch
from dist_hybrid import BF16_TOL, CORRUPT, STEPS
from transformers import Qwen2ForCausalLM

import hybrid_engine
import perf
from conftest import TINY
from tiny import build_byte_tokenizer, build_tiny_qwen2
from sharding import weight_groups

WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "dist_hybrid.py")


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    root = tmp_path_factory.mktemp("hybrid")
    tokenizer = build_byte_tokenizer()
    tied = build_tiny_qwen2(tokenizer, TINY)
    config = build_tiny_qwen2(tokenizer, TINY).config  # a copy: the tied model keeps its own
    config.tie_word_embeddings = False
    torch.manual_seed(1)
    untied = Qwen2ForCausalLM(config)
    for name, model in (("tied", tied), ("untied", untied)):
        model.save_pretrained(root / name)
        tokenizer.save_pretrained(root / name)
    env = dict(os.environ, OMP_NUM_THREADS="1")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", "--rdzv-backend=c10d",
           "--rdzv-endpoint=localhost:0", WORKER, str(root / "tied"), str(root / "untied"), str(root)]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=400)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    ranks = [torch.load(root / f"rank{r}.pt", weights_only=False) for r in (0, 1)]
    return dict(ranks=ranks, models={"tied": tied, "untied": untied})


def model_bytes(model, itemsize: int) -> int:
    return sum(p.numel() * itemsize for p in model.parameters())  # a tied weight counts once


@pytest.mark.parametrize("kind", ["tied", "untied", "bf16"])
def test_verified_syncs_after_training(run, kind):
    model, itemsize, tol = (run["models"]["tied"], 2, BF16_TOL) if kind == "bf16" else (run["models"][kind], 4, 1e-4)
    for rank in run["ranks"]:
        res = rank[kind]
        assert len(res["syncs"]) == STEPS
        for metrics in res["syncs"]:
            assert metrics["reshard/probe_logprob_diff_max"] <= tol
            assert metrics["reshard/bytes"] == model_bytes(model, itemsize)  # bf16 moves half the bytes
            assert metrics["reshard/buckets"] == len(weight_groups(model))  # by default one layer a bucket
            # the peak holds at least the engine's full copy, and the extra is part of it
            assert metrics["perf/max_memory_gb/reshard"] * perf.GB >= model_bytes(model, itemsize)
            assert 0 <= metrics["reshard/max_memory_extra_gb"] < metrics["perf/max_memory_gb/reshard"]
        # the training moved the weights and the engine followed
        moved = (torch.tensor(res["probe_after"]) - torch.tensor(res["probe_before"])).abs().max()
        assert moved > 1e-2


def test_corrupted_bucket_is_named(run):
    r0, r1 = run["ranks"]  # rank 1 corrupted its bucket
    assert CORRUPT in r1["checksum_error"] and "model.layers.0" not in r1["checksum_error"]  # only it is named
    assert "differ from the trainer's: on another rank" in r0["checksum_error"]  # and rank 0 does not hang


def test_probe_catches_corruption_inside_the_engine(run):
    for rank in run["ranks"]:  # rank 0's engine got a corrupted tensor after the checksums
        assert "probe log-probs differ" in rank["probe_error"]
        assert rank["clean_again"]["reshard/probe_logprob_diff_max"] <= 1e-4


def test_bucket_sizes_deliver_the_same_weights(run):
    full = dict(run["models"]["tied"].named_parameters())
    for rank in run["ranks"]:
        small, big = rank["tied"][1], rank["tied"][10 << 30]
        assert len(big["buckets"]) == big["metrics"]["reshard/buckets"] == 1
        # 1 byte: every bucket is one decoder layer or one other tensor, each tensor whole
        layers = [{name.split(".")[2] for name, _ in b} for b in small["buckets"] if b[0][0].startswith("model.layers.")]
        assert layers == [{"0"}, {"1"}]
        assert len(small["buckets"]) == small["metrics"]["reshard/buckets"] == 4  # embed, 2 layers, norm
        delivered = {name: t for b in small["buckets"] for name, t in b}
        assert {n: t.shape for n, t in delivered.items()} == {n: p.shape for n, p in full.items()}
        assert [n for b in small["buckets"] for n, _ in b] == [n for n, _ in big["buckets"][0]]
        for name, tensor in big["buckets"][0]:
            assert torch.equal(delivered[name], tensor), name
        for metrics in (small["metrics"], big["metrics"]):  # and the engine computes with them
            assert metrics["reshard/probe_logprob_diff_max"] <= 1e-4


def test_checksums_add_over_shards_and_see_one_changed_byte():
    x = torch.randn(7, 5)  # [7, 5]
    full = hybrid_engine.checksum(x.reshape(-1), 0)
    parts = [hybrid_engine.checksum(x[rows].reshape(-1), rows.start * 5) for rows in (slice(0, 4), slice(4, 7))]
    assert (parts[0] + parts[1]).item() == full.item()
    y = x.clone()
    y.view(-1).view(torch.uint8)[13] ^= 1  # one bit of one byte
    assert hybrid_engine.checksum(y.reshape(-1), 0).item() != full.item()
    swapped = x[[1, 0, 2, 3, 4, 5, 6]]  # the same values in another order
    assert hybrid_engine.checksum(swapped.reshape(-1), 0).item() != full.item()


def test_peak_memory_sees_a_freed_allocation():
    """The reshard memory metrics' probe: a 256 MB tensor touched and freed between reset and read shows in the
    peak (VmHWM), though the memory in use afterwards is back to where it was."""
    device = torch.device("cpu")
    at_entry = perf.reset_peak_memory(device)
    block = torch.ones(64 << 20)  # 256 MB of fp32, written: resident
    del block
    assert perf.peak_memory(device) - at_entry >= 250 << 20
    perf.reset_peak_memory(device)  # a new high-water mark forgets it
    assert perf.peak_memory(device) < at_entry + (250 << 20)
