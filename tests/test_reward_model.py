"""Preference training (reward_model.py, dpo.py): a reward model that learns separable pairs, DPO's metrics, and the
bad inputs, each named.

    python -m pytest tests/test_reward_model.py -q
"""

import json
import random
from dataclasses import replace

import pandas as pd
import pytest
import torch
from transformers import AutoModelForTokenClassification

from comm import init_distributed
from reward_model import PREF_RESULT, PreferenceConfig, load_models, pair_batch, read_pairs, run
from workers import response_scores

WORDS = ["alpha", "beta", "gamma", "delta", "omega", "sigma"]
GOOD = ["apple", "river", "stone", "cloud", "green", "tiger", "piano", "lemon"]  # the chosen answer's last word
BAD = ["chair", "smoke", "paper", "brick", "storm", "ghost", "sugar", "metal"]  # the rejected one's


def separable_pairs(n: int, seed: int) -> pd.DataFrame:
    """Pairs a reward model can learn and a random head cannot rank: the chosen answer ends in a GOOD word, the
    rejected in a BAD one (random words before, so the rest tells nothing)."""
    rng = random.Random(seed)
    rows = []
    for _ in range(n):
        prompt = " ".join(rng.choices(WORDS, k=2)) + "?"
        words = " ".join(rng.choices(WORDS, k=2))
        rows.append(dict(prompt=prompt, chosen=f"{words} {rng.choice(GOOD)}", rejected=f"{words} {rng.choice(BAD)}"))
    return pd.DataFrame(rows)


@pytest.fixture(scope="module")
def pairs(tmp_path_factory):
    root = tmp_path_factory.mktemp("pairs")
    train, val = root / "train.parquet", root / "val.parquet"
    separable_pairs(256, 0).to_parquet(train)
    separable_pairs(64, 1).to_parquet(val)
    return str(train), str(val)


def test_a_reward_model_learns_separable_pairs(tiny_rl_setup, pairs, tmp_path):
    """Bradley-Terry on pairs that one token separates: held-out pair accuracy > 90% (the new head starts near 50%);
    the kept folder is an HF scalar-head model whose scores (a plain forward at the last token) rank the pairs."""
    out = tmp_path / "rm"
    result = run(PreferenceConfig(model_path=tiny_rl_setup["model_path"], train_files=pairs[0], val_files=pairs[1],
                                  out_dir=str(out), lr=3e-3, batch_size=32, epochs=3, eval_every=8))
    kept = result["kept"]
    assert kept["eval_rewards/accuracies"] > 0.9, kept
    assert json.loads((out / PREF_RESULT).read_text())["kept"]["step"] == kept["step"]
    assert (out / "metrics.jsonl").read_text().count("\n") == result["steps"] == 24
    model = AutoModelForTokenClassification.from_pretrained(out)
    assert model.config.num_labels == 1
    from data import load_tokenizer
    from reward_model import encode_pairs
    tokenizer = load_tokenizer(str(out))
    cfg = PreferenceConfig(model_path=str(out), train_files=pairs[1])
    val = encode_pairs(tokenizer, read_pairs(pairs[1], cfg)[0], 1024)
    batch, _ = pair_batch(val, tokenizer.pad_token_id)
    with torch.no_grad():
        scores = response_scores(model, batch)  # [2n]
    assert (scores[: len(val)] > scores[len(val):]).float().mean().item() == pytest.approx(
        kept["eval_rewards/accuracies"], abs=1e-6)
    untrained, _ = load_models(replace(cfg, model_path=tiny_rl_setup["model_path"]), init_distributed())
    with torch.no_grad():
        scores = response_scores(untrained, batch)  # the same seeded new head, before training
    assert (scores[: len(val)] > scores[len(val):]).float().mean().item() < 0.75  # what training had to learn


def test_response_scores_read_the_head_at_the_last_response_token(tiny_rl_setup):
    """Left-padded prompts, right-padded responses of different lengths: each score is the head's value at that
    response's last token, as an unpadded forward of the one sequence gives it."""
    from transformers import AutoConfig
    from workers import pad_batch
    config = AutoConfig.from_pretrained(tiny_rl_setup["model_path"], num_labels=1)
    torch.manual_seed(0)
    model = AutoModelForTokenClassification.from_pretrained(tiny_rl_setup["model_path"], config=config).eval()
    prompts, responses = [[5, 6, 7], [8]], [[9], [10, 11, 12, 13]]
    batch = pad_batch(prompts, responses, [[], []], 0)
    with torch.no_grad():
        scores = response_scores(model, batch)
        alone = [model(input_ids=torch.tensor([p + r])).logits[0, -1, 0] for p, r in zip(prompts, responses)]
    assert scores.tolist() == pytest.approx([a.item() for a in alone], abs=1e-5)


@pytest.mark.parametrize("frame, kwargs, message", [
    (pd.DataFrame(dict(prompt=["q"], chosen=["a"])), {}, r"no column 'rejected' \(--rejected-key\); its columns: "
                                                         "prompt, chosen"),
    (pd.DataFrame(dict(prompt=["q", "q"], chosen=["a", " "], rejected=["b", "c"])), {},
     r"row 1: the chosen response \('chosen'\) is empty"),
    (pd.DataFrame(dict(prompt=["q"], chosen=["a"], rejected=["b"], m=["big"])), dict(margin_key="m"),
     r"row 0: the margin \('m'\) must be a finite number, got 'big'"),
    (pd.DataFrame(dict(prompt=["q"], chosen=["a"], rejected=["a"])), {},
     "no pair with different chosen and rejected responses"),
])
def test_bad_pairs_are_named(tiny_rl_setup, tmp_path, frame, kwargs, message):
    path = tmp_path / "pairs.parquet"
    frame.to_parquet(path)
    cfg = PreferenceConfig(model_path=tiny_rl_setup["model_path"], train_files=str(path), **kwargs)
    with pytest.raises(ValueError, match=message):
        read_pairs(str(path), cfg)


def test_identical_pairs_are_counted_and_skipped_and_a_long_row_is_named(tiny_rl_setup, tmp_path, capsys):
    path = tmp_path / "pairs.parquet"
    pd.DataFrame(dict(prompt=["q", "q", "q"], chosen=["a", "b", "x" * 80], rejected=["a", "c", "y"])).to_parquet(path)
    cfg = PreferenceConfig(model_path=tiny_rl_setup["model_path"], train_files=str(path), max_length=64)
    pairs, same = read_pairs(str(path), cfg)
    assert same == 1 and len(pairs) == 2
    assert "1 pairs whose chosen equals the rejected are not trained on (first: " in capsys.readouterr().out
    with pytest.raises(ValueError, match=r"pairs.parquet row 2: \d+ prompt \+ 81 chosen response tokens > "
                                         "max_length=64"):
        run(cfg)


def test_dpo_raises_the_chosen_over_the_rejected(tiny_rl_setup, pairs, tmp_path):
    """DPO (sigmoid) and IPO on the separable pairs: TRL's metrics; the held-out rewards/accuracies end above 90%
    and the margin grows; the export is a causal LM."""
    from dpo import DPOConfig
    from transformers import AutoModelForCausalLM
    for loss in ("sigmoid", "ipo"):
        out = tmp_path / loss
        result = run(DPOConfig(model_path=tiny_rl_setup["model_path"], train_files=pairs[0], val_files=pairs[1],
                               out_dir=str(out), loss=loss, lr=3e-3, batch_size=32, epochs=2, eval_every=8))
        kept = result["kept"]
        assert {"eval_logps/chosen", "eval_logps/rejected", "eval_rewards/chosen", "eval_rewards/rejected",
                "eval_rewards/margins", "rewards/accuracies"} <= kept.keys()
        assert kept["eval_rewards/accuracies"] > 0.9, (loss, kept)
        assert kept["eval_rewards/margins"] > result["history"][0]["rewards/margins"], loss
        AutoModelForCausalLM.from_pretrained(out)
