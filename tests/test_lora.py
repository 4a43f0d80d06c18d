"""LoRA (lora.py): only the adapters train, the reference is the base model, the engine computes with the current
adapter (merged) every step, checkpoints resume, and the export loads in transformers and peft (under torchrun and
on Ray, with a critic: conftest.ppo_two_ranks and the runs that test_spmd.py and test_ray.py compare with it):

    python -m pytest tests/test_lora.py -q
"""

import os
from dataclasses import replace

import pytest
import torch
import torch.distributed.checkpoint as dcp
from transformers import AutoModelForCausalLM

from comm import init_distributed
from conftest import toy_config
from hybrid_engine import HybridConfig
from lora import adapters_off, is_adapter
from test_ppo import make_batch as ppo_batch
from workers import ActorWorker, response_log_probs


@pytest.fixture
def model_path(tiny_rl_setup) -> str:
    return tiny_rl_setup["model_path"]  # vLLM on CPU needs a head size of 32 or more: this one has 32


def lora_config(path: str, **overrides):
    return toy_config(**{**dict(model_path=path, rollout_backend="hf", rollout_n=4, train_batch_size=4,
                                ppo_mini_batch_size=4, max_response_length=6, lr=1e-2, lora_rank=4, lora_alpha=8,
                                use_kl_loss=True), **overrides})


def make_batch(worker, seed: int = 0):
    """test_ppo's sampled batch with advantages, and the reference's log-probs (the KL loss is on)."""
    batch = ppo_batch(worker, seed)
    batch["ref_log_probs"] = worker.ref_log_probs(batch)
    return batch


def adapters(worker) -> dict:
    return {n: p.detach().clone() for n, p in worker.model.named_parameters() if is_adapter(n)}


def test_only_the_adapters_train_and_the_reference_is_the_base_model(model_path):
    worker = ActorWorker(lora_config(model_path), model_path, init_distributed())
    assert worker.ref is None  # no second copy of the weights
    trainable = [n for n, p in worker.model.named_parameters() if p.requires_grad]
    assert trainable and all(is_adapter(n) for n in trainable)
    assert {id(p) for g in worker.opt.param_groups for p in g["params"]} == {
        id(p) for n, p in worker.model.named_parameters() if is_adapter(n)}
    base = AutoModelForCausalLM.from_pretrained(model_path)
    frozen = {n: p.detach().clone() for n, p in worker.model.named_parameters() if not is_adapter(n)}
    batch = make_batch(worker)
    start = worker.log_probs(batch)
    mask = batch["response_mask"].bool()
    torch.testing.assert_close(start[mask], worker.ref_log_probs(batch)[mask])  # B = 0: the adapters add nothing yet
    worker.update(batch)
    assert all(torch.equal(frozen[n], p) for n, p in worker.model.named_parameters() if not is_adapter(n))
    moved = worker.log_probs(batch)
    assert (moved - start)[mask].abs().max() > 1e-3  # the adapters learned something
    with torch.no_grad():
        expected = response_log_probs(base, batch, worker.cfg.temperature)[0]  # [B, R]: the plain base model
    torch.testing.assert_close(worker.ref_log_probs(batch)[mask], expected[mask], atol=1e-5, rtol=0)
    with adapters_off(worker.model):  # and the switch comes back on
        pass
    torch.testing.assert_close(worker.log_probs(batch)[mask], moved[mask])


def test_the_engine_generates_with_the_current_adapter(model_path):
    """vLLM after each sync computes the trainer's merged weights (checksums and probe; the frozen weights travel
    once); an engine left with the previous step's adapter, or the base model, fails the verification."""
    cfg = lora_config(model_path, rollout_backend="vllm", hybrid=HybridConfig(verify_sync=True))
    worker = ActorWorker(cfg, model_path, init_distributed())
    try:
        sent = [worker.generate([[5, 6, 7]], seeds=[0])[1]["reshard/bytes"] for _ in range(2)]
        assert sent[1] < sent[0]  # the engine keeps the base (CPU: no sleep): later syncs send the adapted layers
        for _ in range(2):
            batch = make_batch(worker)  # generate: a verified sync
            worker.update(batch)
        gap = (batch["rollout_log_probs"] - batch["old_log_probs"]).abs()[batch["response_mask"].bool()].max()
        assert gap < 1e-4
        worker.rollout.update_weights = lambda weights: [None for _ in weights]  # the engine keeps what it has
        with torch.no_grad():  # a new adapter, which never reaches it
            for name, param in worker.model.named_parameters():
                if ".lora_B." in name:
                    param.add_(0.05)
        with pytest.raises(RuntimeError, match="weight sync: the engine's probe log-probs differ"):
            worker.generate([[5, 6, 7]], seeds=[0])
    finally:
        worker.close()


def test_checkpoint_holds_the_adapter_and_resumes_exactly(model_path, tmp_path):
    cfg = lora_config(model_path)
    a = ActorWorker(cfg, model_path, init_distributed())
    a.update(make_batch(a, seed=1))
    a.save_checkpoint(str(tmp_path / "ckpt"))
    saved = adapters(a)
    meta = dcp.FileSystemReader(str(tmp_path / "ckpt")).read_metadata().state_dict_metadata
    # the adapter, not the base weights (the tied lm_head.weight, a name no parameter has, slips through DCP's
    # frozen filter: one embedding's worth)
    model_keys = [k for k in meta if k.startswith("model.") and k != "model.lm_head.weight"]
    assert model_keys and all(is_adapter(k) for k in model_keys)
    b = ActorWorker(cfg, model_path, init_distributed())
    b.load_checkpoint(str(tmp_path / "ckpt"))
    assert all(torch.equal(saved[n], p) for n, p in adapters(b).items())
    batch = make_batch(a, seed=2)
    a.update(batch)
    b.update(batch)
    assert all(torch.equal(p, adapters(b)[n]) for n, p in adapters(a).items())  # the optimizer state came back too


def test_export_is_a_merged_model_and_a_peft_adapter(model_path, tmp_path):
    from peft import PeftModel

    worker = ActorWorker(lora_config(model_path), model_path, init_distributed())
    batch = make_batch(worker)
    worker.update(batch)
    worker.export(str(tmp_path / "final"))
    mask = batch["response_mask"].bool()
    trainer = worker.log_probs(batch)[mask]
    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "final")
    assert not any("lora" in n or "base_layer" in n for n, _ in merged.named_parameters())
    peft_model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(model_path), tmp_path / "final" /
                                           "adapter")
    with torch.no_grad():
        for model in (merged, peft_model):
            torch.testing.assert_close(response_log_probs(model, batch, worker.cfg.temperature)[0][mask], trainer,
                                       atol=1e-5, rtol=0)
    assert os.path.isfile(tmp_path / "final" / "adapter" / "adapter_config.json")


def test_lora_fields_are_checked():
    with pytest.raises(ValueError, match="lora_rank=-1 must be >= 0"):
        replace(toy_config(), lora_rank=-1).__post_init__()


def test_token_budget_packed_update_equals_the_padded_one(model_path):
    """Dynamic batching with remove-padding on a LoRA actor: the losses and the updated policy of one padded pass."""
    results = []
    for overrides in (dict(ppo_micro_batch_size=16),
                      dict(use_dynamic_bsz=True, ppo_max_token_len_per_gpu=40, use_remove_padding=True)):
        worker = ActorWorker(lora_config(model_path, **overrides), model_path, init_distributed())
        batch = make_batch(worker)
        metrics = worker.update(batch)
        results.append((metrics, worker.log_probs(batch), batch["response_mask"].bool()))
    (m_whole, logp_whole, mask), (m_dyn, logp_dyn, _) = results
    assert m_dyn["actor/num_micro_batches"] > 1 == m_whole["actor/num_micro_batches"]
    for k in ("actor/pg_loss", "actor/kl_loss", "actor/grad_norm"):
        assert m_dyn[k] == pytest.approx(m_whole[k], rel=1e-4, abs=1e-6), k
    torch.testing.assert_close(logp_dyn[mask], logp_whole[mask], atol=1e-4, rtol=0)
