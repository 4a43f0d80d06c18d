"""The rollout pool's parts in one process (the Ray runs are in tests/test_ray.py):

    python -m pytest tests/test_async.py -q

- The weight sync from a trainer without an engine into a pool engine (a side group of its own, here two threads):
  the engine's weights equal the trainer's, its samples carry the new version, the verification passes; after an
  update that did not reach the engine, the verification fails.
- A sample older than async.staleness is refused with an error that names the bound.
- old_log_probs auto: the update's own forward where it is exact, a recomputing pass otherwise (stale samples).
"""

import socket
import threading
from dataclasses import replace

import pytest
import torch

from comm import init_distributed
from conftest import TINY, toy_config
from config import AsyncConfig, Config
from ppo import staleness
from tiny import build_tiny_qwen2
from workers import ActorWorker, RolloutWorker


@pytest.fixture(scope="module")
def model_path(tmp_path_factory, byte_tokenizer):
    path = tmp_path_factory.mktemp("policy")
    build_tiny_qwen2(byte_tokenizer, TINY).save_pretrained(path)
    byte_tokenizer.save_pretrained(path)
    return str(path)


def in_threads(*calls):
    """Run each call in its own thread (the two ends of a side group); returns their answers, or raises the first
    error."""
    out, errors = [None] * len(calls), []

    def run(i, fn):
        try:
            out[i] = fn()
        except Exception as e:  # noqa: BLE001 (re-raised below)
            errors.append(e)

    threads = [threading.Thread(target=run, args=(i, fn)) for i, fn in enumerate(calls)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    if errors:
        raise errors[0]
    return out


def test_weights_reach_the_pool_engine_and_are_verified(model_path):
    cfg = toy_config(model_path=model_path, rollout_backend="hf", rollout_n=2, max_response_length=4,
                     async_=AsyncConfig(rollout_workers=1), hybrid=replace(Config().hybrid, verify_sync=True))
    dist = init_distributed()
    actor, engine = ActorWorker(cfg, model_path, dist), RolloutWorker(cfg, model_path, dist)
    assert actor.rollout is None  # the pool generates: no engine in the trainer
    with torch.no_grad():
        for p in actor.model.parameters():  # a trained policy that the engine has not seen
            p.add_(torch.randn_like(p) * 0.01)
    with socket.socket() as s:
        s.bind(("", 0))
        address = ("127.0.0.1", s.getsockname()[1])
    in_threads(lambda: actor.open_weight_sync(address, 2), lambda: engine.open_weight_sync(address, 1, 2))
    sent, _ = in_threads(actor.send_weights, lambda: engine.receive_weights(actor.weights_plan(), 7))

    trainer, received = actor.model.state_dict(), engine.rollout.model.state_dict()
    assert sent == sum(t.numel() * t.element_size() for n, t in trainer.items() if n != "lm_head.weight")
    for name, tensor in trainer.items():
        assert torch.equal(received[name], tensor), name
    assert engine.verify(*actor.sync_expectation()) < 1e-6
    out, version, _ = engine.generate([[1, 2, 3]], seeds=[0])
    assert version == 7 and len(out.responses) == 2 and list(map(len, out.responses)) == list(map(len, out.log_probs))

    with torch.no_grad():  # an update that was not synced: the engine holds the previous version
        actor.model.get_input_embeddings().weight.add_(0.01)
    with pytest.raises(RuntimeError, match="the engine received weights that differ from the trainer's"):
        engine.verify(*actor.sync_expectation())
    for p in actor.model.parameters():
        p.grad = None


def test_a_sample_beyond_the_staleness_bound_is_refused():
    versions = torch.tensor([3, 3, 2, 2])  # [B]
    assert staleness(versions, 3, bound=1) == {"async/staleness/mean": 0.5, "async/staleness/max": 1,
                                               "async/stale_share": 0.5}
    with pytest.raises(RuntimeError, match=r"2 samples come from weights 2 updates behind the trainer's \(version 4\), "
                                           r"more than async.staleness=1"):
        staleness(versions, 4, bound=1)


def test_old_log_probs_auto_takes_the_update_only_where_it_is_exact():
    assert Config().old_log_probs_from == "recompute"  # 4 mini-batches a step
    assert Config(ppo_mini_batch_size=1024).old_log_probs_from == "update"
    one_step_off = AsyncConfig(rollout_workers=1, staleness=1)
    assert Config(ppo_mini_batch_size=1024, async_=one_step_off).old_log_probs_from == "recompute"
    assert Config(ppo_mini_batch_size=1024, async_=replace(one_step_off, staleness=0)).old_log_probs_from == "update"
    assert Config(ppo_mini_batch_size=1024, rollout_mask="token").old_log_probs_from == "recompute"
    with pytest.raises(ValueError, match="async.staleness=1 must be 0"):
        Config(ppo_mini_batch_size=1024, async_=one_step_off, old_log_probs="update")
