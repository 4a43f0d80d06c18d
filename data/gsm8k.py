"""GSM8K in verl's RL schema, and verl's GSM8K verifier.

Convert openai/gsm8k to data/gsm8k/train.parquet and data/gsm8k/test.parquet:
    python -m data.gsm8k                              # from the Hugging Face hub
    python -m data.gsm8k --local-dir /path/to/gsm8k   # offline: a folder with train*/test* .parquet or .jsonl
Score a response from python:
    python -c "from data.gsm8k import compute_score; print(compute_score('so #### 72', '72'))"
Test:
    python -m pytest tests/test_data.py -q
"""

import json
import re
from dataclasses import dataclass
from pathlib import Path

import pyarrow.parquet as pq
import tyro

from data import rl_row, write_splits

SPLITS = ("train", "test")
INSTRUCTION = 'Let\'s think step by step and output the final answer after "####".'  # verl's, for comparable scores
_CLIP_CHARS = 300  # regexes only see the tail: long responses would make them slow, and the answer sits at the end
_STRICT = re.compile(r"#### (-?[0-9.,]+)")
_FLEXIBLE = re.compile(r"(-?[0-9.,]+)")


@dataclass
class GSM8KConfig:
    local_dir: str | None = None
    """Local openai/gsm8k copy: train*/test* .parquet or .jsonl (question, answer), here or in main/. None: the hub."""
    out_dir: str = "data/gsm8k"
    """Folder for train.parquet and test.parquet (created if missing)."""


def extract_solution(solution_str: str, method: str = "strict") -> str | None:
    """The final answer in solution_str, or None. strict: the number after the last "#### ", commas and "$" removed;
    flexible: the last number-like run in the text that is not "" or "." (commas kept, as in verl)."""
    if method not in ("strict", "flexible"):
        raise ValueError(f"method={method!r}: use 'strict' or 'flexible'")
    tail = solution_str[-_CLIP_CHARS:]
    if method == "strict":
        found = _STRICT.findall(tail)
        return found[-1].replace(",", "").replace("$", "") if found else None
    candidates = [c for c in _FLEXIBLE.findall(tail) if c not in ("", ".")]
    return candidates[-1] if candidates else None


def compute_score(solution_str: str, ground_truth: str, method: str = "strict", format_score: float = 0.0,
                  score: float = 1.0) -> float:
    """verl's GSM8K reward: 0.0 with no answer, format_score for a wrong one, score for a right one (compared as
    strings, as in verl: "72.0" does not match "72")."""
    answer = extract_solution(solution_str, method)
    if answer is None:
        return 0.0
    return float(score) if answer == ground_truth else float(format_score)


def to_row(example: dict, split: str, index: int) -> dict:
    """One openai/gsm8k example {question, answer} as a row of verl's RL schema."""
    ground_truth = extract_solution(example["answer"], "strict")
    if ground_truth is None:
        raise ValueError(f"gsm8k {split} example {index}: no '#### <number>' in its answer {example['answer']!r:.200}")
    return rl_row("openai/gsm8k", example["question"] + " " + INSTRUCTION, ground_truth,
                  {"split": split, "index": index, "answer": example["answer"], "question": example["question"]})


def load_local(local_dir: str, split: str) -> list[dict]:
    """The examples of one split from a local copy (shards read in name order)."""
    root = Path(local_dir)
    if (root / "main").is_dir():  # a snapshot of the hub repo keeps the default config there (beside socratic/)
        root = root / "main"
    files = sorted(root.glob(f"{split}*.parquet")) + sorted(root.glob(f"{split}*.jsonl"))
    if not files:
        raise FileNotFoundError(f"no {split}*.parquet or {split}*.jsonl in {root}")
    examples = []
    for file in files:
        if file.suffix == ".parquet":
            examples += pq.read_table(file, columns=["question", "answer"]).to_pylist()
        else:
            examples += [json.loads(line) for line in file.read_text().splitlines() if line.strip()]
    return examples


def load_hub() -> dict[str, list[dict]]:
    """Both splits of openai/gsm8k ("main") from the Hugging Face hub."""
    import datasets  # slow to import, and only needed here

    try:
        dataset = datasets.load_dataset("openai/gsm8k", "main")
    except Exception as error:
        raise RuntimeError("could not load openai/gsm8k from the hub; pass --local-dir for a local copy") from error
    return {split: list(dataset[split]) for split in SPLITS}


def write_parquet(cfg: GSM8KConfig) -> tuple[str, str]:
    """Convert both splits and write train.parquet and test.parquet in cfg.out_dir; return their paths."""
    examples = load_hub() if cfg.local_dir is None else {s: load_local(cfg.local_dir, s) for s in SPLITS}
    return write_splits(cfg.out_dir, {s: [to_row(e, s, i) for i, e in enumerate(examples[s])] for s in SPLITS})


if __name__ == "__main__":
    for path in write_parquet(tyro.cli(GSM8KConfig)):
        print(path)
