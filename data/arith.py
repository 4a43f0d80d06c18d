"""The built-in arithmetic task: prompts like "12+34=" and an exact-integer verifier.

Write data/arith/train.parquet and data/arith/val.parquet (verl's RL schema):
    python -m data.arith
    python -m data.arith --out-dir /tmp/arith --n-train 5000 --ops "+-*" --digits 3
Score a response from python:
    python -c "from data.arith import compute_score; print(compute_score('46', '46'))"
Test:
    python -m pytest tests/test_data.py -q
"""

import operator
import random
import re
from dataclasses import dataclass

import tyro

from data import rl_row, write_splits

_OPS = {"+": operator.add, "-": operator.sub, "*": operator.mul}


@dataclass
class ArithConfig:
    out_dir: str = "data/arith"
    """Folder for train.parquet and val.parquet (created if missing)."""
    n_train: int = 20000
    """Number of training problems (drawn with replacement, never one of the val problems)."""
    n_val: int = 200
    """Number of validation problems."""
    ops: str = "+-"
    """Operators to draw from: characters among + - *."""
    digits: int = 2
    """Max digits per operand: operands are uniform in [0, 10**digits - 1]."""
    operands: int = 2
    """Numbers per expression (2: "12+34"; 3: "1+2*3", with the usual precedence of *)."""
    seed: int = 0
    """Base seed; train and val draw from different seeds derived from it."""
    pad_operands: bool = True
    """Write operands zero-padded to `digits` ("07+45="): every digit sits at a fixed offset from the "=",
    which a tiny model learns several times faster than the ragged layout ("7+45=")."""
    teacher_slip: float = 0.0
    """The SFT teacher's habit: in a sum, it forgets each carry with this chance (58+67 -> 15 when it
    forgets both). It is right on other operators and when slip is 0. RL rewards always use the true answer."""

    def __post_init__(self):
        if not self.ops or set(self.ops) - set(_OPS):
            raise ValueError(f"ops={self.ops!r}: use one or more characters among {''.join(_OPS)!r}")
        for name, low in (("digits", 1), ("operands", 2), ("n_train", 1), ("n_val", 1)):
            if getattr(self, name) < low:
                raise ValueError(f"{name}={getattr(self, name)}: must be >= {low}")
        if not 0.0 <= self.teacher_slip <= 1.0:
            raise ValueError(f"teacher_slip={self.teacher_slip}: must be in [0, 1]")
        # train skips every val expression, so at least one expression must be left for it
        count = (10**self.digits) ** self.operands * len(set(self.ops)) ** (self.operands - 1)  # distinct expressions
        if self.n_val >= count:
            raise ValueError(f"n_val={self.n_val}: must be below the {count} distinct expressions")


def make_problems(cfg: ArithConfig, n: int, seed: int, exclude: frozenset[str] = frozenset()) -> list[dict]:
    """Draw n problems {"expression", "answer", "teacher_answer"}, deterministic by seed, skipping exclude."""
    rng, teacher_rng = random.Random(seed), random.Random(f"teacher-{seed}")  # the teacher never shifts problems
    ops = sorted(set(cfg.ops))
    problems = []
    while len(problems) < n:
        numbers = [rng.randrange(10**cfg.digits) for _ in range(cfg.operands)]
        signs = [rng.choice(ops) for _ in range(cfg.operands - 1)]
        width = cfg.digits if cfg.pad_operands else 1
        expression = "".join(f"{op}{x:0{width}d}" for op, x in zip([""] + signs, numbers))
        if expression not in exclude:
            value = evaluate(numbers, signs)
            taught = teacher_sum(numbers, cfg.teacher_slip, teacher_rng) if set(signs) == {"+"} else value
            problems.append({"expression": expression, "answer": str(value), "teacher_answer": str(taught)})
    return problems


def teacher_sum(numbers: list[int], slip: float, rng: random.Random) -> int:
    """A sloppy teacher's column addition: each carry is forgotten with chance slip (a systematic mistake, which
    the warm start learns and RL unlearns: see sft.py)."""
    digits, carry = [], 0
    while any(numbers) or carry:
        if carry and rng.random() < slip:
            carry = 0
            if not any(numbers):  # a forgotten final carry loses the leading digit
                break
        column = sum(x % 10 for x in numbers) + carry
        digits.append(column % 10)
        carry, numbers = column // 10, [x // 10 for x in numbers]
    return int("".join(map(str, reversed(digits))) or "0")


def evaluate(numbers: list[int], signs: list[str]) -> int:
    """The value of numbers[0] signs[0] numbers[1] ...: products first, then + and - left to right."""
    terms, term_signs = [numbers[0]], []
    for op, x in zip(signs, numbers[1:]):
        if op == "*":
            terms[-1] *= x
        else:
            terms.append(x)
            term_signs.append(op)
    value = terms[0]
    for op, x in zip(term_signs, terms[1:]):
        value = _OPS[op](value, x)
    return value


def to_row(problem: dict, split: str, index: int) -> dict:
    """One problem as a row of verl's RL schema; the prompt is the bare expression, which a tiny policy reads."""
    return rl_row("arith", problem["expression"] + "=", problem["answer"], {"split": split, "index": index, **problem})


def make_splits(cfg: ArithConfig) -> tuple[list[dict], list[dict]]:
    """(train_rows, val_rows); no val expression appears in train."""
    val = make_problems(cfg, cfg.n_val, seed=2 * cfg.seed + 1)  # 2s and 2s+1 never collide, whatever the base seed
    train = make_problems(cfg, cfg.n_train, seed=2 * cfg.seed, exclude=frozenset(p["expression"] for p in val))
    return [to_row(p, "train", i) for i, p in enumerate(train)], [to_row(p, "val", i) for i, p in enumerate(val)]


def write_parquet(cfg: ArithConfig) -> tuple[str, str]:
    """Write train.parquet and val.parquet in cfg.out_dir; return their paths."""
    train, val = make_splits(cfg)
    return write_splits(cfg.out_dir, {"train": train, "val": val})


# An integer, optionally negative, plain (1234) or with thousands separators (1,234), never part of a larger token:
# "5-3" reads as 5 and 3, "3.5" yields nothing but a sentence-ending "46." yields 46, "12,34" is no number.
_INTEGER = re.compile(
    r"""
    (?<![0-9.,])                        # not inside another number; "5-3" has no sign
    (-?(?:[0-9]{1,3}(?:,[0-9]{3})+|[0-9]+))
    (?![0-9]|[.,][0-9])                 # not followed by more digits or a decimal part
    """,
    re.VERBOSE,
)


def compute_score(solution_str: str, ground_truth: str) -> float:
    """1.0 if the last integer (_INTEGER) in solution_str equals ground_truth ("1,234" is 1234), else 0.0."""
    found = _INTEGER.findall(solution_str)
    return 1.0 if found and int(found[-1].replace(",", "")) == int(ground_truth) else 0.0


if __name__ == "__main__":
    for path in write_parquet(tyro.cli(ArithConfig)):
        print(path)
