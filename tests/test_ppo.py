"""The actor worker's update on a real batch (HF rollout backend, so no engine is needed):

    python -m pytest tests/test_ppo.py -q
"""

import pytest
import torch

from grpo import grpo_advantages
from comm import init_distributed
from ppo import ActorWorker, Config
from sft import SFTConfig, build_tiny_qwen2

MODES = ["token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm"]


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
