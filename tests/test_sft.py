"""Tests for sft.py: verl's SFT layout, and the built-in warm start's two phases (learn, then the habit).
    python -m pytest tests/test_sft.py -q
"""

from dataclasses import replace

import pytest
from conftest import TINY

from data import read_rl_parquet
from data.arith import ArithConfig, write_parquet
from sft import SFTConfig, build_tiny_qwen2, greedy_accuracy, read_sft_rows, train


@pytest.mark.parametrize("field, value", [("stop_accuracy", 1.5), ("teacher_slip", -0.1), ("habit_steps", -1)])
def test_sft_config_rejects(field, value):
    with pytest.raises(ValueError, match=field):
        SFTConfig(**{field: value})


def test_read_sft_rows_names_the_missing_field(tmp_path):
    train_file, _ = write_parquet(ArithConfig(out_dir=str(tmp_path), n_train=4, n_val=2))
    pairs = read_sft_rows(train_file, "prompt", "extra_info.answer")
    assert len(pairs) == 4 and pairs[0][0][0]["role"] == "user" and pairs[0][1].lstrip("-").isdigit()
    with pytest.raises(ValueError, match=r"train.parquet row 0: missing field 'nope'.*response_key='extra_info.nope'"):
        read_sft_rows(train_file, "prompt", "extra_info.nope")


def test_warm_start_learns_then_takes_the_teachers_habit(tmp_path, byte_tokenizer):
    # one-digit sums: a tiny model learns them in a few hundred steps; the teacher forgets every carry. Phase 1 runs
    # to 95%: with units digits still wrong at 80% (one CPU measured 0.73 below), the habit check would test them
    task = ArithConfig(out_dir=str(tmp_path / "data"), ops="+", digits=1, n_train=2000, n_val=40, teacher_slip=1.0)
    train_file, _ = write_parquet(task)
    cfg = replace(TINY, batch_size=64, max_steps=600, eval_every=25, stop_accuracy=0.95, habit_steps=150)
    model = build_tiny_qwen2(byte_tokenizer, cfg)
    # scored on training sums: this checks the two phases, not generalisation from ~60 distinct sums
    val = list({r["extra_info"]["expression"]: r for r in read_rl_parquet(train_file)}.values())
    result = train(cfg, model, byte_tokenizer, read_sft_rows(train_file, "prompt", "extra_info.answer"), val,
                   str(tmp_path / "out"), habit_pairs=read_sft_rows(train_file, "prompt", "extra_info.teacher_answer"))
    learned = [h for h in result["history"] if h["phase"] == "sft"]
    habit = [h for h in result["history"] if h["phase"] != "sft"]
    assert learned[-1]["val/accuracy"] >= 0.95 and learned[-1]["step"] < 600  # stopped at stop_accuracy
    assert habit[-1]["step"] == 150 and result["steps"] == learned[-1]["step"] + 150
    # the habit: on sums that carry, greedy now writes the teacher's answer, so only carry-free sums stay right
    carry = [r for r in val if r["extra_info"]["answer"] != r["extra_info"]["teacher_answer"]]
    as_taught = [{**r, "reward_model": {**r["reward_model"], "ground_truth": r["extra_info"]["teacher_answer"]}}
                 for r in carry]
    assert greedy_accuracy(model, byte_tokenizer, carry, max_new_tokens=4) <= 0.2
    assert greedy_accuracy(model, byte_tokenizer, as_taught, max_new_tokens=4) >= 0.8
    assert (tmp_path / "out" / "sft_result.json").exists() and not (tmp_path / "out.tmp").exists()
