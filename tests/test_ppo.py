"""The actor and critic workers on a real batch (HF rollout backend, so no engine is needed):

    python -m pytest tests/test_ppo.py -q
"""

import json
import math
from dataclasses import replace
from typing import get_args

import pytest
import torch
from safetensors.torch import load_file
from tensordict import TensorDict

from comm import init_distributed, timer
from conftest import toy_config
from config import AsyncConfig, Config
from core_algos import AggMode, grpo_advantages
from hybrid_engine import HybridConfig
from perf import OutOfMemory, model_flops, model_shape, peak_flops
from ppo import policy_loss_mask
from sft import SFTConfig
from tiny import build_tiny_qwen2
from workers import ActorWorker, CriticWorker

MODES = list(get_args(AggMode))


@pytest.fixture(scope="module")
def model_path(tmp_path_factory, byte_tokenizer):
    path = tmp_path_factory.mktemp("policy")
    model = build_tiny_qwen2(byte_tokenizer, SFTConfig(hidden_size=32, num_layers=2, num_heads=2, num_kv_heads=1,
                                                       intermediate_size=64))
    model.save_pretrained(path)
    byte_tokenizer.save_pretrained(path)
    return str(path)


def make_batch(worker: ActorWorker, seed: int = 0):
    """A sampled batch with rewards, old log-probs and GRPO advantages, as the loop builds it."""
    prompts = [worker.tokenizer(t)["input_ids"] for t in ["1+2=", "33-4=", "7+8=", "9-9="]]
    batch, _ = worker.generate(prompts, seeds=[seed + i for i in range(len(prompts))])
    batch["group"] = torch.arange(len(prompts)).repeat_interleave(worker.cfg.rollout_n)
    batch["scores"] = batch["response_mask"].sum(-1) % 3 / 2.0  # any reward that differs within groups
    batch["old_log_probs"] = worker.log_probs(batch)
    batch["advantages"] = grpo_advantages(batch["scores"], batch["group"], batch["response_mask"], True)[0]
    return batch


def params(worker):
    return {k: v.detach().clone() for k, v in worker.model.named_parameters()}


@pytest.mark.parametrize("mode", MODES)
def test_micro_batches_give_the_whole_batch_gradient(model_path, mode):
    """Splitting a mini-batch into micro-batches of 3 sequences changes nothing, in every aggregation mode."""
    results = []
    for micro in (3, 16):
        cfg = toy_config(model_path=model_path, rollout_backend="hf", rollout_n=4, train_batch_size=4,
                         ppo_mini_batch_size=4, ppo_micro_batch_size=micro, loss_agg_mode=mode, lr=1e-2,
                         max_response_length=6)
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
    cfg = toy_config(model_path=model_path, rollout_backend="hf", rollout_n=4, train_batch_size=4,
                     ppo_mini_batch_size=2, max_response_length=6)
    worker = ActorWorker(cfg, model_path, init_distributed())
    batch = make_batch(worker)
    batch["advantages"][: cfg.rollout_n * 2] = float("nan")  # the first mini-batch only
    before = params(worker)
    metrics = worker.update(batch)
    assert metrics["actor/skipped_steps"] == 1.0
    after = params(worker)
    assert all(torch.isfinite(v).all() for v in after.values())
    assert any((before[k] - after[k]).abs().max() > 0 for k in before), "the second, finite mini-batch must still step"


def test_the_sync_verification_proves_an_engine_that_is_not_the_trainers_model(model_path):
    """The probe compares two models: an engine with a copy of its own (HF generate on it, own_model) that starts
    from other weights passes verify_sync only once the sync wrote the trainer's weights into it (gap 0 here, the
    same code computing), and a sync that leaves one weight out is refused: the checksums taken at the hand-over
    agree, the probe does not."""
    import copy

    from hybrid_engine import HybridEngine
    from rollout import HFRollout

    cfg = toy_config(model_path=model_path, rollout_backend="hf", rollout_n=2, max_response_length=6,
                     hybrid=HybridConfig(verify_sync=True))
    worker = ActorWorker(cfg, model_path, init_distributed())
    engine_model = copy.deepcopy(worker.model)
    with torch.no_grad():
        for p in engine_model.parameters():
            p.add_(torch.randn_like(p) * 0.1)  # the engine starts from other weights
    engine = HFRollout(engine_model, worker.tokenizer, worker.dist.device, own_model=True)
    worker.rollout = worker.sampler = engine
    worker.hybrid = HybridEngine(worker.model, engine, worker.dist, cfg.hybrid, torch.float32)
    _, metrics = worker.generate([[5, 6, 7]], seeds=[0])  # raises, naming the problem, if a check fails
    assert metrics["reshard/buckets"] >= 1 and metrics["reshard/probe_logprob_diff_max"] == 0.0
    for name, p in worker.model.state_dict().items():
        assert torch.equal(engine_model.state_dict()[name], p), name
    with torch.no_grad():
        engine_model.model.norm.weight.mul_(3.0)
    load = engine.update_weights
    engine.update_weights = lambda weights: load((n, t) for n, t in weights if n != "model.norm.weight")
    with pytest.raises(RuntimeError, match="the engine's probe log-probs differ from the trainer's"):
        worker.generate([[5, 6, 7]], seeds=[0])


def test_tis_weights_reach_the_update(model_path):
    """The engine's log-probs set apart from the trainer's (ratios e^-1, e^0.5 and e^1.5, the last capped at 2):
    one on-policy mini-batch with tis_cap updates exactly as plain PPO does on advantages times the truncated
    weights, and not as plain PPO on the raw advantages."""
    cfg = toy_config(model_path=model_path, rollout_backend="hf", rollout_n=4, train_batch_size=4,
                     ppo_mini_batch_size=4, max_response_length=6, tis_cap=2.0)
    worker = ActorWorker(cfg, model_path, init_distributed())
    batch = make_batch(worker)
    mask = batch["response_mask"]
    offsets = torch.tensor([-1.0, 0.5, 1.5]).repeat(mask.shape[1])[: mask.shape[1]]  # [R]: old - rollout
    batch["rollout_log_probs"] = (batch["old_log_probs"] - offsets) * mask
    metrics = worker.update(batch.clone())
    weights = offsets.exp().clamp(max=2.0) * mask  # [B, R]
    assert metrics["actor/tis_clipfrac"] == pytest.approx(((offsets == 1.5) * mask).sum().item() / mask.sum().item())
    assert metrics["actor/tis_weight_mean"] == pytest.approx(weights.sum().item() / mask.sum().item(), rel=1e-5)
    assert metrics["actor/tis_weight_max"] == pytest.approx(2.0)
    results = {}
    for name, advantages in (("weighted", batch["advantages"] * weights), ("raw", batch["advantages"])):
        plain = ActorWorker(replace(cfg, tis_cap=None), model_path, init_distributed())
        plain.update(batch.clone().set("advantages", advantages))
        results[name] = params(plain)
    tis = params(worker)
    for k in tis:
        torch.testing.assert_close(tis[k], results["weighted"][k], atol=1e-6, rtol=1e-5)
    assert max((tis[k] - results["raw"][k]).abs().max().item() for k in tis) > 1e-4, "TIS changed nothing"
    with pytest.raises(ValueError, match="tis_cap"):
        Config(tis_cap=0.0)


def test_stale_samples_get_the_decoupled_weight_by_default(model_path):
    """A rollout pool with staleness 1, no flag: the behaviour policy (older weights) sampled, the old log-probs are
    the proximal policy's (recomputed), and each token's loss is weighted by min(pi_prox / pi_behav, 2) (decoupled
    PPO): the update equals plain PPO's on advantages times those weights, by hand, with async/is_weight/mean|max;
    async.behav_imp_weight_cap None turns it off (plain PPO on the raw advantages); staleness 0 needs none."""
    base = toy_config(model_path=model_path, rollout_backend="hf", rollout_n=4, train_batch_size=4,
                      ppo_mini_batch_size=4, max_response_length=6)
    batch = make_batch(ActorWorker(base, model_path, init_distributed()))
    mask = batch["response_mask"]
    offsets = torch.tensor([-1.0, 0.5, 1.5]).repeat(mask.shape[1])[: mask.shape[1]]  # [R]: log pi_prox - log pi_behav
    batch["rollout_log_probs"] = (batch["old_log_probs"] - offsets) * mask
    weights = offsets.exp().clamp(max=2.0) * mask  # [B, R]
    stale = replace(base, async_=AsyncConfig(rollout_workers=1, staleness=1))
    assert stale.old_log_probs_from == "recompute" and stale.behaviour_weight == ("decoupled", 2.0)
    assert replace(base, async_=AsyncConfig(rollout_workers=1, staleness=0)).behaviour_weight is None
    results = {}
    for name, cfg, advantages in (("decoupled", stale, batch["advantages"]),
                                  ("off", replace(stale, async_=replace(stale.async_, behav_imp_weight_cap=None)),
                                   batch["advantages"]),
                                  ("weighted", base, batch["advantages"] * weights), ("raw", base, batch["advantages"])):
        worker = ActorWorker(cfg, model_path, init_distributed())  # a pool's trainer has no engine of its own
        metrics = worker.update(batch.clone().set("advantages", advantages))
        results[name] = metrics, params(worker)
    metrics = results["decoupled"][0]
    assert metrics["async/is_weight/mean"] == pytest.approx(weights.sum().item() / mask.sum().item(), rel=1e-5)
    assert metrics["async/is_weight/max"] == pytest.approx(2.0)
    assert metrics["async/is_weight/clipfrac"] == pytest.approx(((offsets == 1.5) * mask).sum().item() / mask.sum().item())
    assert "async/is_weight/mean" not in results["off"][0]
    for got, expected in (("decoupled", "weighted"), ("off", "raw")):
        for k, v in results[got][1].items():
            torch.testing.assert_close(v, results[expected][1][k], atol=1e-6, rtol=1e-5)
    assert max((results["decoupled"][1][k] - v).abs().max().item() for k, v in results["raw"][1].items()) > 1e-4
    with pytest.raises(ValueError, match="async.staleness=2: the rollout pool's engines take new weights only"):
        AsyncConfig(rollout_workers=1, staleness=2)
    with pytest.raises(ValueError, match="async.behav_imp_weight_cap=0.0 must be > 0"):
        AsyncConfig(behav_imp_weight_cap=0.0)


def test_old_log_probs_from_the_update_or_the_engine_match_the_recomputed(model_path):
    """One optimizer step on the sampling weights: old log-probs from the update's own first forward (update) give
    the recomputing pass's update exactly; the engine's (rollout) give it within what the engine-trainer gap
    allows, and the update reports that gap as the recomputing pass measures it."""
    base = toy_config(model_path=model_path, rollout_backend="hf", rollout_n=4, train_batch_size=4,
                      ppo_mini_batch_size=4, max_response_length=6, lr=1e-2, clip_ratio_low=10.0,
                      clip_ratio_high=10.0)  # no clipping: ratios
    runs = {}
    for mode in ("recompute", "update", "rollout"):
        worker = ActorWorker(replace(base, old_log_probs=mode), model_path, init_distributed())
        batch = make_batch(worker)  # the same samples every time (seeded), recomputed old log-probs included
        gap = ((batch["rollout_log_probs"] - batch["old_log_probs"]).abs() * batch["response_mask"]).max().item()
        if mode != "recompute":
            del batch["old_log_probs"]
        runs[mode] = worker.update(batch), params(worker), gap
    (m_ref, p_ref, gap), (m_upd, p_upd, _), (m_roll, _, _) = runs["recompute"], runs["update"], runs["rollout"]
    for k in p_ref:
        torch.testing.assert_close(p_upd[k], p_ref[k], atol=1e-6, rtol=0)
    assert m_upd["actor/pg_loss"] == pytest.approx(m_ref["actor/pg_loss"], abs=1e-6)
    # pg_loss = -mean(A * ratio): a log-ratio off by at most gap moves it by at most max|A| * (e^gap - 1)
    bound = batch["advantages"].abs().max().item() * math.expm1(gap) + 1e-6
    assert abs(m_roll["actor/pg_loss"] - m_ref["actor/pg_loss"]) <= bound
    for m in (m_upd, m_roll):  # measured on the update's first forward, the same gap as the recomputing pass's
        assert m["rollout/logprob_diff_max"] == pytest.approx(gap, abs=1e-6)
    assert "rollout/logprob_diff_max" not in m_ref  # there batch_metrics reports it
    with pytest.raises(ValueError, match="ppo_epochs=2 must be 1"):
        replace(base, old_log_probs="update", ppo_epochs=2)
    with pytest.raises(ValueError, match="ppo_mini_batch_size=2 must equal train_batch_size=4"):
        replace(base, old_log_probs="update", ppo_mini_batch_size=2)
    with pytest.raises(ValueError, match="tis_cap"):
        replace(base, old_log_probs="rollout", tis_cap=2.0)


def test_one_process_computes_in_param_dtype(model_path):
    """Without FSDP, fsdp.param_dtype=bfloat16 still sets the compute dtype (autocast): the log-probs move by a
    bf16 rounding, not more; the masters and their update stay fp32."""
    cfg = toy_config(model_path=model_path, rollout_backend="hf", rollout_n=4, train_batch_size=4,
                     ppo_mini_batch_size=4, max_response_length=6)
    fp32 = ActorWorker(cfg, model_path, init_distributed())
    batch = make_batch(fp32)
    cfg.fsdp.param_dtype = "bfloat16"
    bf16 = ActorWorker(cfg, model_path, init_distributed())
    with torch.no_grad():
        logits = bf16.model(input_ids=batch["input_ids"][:1]).logits
    assert logits.dtype == torch.bfloat16
    gap = (bf16.log_probs(batch) - batch["old_log_probs"]).abs().max().item()
    assert 1e-4 < gap < 0.1, gap
    bf16.update(batch)
    assert all(p.dtype == torch.float32 for p in bf16.model.parameters())


def test_the_frozen_reference_is_in_the_compute_dtype_and_the_export_in_export_dtype(model_path, tmp_path):
    """fsdp.param_dtype=bfloat16: the actor keeps fp32 masters, the reference (which never steps) is loaded in bf16
    (half its memory) and its log-probs are the bf16 policy's within bf16's rounding; --export-dtype bfloat16 writes
    final/ in bf16, the masters rounded once, and config.json says so."""
    cfg = toy_config(model_path=model_path, rollout_backend="hf", rollout_n=4, train_batch_size=4,
                     ppo_mini_batch_size=4, max_response_length=6, use_kl_loss=True, export_dtype="bfloat16")
    cfg.fsdp.param_dtype = "bfloat16"
    worker = ActorWorker(cfg, model_path, init_distributed())
    assert {p.dtype for p in worker.ref.parameters()} == {torch.bfloat16}
    assert {p.dtype for p in worker.model.parameters()} == {torch.float32}
    batch = make_batch(worker)
    mask = batch["response_mask"].bool()
    gap = (worker.ref_log_probs(batch) - batch["old_log_probs"])[mask].abs().max().item()
    assert gap < 0.05, gap  # the same weights at step 0, bf16 compute either way
    worker.export(str(tmp_path / "final"))
    saved = load_file(str(tmp_path / "final" / "model.safetensors"))
    masters = worker.model.state_dict()  # a tied head under both names
    for name, tensor in saved.items():
        assert tensor.dtype == torch.bfloat16 and torch.equal(tensor, masters[name].detach().to(torch.bfloat16)), name
    assert json.load(open(tmp_path / "final" / "config.json"))["dtype"] == "bfloat16"
    with pytest.raises(ValueError, match="export_dtype"):
        Config(export_dtype="int8")


def test_lr_schedule_resumes_where_it_stopped(model_path, tmp_path):
    """Warmup then cosine over 4 updates: 2 updates, a checkpoint, a new worker that loads it and makes 2 more
    runs at the uninterrupted worker's learning rates, and ends with its weights."""
    cfg = toy_config(model_path=model_path, rollout_backend="hf", rollout_n=4, train_batch_size=4,
                     ppo_mini_batch_size=4, max_response_length=6, total_steps=4, lr_warmup_steps=2,
                     lr_scheduler="cosine", min_lr_ratio=0.1)
    whole = ActorWorker(cfg, model_path, init_distributed())
    batch = make_batch(whole)
    lrs = [whole.update(batch.clone())["actor/lr"] for _ in range(4)]
    assert lrs == [pytest.approx(cfg.lr * f) for f in (0.5, 1.0, 1.0, 0.1 + 0.9 * 0.5)]  # the floor at update 4
    first = ActorWorker(cfg, model_path, init_distributed())
    resumed = [first.update(batch.clone())["actor/lr"] for _ in range(2)]
    first.save_checkpoint(str(tmp_path / "ckpt"))
    second = ActorWorker(cfg, model_path, init_distributed())
    second.load_checkpoint(str(tmp_path / "ckpt"))
    resumed += [second.update(batch.clone())["actor/lr"] for _ in range(2)]
    assert resumed == lrs
    for k, v in params(whole).items():
        torch.testing.assert_close(params(second)[k], v, atol=1e-6, rtol=0)


def test_loss_mask_drops_responses_from_the_update(model_path):
    """A loss_mask that drops the first prompt's responses updates the actor exactly as the batch without them."""
    cfg = toy_config(model_path=model_path, rollout_backend="hf", rollout_n=4, train_batch_size=4,
                     ppo_mini_batch_size=4, max_response_length=6, lr=1e-2)
    masked, dropped = (ActorWorker(cfg, model_path, init_distributed()) for _ in range(2))
    batch = make_batch(masked)
    keep = torch.arange(batch.batch_size[0]) >= cfg.rollout_n  # [B]
    masked.update(batch.clone().set("loss_mask", batch["response_mask"] * keep.unsqueeze(-1)))
    dropped.update(batch[keep].clone())
    for k, v in params(dropped).items():
        torch.testing.assert_close(params(masked)[k], v, atol=1e-6, rtol=1e-5)


def test_policy_loss_mask_drops_truncated_responses(byte_tokenizer):
    """mask_truncated: a response that hit max_response_length without EOS gets no loss; one ending on EOS keeps it."""
    eos = byte_tokenizer.eos_token_id
    responses = torch.tensor([[5, 6, 7, 8], [5, 6, 7, eos], [5, 6, 0, 0], [5, 6, 7, 8]])
    attention = torch.tensor([[1, 1, 1, 1], [1, 1, 1, 1], [1, 1, 0, 0], [1, 1, 1, 1]])  # [B, P + R], P = 0 here
    mask = torch.tensor([[1.0, 1, 1, 1], [1, 1, 1, 1], [1, 1, 0, 0], [1, 0, 0, 1]])  # the last: a tool's span
    batch = TensorDict(responses=responses, attention_mask=attention, response_mask=mask, batch_size=[4])
    loss_mask, metrics = policy_loss_mask(batch, Config(max_response_length=4, mask_truncated=True), eos)
    assert loss_mask.tolist() == [[0, 0, 0, 0], [1, 1, 1, 1], [1, 1, 0, 0], [0, 0, 0, 0]]
    assert metrics["response_length/truncated_masked"] == pytest.approx(2 / 4)
    with pytest.raises(ValueError, match="rollout_mask='token' .* needs old_log_probs='recompute'"):
        Config(rollout_mask="token", old_log_probs="rollout")


def test_ignore_eos_samples_full_length(model_path):
    cfg = toy_config(model_path=model_path, rollout_backend="hf", rollout_n=4, max_response_length=6, ignore_eos=True)
    worker = ActorWorker(cfg, model_path, init_distributed())
    batch, _ = worker.generate([[5, 6, 7], [8, 9]], seeds=[0, 1])
    assert (batch["response_mask"].sum(-1) == 6).all()
    # evaluation (greedy) still stops at EOS: the engine is asked for ignore_eos on sampled calls only (a tiny
    # random model seldom emits EOS, so the request itself is what is checked)
    asked, generate = [], worker.rollout.generate
    worker.rollout.generate = lambda *a, **kw: asked.append(kw["ignore_eos"]) or generate(*a, **kw)
    worker.generate([[5, 6, 7]], seeds=[0])
    worker.generate([[5, 6, 7]], seeds=None, greedy=True)
    assert asked == [True, False]


@pytest.fixture(scope="module")
def critic_setup(model_path):
    """A sampled batch whose returns are the scores on every response token (gamma = lambda = 1, no KL)."""
    cfg = toy_config(model_path=model_path, rollout_backend="hf", rollout_n=4, train_batch_size=4,
                     ppo_mini_batch_size=4, max_response_length=6, critic_lr=1e-2)
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
    CriticWorker(toy_config(model_path=model_path, seed=1), model_path, init_distributed())
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


def test_ppo_epochs_replay_the_batch(model_path):
    """ppo_epochs=2 is two passes over the same batch with the same old log-probs: the weights of one update with
    2 epochs equal those of two updates with 1, and the second pass starts off-policy (a nonzero ratio)."""
    cfg = toy_config(model_path=model_path, rollout_backend="hf", rollout_n=4, train_batch_size=4,
                     ppo_mini_batch_size=2, max_response_length=6, lr=1e-2)
    once = ActorWorker(cfg, model_path, init_distributed())
    batch = make_batch(once)
    first = once.update(batch)
    second = once.update(batch)
    twice = ActorWorker(replace(cfg, ppo_epochs=2), model_path, init_distributed())
    both = twice.update(batch)
    for name, weight in params(once).items():
        torch.testing.assert_close(params(twice)[name], weight, atol=1e-6, rtol=1e-5)
    assert abs(second["actor/ppo_kl"]) > 1e-4  # the replayed pass sees a moved policy
    assert both["actor/ppo_kl"] == pytest.approx((first["actor/ppo_kl"] + second["actor/ppo_kl"]) / 2, abs=1e-6)


@pytest.mark.parametrize("coeff", [0.5, -0.5])
def test_entropy_bonus_raises_the_entropy(model_path, coeff):
    """With zero advantages only the bonus pulls: entropy_coeff > 0 raises the policy's entropy on the batch (the
    loss subtracts coeff * entropy), < 0 lowers it."""
    cfg = toy_config(model_path=model_path, rollout_backend="hf", rollout_n=4, train_batch_size=4,
                     ppo_mini_batch_size=4, max_response_length=6, lr=1e-2, entropy_coeff=coeff)
    worker = ActorWorker(cfg, model_path, init_distributed())
    batch = make_batch(worker)
    batch["advantages"] = torch.zeros_like(batch["advantages"])
    before = worker.update(batch)["actor/entropy"]  # the entropy the first step saw, then it moved
    after = worker.update(batch)["actor/entropy"]
    assert (after - before) * coeff > 1e-4, (before, after)


def test_a_sync_that_leaves_out_a_weight_raises_naming_it(model_path, monkeypatch):
    """Every sync checks that its buckets handed over each weight once (vLLM's own warnings are muted)."""
    import hybrid_engine

    cfg = toy_config(model_path=model_path, rollout_backend="hf", rollout_n=2, max_response_length=6)
    worker = ActorWorker(cfg, model_path, init_distributed())
    clean = hybrid_engine.full_weights
    monkeypatch.setattr(hybrid_engine, "full_weights", lambda *args: (
        [(n, t) for n, t in bucket if n != "model.norm.weight"] for bucket in clean(*args)))
    with pytest.raises(RuntimeError, match=r"left out \['model.norm.weight'\]"):
        worker.generate([[5, 6, 7]], seeds=[0])


def test_gradient_checkpointing_gives_the_same_update(model_path):
    """Recomputing each layer's activations in backward changes memory, not the gradient: one update with and one
    without gradient checkpointing end with the same weights and grad norm, the first keeping far fewer tensors."""
    results = []
    for checkpointing in (False, True):
        cfg = toy_config(model_path=model_path, rollout_backend="hf", rollout_n=4, train_batch_size=4,
                         ppo_mini_batch_size=4, ppo_micro_batch_size=8, max_response_length=6, lr=1e-2,
                         entropy_coeff=0.01, gradient_checkpointing=checkpointing)
        worker = ActorWorker(cfg, model_path, init_distributed())
        batch, saved = make_batch(worker), []
        with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(1) or t, lambda t: t):
            metrics = worker.update(batch)  # counts the tensors its forwards keep for backward
        results.append((metrics["actor/grad_norm"], params(worker), len(saved)))
    (norm, plain, saved), (norm_ckpt, ckpt, saved_ckpt) = results
    assert saved_ckpt < saved / 3, (saved_ckpt, saved)  # the layers' activations are recomputed, not kept
    assert norm_ckpt == pytest.approx(norm, rel=1e-5)
    for k in plain:
        torch.testing.assert_close(ckpt[k], plain[k], atol=1e-6, rtol=1e-5)


def injected_oom(fn, at: int):
    """fn, except that its call number `at` raises the out-of-memory a device would (once)."""
    calls = []

    def wrapped(*args, **kwargs):
        calls.append(1)
        if len(calls) == at:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB (injected)")
        return fn(*args, **kwargs)
    return wrapped


def test_an_out_of_memory_names_the_phase_the_micro_batch_and_the_knobs(model_path):
    cfg = toy_config(model_path=model_path, rollout_backend="hf", rollout_n=4, train_batch_size=4,
                     ppo_mini_batch_size=4, ppo_micro_batch_size=4, max_response_length=6)
    worker = ActorWorker(cfg, model_path, init_distributed())
    batch = make_batch(worker)
    worker.micro_batch_loss = injected_oom(worker.micro_batch_loss, at=3)
    with pytest.raises(OutOfMemory, match=r"out of memory in actor update_actor: micro-batch 3 of 4 \(4 sequences, "
                                          r"\d+ tokens\) under ppo_micro_batch_size=4\. Lower --ppo-micro-batch-size "
                                          r"\(--oom-retry halves it and retries\), or turn on --gradient-checkpointing"):
        worker.update(batch)
    worker.micro_batch_loss = lambda *a, **k: (_ for _ in ()).throw(ValueError("not memory"))
    with pytest.raises(ValueError, match="not memory"):  # any other error goes up as it was
        worker.update(batch)


def test_oom_retry_halves_the_budget_and_changes_nothing(model_path, capsys):
    """An out-of-memory injected into the update's second micro-batch and the log-prob pass's first, under
    --oom-retry: each phase reruns with half the token budget (which stays), and the log-probs and the updated
    weights equal a run that met no error."""
    cfg = toy_config(model_path=model_path, rollout_backend="hf", rollout_n=4, train_batch_size=4,
                     ppo_mini_batch_size=4, max_response_length=6, use_dynamic_bsz=True,
                     ppo_max_token_len_per_gpu=64, log_prob_max_token_len_per_gpu=64, oom_retry=True)
    plain, hit = (ActorWorker(cfg, model_path, init_distributed()) for _ in range(2))
    batch = make_batch(plain)
    hit.micro_batch_loss = injected_oom(hit.micro_batch_loss, at=2)
    metrics = {"plain": plain.update(batch.clone()), "hit": hit.update(batch.clone())}
    assert metrics["hit"]["actor/num_micro_batches"] > metrics["plain"]["actor/num_micro_batches"]
    for k, v in params(plain).items():
        torch.testing.assert_close(params(hit)[k], v, atol=1e-6, rtol=1e-5)
    import workers
    forward = workers.response_log_probs
    workers.response_log_probs = injected_oom(forward, at=1)
    try:
        torch.testing.assert_close(hit.log_probs(batch), plain.log_probs(batch), atol=1e-6, rtol=1e-5)
    finally:
        workers.response_log_probs = forward
    assert hit.limits == {"update_actor": 32, "old_log_prob": 32}
    assert hit.perf()["perf/oom_retries/actor"] == 2.0 and plain.perf()["perf/oom_retries/actor"] == 0.0
    out = capsys.readouterr().out
    assert "[oom-retry] out of memory in actor update_actor: micro-batch 2 of" in out
    assert "retrying with log_prob_max_token_len_per_gpu=32" in out


def test_mfu_against_a_hand_count_of_the_tiny_models_flops(model_path):
    """The tiny Qwen2's model FLOPs counted by hand from its config (every matmul's weights, biases and norms: 2 per
    token forward, 6 with backward; the tied embedding is the LM head; attention's QK^T and AV, 4 x layers x query
    width x s^2 forward): perf.model_flops gives exactly that, and perf/mfu/actor is that count over the update's
    time (the controller's timer, within 10%) and the peak."""
    cfg = toy_config(model_path=model_path, rollout_backend="hf", rollout_n=8, train_batch_size=4,
                     ppo_mini_batch_size=4, max_response_length=6)
    worker = ActorWorker(cfg, model_path, init_distributed())
    c = worker.model.config
    H, I, L, V = c.hidden_size, c.intermediate_size, c.num_hidden_layers, c.vocab_size
    kv = c.num_key_value_heads * (H // c.num_attention_heads)  # k and v's width (grouped-query attention)
    per_layer = H * H + H + 2 * (H * kv + kv) + H * H + 3 * H * I + 2 * H  # q, k, v (with biases), o, MLP, 2 norms
    params = V * H + L * per_layer + H  # the head (tied: the embedding), the layers, the final norm
    assert params == sum(p.numel() for p in worker.model.parameters())  # the count is the model's
    batch = make_batch(worker)
    seqlens = batch["attention_mask"].sum(-1)  # [B]
    hand = 6 * params * seqlens.sum().item() + 3 * 4 * L * H * (seqlens.double() ** 2).sum().item()
    assert model_flops(seqlens, model_shape(worker.model), backward=True) == pytest.approx(hand, rel=1e-12)
    assert model_flops(seqlens, model_shape(worker.model), backward=True, lora=True) == pytest.approx(
        4 * params * seqlens.sum().item() + 12 * L * H * (seqlens.double() ** 2).sum().item(), rel=1e-12)
    timed = {}
    with timer("update_actor", timed):
        metrics = worker.update(batch)
    figure = hand / timed["timing_s/update_actor"] / peak_flops(worker.dist.device, torch.float32)
    assert 0 < metrics["perf/mfu/actor"] < 1
    assert metrics["perf/mfu/actor"] == pytest.approx(figure, rel=0.1)
    assert worker.perf()["perf/max_memory_gb/update_actor"] > 0
