"""Every tensor has one home, checked without a GPU: a worker takes a CPU batch, computes each micro-batch on its
device and returns CPU results (DESIGN.md, "Where a tensor lives").

    python -m pytest tests/test_device.py -q

The workers' models go to a pretend accelerator: FakeTensorMode's fake tensors on the `meta` device (shapes and
devices, no data). An op that mixes a pretend-device tensor with a CPU one raises here, as it would on CUDA. The
fake device is `meta`, not `cuda`: on this CPU-only torch, a fake cuda tensor aborts the process at the first
embedding (c10's device guard has no CUDA, see CPU-NOTES.md), while meta's guard is a no-op. The check is stricter
than CUDA (which allows CPU index tensors and CPU scalars): any op whose tensor arguments sit on two devices raises,
except the copies between them. `.item()` reads no data from a fake tensor: it answers 1.
"""

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils._pytree import tree_leaves

from comm import init_distributed
from conftest import toy_config
from workers import ActorWorker, CriticWorker, pad_batch

DEVICE = torch.device("meta")  # the pretend accelerator
aten = torch.ops.aten
CROSSING = {aten._to_copy.default, aten.copy_.default}  # the ops that move a tensor between devices


class MixedDevices(RuntimeError):
    pass


class PretendAccelerator(FakeTensorMode):
    """Fake tensors with a strict device check (see the module docstring)."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is aten._local_scalar_dense.default:  # .item(), .tolist(): a fake tensor has no data
            return 1.0 if args[0].is_floating_point() else 1
        if func is aten.nonzero.default:  # a boolean mask selects all of its entries (no data: the count is unknown)
            x = args[0]
            return super().__torch_dispatch__(aten.empty.memory_format, types, ((x.numel(), x.dim()),),
                                              dict(dtype=torch.long, device=x.device))
        devices = {t.device for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)}
        if len(devices) > 1 and func not in CROSSING:
            raise MixedDevices(f"{func} mixes tensors on {sorted(map(str, devices))}")
        return super().__torch_dispatch__(func, types, args, kwargs)


@pytest.fixture(scope="module")
def model_path(tiny_rl_setup):
    return tiny_rl_setup["model_path"]


def cpu_batch(pad_id: int):
    """Two prompts x two samples of different lengths, with every field the update reads (real CPU tensors)."""
    g = torch.Generator().manual_seed(0)
    prompts = [[7, 8, 9], [7, 8, 9], [10, 11], [10, 11]]
    responses = [[12, 13, 14, 1], [15, 1], [16, 17, 18, 19], [20, 21, 1]]
    batch = pad_batch(prompts, responses, [[-1.0] * len(r) for r in responses], pad_id)
    mask = batch["response_mask"]
    for key in ("old_log_probs", "ref_log_probs", "values", "returns"):
        batch[key] = torch.randn(mask.shape, generator=g) * mask  # [B, R]
    batch["advantages"] = torch.tensor([1.0, -1.0, 0.5, -0.5])[:, None] * mask  # [B, R]
    return batch


def test_worker_passes_and_updates_compute_on_the_device_and_return_cpu(model_path, byte_tokenizer):
    """log_probs, ref_log_probs, values and both updates (policy, KL and entropy losses, value loss, AdamW, gradient
    checkpointing) with the models on the pretend device and a CPU batch: nothing mixes devices, and what comes back
    is on the CPU. (Offload, which moves the models between phases, cannot be shown here: a move between a fake and a
    real tensor makes new Parameter objects, which a move between CUDA and the host does not; bench/gpu_smoke.py
    checks it on a GPU.)"""
    cfg = toy_config(model_path=model_path, rollout_backend="hf", adv_estimator="gae", rollout_n=2, train_batch_size=2,
                     ppo_mini_batch_size=2, ppo_micro_batch_size=2, use_kl_loss=True, entropy_coeff=0.01,
                     gradient_checkpointing=True)
    actor, critic = ActorWorker(cfg, model_path, init_distributed()), CriticWorker(cfg, model_path, init_distributed())
    batch = cpu_batch(byte_tokenizer.pad_token_id)
    with PretendAccelerator(allow_non_fake_inputs=True):
        for model in (actor.model, actor.ref, critic.model):
            model.to(DEVICE)  # new (fake) Parameter objects: each optimizer is made again over them
        actor.opt, critic.opt = (torch.optim.AdamW(w.model.parameters(), lr=1e-3) for w in (actor, critic))
        actor.dist.device = critic.dist.device = DEVICE  # where a worker computes
        results = {"old_log_probs": actor.log_probs(batch), "ref_log_probs": actor.ref_log_probs(batch),
                   "values": critic.values(batch)}
        metrics = {**actor.update(batch), **critic.update(batch)}
        assert {v.device for s in actor.opt.state.values() for v in s.values() if v.dim()} == {DEVICE}
    for key, value in results.items():
        assert value.device.type == "cpu" and value.shape == batch["response_mask"].shape, key
    assert all(isinstance(v, float) for v in metrics.values()) and "actor/kl_loss" in metrics


def test_the_check_sees_a_cpu_batch_on_a_device_model(model_path, byte_tokenizer):
    """What the rule prevents, made visible: the model on the pretend device fed the CPU batch as it is."""
    actor = ActorWorker(toy_config(model_path=model_path, rollout_backend="hf"), model_path, init_distributed())
    batch = cpu_batch(byte_tokenizer.pad_token_id)
    with PretendAccelerator(allow_non_fake_inputs=True), pytest.raises(MixedDevices, match="cpu"):
        actor.model.to(DEVICE)
        actor.model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"])


def test_every_move_to_the_host_hands_the_device_memory_back(model_path, monkeypatch):
    """GPU start-up with offload: a role moved to the host at construction (the actor's parameters, the reference)
    goes through sharding.relocate, which empties CUDA's cache after a move to the host, so that the engine that
    starts next (vLLM checks the free device memory) sees the blocks freed. CUDA is pretended for relocate alone."""
    import sharding
    import workers

    events = []
    monkeypatch.setattr(workers, "relocate", lambda device, models=(), optimizers=(): events.append(
        (str(device), len(models), len(optimizers))))
    cfg = toy_config(model_path=model_path, rollout_backend="hf", use_kl_loss=True)
    cfg.offload.actor_params = cfg.offload.ref_params = True
    ActorWorker(cfg, model_path, init_distributed())
    assert events == [("cpu", 1, 0), ("cpu", 1, 0)]  # the actor's parameters, then the reference
    monkeypatch.undo()
    emptied = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: emptied.append(True))
    sharding.relocate("cpu", [torch.nn.Linear(2, 2)])
    assert emptied == [True]


def test_generation_leaves_the_optimizer_where_offload_says(model_path, monkeypatch):
    """AdamW's state does not cross to the host and back for each generate (7.6 GB a rank each way for 7B on 8 ranks):
    without --offload.actor-optimizer it stays on the device, with it it lives on the host anyway; only the update
    (and checkpoints) bring an offloaded state in."""
    import workers

    real, calls = workers.placed, []

    def recording(inside, after, models=(), optimizers=()):
        calls.append(len(optimizers))
        return real(inside, after, models, optimizers)

    monkeypatch.setattr(workers, "placed", recording)
    for offload in (False, True):
        cfg = toy_config(model_path=model_path, rollout_backend="hf", rollout_n=2, max_response_length=4)
        cfg.offload.actor_optimizer = offload
        worker = ActorWorker(cfg, model_path, init_distributed())
        calls.clear()
        worker.generate([[5, 6, 7]], seeds=[0])
        assert sum(calls) == 0, calls  # no optimizer moved by generation
        with worker.resident(optimizer=True):
            pass
        assert sum(calls) == int(offload)
