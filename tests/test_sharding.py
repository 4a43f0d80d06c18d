"""FSDP2 over 2 torchrun ranks (gloo) against a plain single process: training, buffers, resharding resume,
full-weight buckets, checkpoint safety, metric reduction.

    OMP_NUM_THREADS=1 python -m pytest tests/test_sharding.py -q

One torchrun launch (tests/dist_fsdp.py, ~30-40 s on 2 busy cores) serves every 2-rank test; the single-process
reference runs in this process through the same functions (no process group: sharding.py's plain path).
"""

import os
import subprocess
import sys

import pytest
import torch
from dist_fsdp import MAX_NORM, full_optim, full_params, make_batch, make_optimizer, train_step
from transformers import AutoModelForCausalLM

import sharding
from comm import Max, Min, Sum, init_distributed
from conftest import TINY
from tiny import build_byte_tokenizer, build_tiny_qwen2

WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "dist_fsdp.py")


def assert_close_dicts(a: dict, b: dict, atol: float):
    assert a.keys() == b.keys()
    for k in a:
        torch.testing.assert_close(a[k], b[k], atol=atol, rtol=0, msg=lambda m: f"{k}: {m}")


def assert_optim_equal(a: dict, b: dict):
    assert a["state"].keys() == b["state"].keys() and a["state"]
    for name in a["state"]:
        assert_close_dicts(a["state"][name], b["state"][name], atol=0)
    assert [g["lr"] for g in a["param_groups"]] == [g["lr"] for g in b["param_groups"]]


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """The reference run here (saving a 1-process checkpoint after step 2), then one 2-rank torchrun."""
    root = tmp_path_factory.mktemp("sharding")
    model_dir, out_dir = str(root / "model"), str(root / "out")
    tokenizer = build_byte_tokenizer()
    build_tiny_qwen2(tokenizer, TINY).save_pretrained(model_dir)
    tokenizer.save_pretrained(model_dir)
    dist = init_distributed()  # no torchrun env here: one process, no group
    assert dist.mesh is None
    batch = make_batch(len(tokenizer))

    ref = {"losses": [], "norms": []}
    model = sharding.load_sharded_model(model_dir, dist)
    ref["weights"] = full_params(model)
    optimizer = make_optimizer(model)
    for step in (1, 2, 3):
        loss, norm = train_step(model, optimizer, batch, dist)
        ref["losses"].append(loss)
        ref["norms"].append(norm)
        if step == 2:
            sharding.save_sharded(str(root / "ckpt1"), model, optimizer, {"step": step, "rank": 0}, dist)
            ref["optim_2"] = full_optim(model, optimizer)
    ref["params_3"] = full_params(model)

    env = dict(os.environ, OMP_NUM_THREADS="1")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", "--rdzv-backend=c10d",
           "--rdzv-endpoint=localhost:0", WORKER, model_dir, str(root / "ckpt1"), out_dir]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    ranks = [torch.load(os.path.join(out_dir, f"rank{r}.pt"), weights_only=False) for r in (0, 1)]

    # 2 -> 1: the 2-rank checkpoint resumed in this process
    model = sharding.load_sharded_model(model_dir, dist)
    optimizer = make_optimizer(model)
    ref["2to1_extra"] = sharding.load_sharded(os.path.join(out_dir, "ckpt"), model, optimizer, dist)
    ref["2to1_optim"] = full_optim(model, optimizer)
    train_step(model, optimizer, batch, dist)
    ref["2to1_params"] = full_params(model)
    return dict(ref=ref, ranks=ranks, tokenizer=tokenizer, out_dir=out_dir, root=root, dist=dist)


def test_fsdp_training_equals_single_process(run):
    ref, r0, r1 = run["ref"], *run["ranks"]
    assert r0["losses"] == r1["losses"]  # reduced: the same on both ranks
    torch.testing.assert_close(torch.tensor(r0["losses"]), torch.tensor(ref["losses"]), atol=1e-5, rtol=0)
    # clip_grad_norm over DTensor shards gives the full model's norm, and it did clip (norm > MAX_NORM)
    torch.testing.assert_close(torch.tensor(r0["norms"]), torch.tensor(ref["norms"]), atol=1e-5, rtol=1e-5)
    assert ref["norms"][0] > MAX_NORM
    assert_close_dicts(r0["params_3"], ref["params_3"], atol=1e-5)
    assert_close_dicts(r1["params_3"], ref["params_3"], atol=1e-5)
    # MixedPrecisionPolicy(bf16 params, fp32 reduce) + CPUOffloadPolicy: bf16-close loss, fp32 masters
    assert abs(r0["bf16_loss"] - ref["losses"][0]) < 0.05 and r0["bf16_master_dtypes"] == {torch.float32}


def test_non_persistent_buffers_agree_after_meta_init(run):
    fresh = dict(build_tiny_qwen2(run["tokenizer"], TINY).named_buffers())
    assert any(name.endswith("inv_freq") for name in fresh)
    for rank in run["ranks"]:  # rank 1 was built on the meta device
        assert_close_dicts(rank["buffers"], fresh, atol=0)


def test_resume_across_world_sizes(run):
    ref, r0, r1 = run["ref"], *run["ranks"]
    # the optimizer state comes back exactly, whichever world size saved it
    assert_optim_equal(r0["2to2_optim"], r0["optim_2"])
    assert_optim_equal(ref["2to1_optim"], r0["optim_2"])
    assert_optim_equal(r0["1to2_optim"], ref["optim_2"])
    # one more step after the resume lands where the uninterrupted runs did
    assert_close_dicts(r0["2to2_params"], r0["params_3"], atol=1e-6)
    assert_close_dicts(ref["2to1_params"], r0["params_3"], atol=1e-6)
    assert_close_dicts(r0["1to2_params"], ref["params_3"], atol=1e-6)
    assert r0["2to2_loss"] == r0["losses"][2]
    # extra: each rank its own file when the world matches; rank 0's when a rank has none
    assert (r0["2to2_extra"], r1["2to2_extra"]) == ({"step": 2, "rank": 0}, {"step": 2, "rank": 1})
    assert r1["1to2_extra"] == {"step": 2, "rank": 0} and ref["2to1_extra"] == {"step": 2, "rank": 0}


def test_full_weights_buckets(run):
    ref, r0, r1 = run["ref"], *run["ranks"]
    for rank in (r0, r1):
        one, big = rank["weights_1"], rank["weights_big"]
        # 1 byte: each bucket is one decoder layer (kept whole for vLLM's fused modules) or one other tensor
        assert len(big) == 1 and [sorted({".".join(n.split(".")[:3]) for n, _ in b}) for b in one] == [
            ["model.embed_tokens.weight"], ["model.layers.0"], ["model.layers.1"], ["model.norm.weight"]]
        assert [n for b in one for n, _ in b] == [n for b in big for n, _ in b] == list(ref["weights"])
        assert_close_dicts(dict(p for b in one for p in b), ref["weights"], atol=0)
        assert_close_dicts(dict(p for b in big for p in b), ref["weights"], atol=0)
    # HF names, tied lm_head once (as embed_tokens), no non-persistent buffers
    assert "model.embed_tokens.weight" in ref["weights"] and "lm_head.weight" not in ref["weights"]
    assert not any("inv_freq" in n for n in ref["weights"])


def test_buckets_hold_whole_layers_within_the_bound(run):
    model = build_tiny_qwen2(run["tokenizer"], TINY)
    layer = sum(p.numel() for p in model.model.layers[0].parameters())  # elements of one decoder layer
    for dtype in (None, torch.bfloat16):
        size = (dtype or torch.float32).itemsize
        limit = (layer + TINY.hidden_size) * size  # one layer and the final norm fit; two layers do not
        buckets = list(sharding.full_weights(model, limit, dtype))
        assert [sorted({".".join(n.split(".")[:3]) for n, _ in b}) for b in buckets] == [
            ["model.embed_tokens.weight"], ["model.layers.0"], ["model.layers.1", "model.norm.weight"]]
        assert sum(t.numel() * t.element_size() for _, t in buckets[2]) == limit  # the bound is inclusive
        assert {t.dtype for b in buckets for _, t in b} == {dtype or torch.float32}  # cast on the way out
        assert buckets[0][0][1].shape == model.model.embed_tokens.weight.shape  # alone: it and a layer exceed the limit


def test_export_hf_loads_back(run):
    exported = AutoModelForCausalLM.from_pretrained(os.path.join(run["out_dir"], "hf"))
    assert exported.config.architectures == ["Qwen2ForCausalLM"]
    params = dict(exported.named_parameters())
    assert_close_dicts({k: params[k] for k in run["ranks"][0]["1to2_params"]}, run["ranks"][0]["1to2_params"], atol=0)


def test_reduce_metrics_across_ranks(run):
    """Each metric is reduced as its type declares (a plain number: the mean, whatever its name), and keeps that
    type; all_max agrees on the largest of each value."""
    for rank in run["ranks"]:
        assert rank["metrics"] == {"a": 1.5, "x/max": 1.0, "x/min": 0.0, "y_max": 0.5, "tokens": 11.0}
        assert [type(rank["metrics"][k]) for k in ("a", "x/max", "x/min", "tokens")] == [float, Max, Min, Sum]
        assert rank["widths"] == [1.0, 7.0]


def test_missing_and_corrupt_checkpoints_name_the_path(run, tmp_path):
    dist, model = run["dist"], build_tiny_qwen2(run["tokenizer"], TINY)
    optimizer = make_optimizer(model)
    missing = str(tmp_path / "nowhere")
    with pytest.raises(FileNotFoundError, match=missing):
        sharding.load_sharded(missing, model, optimizer, dist)
    assert sharding.find_latest(missing) is None

    ckpt = str(tmp_path / "a")
    sharding.save_sharded(ckpt, model, optimizer, {}, dist)
    os.remove(os.path.join(ckpt, ".metadata"))
    with pytest.raises(RuntimeError, match=ckpt):
        sharding.load_sharded(ckpt, model, optimizer, dist)

    ckpt = str(tmp_path / "b")
    sharding.save_sharded(ckpt, model, optimizer, {}, dist)
    data = next(os.path.join(ckpt, f) for f in os.listdir(ckpt) if f.endswith(".distcp"))
    with open(data, "r+b") as f:
        f.truncate(os.path.getsize(data) // 2)
    with pytest.raises(RuntimeError, match=ckpt):
        sharding.load_sharded(ckpt, model, optimizer, dist)


def save_step(ckpt_dir: str, step: int, model, optimizer, dist) -> str:
    """A step checkpoint as the loop writes one: a fresh .tmp folder, the model's part, then the commit."""
    tmp = sharding.begin_checkpoint(ckpt_dir, step)
    sharding.save_sharded(os.path.join(tmp, "actor"), model, optimizer, {"step": step}, dist)
    return sharding.commit_checkpoint(ckpt_dir, step)


def test_interrupted_save_leaves_latest_on_the_previous_step(run, tmp_path, monkeypatch):
    dist, model = run["dist"], build_tiny_qwen2(run["tokenizer"], TINY)
    optimizer = make_optimizer(model)
    ckpt_dir = str(tmp_path)
    first = save_step(ckpt_dir, 1, model, optimizer, dist)
    assert sharding.find_latest(ckpt_dir) == first

    real_replace = os.replace

    def crash_on_rename(src, dst):  # the process dies after writing step_2.tmp, before renaming it
        if src.endswith("step_2.tmp"):
            raise KeyboardInterrupt
        real_replace(src, dst)

    monkeypatch.setattr(sharding.os, "replace", crash_on_rename)
    with pytest.raises(KeyboardInterrupt):
        save_step(ckpt_dir, 2, model, optimizer, dist)
    monkeypatch.undo()
    assert os.path.isdir(os.path.join(ckpt_dir, "step_2.tmp")) and sharding.find_latest(ckpt_dir) == first
    assert sharding.load_sharded(os.path.join(first, "actor"), model, optimizer, dist) == {"step": 1}
    # the next save clears the leftover and moves the pointer
    assert save_step(ckpt_dir, 2, model, optimizer, dist) == sharding.find_latest(ckpt_dir)
    assert not os.path.exists(os.path.join(ckpt_dir, "step_2.tmp"))
