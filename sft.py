"""Supervised fine-tuning (SFT), and the built-in tiny policy that the default RL run starts from.

    python sft.py                                   # build the tiny policy, warm-start it on arith
    python sft.py --model-path PATH --train-files train.parquet --val-files val.parquet \
        --response-key extra_info.answer --out-dir out/sft --stop-accuracy 0   # any HF model, any parquet

The built-in policy is made here, with no download: a byte-level tokenizer (one token per byte) built with
the `tokenizers` library (saved as an HF tokenizer with a minimal chat template, so the prompt path is the
one real chat models use) and a tiny `Qwen2ForCausalLM` made from a config. Its warm start has two phases
on the built-in arithmetic task: it learns to add from the true answers (until held-out greedy accuracy
reaches `stop_accuracy`), then picks up a habit from a sloppy teacher that forgets each carry with chance
`teacher_slip`. The result knows how to carry and samples it now and then, but its greedy answer drops
carries, so RL has a behaviour to select (as RL on an LLM sharpens what the base model does sometimes).
The result is cached: a second run with the same config reuses it.

The SFT data layout is verl's: a parquet with a prompt column (a chat list or a plain string) and a
response column (`response_key`, which may be a dotted path into a dict column, e.g. extra_info.answer).
The loss covers response tokens (and the closing EOS) only.
"""

import hashlib
import json
import os
import random
import shutil
from dataclasses import asdict, dataclass

import pandas as pd
import torch
import torch.nn.functional as F
import tyro
from data import default_compute_score, read_rl_parquet, tokenize_prompt
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from tqdm import tqdm
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM

SPECIAL_TOKENS = ["<|pad|>", "<|end|>", "<|unk|>", "<|system|>", "<|user|>", "<|assistant|>"]
# One turn is <|role|>content<|end|>; generation starts after <|assistant|> and stops at <|end|> (the EOS).
CHAT_TEMPLATE = (
    "{% for m in messages %}{{ '<|' + m['role'] + '|>' + m['content'] + '<|end|>' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>' }}{% endif %}"
)


@dataclass
class SFTConfig:
    model_path: str | None = None
    """HF model folder to fine-tune; None builds the built-in tiny policy (tokenizer + tiny Qwen2)."""
    train_files: str | None = None
    """SFT parquet (comma-separated list); None generates the built-in arithmetic task."""
    val_files: str | None = None
    """Held-out parquet in verl's RL schema, scored by greedy decoding; None uses the built-in task's."""
    prompt_key: str = "prompt"
    """Column holding the prompt: a chat list of {role, content} or a plain user string."""
    response_key: str = "extra_info.answer"
    """Column holding the target response; a dotted path reads into a dict column."""
    out_dir: str = "~/.cache/nanoverl/warmstart"
    """Where the trained model goes; for the built-in policy a subfolder named by the config's hash."""
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
    """Built-in task: steps on the sloppy teacher's answers."""
    seed: int = 0
    """Seed for the model initialisation and data order."""
    arith_digits: int = 2
    """Built-in task: max digits per operand (see data/arith.py)."""
    arith_ops: str = "+"
    """Built-in task: operators (see data/arith.py)."""
    arith_operands: int = 2
    """Built-in task: numbers per expression (see data/arith.py)."""

    def __post_init__(self):
        for name in ("stop_accuracy", "teacher_slip"):
            if not 0.0 <= getattr(self, name) <= 1.0:
                raise ValueError(f"{name} must be in [0, 1], got {getattr(self, name)}")
        if self.hidden_size % self.num_heads or self.num_heads % self.num_kv_heads:
            raise ValueError("hidden_size must divide by num_heads, and num_heads by num_kv_heads")
        if self.batch_size < 1 or self.max_steps < 1 or self.eval_every < 1:
            raise ValueError("batch_size, max_steps and eval_every must be >= 1")
        if self.habit_steps < 0:
            raise ValueError(f"habit_steps={self.habit_steps} must be >= 0 (0: no sloppy-teacher phase)")


# ---------------------------------------------------------------------------------------------------
# The built-in policy: a byte-level tokenizer (one token per byte) and a tiny Qwen2, both made locally
# ---------------------------------------------------------------------------------------------------


def build_byte_tokenizer() -> PreTrainedTokenizerFast:
    """A byte-level tokenizer with no merges: one token per byte, so any text encodes.

    It is a GPT-2/Qwen-style byte-level BPE with an empty merge list, so transformers' Qwen2Tokenizer
    (which AutoTokenizer picks for a qwen2 model) and vLLM rebuild exactly the same tokenizer from it.
    """
    vocab = {tok: i for i, tok in enumerate(SPECIAL_TOKENS + sorted(pre_tokenizers.ByteLevel.alphabet()))}
    tok = Tokenizer(models.BPE(vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token="<|end|>", pad_token="<|pad|>", unk_token="<|unk|>",
        additional_special_tokens=SPECIAL_TOKENS[3:],
    )
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


def build_tiny_qwen2(tokenizer, cfg: SFTConfig) -> Qwen2ForCausalLM:
    """A tiny Qwen2 from a config (no download); vLLM serves it like any Qwen2."""
    config = Qwen2Config(
        vocab_size=len(tokenizer), hidden_size=cfg.hidden_size, intermediate_size=cfg.intermediate_size,
        num_hidden_layers=cfg.num_layers, num_attention_heads=cfg.num_heads,
        num_key_value_heads=cfg.num_kv_heads, max_position_embeddings=512, tie_word_embeddings=True,
        rope_theta=10000.0, bos_token_id=tokenizer.eos_token_id, eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id, torch_dtype="float32",
    )
    torch.manual_seed(cfg.seed)
    return Qwen2ForCausalLM(config)


# ---------------------------------------------------------------------------------------------------
# Data: (prompt, response) pairs -> token ids with a loss mask on the response
# ---------------------------------------------------------------------------------------------------


def lookup(row: dict, key: str):
    """row["a.b"] reads row["a"]["b"]: verl's SFT keys may point into a dict column."""
    value = row
    for part in key.split("."):
        value = value[part]
    return value


def read_sft_rows(files: str, prompt_key: str, response_key: str) -> list[tuple[list, str]]:
    """(chat prompt, response text) pairs from parquet; a missing column or field names the file."""
    pairs = []
    for path in files.split(","):
        if not os.path.exists(path):
            raise FileNotFoundError(f"SFT file not found: {path}")
        for i, row in enumerate(pd.read_parquet(path).to_dict("records")):
            try:
                prompt, response = lookup(row, prompt_key), lookup(row, response_key)
            except (KeyError, TypeError) as e:
                raise ValueError(f"{path} row {i}: missing field {e} (prompt_key={prompt_key!r}, "
                                 f"response_key={response_key!r})") from None
            if isinstance(prompt, str):
                prompt = [{"role": "user", "content": prompt}]
            pairs.append(([dict(m) for m in prompt], str(response)))
    return pairs


def encode_pairs(tokenizer, pairs, max_length: int) -> list[tuple[list[int], int]]:
    """Each pair -> (prompt + response + EOS ids, prompt length)."""
    out = []
    for i, (prompt, response) in enumerate(pairs):
        p = tokenize_prompt(tokenizer, prompt)
        r = tokenizer(response, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
        if len(p) + len(r) > max_length:
            raise ValueError(f"SFT row {i} has {len(p) + len(r)} tokens > max_length={max_length}")
        out.append((p + r, len(p)))
    return out


def collate(examples, pad_id: int):
    """Right-padded input_ids [B, T], attention_mask [B, T], and labels [B, T] (-100 off the response)."""
    T = max(len(ids) for ids, _ in examples)
    input_ids = torch.full((len(examples), T), pad_id)  # [B, T]
    labels = torch.full((len(examples), T), -100)  # [B, T]
    for b, (ids, plen) in enumerate(examples):
        input_ids[b, : len(ids)] = torch.tensor(ids)
        labels[b, plen : len(ids)] = torch.tensor(ids[plen:])
    return input_ids, (input_ids != pad_id).long(), labels


def sft_loss(model, input_ids, attention_mask, labels) -> torch.Tensor:
    """Mean next-token cross-entropy over response tokens."""
    logits = model(input_ids=input_ids, attention_mask=attention_mask, use_cache=False).logits  # [B, T, V]
    return F.cross_entropy(logits[:, :-1].flatten(0, 1), labels[:, 1:].flatten(), ignore_index=-100)


# ---------------------------------------------------------------------------------------------------
# Evaluation: greedy decoding on held-out prompts, scored by the task's verifier
# ---------------------------------------------------------------------------------------------------


@torch.no_grad()
def greedy_accuracy(model, tokenizer, rows: list[dict], max_new_tokens: int) -> float:
    """Fraction of rows whose greedy response the task's verifier scores 1 (HF generate, left padding)."""
    model.eval()
    prompts = [tokenize_prompt(tokenizer, r["prompt"]) for r in rows]
    T = max(map(len, prompts))
    input_ids = torch.tensor([[tokenizer.pad_token_id] * (T - len(p)) + p for p in prompts])  # [B, T]
    out = model.generate(
        input_ids=input_ids, attention_mask=(input_ids != tokenizer.pad_token_id).long(), do_sample=False,
        max_new_tokens=max_new_tokens, eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
    )  # [B, T + new]
    texts = tokenizer.batch_decode(out[:, T:], skip_special_tokens=True)
    model.train()
    scores = [default_compute_score(r["data_source"], t, r["reward_model"]["ground_truth"]) for r, t in zip(rows, texts)]
    return sum(scores) / len(scores)


# ---------------------------------------------------------------------------------------------------
# Training
# ---------------------------------------------------------------------------------------------------


def train(cfg: SFTConfig, model, tokenizer, pairs, val_rows: list[dict], out_dir: str, habit_pairs=None) -> dict:
    """AdamW on the response loss, evaluating every eval_every steps, until stop_accuracy (or max_steps);
    then, given habit_pairs (the built-in task's sloppy teacher), habit_steps more on those."""
    random.seed(cfg.seed)
    max_new = max(len(tokenizer(str(lookup(r, "reward_model.ground_truth")))["input_ids"]) for r in val_rows) + 4
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=0.0)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / cfg.warmup_steps))
    history = []
    model.train()

    def fit(pairs, max_steps: int, stop_accuracy: float, phase: str) -> int:
        """Train on pairs; returns the steps taken."""
        examples, order, pos = encode_pairs(tokenizer, pairs, cfg.max_length), [], 0
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
            if step % cfg.eval_every == 0 or step == max_steps:
                acc = greedy_accuracy(model, tokenizer, val_rows, max_new)
                history.append({"phase": phase, "step": step, "loss": loss.item(), "val/accuracy": acc})
                bar.set_postfix(loss=f"{loss.item():.3f}", acc=f"{acc:.3f}")
                if stop_accuracy and acc >= stop_accuracy:
                    break
        return step

    steps = fit(pairs, cfg.max_steps, cfg.stop_accuracy, "sft")
    if habit_pairs and cfg.habit_steps:
        steps += fit(habit_pairs, cfg.habit_steps, 0.0, "sft on the sloppy teacher")
    tmp = out_dir + ".tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    result = {"steps": steps, "val/accuracy": history[-1]["val/accuracy"], "history": history, "config": asdict(cfg)}
    with open(os.path.join(tmp, "sft_result.json"), "w") as f:
        json.dump(result, f, indent=1)
    shutil.rmtree(out_dir, ignore_errors=True)
    os.replace(tmp, out_dir)  # a half-trained model never sits at out_dir
    return result


def builtin_files(cfg: SFTConfig, root: str) -> tuple[str, str]:
    """The built-in arithmetic task's train/val parquet, generated once under root."""
    from data.arith import ArithConfig, write_parquet

    return write_parquet(ArithConfig(out_dir=os.path.join(root, "arith"), digits=cfg.arith_digits, ops=cfg.arith_ops,
                                     operands=cfg.arith_operands, teacher_slip=cfg.teacher_slip))


def run(cfg: SFTConfig) -> str:
    """Train as configured and return the model folder (reused if the built-in warm start is cached)."""
    out_dir = os.path.expanduser(cfg.out_dir)
    if cfg.model_path is None:  # the built-in policy: cache by config so a second run reuses it
        key = hashlib.sha1(json.dumps(asdict(cfg), sort_keys=True).encode()).hexdigest()[:10]
        out_dir = os.path.join(out_dir, key)
        if os.path.exists(os.path.join(out_dir, "sft_result.json")):
            print(f"warm start cached at {out_dir}")
            return out_dir
    train_files, val_files = cfg.train_files, cfg.val_files
    if train_files is None or val_files is None:
        default_train, default_val = builtin_files(cfg, out_dir + ".data")
        train_files, val_files = train_files or default_train, val_files or default_val
    if cfg.model_path is None:
        tokenizer = build_byte_tokenizer()
        model = build_tiny_qwen2(tokenizer, cfg)
    else:
        tokenizer = AutoTokenizer.from_pretrained(cfg.model_path)
        model = AutoModelForCausalLM.from_pretrained(cfg.model_path, torch_dtype=torch.float32)
    print(f"model: {sum(p.numel() for p in model.parameters()) / 1e6:.2f}M parameters")
    pairs = read_sft_rows(train_files, cfg.prompt_key, cfg.response_key)
    habit_pairs = None
    if cfg.train_files is None and cfg.teacher_slip:  # the built-in task's second phase: the sloppy teacher
        habit_pairs = read_sft_rows(train_files, cfg.prompt_key, "extra_info.teacher_answer")
    val_rows = read_rl_parquet(val_files.split(",")[0])[: cfg.eval_size]  # schema-checked, plain python rows
    result = train(cfg, model, tokenizer, pairs, val_rows, out_dir, habit_pairs)
    print(f"SFT stopped at step {result['steps']}: held-out greedy accuracy {result['val/accuracy']:.3f} -> {out_dir}")
    return out_dir


if __name__ == "__main__":
    run(tyro.cli(SFTConfig))
