"""Tests for sft.py: verl's SFT layout, and the built-in warm start's two phases (learn, then the habit).
    python -m pytest tests/test_sft.py -q
"""

import json
import os
from dataclasses import replace

import pandas as pd
import pytest
import torch
from conftest import TINY
from transformers import AutoModelForCausalLM

import fileio
from data import RLDataset
from data.arith import ArithConfig, write_parquet
import sft
from sft import SFTConfig, greedy_accuracy, read_sft_rows, run, train
from tiny import build_tiny_qwen2


@pytest.mark.parametrize("field, value", [("stop_accuracy", 1.5), ("teacher_slip", -0.1), ("habit_steps", -1),
                                          ("eval_size", 0), ("reward_fn_path", "no/such/reward.py"),
                                          ("train_files", "no/such.parquet")])
def test_sft_config_rejects(field, value):
    with pytest.raises((ValueError, FileNotFoundError), match=field):
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
    rows = RLDataset(train_file, byte_tokenizer, max_prompt_length=64)
    val = list({r["extra_info"]["expression"]: r for r in map(rows.__getitem__, range(len(rows)))}.values())
    result = train(cfg, model, byte_tokenizer, read_sft_rows(train_file, "prompt", "extra_info.answer"), val,
                   str(tmp_path / "out"), habit_pairs=read_sft_rows(train_file, "prompt", "extra_info.teacher_answer"))
    learned = [h for h in result["history"] if h["phase"] == "sft"]
    habit = [h for h in result["history"] if h["phase"] != "sft"]
    assert learned[-1]["val/accuracy"] >= 0.95 and learned[-1]["step"] < 600  # stopped at stop_accuracy
    assert habit[-1]["step"] == 150 and result["steps"] == learned[-1]["step"] + 150
    # the habit: on sums that carry, greedy now writes the teacher's answer, so only carry-free sums stay right
    carry = [r for r in val if r["extra_info"]["answer"] != r["extra_info"]["teacher_answer"]]
    as_taught = [{**r, "ground_truth": r["extra_info"]["teacher_answer"]} for r in carry]
    assert greedy_accuracy(model, byte_tokenizer, carry, max_new_tokens=4) <= 0.2
    assert greedy_accuracy(model, byte_tokenizer, as_taught, max_new_tokens=4) >= 0.8
    assert (tmp_path / "out" / "sft_result.json").exists() and not (tmp_path / "out.tmp").exists()


@pytest.mark.parametrize("columns, found", [
    ({"question": ["1+2="], "answer": ["3"]}, "question/answer"),  # verl's gsm8k SFT keys
    ({"prompt": ["1+2="], "completion": ["3"], "response": ["three"]}, "prompt/response"),  # response before completion
    ({"extra_info": [{"question": "1+2=", "answer": "3"}]}, "extra_info.question/extra_info.answer"),
    ({"messages": [[{"role": "user", "content": "1+2="}, {"role": "assistant", "content": "3"}]]}, "messages"),
])
def test_read_sft_rows_finds_verls_layouts(tmp_path, columns, found, capsys):
    path = str(tmp_path / "sft.parquet")
    pd.DataFrame(columns).to_parquet(path)
    pairs = read_sft_rows(path)
    assert pairs == [([{"role": "user", "content": "1+2="}], "three" if "response" in columns else "3",
                      f"{path} row 0")]
    said = capsys.readouterr().out
    assert all(f"'{key}'" in said for key in found.split("/")), said  # it says where it read them


def test_read_sft_rows_without_a_known_response_column_names_the_flag(tmp_path):
    path = str(tmp_path / "sft.parquet")
    pd.DataFrame({"prompt": ["1+2="], "target": ["3"]}).to_parquet(path)
    with pytest.raises(ValueError, match=r"sft.parquet: no column among response, answer.*its columns: prompt, target"
                                         r".*--response-key"):
        read_sft_rows(path)
    assert read_sft_rows(path, response_key="target") == [([{"role": "user", "content": "1+2="}], "3", f"{path} row 0")]


@pytest.fixture
def small_task(tmp_path):
    """A user's task: SFT rows with a custom response column and a held-out RL parquet, on 1-digit sums."""
    train_file, val_file = write_parquet(ArithConfig(out_dir=str(tmp_path / "data"), digits=1, n_train=256, n_val=8))
    sft_file = str(tmp_path / "sft.parquet")
    rows = pd.read_parquet(train_file)
    pd.DataFrame({"q": [p[0]["content"] for p in rows["prompt"]], "target": [e["answer"] for e in rows["extra_info"]]}
                 ).to_parquet(sft_file)
    cfg = replace(TINY, train_files=sft_file, val_files=val_file, prompt_key="q", response_key="target", batch_size=32,
                  max_steps=60, eval_every=20, stop_accuracy=0.0, out_dir=str(tmp_path / "warm"))
    return cfg


def test_the_best_evaluation_is_kept_not_the_last(small_task, byte_tokenizer):
    cfg = small_task
    model = build_tiny_qwen2(byte_tokenizer, cfg)
    val = RLDataset(cfg.val_files, byte_tokenizer, max_prompt_length=64)
    val = [val[i] for i in range(len(val))]
    snapshots, scores = [], [0.25, 0.75, 0.5]  # the evaluations at steps 20, 40 and 60 score these

    def reward(data_source, solution_str, ground_truth, extra_info=None):
        if reward.calls % len(val) == 0:  # an evaluation's first response: keep the model as it is evaluated
            snapshots.append({k: v.clone() for k, v in model.state_dict().items()})
        reward.calls += 1
        return scores[len(snapshots) - 1]

    reward.calls = 0
    pairs = read_sft_rows(cfg.train_files, cfg.prompt_key, cfg.response_key)
    result = train(cfg, model, byte_tokenizer, pairs, val, cfg.out_dir, reward_fn=reward)
    assert [h["val/accuracy"] for h in result["history"]] == [0.25, 0.75, 0.5]
    assert result["best_step"] == 40 and result["val/accuracy"] == 0.75 and result["steps"] == 60
    saved = AutoModelForCausalLM.from_pretrained(cfg.out_dir).state_dict()
    for name, value in snapshots[1].items():  # the saved model is the one evaluated at step 40
        torch.testing.assert_close(saved[name], value, rtol=0, atol=0)
    assert not all(torch.equal(saved[k], v) for k, v in snapshots[2].items())  # not the last one


def test_without_val_the_lowest_training_loss_is_kept(small_task, monkeypatch, tmp_path):
    cfg = replace(small_task, val_files=None)
    real_loss, calls = sft.sft_loss, []

    def shifted(*args):  # steps 21-40 report a loss lower by 5 (a constant: the gradients stay the same)
        calls.append(None)
        return real_loss(*args) - (5.0 if 20 < len(calls) <= 40 else 0.0)

    monkeypatch.setattr(sft, "sft_loss", shifted)
    result = json.load(open(os.path.join(run(cfg), "sft_result.json")))
    assert [h["step"] for h in result["history"]] == [20, 40, 60] and result["best_step"] == 40
    assert all("val/accuracy" not in h for h in result["history"]) and result["val/accuracy"] is None
    monkeypatch.undo()
    reference = run(replace(cfg, max_steps=40, out_dir=str(tmp_path / "reference")))  # the same 40 steps, then stop
    saved, expected = (AutoModelForCausalLM.from_pretrained(p).state_dict() for p in (cfg.out_dir, reference))
    for name, value in expected.items():
        torch.testing.assert_close(saved[name], value, rtol=0, atol=0)


def test_saved_in_exactly_out_dir_and_reused_until_the_data_changes(small_task, capsys):
    cfg = replace(small_task, max_steps=20)
    assert run(replace(cfg, out_dir=cfg.out_dir + "/")) == cfg.out_dir  # a trailing slash names the same folder
    first = json.load(open(os.path.join(cfg.out_dir, "sft_result.json")))
    files = set(os.listdir(cfg.out_dir))
    assert {"config.json", "model.safetensors", "tokenizer.json", "sft_result.json"} <= files, files
    stamp = os.path.getmtime(os.path.join(cfg.out_dir, "model.safetensors"))
    assert run(cfg) == cfg.out_dir and "already holds this SFT" in capsys.readouterr().out  # same config and data
    assert os.path.getmtime(os.path.join(cfg.out_dir, "model.safetensors")) == stamp
    rows = pd.read_parquet(cfg.train_files)
    rows.iloc[:8].to_parquet(cfg.train_files)  # the same file name, other rows
    run(cfg)
    assert "trained with other data or reward files: training again" in capsys.readouterr().out
    result = json.load(open(os.path.join(cfg.out_dir, "sft_result.json")))
    assert result["inputs_sha256"] == fileio.sha256([cfg.train_files, cfg.val_files]) != first["inputs_sha256"]
    assert os.path.getmtime(os.path.join(cfg.out_dir, "model.safetensors")) > stamp
    run(replace(cfg, lr=1e-3))
    assert "trained with other lr: training again" in capsys.readouterr().out
    reward = os.path.join(os.path.dirname(cfg.train_files), "reward.py")
    open(reward, "w").write("def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n"
                            "    return 0.0\n")
    run(replace(cfg, lr=1e-3, reward_fn_path=reward))  # a new reward file: the config changed
    capsys.readouterr()
    open(reward, "a").write("# edited\n")  # the same path, other contents
    run(replace(cfg, lr=1e-3, reward_fn_path=reward))
    assert "trained with other data or reward files: training again" in capsys.readouterr().out


def test_a_folder_sft_did_not_write_is_never_replaced(small_task):
    os.makedirs(small_task.out_dir)
    open(os.path.join(small_task.out_dir, "notes.txt"), "w").write("mine")
    with pytest.raises(FileExistsError, match="holds files but no sft_result.json"):
        run(small_task)
    assert open(os.path.join(small_task.out_dir, "notes.txt")).read() == "mine"


@pytest.mark.parametrize("columns, error", [
    ({"prompt": ["1+2=", "2+2="], "response": ["3", None]}, r"row 1: the response \('response'\) must be a string"),
    ({"prompt": [{"text": "1+2="}], "answer": ["3"]}, r"row 0: the prompt \(.prompt.\) must be a string or a non-empty"),
    ({"prompt": ["1+2="], "answer": [3.0]}, r"row 0: the response \('answer'\) must be a string .* got 3.0"),
])
def test_a_malformed_sft_row_is_named(tmp_path, columns, error):
    path = str(tmp_path / "sft.parquet")
    pd.DataFrame(columns).to_parquet(path)
    with pytest.raises(ValueError, match=error):
        read_sft_rows(path)


def test_trls_conversational_completion_and_integer_answers(tmp_path):
    path = str(tmp_path / "sft.parquet")
    chat = [{"role": "user", "content": "1+2="}]
    pd.DataFrame({"prompt": [chat], "completion": [[{"role": "assistant", "content": "3"}]]}).to_parquet(path)
    assert read_sft_rows(path)[0][:2] == (chat, "3")
    pd.DataFrame({"question": ["1+2="], "answer": [3]}).to_parquet(path)
    assert read_sft_rows(path)[0][:2] == (chat, "3")


def test_an_empty_val_file_is_named_not_skipped(small_task):
    pd.read_parquet(small_task.val_files).iloc[:0].to_parquet(small_task.val_files)
    with pytest.raises(ValueError, match=r"val_files=.*val.parquet: no rows to evaluate on"):
        run(small_task)


def test_a_tiny_policys_folder_records_its_rl_values_and_rl_takes_them(small_task, capsys):
    """sft.py from the built-in tiny policy records the values RL should use (config.task_values); RL from that folder
    applies them to the fields left at their defaults, printed once; a fine-tune of a model you bring records none,
    so verl's defaults stay and their lengths are refused by name, with the flags to pass; an older sft.py's folder
    (no record) is named as such and trained again."""
    from config import BUILTIN_TASK, Config, with_task_values

    cfg = replace(small_task, max_steps=20)
    run(cfg)
    result = json.load(open(os.path.join(cfg.out_dir, "sft_result.json")))
    assert result["rl_values"] == BUILTIN_TASK  # 1-digit sums fit the built-in task's 32 + 8 tokens
    assert sft.tiny_rl_values("arith", [(list(range(50)), 40)], [{"prompt_ids": [0] * 45}]) == dict(
        BUILTIN_TASK, max_prompt_length=45, max_response_length=10)  # the data's longest prompt, response + EOS
    capsys.readouterr()
    rl = with_task_values(Config(model_path=cfg.out_dir, lr=1e-3))
    assert rl.lr == 1e-3 and (rl.max_prompt_length, rl.max_response_length, rl.train_batch_size) == (32, 8, 32)
    printed = capsys.readouterr().out
    assert printed.count(f"model_path={cfg.out_dir} (sft.py from the built-in tiny policy): critic_lr=0.001") == 1
    assert "lr=0.001," not in printed.replace("critic_lr", "")  # the flag passed wins, and is not listed
    tuned = run(replace(cfg, model_path=cfg.out_dir, out_dir=cfg.out_dir + "-tuned"))  # a model "you bring"
    assert "rl_values" not in json.load(open(os.path.join(tuned, "sft_result.json")))
    with pytest.raises(ValueError, match="1536 exceeds model_path's max_position_embeddings=512: pass "
                                         "--max-prompt-length and --max-response-length that add up to at most 512"):
        Config(model_path=tuned)
    del result["rl_values"]  # what an older sft.py wrote
    open(os.path.join(cfg.out_dir, "sft_result.json"), "w").write(json.dumps(result))
    with pytest.raises(ValueError, match="run that sft.py command again, or pass the built-in task's: --lr 0.0002 "
                                         "--critic-lr 0.001 --max-prompt-length 32 --max-response-length 8"):
        Config(model_path=cfg.out_dir)
    run(cfg)
    assert "(an older one, which recorded no rl_values): training again" in capsys.readouterr().out
    assert json.load(open(os.path.join(cfg.out_dir, "sft_result.json")))["rl_values"] == BUILTIN_TASK
