"""The actor and critic workers on a real batch (HF rollout backend, so no engine is needed):

    python -m pytest tests/test_ppo.py -q
"""

from dataclasses import replace
from typing import get_args

import pytest
import torch

from grpo import grpo_advantages
from comm import init_distributed
from hybrid_engine import HybridConfig
from ppo import ActorWorker, AggMode, Config, CriticWorker
from sft import SFTConfig, build_tiny_qwen2

MODES = list(get_args(AggMode))


@pytest.fixture(scope="module")
def model_path(tmp_path_factory, char_tokenizer):
    path = tmp_path_factory.mktemp("policy")
    model = build_tiny_qwen2(char_tokenizer, SFTConfig(hidden_size=32, num_layers=2, num_heads=2, num_kv_heads=1,
                                                       intermediate_size=64))
    model.save_pretrained(path)
    char_tokenizer.save_pretrained(path)
    return str(path)


def make_batch(worker: ActorWorker, seed: int = 0):
    """A sampled batch with rewards, old log-probs and GRPO advantages, as the loop builds it."""
    prompts = [worker.tokenizer(t)["input_ids"] for t in ["1+2=", "33-4=", "7+8=", "9-9="]]
    batch = worker.generate(prompts, seeds=[seed + i for i in range(len(prompts))])
    batch["group"] = torch.arange(len(prompts)).repeat_interleave(worker.cfg.rollout_n)
    batch["scores"] = batch["response_mask"].sum(-1) % 3 / 2.0  # any reward that differs within groups
    batch["old_log_probs"] = worker.log_probs(batch)
    batch["advantages"] = grpo_advantages(batch, worker.cfg, worker.dist)[0]
    return batch


def params(worker):
    return {k: v.detach().clone() for k, v in worker.model.named_parameters()}


@pytest.mark.parametrize("mode", MODES)
def test_micro_batches_give_the_whole_batch_gradient(model_path, mode):
    """Splitting a mini-batch into micro-batches of 3 sequences changes nothing, in every aggregation mode."""
    results = []
    for micro in (3, 16):
        cfg = Config(model_path=model_path, rollout_backend="hf", rollout_n=4, train_batch_size=4, ppo_mini_batch_size=4,
                     ppo_micro_batch_size=micro, loss_agg_mode=mode, lr=1e-2, max_response_length=6)
        worker = ActorWorker(cfg, model_path, init_distributed())
        batch = make_batch(worker)
        before = params(worker)
        metrics = worker.update(batch)
        results.append((metrics, params(worker)))
        assert any((before[k] - v).abs().max() > 1e-4 for k, v in results[-1][1].items()), "the update moved nothing"
    (m_micro, p_micro), (m_whole, p_whole) = results
    for k in p_whole:
        torch.testing.assert_close(p_micro[k], p_whole[k], atol=1e-5, rtol=1e-4)
    for k in ("actor/pg_loss", "actor/entropy", "actor/grad_norm", "actor/pg_clipfrac"):
        assert m_micro[k] == pytest.approx(m_whole[k], rel=1e-4, abs=1e-6), k


def test_non_finite_gradient_skips_the_step(model_path):
    """A NaN advantage poisons the gradient: the optimizer step is skipped and the weights stay as they were."""
    cfg = Config(model_path=model_path, rollout_backend="hf", rollout_n=4, train_batch_size=4, ppo_mini_batch_size=2,
                 max_response_length=6)
    worker = ActorWorker(cfg, model_path, init_distributed())
    batch = make_batch(worker)
    batch["advantages"][: cfg.rollout_n * 2] = float("nan")  # the first mini-batch only
    before = params(worker)
    metrics = worker.update(batch)
    assert metrics["actor/skipped_steps"] == 1.0
    after = params(worker)
    assert all(torch.isfinite(v).all() for v in after.values())
    assert any((before[k] - after[k]).abs().max() > 0 for k in before), "the second, finite mini-batch must still step"


def test_hf_rollout_passes_sync_verification(model_path):
    """HF generate runs on the trainer's model, yet the hybrid engine's checksums must still see every weight."""
    cfg = Config(model_path=model_path, rollout_backend="hf", rollout_n=2, max_response_length=6,
                 hybrid=HybridConfig(verify_sync=True))
    worker = ActorWorker(cfg, model_path, init_distributed())
    metrics = {}
    with worker.hybrid.rollout_mode(metrics):  # raises, naming a parameter, if a checksum or the probe disagrees
        pass
    assert metrics["reshard/buckets"] >= 1 and metrics["reshard/probe_logprob_diff_max"] == 0.0


def test_tis_weights_reach_the_update(model_path):
    """With tis_cap the update reports TIS metrics; HF generate samples with the trainer's own weights, so the
    rollout and old log-probs agree and every weight is ~1 (nothing truncated)."""
    cfg = Config(model_path=model_path, rollout_backend="hf", rollout_n=4, train_batch_size=4, ppo_mini_batch_size=4,
                 max_response_length=6, tis_cap=2.0)
    worker = ActorWorker(cfg, model_path, init_distributed())
    metrics = worker.update(make_batch(worker))
    assert metrics["actor/tis_weight_mean"] == pytest.approx(1.0, abs=1e-4)
    assert metrics["actor/tis_clipfrac"] == 0.0
    with pytest.raises(ValueError, match="tis_cap"):
        Config(tis_cap=0.0)


@pytest.fixture(scope="module")
def critic_setup(model_path):
    """A sampled batch whose returns are the scores on every response token (gamma = lambda = 1, no KL)."""
    cfg = Config(model_path=model_path, rollout_backend="hf", rollout_n=4, train_batch_size=4, ppo_mini_batch_size=4,
                 max_response_length=6, critic_lr=1e-2)
    batch = make_batch(ActorWorker(cfg, model_path, init_distributed()))
    batch["returns"] = batch["scores"].unsqueeze(-1) * batch["response_mask"]  # [B, R]
    return cfg, batch


def test_critic_values_sit_before_each_response_token(model_path, critic_setup):
    cfg, batch = critic_setup
    critic = CriticWorker(cfg, model_path, init_distributed())
    values = critic.values(batch)  # [B, R]
    with torch.no_grad():
        out = critic.model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"],
                           position_ids=batch["position_ids"]).logits[..., 0]  # [B, P + R]
    P = batch["prompts"].shape[1]  # prompts are left-padded: position P - 1 is every row's last prompt token
    for b, n in enumerate(batch["response_mask"].sum(-1).int().tolist()):
        torch.testing.assert_close(values[b, :n], out[b, P - 1 : P - 1 + n])  # the state before response token t
        assert (values[b, n:] == 0).all()
    critic.remove_padding = True  # packed micro-batches (sdpa keeps the sequences apart): the same values
    torch.testing.assert_close(critic.values(batch), values, atol=1e-5, rtol=0)


def test_critic_head_initialisation_is_seeded(model_path, critic_setup):
    cfg, batch = critic_setup
    first, second = (CriticWorker(cfg, model_path, init_distributed()).values(batch) for _ in range(2))
    assert (first == second).all()
    rng = torch.get_rng_state()
    CriticWorker(Config(model_path=model_path, seed=1), model_path, init_distributed())
    assert (torch.get_rng_state() == rng).all(), "loading the critic must leave the global RNG alone"


def test_critic_micro_batches_give_the_whole_batch_update(model_path, critic_setup):
    cfg, batch = critic_setup
    results = []
    for micro in (3, 16):
        critic = CriticWorker(replace(cfg, ppo_micro_batch_size=micro), model_path, init_distributed())
        batch["values"] = critic.values(batch)
        metrics = critic.update(batch)
        results.append((metrics, {k: v.detach().clone() for k, v in critic.model.named_parameters()}))
    (m_micro, p_micro), (m_whole, p_whole) = results
    for k in p_whole:
        torch.testing.assert_close(p_micro[k], p_whole[k], atol=1e-5, rtol=1e-4)
    for k in ("critic/vf_loss", "critic/grad_norm", "critic/vf_clipfrac"):
        assert m_micro[k] == pytest.approx(m_whole[k], rel=1e-4, abs=1e-6), k


def test_critic_fits_the_returns(model_path, critic_setup):
    cfg, batch = critic_setup
    critic = CriticWorker(cfg, model_path, init_distributed())
    losses = []
    for _ in range(30):  # as the loop does: the old values are the critic's own before each update
        batch["values"] = critic.values(batch)
        losses.append(critic.update(batch)["critic/vf_loss"])
    assert losses[-1] < 0.2 * losses[0], losses
