"""Tests for the data/ package: verifiers, task generation, the parquet loader and reward loading.
    python -m pytest tests/test_data.py -q
"""

import json
import random

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from data import RLDataset, arith, calculator, default_compute_score, gsm8k, load_reward_fn, read_rl_parquet, tokenize_prompt


def row(content: str, ground_truth: str = "46", data_source: str = "arith") -> dict:
    return {
        "data_source": data_source,
        "prompt": [{"role": "user", "content": content}],
        "ability": "math",
        "reward_model": {"style": "rule", "ground_truth": ground_truth},
        "extra_info": {"split": "train", "index": 0},
    }


def write(rows: list[dict], path) -> str:
    pq.write_table(pa.Table.from_pylist(rows), path)
    return str(path)



@pytest.mark.parametrize(
    "response, truth, expected",
    [
        ("46", "46", 1.0),
        ("45", "46", 0.0),
        ("", "46", 0.0),  # no integer at all
        ("no idea", "46", 0.0),
        ("the answer is 46.", "46", 1.0),  # a sentence-ending period is not a decimal point
        ("12+34=46", "46", 1.0),  # the last integer counts
        ("46 or maybe 47", "46", 0.0),
        ("-7", "-7", 1.0),
        ("3-10 = -7", "-7", 1.0),
        ("5-3", "-3", 0.0),  # a "-" after a digit is subtraction: the last integer is 3
        ("5-3", "3", 1.0),
        ("1,234", "1234", 1.0),
        ("total: -1,234,567!", "-1234567", 1.0),
        ("46, I think", "46", 1.0),
        ("3.5", "5", 0.0),  # decimals are not integers
        ("12,34", "34", 0.0),  # not a thousands group: no integer
    ],
)
def test_arith_compute_score(response, truth, expected):
    assert arith.compute_score(response, truth) == expected



def test_gsm8k_strict_and_flexible():
    text = "She has 3 + 4 = 7 apples, then 7 * 2 = 14.\n#### 1,400"
    assert gsm8k.extract_solution(text, "strict") == "1400"
    assert gsm8k.extract_solution(text, "flexible") == "1,400"  # verl keeps commas in flexible
    assert gsm8k.extract_solution("the answer is 14", "strict") is None
    assert gsm8k.extract_solution("the answer is 14.", "flexible") == "14."
    assert gsm8k.extract_solution("#### -3 then #### 9", "strict") == "9"
    assert gsm8k.extract_solution("nothing . here", "flexible") is None
    with pytest.raises(ValueError, match="method"):
        gsm8k.extract_solution("#### 1", "loose")


def test_gsm8k_compute_score():
    assert gsm8k.compute_score("so #### 72", "72") == 1.0
    assert gsm8k.compute_score("so #### 71", "72", format_score=0.1) == 0.1
    assert gsm8k.compute_score("so 72", "72", format_score=0.1) == 0.0  # strict needs "#### "
    assert gsm8k.compute_score("so 72", "72", method="flexible") == 1.0
    assert gsm8k.compute_score("#### -5", "-5", score=2.0) == 2.0
    # only the last 300 characters are searched
    assert gsm8k.compute_score("#### 72" + " " * 300, "72") == 0.0
    assert gsm8k.compute_score("#### 72" + " " * 290, "72") == 1.0



def test_arith_deterministic_by_seed():
    cfg = arith.ArithConfig(ops="+-*", digits=3)
    assert arith.make_problems(cfg, 50, seed=3) == arith.make_problems(cfg, 50, seed=3)
    assert arith.make_problems(cfg, 50, seed=3) != arith.make_problems(cfg, 50, seed=4)
    for p in arith.make_problems(cfg, 200, seed=0):
        a, op, b = next((p["expression"].partition(op) for op in "*+-" if op in p["expression"]))
        assert int(p["answer"]) == {"+": int(a) + int(b), "-": int(a) - int(b), "*": int(a) * int(b)}[op]
        assert 0 <= int(a) < 1000 and 0 <= int(b) < 1000


def test_arith_train_val_disjoint():
    # 1 digit, "+" only: 100 expressions, so train would hit val expressions without the exclusion
    cfg = arith.ArithConfig(n_train=2000, n_val=30, ops="+", digits=1, seed=5)
    train, val = arith.make_splits(cfg)
    val_expressions = {r["extra_info"]["expression"] for r in val}
    assert len(train) == 2000 and len(val) == 30
    assert not val_expressions & {r["extra_info"]["expression"] for r in train}
    assert len({r["extra_info"]["expression"] for r in train}) == 100 - len(val_expressions)
    assert arith.make_splits(cfg) == (train, val)


def test_arith_evaluate_multiplies_first():
    assert arith.evaluate([1, 2, 3], ["+", "*"]) == 7 and arith.evaluate([2, 3, 4], ["*", "-"]) == 2
    assert arith.evaluate([10, 2, 3, 4], ["-", "*", "+"]) == 8


def test_arith_pads_operands():
    padded = arith.make_problems(arith.ArithConfig(ops="+", digits=3), 100, seed=0)
    ragged = arith.make_problems(arith.ArithConfig(ops="+", digits=3, pad_operands=False), 100, seed=0)
    assert all(len(p["expression"]) == 7 for p in padded)  # "007+120"
    assert any(len(p["expression"]) < 7 for p in ragged)
    for p, r in zip(padded, ragged):  # the same problems, written two ways
        assert [int(x) for x in p["expression"].split("+")] == [int(x) for x in r["expression"].split("+")]
        assert p["answer"] == r["answer"]


@pytest.mark.parametrize("numbers, forgets_all", [([58, 67], 15), ([99, 1], 90), ([5, 5], 0), ([12, 34], 46),
                                                  ([999, 1, 5], 995), ([0, 0], 0)])
def test_teacher_sum_forgets_carries(numbers, forgets_all):
    rng = random.Random(0)
    assert arith.teacher_sum(numbers, 0.0, rng) == sum(numbers)
    assert arith.teacher_sum(numbers, 1.0, rng) == forgets_all


def test_teacher_slip_rate():
    cfg = arith.ArithConfig(ops="+", digits=2, teacher_slip=0.6, n_train=4000)
    train, _ = arith.make_splits(cfg)
    assert [r["extra_info"]["expression"] for r in train] == \
        [r["extra_info"]["expression"] for r in arith.make_splits(arith.ArithConfig(ops="+", n_train=4000))[0]]
    wrong = [r for r in train if r["extra_info"]["teacher_answer"] != r["extra_info"]["answer"]]
    carries = [r for r in train if (lambda a, b: a % 10 + b % 10 >= 10 or a + b >= 100)(
        *map(int, r["extra_info"]["expression"].split("+")))]
    assert {r["extra_info"]["expression"] for r in wrong} <= {r["extra_info"]["expression"] for r in carries}
    # one carry is kept with chance 0.4, two with 0.16: the teacher is right on ~30% of carrying sums
    assert 0.2 < 1 - len(wrong) / len(carries) < 0.4
    products, _ = arith.make_splits(arith.ArithConfig(ops="*", teacher_slip=1.0, n_train=50))
    assert all(r["extra_info"]["teacher_answer"] == r["extra_info"]["answer"] for r in products)  # sums only


def test_arith_row_schema_and_parquet(tmp_path):
    train_path, val_path = arith.write_parquet(arith.ArithConfig(out_dir=str(tmp_path / "a"), n_train=20, n_val=5))
    assert sorted(p.name for p in (tmp_path / "a").iterdir()) == ["train.parquet", "val.parquet"]
    rows = read_rl_parquet(val_path)
    assert len(rows) == 5 and len(read_rl_parquet(train_path)) == 20
    first = rows[0]
    expression, answer = first["extra_info"]["expression"], first["extra_info"]["answer"]
    assert first["prompt"] == [{"role": "user", "content": expression + "="}]
    assert first["reward_model"] == {"style": "rule", "ground_truth": answer}
    assert first["extra_info"] == {"split": "val", "index": 0, "expression": expression, "answer": answer,
                                   "teacher_answer": answer}  # teacher_slip 0: the teacher is right
    assert (first["data_source"], first["ability"]) == ("arith", "math")
    assert default_compute_score("arith", f"{expression}={answer}", answer) == 1.0


@pytest.mark.parametrize("field, value", [("ops", "+/"), ("digits", 0), ("n_val", 100), ("teacher_slip", 1.5)])
def test_arith_config_rejects(field, value):
    kwargs = {"digits": 1, "ops": "+", field: value}
    with pytest.raises(ValueError, match=field):
        arith.ArithConfig(**kwargs)



def test_calculator_task_its_tool_and_its_teacher(tmp_path):
    """The tool computes, the teacher calls it for its share of the problems (and its trace scores 1), and only the
    text after the tool's last output counts as the answer."""
    assert calculator.calc(" 123*456 ") == 56088 and calculator.calc("-(2+3)*4") == -20
    for bad in ("2**10", "__import__('os')", "1.5*2"):
        with pytest.raises(ValueError, match="not an integer expression"):
            calculator.calc(bad)
    train, val = map(read_rl_parquet, calculator.write_parquet(calculator.CalculatorConfig(
        out_dir=str(tmp_path), n_train=2000, n_val=50)))
    assert not {r["extra_info"]["expression"] for r in val} & {r["extra_info"]["expression"] for r in train}
    calls = [r["extra_info"]["teacher_answer"].startswith("<<") for r in train]
    assert 0.17 < sum(calls) / len(calls) < 0.23  # teacher_call_rate 0.2
    for row in train[:50]:
        truth = row["reward_model"]["ground_truth"]
        assert int(truth) == calculator.calc(row["extra_info"]["expression"]) and 1000 <= int(truth) < 1_000_000
        for trace in (row["extra_info"]["teacher_answer"], row["extra_info"]["tool_answer"]):
            assert default_compute_score("calculator", trace, truth) == 1.0
    assert calculator.compute_score("<<12*34=408>>", "408") == 0.0  # the tool's output alone is not an answer
    assert calculator.compute_score("<<12*34=408>>408", "408") == 1.0


def test_read_rl_parquet_missing_column(tmp_path):
    rows = [{k: v for k, v in row("1+1=").items() if k != "reward_model"}]
    path = write(rows, tmp_path / "bad.parquet")
    with pytest.raises(ValueError, match="reward_model") as error:
        read_rl_parquet(path)
    assert path in str(error.value)


def test_read_rl_parquet_missing_file(tmp_path):
    with pytest.raises(FileNotFoundError, match="nope.parquet"):
        read_rl_parquet(str(tmp_path / "nope.parquet"))


@pytest.mark.parametrize(
    "field, bad",
    [
        ("prompt", {"prompt": []}),
        ("prompt", {"prompt": [{"role": "user"}]}),
        ("reward_model", {"reward_model": {"style": "rule"}}),
    ],
)
def test_read_rl_parquet_malformed_row(tmp_path, field, bad):
    path = write([row("1+1="), row("2+2="), {**row("3+3="), **bad}], tmp_path / "rows.parquet")
    with pytest.raises(ValueError, match=f"row 2: field '{field}'") as error:
        read_rl_parquet(path)
    assert path in str(error.value)


def test_read_rl_parquet_plain_python(tmp_path):
    [got] = read_rl_parquet(write([row("1+1=")], tmp_path / "ok.parquet"))
    assert got == row("1+1=")
    assert type(got["prompt"]) is list and type(got["prompt"][0]) is dict


def test_rl_dataset_items(tmp_path, byte_tokenizer):
    first = write([row("12+34=", "46")], tmp_path / "one.parquet")
    second = write([row("9-9=", "0"), row("#### 7", "7", "openai/gsm8k")], tmp_path / "two.parquet")
    dataset = RLDataset([first, second], byte_tokenizer, max_prompt_length=9)
    assert len(dataset) == 3 and dataset.num_truncated == 0
    item = dataset[0]
    assert byte_tokenizer.convert_ids_to_tokens(item["prompt_ids"]) == (
        ["<|user|>"] + list("12+34=") + ["<|end|>", "<|assistant|>"]
    )
    assert type(item["prompt_ids"]) is list and all(type(i) is int for i in item["prompt_ids"])
    assert {k: v for k, v in item.items() if k != "prompt_ids"} == {
        "data_source": "arith",
        "ground_truth": "46",
        "extra_info": {"split": "train", "index": 0},
        "index": 0,
        "where": f"{first}, row 0",
        "messages": [{"role": "user", "content": "12+34="}],  # the chat prompt, for a reward model's own template
    }
    assert (dataset[2]["index"], dataset[2]["data_source"], dataset[2]["ground_truth"]) == (2, "openai/gsm8k", "7")
    assert dataset[2]["where"] == f"{second}, row 1"  # file and row, for errors about this prompt


def test_rl_dataset_too_long(tmp_path, byte_tokenizer):
    path = write([row("1+1="), row("12345+67890=")], tmp_path / "long.parquet")
    with pytest.raises(ValueError, match=r"row 1: prompt is 15 tokens, over max_prompt_length=10"):
        RLDataset(path, byte_tokenizer, max_prompt_length=10)


def test_rl_dataset_truncates_left(tmp_path, byte_tokenizer):
    path = write([row("1+1="), row("12345+67890="), row("123456789+1=")], tmp_path / "long.parquet")
    dataset = RLDataset(path, byte_tokenizer, max_prompt_length=10, truncate=True)
    full = tokenize_prompt(byte_tokenizer, [{"role": "user", "content": "12345+67890="}])
    assert dataset.num_truncated == 2
    assert dataset[1]["prompt_ids"] == full[-10:]
    assert byte_tokenizer.decode(dataset[1]["prompt_ids"]) == "5+67890=<|end|><|assistant|>"
    assert len(dataset[0]["prompt_ids"]) == 7



def test_default_compute_score_dispatch():
    assert default_compute_score("openai/gsm8k", "so #### 72", "72") == 1.0
    assert default_compute_score("openai/gsm8k", "72", "72") == 0.0  # gsm8k is strict by default
    assert default_compute_score("arith", "72", "72") == 1.0
    with pytest.raises(ValueError, match="lighteval/MATH"):
        default_compute_score("lighteval/MATH", "1", "1")


def test_load_reward_fn(tmp_path):
    assert load_reward_fn(None) is default_compute_score
    path = tmp_path / "my_reward.py"
    path.write_text(
        "def length_reward(data_source, solution_str, ground_truth, extra_info=None):\n"
        "    return float(len(solution_str))\n"
    )
    fn = load_reward_fn(str(path), "length_reward")
    assert fn("any", "abcd", "x") == 4.0
    with pytest.raises(AttributeError, match="compute_score") as error:
        load_reward_fn(str(path))
    assert str(path) in str(error.value)
    with pytest.raises(FileNotFoundError, match="missing.py"):
        load_reward_fn(str(tmp_path / "missing.py"))



def test_gsm8k_from_local_jsonl(tmp_path):
    examples = {
        "train": [
            {"question": "Tom has 2 apples and buys 3. How many?", "answer": "2 + 3 = <<2+3=5>>5\n#### 5"},
            {"question": "A car costs $1,200 twice. Total?", "answer": "2 * 1200 = 2400\n#### 2,400"},
        ],
        "test": [{"question": "What is 10 - 13?", "answer": "10 - 13 = -3\n#### -3"}],
    }
    local = tmp_path / "gsm8k" / "main"
    local.mkdir(parents=True)
    for split, rows in examples.items():
        (local / f"{split}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    cfg = gsm8k.GSM8KConfig(local_dir=str(tmp_path / "gsm8k"), out_dir=str(tmp_path / "out"))
    train_path, test_path = gsm8k.write_parquet(cfg)
    train, test = read_rl_parquet(train_path), read_rl_parquet(test_path)
    assert [r["reward_model"]["ground_truth"] for r in train] == ["5", "2400"]
    assert test[0]["reward_model"] == {"style": "rule", "ground_truth": "-3"}
    assert test[0]["prompt"] == [
        {
            "role": "user",
            "content": "What is 10 - 13? Let's think step by step and output the final answer after \"####\".",
        }
    ]
    assert train[1]["extra_info"] == {"split": "train", "index": 1, **examples["train"][1]}
    assert (train[1]["data_source"], train[1]["ability"]) == ("openai/gsm8k", "math")
    # the reference solution (sft.py's --response-key extra_info.answer) scores full marks against its ground truth
    for r in train + test:
        assert default_compute_score(r["data_source"], r["extra_info"]["answer"], r["reward_model"]["ground_truth"]) == 1.0


def test_gsm8k_local_missing_split(tmp_path):
    (tmp_path / "train.jsonl").write_text(json.dumps({"question": "q", "answer": "#### 1"}) + "\n")
    with pytest.raises(FileNotFoundError, match="test"):
        gsm8k.write_parquet(gsm8k.GSM8KConfig(local_dir=str(tmp_path), out_dir=str(tmp_path / "out")))
