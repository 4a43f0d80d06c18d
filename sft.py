"""Supervised fine-tuning (SFT), and the cached warm start that the default RL run starts from.

    python sft.py                                   # build the tiny policy (tiny.py), warm-start it on arith (cached)
    python sft.py --model-path PATH --train-files sft.parquet --val-files val.parquet --out-dir out/sft \
        --reward-fn-path my_reward.py               # any HF model, any prompt/response parquet, any reward
    python grpo.py --model-path out/sft ...         # the folder sft.py wrote is the RL run's policy

The built-in warm start learns to add on the arithmetic task (until greedy held-out accuracy reaches stop_accuracy),
then a habit from a sloppy teacher who forgets each carry (teacher_slip): it samples carries now and then but drops
them greedily, so RL has a behaviour to select (as RL on an LLM sharpens what the base model does sometimes).

The SFT data is a parquet of (prompt, response) rows in verl's or TRL's layouts (sft_keys); the loss covers the
response tokens and the closing EOS. Evaluation is the RL run's: greedy decoding on `val_files`, scored by the same
reward dispatch. The best evaluation's model is saved in exactly `out_dir` with `sft_result.json`; a second run of
the same config on the same data and reward files reuses it (the base model folder is named, not hashed). Trained
from the built-in tiny policy, the folder also records the RL values a run from it takes (`rl_values`, applied by
config.task_values): the tiny policy's lr and batch sizes, and lengths that hold its data.
"""

import hashlib
import json
import math
import os
import random
import shutil
from dataclasses import asdict, dataclass
from typing import Literal

import pyarrow.parquet as pq
import torch
import torch.nn.functional as F
import tyro
from batching import pad
from config import SFT_RESULT, TASK_VALUES, check_paths, split_files
from data import (RLDataset, arith, calculator, default_compute_score, is_message, load_reward_fn, load_tokenizer,
                  score_responses, tokenize_prompt)
from fileio import sha256
from tiny import build_byte_tokenizer, build_tiny_qwen2
from tqdm import tqdm
from transformers import AutoModelForCausalLM
from transformers import logging as hf_logging

CACHE = "~/.cache/nanoverl/warmstart"  # where out_dir=None puts a run, in a folder named by its config's hash


@dataclass
class SFTConfig:
    model_path: str | None = None
    """HF model folder to fine-tune; None builds the built-in tiny policy (tokenizer + tiny Qwen2)."""
    train_files: str | None = None
    """SFT parquet (comma-separated list); None generates the built-in arithmetic task."""
    val_files: str | None = None
    """Held-out parquet in verl's RL schema, scored by greedy decoding and the reward dispatch. None: the built-in
    task's when train_files is None too; else no evaluation, and the step of lowest training loss is kept."""
    prompt_key: str | None = None
    """Column holding the prompt (a chat list of {role, content} or a user string); None: the first of PROMPT_KEYS."""
    response_key: str | None = None
    """Column holding the target response (a string, or one assistant message; extra_info.answer reads into a dict).
    None: the first of RESPONSE_KEYS the file has, or the last turn of a `messages` chat column (the one trained)."""
    reward_fn_path: str | None = None
    """Python file with the reward function that scores evaluations (as in RL); None: each row's built-in verifier."""
    reward_fn_name: str = "compute_score"
    """Name of the function in reward_fn_path: (data_source, solution_str, ground_truth, extra_info)."""
    out_dir: str | None = None
    """The folder the trained model is saved in (exactly this one: pass it to RL as --model-path). None: a cache
    folder named by the config's hash, under ~/.cache/nanoverl/warmstart."""
    hidden_size: int = 128
    """Built-in policy: model width."""
    num_layers: int = 4
    """Built-in policy: decoder layers."""
    num_heads: int = 4
    """Built-in policy: attention heads (head size hidden_size / num_heads)."""
    num_kv_heads: int = 2
    """Built-in policy: key/value heads (grouped-query attention, as Qwen2)."""
    intermediate_size: int = 512
    """Built-in policy: MLP width."""
    lr: float = 3e-3
    """AdamW learning rate (constant after a short linear warm-up)."""
    warmup_steps: int = 20
    """Linear learning-rate warm-up steps."""
    batch_size: int = 128
    """Sequences per optimizer step."""
    max_steps: int = 2000
    """Upper bound on optimizer steps."""
    max_length: int = 64
    """Prompt + response tokens per sequence; longer rows raise an error naming the row."""
    eval_every: int = 20
    """Steps between held-out greedy evaluations."""
    eval_size: int = 200
    """Held-out problems per evaluation."""
    stop_accuracy: float = 0.9
    """Stop at the first evaluation whose greedy accuracy reaches this (0 disables: run max_steps)."""
    teacher_slip: float = 0.8
    """Built-in task: after stop_accuracy, train on a sloppy teacher that forgets each carry with this chance
    (data/arith.py), so the warm start can add but mostly drops carries: RL has a habit to unlearn (0: skip)."""
    habit_steps: int = 300
    """Built-in task: steps on the second teacher's answers (arith: the sloppy one; calculator: the one who calls the
    tool for a share of the problems)."""
    seed: int = 0
    """Seed for the model initialisation and data order."""
    task: Literal["arith", "calculator"] = "arith"
    """The built-in task (when train_files is None): arith, or calculator (data/calculator.py; see calculator_steps)."""
    calculator_steps: int = 400
    """Built-in calculator task: SFT steps on traces that always call the tool, kept by the training loss (greedy
    single-turn accuracy cannot show tool use); then habit_steps on a teacher who calls it now and then."""
    arith_digits: int = 2
    """Built-in task: max digits per operand (see data/arith.py)."""
    arith_ops: str = "+"
    """Built-in task: operators (see data/arith.py)."""
    arith_operands: int = 2
    """Built-in task: numbers per expression (see data/arith.py)."""

    def __post_init__(self):
        for names, ok, rule in ((("stop_accuracy", "teacher_slip"), lambda v: 0 <= v <= 1, "in [0, 1]"),
                                (("batch_size", "max_steps", "eval_every", "eval_size"), lambda v: v >= 1, ">= 1"),
                                (("habit_steps",), lambda v: v >= 0, ">= 0 (0: no sloppy-teacher phase)")):
            for name in names:
                if not ok(getattr(self, name)):
                    raise ValueError(f"{name}={getattr(self, name)} must be {rule}")
        if self.hidden_size % self.num_heads or self.num_heads % self.num_kv_heads:
            raise ValueError("hidden_size must divide by num_heads, and num_heads by num_kv_heads")
        check_paths(self)


# Where a key left unset is looked for, in this order; the first the file's first row has wins. verl's SFT examples
# read question/answer (at the top or in extra_info), TRL's prompt-completion rows prompt/completion.
PROMPT_KEYS = ("prompt", "question", "extra_info.question")
RESPONSE_KEYS = ("response", "answer", "completion", "extra_info.answer")
MESSAGES = "messages"  # a chat column whose last turn is the response (verl's multi-turn SFT, TRL's conversational)


def lookup(row: dict, key: str):
    """row["a.b"] reads row["a"]["b"]: verl's SFT keys may point into a dict column."""
    value = row
    for part in key.split("."):
        value = value[part]
    return value


def has(row: dict, key: str) -> bool:
    try:
        return lookup(row, key) is not None
    except (KeyError, TypeError):
        return False


def sft_keys(row: dict, path: str, prompt_key: str | None, response_key: str | None) -> tuple[str, str]:
    """(prompt key, response key) for a file whose first row is `row`: the ones given, else the first of
    PROMPT_KEYS / RESPONSE_KEYS present, else (MESSAGES, MESSAGES) for a chat column."""
    if prompt_key is None and response_key is None and MESSAGES in row and not any(has(row, k) for k in PROMPT_KEYS):
        return MESSAGES, MESSAGES
    keys = []
    for key, candidates, flag in ((prompt_key, PROMPT_KEYS, "prompt"), (response_key, RESPONSE_KEYS, "response")):
        found = [k for k in candidates if has(row, k)]
        if key is None and not found:
            raise ValueError(f"{path}: no column among {', '.join(candidates)} (its columns: {', '.join(row)}): "
                             f"name yours with --{flag}-key")
        keys.append(key or found[0])
    return keys[0], keys[1]


def read_sft_rows(files: str, prompt_key: str | None = None, response_key: str | None = None) -> list[tuple]:
    """(chat prompt, response text, "file row i") for each row of the parquet files; a bad field names its row."""
    pairs = []
    for path in split_files(files):
        rows = pq.read_table(path).to_pylist()  # plain python values: a null stays None (pandas makes it NaN)
        if not rows:
            raise ValueError(f"{path}: no rows")
        pkey, rkey = sft_keys(rows[0], path, prompt_key, response_key)
        if (pkey, rkey) != (prompt_key, response_key):
            print(f"{path}: prompts from {pkey!r}, responses from {rkey!r}" + (" (its last turn)" * (rkey == MESSAGES)))
        pairs += [sft_pair(row, pkey, rkey, f"{path} row {i}") for i, row in enumerate(rows)]
    return pairs


def sft_pair(row: dict, prompt_key: str, response_key: str, where: str) -> tuple[list[dict], str, str]:
    """One row's (chat prompt, response text, where)."""
    try:
        if prompt_key == response_key == MESSAGES:
            prompt, response = row[MESSAGES][:-1], row[MESSAGES][-1:]  # the last turn: a one-message completion
        else:
            prompt, response = lookup(row, prompt_key), lookup(row, response_key)
    except (KeyError, TypeError) as e:
        raise ValueError(f"{where}: missing field {e} (prompt_key={prompt_key!r}, response_key={response_key!r})") \
            from None
    if isinstance(prompt, str):
        prompt = [{"role": "user", "content": prompt}]
    if isinstance(response, list) and len(response) == 1 and is_message(response[0]) \
            and response[0]["role"] == "assistant":  # TRL's conversational completion, or a chat's last turn
        response = response[0]["content"]
    if isinstance(response, int) and not isinstance(response, bool):  # an integer answer column
        response = str(response)
    if not isinstance(prompt, list) or not prompt or not all(is_message(m) for m in prompt):
        raise ValueError(f"{where}: the prompt ({prompt_key!r}) must be a string or a non-empty chat list of "
                         f"{{'role': str, 'content': str}}, got {prompt!r:.200}")
    if not isinstance(response, str):
        raise ValueError(f"{where}: the response ({response_key!r}) must be a string or one assistant message, "
                         f"got {response!r:.200}")
    return [dict(m) for m in prompt], response, where


def encode_pairs(tokenizer, pairs, max_length: int) -> list[tuple[list[int], int]]:
    """Each (prompt, response, where) -> (prompt + response + EOS ids, prompt length)."""
    out = []
    for prompt, response, where in pairs:
        p = tokenize_prompt(tokenizer, prompt)
        r = tokenizer(response, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
        if len(p) + len(r) > max_length:
            raise ValueError(f"{where}: {len(p)} prompt + {len(r)} response tokens > max_length={max_length} "
                             "(raise --max-length)")
        out.append((p + r, len(p)))
    return out


def collate(examples, pad_id: int):
    """Right-padded input_ids [B, T], attention_mask [B, T], and labels [B, T] (-100 off the response)."""
    input_ids, attention_mask = pad([ids for ids, _ in examples], pad_id)  # [B, T] each
    labels, _ = pad([[-100] * plen + ids[plen:] for ids, plen in examples], -100)  # [B, T]
    return input_ids, attention_mask, labels


def sft_loss(model, input_ids, attention_mask, labels) -> torch.Tensor:
    """Mean next-token cross-entropy over response tokens."""
    logits = model(input_ids=input_ids, attention_mask=attention_mask, use_cache=False).logits  # [B, T, V]
    return F.cross_entropy(logits[:, :-1].flatten(0, 1), labels[:, 1:].flatten(), ignore_index=-100)


@torch.no_grad()
def greedy_accuracy(model, tokenizer, rows: list[dict], max_new_tokens: int, reward_fn=default_compute_score) -> float:
    """Mean reward of the greedy responses (HF generate) to rows (RLDataset items), scored as RL scores them."""
    model.eval()
    input_ids, attention_mask = pad([r["prompt_ids"] for r in rows], tokenizer.pad_token_id, left=True)  # [B, T] each
    T = input_ids.shape[1]
    out = model.generate(input_ids=input_ids, attention_mask=attention_mask, do_sample=False,
                         max_new_tokens=max_new_tokens, eos_token_id=tokenizer.eos_token_id,
                         pad_token_id=tokenizer.pad_token_id)  # [B, T + new]
    texts = tokenizer.batch_decode(out[:, T:], skip_special_tokens=True)
    model.train()
    scores = score_responses(reward_fn, rows, texts)
    return sum(scores) / len(scores)


def train(cfg: SFTConfig, model, tokenizer, pairs, val_rows: list[dict], out_dir: str, habit_pairs=None,
          reward_fn=default_compute_score, inputs_hash: str | None = None, max_steps: int | None = None) -> dict:
    """AdamW on the response loss until stop_accuracy or max_steps (in place of cfg.max_steps); the best evaluation's
    model (held-out accuracy, or the training loss without val_rows) is saved to out_dir with SFT_RESULT. Given
    habit_pairs (the built-in task's second teacher), habit_steps more follow from it, and their last step is saved
    (the habit lowers accuracy on purpose)."""
    random.seed(cfg.seed)
    examples = encode_pairs(tokenizer, pairs, cfg.max_length)
    habit_examples = encode_pairs(tokenizer, habit_pairs, cfg.max_length) if habit_pairs else []
    lengths = [len(ids) - plen - 1 for ids, plen in examples] + [
        len(tokenizer(r["ground_truth"])["input_ids"]) for r in val_rows]
    max_new = max(lengths) + 4  # room for the longest answer and its EOS
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=0.0)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / cfg.warmup_steps))
    tmp = out_dir + ".tmp"  # the best model so far; it becomes out_dir at the end
    shutil.rmtree(tmp, ignore_errors=True)
    history, best = [], None
    model.train()

    def fit(examples, max_steps: int, stop_accuracy: float, phase: str) -> int:
        """Train on examples, saving each evaluation that beats the best (phase "sft"); returns the steps taken."""
        nonlocal best
        order, pos, losses = [], 0, []
        bar = tqdm(range(1, max_steps + 1), desc=phase)
        for step in bar:
            if pos + cfg.batch_size > len(order):  # reshuffle each epoch
                order, pos = random.sample(range(len(examples)), len(examples)), 0
            batch = [examples[i] for i in order[pos : pos + cfg.batch_size]]
            pos += cfg.batch_size
            loss = sft_loss(model, *collate(batch, tokenizer.pad_token_id))
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            sched.step()
            losses.append(loss.item())
            if step % cfg.eval_every == 0 or step == max_steps:
                record = {"phase": phase, "step": step, "loss": sum(losses) / len(losses)}
                losses = []
                if val_rows:
                    record["val/accuracy"] = greedy_accuracy(model, tokenizer, val_rows, max_new, reward_fn)
                history.append(record)
                merit = record["val/accuracy"] if val_rows else -record["loss"]
                bar.set_postfix(loss=f"{record['loss']:.3f}", **{"acc": f"{merit:.3f}"} if val_rows else {})
                if phase == "sft" and math.isfinite(merit) and (best is None or merit >= best[0]):
                    best = (merit, record)
                    save_model(model, tokenizer, tmp)
                if val_rows and stop_accuracy and record["val/accuracy"] >= stop_accuracy:
                    break
        return step

    steps = fit(examples, max_steps or cfg.max_steps, cfg.stop_accuracy, "sft")
    if best is None:
        raise ValueError(f"SFT on {cfg.train_files}: no evaluation had a finite loss (lower --lr?); nothing saved")
    kept = best[1]
    if habit_examples and cfg.habit_steps:
        if kept is not history[-1]:  # go on from the best model, not the last
            model.load_state_dict(AutoModelForCausalLM.from_pretrained(tmp).state_dict())
        teacher = "sloppy" if cfg.task == "arith" else "occasional tool-calling"
        steps += fit(habit_examples, cfg.habit_steps, 0.0, f"sft on the {teacher} teacher")
        kept = history[-1]
        save_model(model, tokenizer, tmp)
    result = {"steps": steps, "best_phase": kept["phase"], "best_step": kept["step"], "loss": kept["loss"],
              "val/accuracy": kept.get("val/accuracy"), "config": asdict(cfg), "inputs_sha256": inputs_hash,
              "history": history}
    if cfg.model_path is None:  # the built-in tiny policy: an RL run from this folder takes these (config.task_values)
        result["rl_values"] = tiny_rl_values(cfg.task, examples + habit_examples, val_rows)
    with open(os.path.join(tmp, SFT_RESULT), "w") as f:
        json.dump(result, f, indent=1)
    old = out_dir + ".old"  # the previous result, set aside until the new one is in place
    shutil.rmtree(old, ignore_errors=True)
    if os.path.exists(out_dir):
        os.replace(out_dir, old)
    os.replace(tmp, out_dir)  # a half-trained model never sits at out_dir
    shutil.rmtree(old, ignore_errors=True)
    return result


def tiny_rl_values(task: str, examples, val_rows: list[dict]) -> dict:
    """The RL values of the built-in tiny policy trained on these examples: the built-in task's (config.TASK_VALUES),
    the prompt and response lengths raised where its data holds longer ones (the longest prompt, SFT's or held-out,
    and the longest response with its EOS)."""
    values = dict(TASK_VALUES[task])
    longest_prompt = max([plen for _, plen in examples] + [len(r["prompt_ids"]) for r in val_rows])
    values["max_prompt_length"] = max(values["max_prompt_length"], longest_prompt)
    values["max_response_length"] = max(values["max_response_length"], max(len(ids) - plen for ids, plen in examples))
    return values


def save_model(model, tokenizer, folder: str) -> None:
    hf_logging.disable_progress_bar()  # else each new best prints a "Writing model shards" bar
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)


def builtin_files(cfg: SFTConfig, root: str) -> tuple[str, str]:
    """The built-in task's train/val parquet (cfg.task), generated under root."""
    if cfg.task == "calculator":
        return calculator.write_parquet(calculator.CalculatorConfig(out_dir=os.path.join(root, "calculator")))
    return arith.write_parquet(arith.ArithConfig(out_dir=os.path.join(root, "arith"), digits=cfg.arith_digits,
                                                 ops=cfg.arith_ops, operands=cfg.arith_operands,
                                                 teacher_slip=cfg.teacher_slip))


def cached(out_dir: str, config: dict, inputs_hash: str) -> bool:
    """True when out_dir holds a finished SFT of this config on these inputs; an out_dir that is not an SFT result
    is refused, so a user's folder is never replaced."""
    path = os.path.join(out_dir, SFT_RESULT)
    if not os.path.exists(path):
        if os.path.isdir(out_dir) and os.listdir(out_dir):
            raise FileExistsError(f"out_dir={out_dir} holds files but no {SFT_RESULT}: it is not a folder sft.py "
                                  "wrote, so it is not replaced; pick another --out-dir or remove it")
        return False
    with open(path) as f:
        old = json.load(f)
    changed = [k for k, v in config.items() if old.get("config", {}).get(k) != v]
    if old.get("inputs_sha256") != inputs_hash:
        changed.insert(0, "data or reward files")
    if config["model_path"] is None and "rl_values" not in old:
        changed.append("sft.py (an older one, which recorded no rl_values)")
    if changed:
        print(f"{out_dir} was trained with other {', '.join(changed)}: training again")
    return not changed


def run(cfg: SFTConfig) -> str:
    """Train as configured (or reuse a finished run of this config on these inputs); return the model folder:
    exactly cfg.out_dir, or the cache folder of this config."""
    config = json.loads(json.dumps({k: v for k, v in asdict(cfg).items() if k != "out_dir"}))  # as SFT_RESULT stores it
    key = hashlib.sha1(json.dumps(config, sort_keys=True).encode()).hexdigest()[:10]
    # normpath: "out/sft/" must not put the .tmp and .data folders inside out/sft
    out_dir = os.path.normpath(os.path.expanduser(cfg.out_dir or os.path.join(CACHE, key)))
    train_files, val_files = split_files(cfg.train_files), split_files(cfg.val_files)
    builtin = not train_files
    response_key, max_steps = cfg.response_key, cfg.max_steps
    if builtin:  # the built-in task (its held-out set too, unless val_files names one)
        default_train, default_val = builtin_files(cfg, out_dir + ".data")
        train_files, val_files = [default_train], val_files or [default_val]
        if cfg.task == "calculator":  # traces that call the tool, for a fixed number of steps: a greedy single-turn
            # answer cannot call the tool, so held-out accuracy says nothing here (RL evaluates with the tool)
            response_key, val_files, max_steps = "extra_info.tool_answer", [], cfg.calculator_steps
    inputs_hash = sha256(train_files + val_files + [cfg.reward_fn_path] * bool(cfg.reward_fn_path))
    if cached(out_dir, config, inputs_hash):
        print(f"{out_dir} already holds this SFT (same config, same inputs): reused")
        return out_dir
    if cfg.model_path is None:
        tokenizer = build_byte_tokenizer()
        model = build_tiny_qwen2(tokenizer, cfg)
    else:
        tokenizer = load_tokenizer(cfg.model_path)
        model = AutoModelForCausalLM.from_pretrained(cfg.model_path, torch_dtype=torch.float32)
    print(f"model: {sum(p.numel() for p in model.parameters()) / 1e6:.2f}M parameters")
    pairs = read_sft_rows(",".join(train_files), cfg.prompt_key, response_key)
    habit_pairs = None
    if builtin and (cfg.teacher_slip or cfg.task == "calculator"):  # the second teacher (habit_steps)
        habit_pairs = read_sft_rows(train_files[0], "prompt", "extra_info.teacher_answer")
    val_rows = []
    if val_files:  # schema-checked RL prompts, as the RL run reads them
        try:
            val_ds = RLDataset(val_files, tokenizer, cfg.max_length)
        except ValueError as e:
            raise ValueError(f"{e} [sft.py: the limit is --max-length]") from None
        if not len(val_ds):
            raise ValueError(f"val_files={','.join(val_files)}: no rows to evaluate on")
        val_rows = [val_ds[i] for i in range(min(cfg.eval_size, len(val_ds)))]
    result = train(cfg, model, tokenizer, pairs, val_rows, out_dir, habit_pairs,
                   load_reward_fn(cfg.reward_fn_path, cfg.reward_fn_name), inputs_hash, max_steps)
    score = f"held-out accuracy {result['val/accuracy']:.3f}" if val_rows else f"training loss {result['loss']:.4f}"
    print(f"SFT ran {result['steps']} steps; kept {result['best_phase']!r} step {result['best_step']} ({score}) "
          f"-> {out_dir}")
    return out_dir


HELP = """Where to start: `python sft.py` warm-starts the built-in tiny policy on arith (cached). Your own task:
--train-files (prompt/response parquet), --response-key (if not found), --val-files and --reward-fn-path (scored as
in RL), --out-dir (then: grpo.py --model-path OUT_DIR); the README's "Your own data" shows it all. All fields:"""

if __name__ == "__main__":
    run(tyro.cli(SFTConfig, description=HELP))
