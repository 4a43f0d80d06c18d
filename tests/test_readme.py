"""What the README says runs, runs: its CPU walk-throughs are run as written, and every command in it parses.

    python -m pytest tests/test_readme.py -q

- The "Your own data" block and the tools block ("Tools and multi-turn") are extracted from README.md and run with
  bash in a fresh folder (the repository's modules linked in, nothing else): each exits 0, and the held-out accuracy
  after RL beats the warm start's.
- Every `python X.py`, `python -m M` and `torchrun ... X.py` command in the README's bash blocks (and the flags a
  `scripts/slurm_ray.sh` line passes on to ray_trainer.py) is parsed by that entry point's own tyro call, run as
  __main__ with tyro.cli stopped right after it parses: a renamed flag, a removed option or a default that clashes
  with the command fails here. Nothing loads or runs. A path the command needs that a fresh clone does not hold (a
  downloaded model, a parquet or a folder that an earlier line of the block writes) is given a stand-in: a model
  folder that sft.py writes from the built-in tiny policy gets its config and recorded values, any other one a real
  model's context (Qwen2.5's 32,768 positions).
"""

import json
import os
import re
import runpy
import shlex
import subprocess
import sys

import pytest
import tyro

from config import TASK_VALUES, Config, with_task_values

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
README = os.path.join(ROOT, "README.md")


def bash_blocks() -> list[tuple[str, str]]:
    """(the section heading above it, its text) for each ```bash block of the README."""
    text, out, heading = open(README).read(), [], ""
    for match in re.finditer(r"^(#+ [^\n]*)$|^```bash\n(.*?)^```", text, re.M | re.S):
        if match.group(1):
            heading = match.group(1).lstrip("# ")
        else:
            out.append((heading, match.group(2)))
    return out


def block(heading: str) -> str:
    """The first bash block under the section `heading`."""
    found = [body for h, body in bash_blocks() if h == heading]
    assert found, f"README.md has no bash block under a heading {heading!r}"
    return found[0]


def commands(body: str) -> list[list[str]]:
    """The simple commands of a bash block as argv lists: heredoc bodies dropped, continuations joined, comments
    cut, split at && ; | and with leading VAR=value assignments removed."""
    lines, skip_until = [], None
    for line in body.splitlines():
        if skip_until is not None:
            skip_until = None if line.strip() == skip_until else skip_until
            continue
        if heredoc := re.search(r"<<-?\s*'?(\w+)'?", line):
            skip_until = heredoc.group(1)
            line = line[: heredoc.start()]
        lines.append(line)
    out = []
    for line in "\n".join(lines).replace("\\\n", " ").splitlines():
        lexer = shlex.shlex(line, posix=True, punctuation_chars=";&|")
        lexer.whitespace_split = True
        argv = []
        for token in list(lexer) + [";"]:
            if token in (";", "&&", "||", "|", "&"):
                while argv and re.fullmatch(r"[A-Z_]+=\S*", argv[0]):
                    argv.pop(0)
                if argv:
                    out.append(argv)
                argv = []
            else:
                argv.append(token)
    return out


def entry_point(argv: list[str]) -> tuple[str, str, list[str]] | None:
    """(kind "path" or "module", the script or module, its arguments) of a README command that runs one of ours."""
    if argv[0] in ("python", "python3") and len(argv) > 1:
        if argv[1] == "-m" and os.path.isfile(os.path.join(ROOT, *argv[2].split(".")) + ".py"):  # ours, not pip's
            return "module", argv[2], argv[3:]
        if argv[1].endswith(".py"):
            return "path", argv[1], argv[2:]
    if argv[0] == "torchrun":
        first = next(i for i, a in enumerate(argv) if a.endswith(".py"))
        return "path", argv[first], argv[first + 1 :]
    if "scripts/slurm_ray.sh" in argv:  # its arguments go to ray_trainer.py
        return "path", "ray_trainer.py", argv[argv.index("scripts/slurm_ray.sh") + 1 :]
    return None


def readme_commands() -> list[tuple[str, tuple, dict]]:
    """(a test id, the entry point, the sft.py output folders written earlier in its block: {out_dir: argv})."""
    out = []
    for heading, body in bash_blocks():
        sft_outputs = {}
        for argv in commands(body):
            target = entry_point(argv)
            if target is None:
                continue
            out.append((f"{heading}: {' '.join(argv)}"[:150], target, dict(sft_outputs)))
            if target[1] == "sft.py" and "--out-dir" in target[2]:
                sft_outputs[target[2][target[2].index("--out-dir") + 1]] = target[2]
    return out


class Parsed(Exception):
    """Raised by the stopped tyro.cli with what it parsed."""

    def __init__(self, config):
        self.config = config


PATH_FLAGS = {"--model-path": "model", "--critic-model-path": "model", "--train-files": "file",
              "--val-files": "file", "--reward-fn-path": "file", "--agent.tools-path": "file",
              "--reward-model-path": "reward model"}


def parse(kind: str, target: str, argv: list[str], monkeypatch):
    """What the entry point's own tyro.cli makes of argv (None for --help), run as __main__ from the repo root;
    a parse error fails the test with tyro's message."""
    real = tyro.cli

    def parse_only(*args, **kwargs):
        raise Parsed(real(*args, **kwargs))

    monkeypatch.setattr(tyro, "cli", parse_only)
    monkeypatch.setattr(sys, "argv", [target, *argv])
    monkeypatch.chdir(ROOT)
    path = os.path.join(ROOT, target) if kind == "path" else None
    monkeypatch.syspath_prepend(os.path.dirname(path) if path else ROOT)  # as python puts the script's folder first
    source = open(path).read() if path else open(os.path.join(ROOT, *target.split(".")) + ".py").read()
    assert "tyro.cli(" in source, f"{target} has no tyro.cli to parse its flags with (it would run for real)"
    try:
        runpy.run_path(path, run_name="__main__") if path else runpy.run_module(target, run_name="__main__")
    except Parsed as parsed:
        return parsed.config
    except SystemExit as e:
        if e.code == 0 and "--help" in argv:
            return None
        raise AssertionError(f"{target} {' '.join(argv)}: exit {e.code} in the parser") from None
    raise AssertionError(f"{target} ran past its tyro.cli call")


def stand_ins(argv: list[str], sft_outputs: dict, root, monkeypatch) -> list[str]:
    """argv with each path it needs that a fresh clone lacks replaced by a stand-in under root (see the docstring)."""
    argv = list(argv)
    for i, flag in enumerate(argv[:-1]):
        if flag not in PATH_FLAGS:
            continue
        paths = []
        for value in argv[i + 1].split(","):
            if os.path.exists(os.path.join(ROOT, value)):
                paths.append(value)
                continue
            stand_in = root / re.sub(r"[^\w.-]", "_", value.strip("/")) if value != "..." else root / flag.strip("-")
            if PATH_FLAGS[flag] == "file":
                stand_in.touch()
            else:
                stand_in.mkdir(exist_ok=True)
                config = {"model_type": "qwen2", "max_position_embeddings": 32768}  # a real model's (Qwen2.5's)
                if value in sft_outputs and "--model-path" not in sft_outputs[value]:  # sft.py's tiny policy
                    sft = parse("path", "sft.py", stand_ins(sft_outputs[value], {}, root, monkeypatch), monkeypatch)
                    config = {"max_position_embeddings": 512}  # tiny.build_tiny_qwen2's
                    (stand_in / "sft_result.json").write_text(json.dumps({"rl_values": TASK_VALUES[sft.task]}))
                if PATH_FLAGS[flag] == "reward model":  # reward_model.py's output: a scalar head
                    config.update(architectures=["Qwen2ForTokenClassification"], id2label={"0": "LABEL_0"})
                (stand_in / "config.json").write_text(json.dumps(config))
            paths.append(str(stand_in))
        argv[i + 1] = ",".join(paths)
    return argv


@pytest.mark.parametrize("where, target, sft_outputs", readme_commands(), ids=lambda v: v if isinstance(v, str)
                         else "")
def test_every_readme_command_parses(where, target, sft_outputs, tmp_path, monkeypatch, capsys):
    kind, script, argv = target
    config = parse(kind, script, stand_ins(argv, sft_outputs, tmp_path, monkeypatch), monkeypatch)
    if isinstance(config, Config):
        with_task_values(config, is_main=False)  # the values the run applies, validated again
    elif type(config).__name__ == "RayTrainerConfig":
        from ray_trainer import check
        check(with_task_values(config.run, is_main=False), config.ray)


def test_the_readme_commands_are_all_found():
    """The parser of bash blocks finds what a reader sees (so the test above cannot pass by finding nothing)."""
    found = {(t[1], " ".join(t[2])) for _, t, _ in readme_commands()}
    assert ("grpo.py", "") in found and ("ray_trainer.py", "--ray.dashboard") in found
    assert ("data.arith", "--ops + --out-dir data/arith") in found
    assert any(s == "ray_trainer.py" and a.startswith("--model-path /path/to/model") for s, a in found)  # slurm
    assert sum(s == "grpo.py" for s, _ in found) >= 25
    assert commands("A=1 python x.py --a 'b c' && cat > f <<'PY'\nbody\nPY\npython y.py \\\n  --z 1  # note") == [
        ["python", "x.py", "--a", "b c"], ["cat", ">", "f"], ["python", "y.py", "--z", "1"]]


# ---- The walk-throughs, run -----------------------------------------------------------------------


def run_block(heading: str, folder) -> str:
    """Run the README's first bash block under `heading` with bash -e in folder, which holds links to the
    repository's modules and nothing else; returns its output, failing the test (with the output's end) on an error."""
    for name in os.listdir(ROOT):
        if name.endswith(".py") or name == "data":
            os.symlink(os.path.join(ROOT, name), folder / name)
    log = folder / "block.log"
    with open(log, "w") as f:
        done = subprocess.run(["bash", "-e", "-c", block(heading)], cwd=folder, stdout=f, stderr=subprocess.STDOUT,
                              env={**os.environ, "PYTHONPATH": ""}, timeout=900)
    output = log.read_text()
    assert done.returncode == 0, f"the README's {heading!r} block exited {done.returncode}:\n{output[-3000:]}"
    return output


def accuracies(metrics_path) -> list[float]:
    return [r["val/accuracy"] for r in map(json.loads, open(metrics_path)) if "val/accuracy" in r]


def test_the_readme_own_data_block_runs_and_rl_lifts_the_warm_start(tmp_path):
    output = run_block("Your own data", tmp_path)
    sft = json.load(open(tmp_path / "out/mytask-sft/sft_result.json"))
    assert 0.1 <= sft["val/accuracy"] <= 0.9  # the sloppy teacher's habit: greedy is right on some words, not most
    assert sft["val/accuracy"] == max(h["val/accuracy"] for h in sft["history"])  # the best evaluation kept
    # the folder carries the tiny policy's values, which the RL run applies (and says so once)
    assert sft["rl_values"]["lr"] == TASK_VALUES["arith"]["lr"]
    assert output.count("model_path=out/mytask-sft (sft.py from the built-in tiny policy): lr=0.0002") == 1
    accuracy = accuracies(tmp_path / "out/mytask/metrics.jsonl")
    # RL scores the warm start as sft.py did (the same reward dispatch; vLLM's greedy instead of HF's), then lifts it
    assert abs(accuracy[0] - sft["val/accuracy"]) <= 0.03, (accuracy[0], sft["val/accuracy"])
    assert accuracy[-1] >= sft["val/accuracy"] + 0.2 and accuracy[-1] >= 0.8, accuracy
    assert (tmp_path / "out/mytask/curves.png").is_file()


def test_the_readme_tools_block_runs_and_rl_lifts_the_warm_start(tmp_path):
    run_block("Tools and multi-turn (`agent.py`)", tmp_path)
    records = [json.loads(line) for line in open(tmp_path / "out/lookup/metrics.jsonl")]
    accuracy = accuracies(tmp_path / "out/lookup/metrics.jsonl")
    calls = [r["val/tool_call_rate"] for r in records if "val/tool_call_rate" in r]
    assert accuracy[-1] >= accuracy[0] + 0.3 and calls[-1] > calls[0], (accuracy, calls)  # RL learns to call
    assert accuracy[-1] <= calls[-1]  # the code cannot be guessed: every right answer called the user's tool
