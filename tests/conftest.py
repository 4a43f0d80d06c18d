"""Shared pytest fixtures. Used by every test file:
    python -m pytest tests -q
"""

import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repo root: import ppo, sft, ...

from agent import AgentConfig  # noqa: E402
from config import BUILTIN_TASK, Config  # noqa: E402
from data.arith import ArithConfig, write_parquet  # noqa: E402
from sft import SFTConfig  # noqa: E402
from tiny import build_byte_tokenizer, build_tiny_qwen2  # noqa: E402

# The tiny policy of most tests: 2 layers of width 64 (a few hundred thousand parameters with the byte vocabulary).
TINY = SFTConfig(hidden_size=64, num_layers=2, num_heads=2, num_kv_heads=1, intermediate_size=128)

def toy_config(**kwargs) -> Config:
    """A Config for the tests' tiny policies: the built-in task's values (config.BUILTIN_TASK) for what kwargs leave
    out, as a run without --model-path gets them."""
    return Config(**{**BUILTIN_TASK, **kwargs})


# A dense reward that a random policy can learn in a few steps: the share of digits in the response.
DIGIT_REWARD = '''
def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    return sum(c.isdigit() for c in solution_str) / max(len(solution_str), 1)
'''


def assert_reward_rises(records: list[dict], by: float = 0.2):
    """The mean training reward of a run's last 4 steps exceeds its first 4 steps' by more than `by`."""
    rewards = [r["critic/score/mean"] for r in records if "critic/score/mean" in r]
    first, last = sum(rewards[:4]) / 4, sum(rewards[-4:]) / 4
    assert last > first + by, f"mean reward {first:.3f} (first 4 steps) -> {last:.3f} (last 4)"


@pytest.fixture(scope="session")
def byte_tokenizer():
    """The built-in byte-level tokenizer (one token per byte) with its minimal chat template."""
    return build_byte_tokenizer()


@pytest.fixture(scope="session")
def tiny_rl_setup(tmp_path_factory, byte_tokenizer) -> dict:
    """A tiny random Qwen2 policy, a small arith task and the digit reward, on disk: grpo.py's arguments."""
    root = tmp_path_factory.mktemp("tiny_rl")
    model = build_tiny_qwen2(byte_tokenizer, TINY)
    model.save_pretrained(root / "model")
    byte_tokenizer.save_pretrained(root / "model")
    train_file, val_file = write_parquet(ArithConfig(out_dir=str(root / "data"), n_train=512, n_val=16))
    (root / "reward.py").write_text(DIGIT_REWARD)
    return dict(model_path=str(root / "model"), train_files=train_file, val_files=val_file,
                reward_fn_path=str(root / "reward.py"))


# The PPO run on 2 torchrun ranks that tests/test_spmd.py (1 process, a resumed copy, a rank that dies) and
# tests/test_ray.py (the Ray driver, critic apart) compare against: a critic, a LoRA actor, and an adaptive KL
# coefficient in the reward (to the adapters-off base), a checkpoint every step; its rollout engine is one vLLM
# engine sharded over both ranks (rollout_tp 2), which every run compared with it is not (one engine a rank).
PPO_TWO_RANKS = dict(adv_estimator="gae", total_steps=2, ckpt_every=1, lora_rank=4, lora_alpha=8, lr=2e-2,
                     use_kl_in_reward=True, kl_ctrl_type="adaptive", kl_horizon=100)
ROLLOUT_TP = dict(rollout_tp=2)  # ppo_two_ranks' own: a resumed or replayed run leaves it out


@pytest.fixture(scope="session")
def ppo_two_ranks(tiny_rl_setup, tmp_path_factory):
    """PPO_TWO_RANKS's run, launched once for the session (ppo.py under torchrun); its folder. No test writes in it:
    one that resumes it does so in a copy."""
    from test_spmd import args, launch  # the tests' launcher (the test files import conftest, not the reverse)
    out = tmp_path_factory.mktemp("ppo_two_ranks")
    launch(args(tiny_rl_setup, out, **PPO_TWO_RANKS, **ROLLOUT_TP), out / "log", ranks=2, script="ppo.py")
    return out


# A tool whose answer the tests know, and the tiny random policy made to call it: every token's embedding gets a
# feature (its dimension 0) that the logits of the call's tokens "[" and "]" weigh more, so both come now and then
# at any position (the rest stays random).
PROBE_TOOL = '''
def probe(text):
    """Answers "ok" to any call."""
    return "ok"
'''
AGENT_FORMAT = dict(call_start="[", call_end="]", observation="({result})")
CALL_TOKENS = {"[": 0.5, "]": 0.35}  # each token's logit offset, over the 1.0 every token gets


@pytest.fixture(scope="session")
def calling_setup(tiny_rl_setup, tmp_path_factory, byte_tokenizer) -> dict:
    """tiny_rl_setup with a policy that calls tools often, and the agent's config (key "agent") for PROBE_TOOL."""
    root = tmp_path_factory.mktemp("calling")
    model = build_tiny_qwen2(byte_tokenizer, TINY)
    with torch.no_grad():
        head = model.get_output_embeddings().weight  # [V, H], tied with the input embeddings
        head[:, 0] += 1.0  # a feature every position carries: a logit offset for the tokens below
        for text, offset in CALL_TOKENS.items():
            head[byte_tokenizer.encode(text, add_special_tokens=False)[0], 0] += offset
    model.save_pretrained(root / "model")
    byte_tokenizer.save_pretrained(root / "model")
    (root / "tools.py").write_text(PROBE_TOOL)
    return dict(tiny_rl_setup, model_path=str(root / "model"),
                agent=AgentConfig(tools_path=str(root / "tools.py"), **AGENT_FORMAT))
