"""The built-in task that needs a tool: products of 2-3 by 3 digits ("123*456=", 4-6 digit answers, beyond the tiny
policy's reach) with a calculator tool. This file is also the task's tool file (agent.py reads TOOLS) and verifier.

    python grpo.py --task calculator            # warm start, then RL with the tool (README: "Tools and multi-turn")
    python -m data.calculator                   # data/calculator/{train,val}.parquet
    python -c "from data.calculator import calc; print(calc('123*456'))"
    python -m pytest tests/test_agent.py -q

A call is the text between "<<" and "=" and the tool's answer comes back as "56088>>" (AGENT: the agent loop's
format for this task; "=" is one token of the byte tokenizer, on which generation stops), so a response that uses
the tool reads "<<123*456=56088>>56088", one that does not "56088". The warm start (sft.py) learns the tool's use
from traces that always call it (extra_info.tool_answer), then from a teacher who calls it for a random share
(teacher_call_rate) and answers the rest at once (extra_info.teacher_answer): RL has to learn that calling pays.
Only the text after the last tool output is the answer: copying the output is the model's work.
"""

import ast
import operator
import os
import random
from dataclasses import dataclass

import tyro

from data import arith, rl_row, write_splits

AGENT = dict(tools_path=os.path.abspath(__file__), call_start="<<", call_end="=", observation="{result}>>")
_OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul}


@dataclass
class CalculatorConfig:
    out_dir: str = "data/calculator"
    """Folder for train.parquet and val.parquet (created if missing)."""
    n_train: int = 20000
    """Training problems (drawn with replacement, never one of the val problems)."""
    n_val: int = 200
    """Validation problems."""
    teacher_call_rate: float = 0.2
    """The share of the SFT teacher's answers that call the tool (the rest answer at once, right)."""
    seed: int = 0
    """Base seed; train and val draw from different seeds derived from it."""

    def __post_init__(self):
        if not 0.0 <= self.teacher_call_rate <= 1.0:
            raise ValueError(f"teacher_call_rate={self.teacher_call_rate}: must be in [0, 1]")
        if self.n_train < 1 or self.n_val < 1:
            raise ValueError(f"n_train={self.n_train}, n_val={self.n_val}: both must be >= 1")


def calc(expression: str) -> int:
    """The value of an arithmetic expression of integers with + - * and parentheses, e.g. calc("123*456")."""

    def value(node):
        if isinstance(node, ast.Constant) and type(node.value) is int:
            return node.value
        if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
            return _OPS[type(node.op)](value(node.left), value(node.right))
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
            return -value(node.operand)
        raise ValueError(f"not an integer expression of + - *: {expression!r}")

    if len(expression) > 100:
        raise ValueError(f"expression of {len(expression)} characters: at most 100")
    return value(ast.parse(expression.strip(), mode="eval").body)


TOOLS = [calc]


def teacher_trace(expression: str, answer: int, calls: bool) -> str:
    """The teacher's response: through the tool ("<<e=v>>v") or at once ("v")."""
    return f"{AGENT['call_start']}{expression}{AGENT['call_end']}{AGENT['observation'].format(result=answer)}{answer}" \
        if calls else str(answer)


def make_rows(cfg: CalculatorConfig, n: int, seed: int, split: str, exclude: frozenset = frozenset()) -> list[dict]:
    """n problems in verl's RL schema, deterministic by seed, skipping the expressions in exclude."""
    rng, teacher = random.Random(seed), random.Random(f"teacher-{seed}")  # the teacher never shifts problems
    rows = []
    while len(rows) < n:
        a, b = rng.randrange(10, 1000), rng.randrange(100, 1000)
        expression = f"{a}*{b}"
        if expression not in exclude:
            trace = teacher_trace(expression, a * b, teacher.random() < cfg.teacher_call_rate)
            rows.append(rl_row("calculator", expression + "=", str(a * b), {
                "split": split, "index": len(rows), "expression": expression, "answer": str(a * b),
                "tool_answer": teacher_trace(expression, a * b, True), "teacher_answer": trace}))
    return rows


def write_parquet(cfg: CalculatorConfig) -> tuple[str, str]:
    """Write train.parquet and val.parquet in cfg.out_dir; return their paths."""
    val = make_rows(cfg, cfg.n_val, 2 * cfg.seed + 1, "val")
    train = make_rows(cfg, cfg.n_train, 2 * cfg.seed, "train", frozenset(r["extra_info"]["expression"] for r in val))
    return write_splits(cfg.out_dir, {"train": train, "val": val})


def compute_score(solution_str: str, ground_truth: str) -> float:
    """arith's verifier on the text after the last tool output (">>"): the model must write the answer itself."""
    return arith.compute_score(solution_str.rsplit(AGENT["observation"].format(result=""), 1)[-1], ground_truth)


if __name__ == "__main__":
    for path in write_parquet(tyro.cli(CalculatorConfig)):
        print(path)
