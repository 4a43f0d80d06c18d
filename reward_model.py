"""Preference training on (prompt, chosen, rejected) pairs: a Bradley-Terry reward model for RL, or DPO / IPO on the
policy itself (dpo.py runs this trainer with loss sigmoid). FSDP2 under torchrun, token-budget micro-batches.

    python reward_model.py                                 # the built-in RLHF task's reward model (cached inputs)
    python reward_model.py --model-path out/sft --train-files pairs.parquet --val-files pairs_val.parquet \
        --out-dir out/rm                                   # a reward model: the policy's backbone + a scalar head
    torchrun --nproc_per_node=2 reward_model.py ...        # the same, FSDP2-sharded over 2 ranks
    python ppo.py --model-path out/sft --reward-model-path out/rm ...   # RL against it (workers.RewardWorker)
    python dpo.py --model-path out/sft --train-files pairs.parquet --val-files pairs_val.parquet --out-dir out/dpo

The pairs are a parquet with prompt, chosen and rejected columns (TRL's and OpenRLHF's preference layout; the names
are options): a prompt is a string or a chat list, a response a string or one assistant message; an optional
margin column (Llama 2's) is subtracted inside the Bradley-Terry loss. A response is trained as the policy would
sample it: its tokens and the EOS. The reward model is AutoModelForTokenClassification with one label (the critic's
class: the backbone and a scalar head), read at the response's last token (workers.response_scores).

Every eval_every steps (and at the end) the held-out pairs give TRL's metrics: eval_loss, eval_rewards/accuracies
(the share of pairs whose chosen scores above the rejected), eval_rewards/margins, eval_rewards/chosen|rejected
(DPO's rewards: beta * log pi / pi_ref; also eval_logps/chosen|rejected). The best evaluation's model is exported
at out_dir as a plain HF folder (without val_files: the last), with preference_result.json (the config, the kept
evaluation, the history) and metrics.jsonl. A step whose loss is not finite is skipped, its gradients dropped.
"""

import hashlib
import json
import math
import os
import random
import shutil
from dataclasses import asdict, dataclass, field, fields, replace

import pandas as pd
import pyarrow.parquet as pq
import torch
import tyro
from tensordict import TensorDict
from tqdm import tqdm
from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForTokenClassification

from batching import micro_batches, pad
from comm import Dist, all_sum_fn, barrier, broadcast_object, init_distributed, shutdown
from config import PREF_RESULT, SFT_RESULT, recorded_values, split_files
from core_algos import PreferenceLoss, preference_loss
from data import RLDataset, default_compute_score, load_tokenizer, tokenize_prompt
from sft import has, lookup, sft_pair
from sharding import FSDPConfig, clip_grad_norm, export_hf, load_sharded_model
from workers import pad_batch, response_log_probs, response_scores


@dataclass
class PreferenceConfig:
    model_path: str | None = None
    """HF model folder to start from: a policy (the reward model adds a scalar head to its backbone; DPO trains it,
    and it is DPO's frozen reference too)."""
    train_files: str | None = None
    """Preference parquet (comma-separated list) with prompt, chosen and rejected columns."""
    val_files: str | None = None
    """Held-out preference parquet, evaluated every eval_every steps; None: no evaluation, the last model is kept."""
    out_dir: str = "out/reward_model"
    """Where the kept model goes (a plain HF folder), with preference_result.json and metrics.jsonl."""
    prompt_key: str = "prompt"
    """Column holding the prompt: a user string or a chat list of {role, content}."""
    chosen_key: str = "chosen"
    """Column holding the preferred response: a string, or one assistant message."""
    rejected_key: str = "rejected"
    """Column holding the other response."""
    margin_key: str | None = None
    """Optional column of how much better the chosen is (a number): Bradley-Terry then wants r_c - r_r > margin."""
    loss: PreferenceLoss = "bt"
    """bt: a reward model (Bradley-Terry); sigmoid: DPO; ipo: IPO (core_algos.preference_loss)."""
    beta: float = 0.1
    """DPO / IPO: the strength of the implicit KL to the reference (TRL's default 0.1)."""
    lr: float = 1e-5
    """AdamW learning rate (constant after a linear warm-up)."""
    warmup_steps: int = 10
    """Linear learning-rate warm-up steps."""
    batch_size: int = 32
    """Pairs per optimizer step, over all data-parallel ranks (it must divide by them)."""
    epochs: int = 1
    """Passes over the training pairs."""
    max_length: int = 1024
    """Prompt + response tokens (with the EOS) per sequence; a longer row raises an error naming it."""
    max_token_len: int = 8192
    """Token budget of a micro-batch per rank (the pair's two sequences stay together; a longer pair runs alone)."""
    eval_every: int = 50
    """Steps between held-out evaluations."""
    seed: int = 0
    """Seed for the new head's initialisation and the data order."""
    fsdp: FSDPConfig = field(default_factory=FSDPConfig)
    """FSDP2 sharding, compute dtype and training TP (sharding.FSDPConfig), as in RL."""
    gradient_checkpointing: bool = False
    """Recompute each decoder layer's activations in backward (less memory, ~30% more time)."""
    dist_timeout_s: int = 1800
    """Seconds a collective may wait for the other ranks before the job stops."""

    def __post_init__(self):
        for name, value, ok, rule in (("beta", self.beta, self.beta > 0, "> 0"),
                                      ("lr", self.lr, self.lr > 0, "> 0"),
                                      *((n, getattr(self, n), getattr(self, n) >= 1, ">= 1") for n in
                                        ("batch_size", "epochs", "max_length", "max_token_len", "eval_every"))):
            if not ok:
                raise ValueError(f"{name}={value} must be {rule}")
        if (self.model_path is None) != (self.train_files is None):
            raise ValueError("model_path and train_files go together: both (your policy and pairs; the README's "
                             "\"Bring your preferences\"), or neither (the built-in RLHF task)")
        if self.model_path is not None and not os.path.isfile(os.path.join(self.model_path, "config.json")):
            raise FileNotFoundError(f"model_path={self.model_path}: not an HF model folder (no config.json there)")
        for name in ("train_files", "val_files"):
            for path in split_files(getattr(self, name)):
                if not os.path.isfile(path):
                    raise FileNotFoundError(f"{name}: no such parquet file {path}")


# ---- The pairs: read, checked, tokenized -----------------------------------------------------------


def read_pairs(files: str, cfg: PreferenceConfig) -> tuple[list[tuple], int]:
    """(chat prompt, chosen text, rejected text, margin, "file row i") of each row, and how many rows were skipped
    because their chosen equals their rejected (warned about: such a pair teaches nothing). A missing column, an
    empty response or a bad margin names its file and row."""
    pairs, same = [], []
    for path in split_files(files):
        rows = pq.read_table(path).to_pylist()  # plain python values: a null stays None
        if not rows:
            raise ValueError(f"{path}: no rows")
        keys = (("prompt", cfg.prompt_key), ("chosen", cfg.chosen_key), ("rejected", cfg.rejected_key),
                ("margin", cfg.margin_key))
        missing = [f"{key!r} (--{flag}-key)" for flag, key in keys if key is not None and not has(rows[0], key)]
        if missing:
            raise ValueError(f"{path}: no column {', '.join(missing)}; its columns: {', '.join(rows[0])}")
        for i, row in enumerate(rows):
            where = f"{path} row {i}"
            prompt, chosen, _ = sft_pair(row, cfg.prompt_key, cfg.chosen_key, where)
            rejected = sft_pair(row, cfg.prompt_key, cfg.rejected_key, where)[1]
            for name, key, text in (("chosen", cfg.chosen_key, chosen), ("rejected", cfg.rejected_key, rejected)):
                if not text.strip():
                    raise ValueError(f"{where}: the {name} response ({key!r}) is empty")
            if chosen == rejected:
                same.append(where)
                continue
            margin = 0.0
            if cfg.margin_key is not None:
                margin = lookup(row, cfg.margin_key)
                if isinstance(margin, bool) or not isinstance(margin, (int, float)) or not math.isfinite(margin):
                    raise ValueError(f"{where}: the margin ({cfg.margin_key!r}) must be a finite number, got "
                                     f"{margin!r:.100}")
            pairs.append((prompt, chosen, rejected, float(margin), where))
    if same:
        print(f"{files}: {len(same)} pairs whose chosen equals the rejected are not trained on (first: {same[0]})")
    if not pairs:
        raise ValueError(f"{files}: no pair with different chosen and rejected responses")
    return pairs, len(same)


def encode_pairs(tokenizer, pairs: list[tuple], max_length: int) -> list[tuple]:
    """Each pair -> (prompt ids, chosen ids + EOS, rejected ids + EOS, margin): the tokens the policy would sample."""
    out = []
    for prompt, chosen, rejected, margin, where in pairs:
        p = tokenize_prompt(tokenizer, prompt)
        responses = [tokenizer(t, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
                     for t in (chosen, rejected)]
        for name, r in zip(("chosen", "rejected"), responses):
            if len(p) + len(r) > max_length:
                raise ValueError(f"{where}: {len(p)} prompt + {len(r)} {name} response tokens > max_length="
                                 f"{max_length} (raise --max-length)")
        out.append((p, *responses, margin))
    return out


def pair_batch(pairs: list[tuple], pad_id: int) -> tuple[TensorDict, torch.Tensor]:
    """The chosen responses (rows 0 .. n-1) then the rejected (n .. 2n-1) in verl's batch layout [2n, ...], and the
    margins [n]."""
    prompts = [p for p, *_ in pairs] * 2
    responses = [c for _, c, _, _ in pairs] + [r for _, _, r, _ in pairs]
    batch = pad_batch(prompts, responses, [[] for _ in responses], pad_id)
    return batch, torch.tensor([m for *_, m in pairs], dtype=torch.float32)


# ---- The model and its scores ---------------------------------------------------------------------


def load_models(cfg: PreferenceConfig, dist) -> tuple[torch.nn.Module, torch.nn.Module | None]:
    """(the trained model, DPO's frozen reference or None). bt: the backbone with a new scalar head (seeded, no
    dropout: the critic's); DPO / IPO: the policy, and a frozen copy of it."""
    if cfg.loss == "bt":
        config = AutoConfig.from_pretrained(cfg.model_path, num_labels=1)
        config.classifier_dropout = 0.0
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(cfg.seed)
            model = load_sharded_model(cfg.model_path, dist, cfg.fsdp, model_class=AutoModelForTokenClassification,
                                       config=config, gradient_checkpointing=cfg.gradient_checkpointing)
        return model, None
    model = load_sharded_model(cfg.model_path, dist, cfg.fsdp, gradient_checkpointing=cfg.gradient_checkpointing)
    return model, load_sharded_model(cfg.model_path, dist, cfg.fsdp, trainable=False)


def pair_losses(model, ref, batch: TensorDict, margin: torch.Tensor, cfg: PreferenceConfig) -> tuple:
    """(loss [n], sums of the metrics over the n pairs) of one micro-batch on the device."""
    n = margin.shape[0]
    if cfg.loss == "bt":
        scores = response_scores(model, batch)  # [2n]
        chosen, rejected = scores[:n], scores[n:]  # [n] each
        loss = preference_loss(chosen, rejected, "bt", margin=margin)
        logps = {}
    else:  # DPO's rewards: beta * (log pi - log pi_ref) of each response, summed over its tokens (IPO: averaged)
        mask = batch["response_mask"]  # [2n, R]
        agg = (lambda x: (x * mask).sum(-1)) if cfg.loss == "sigmoid" else \
            (lambda x: (x * mask).sum(-1) / mask.sum(-1))
        logp = agg(response_log_probs(model, batch, 1.0)[0])  # [2n]
        with torch.no_grad():
            ref_logp = agg(response_log_probs(ref, batch, 1.0)[0])  # [2n]
        ratio = logp - ref_logp  # [2n]
        loss = preference_loss(ratio[:n], ratio[n:], cfg.loss, cfg.beta)
        chosen, rejected = cfg.beta * ratio[:n].detach(), cfg.beta * ratio[n:].detach()
        logps = {"logps/chosen": logp[:n].detach().sum(), "logps/rejected": logp[n:].detach().sum()}
    chosen, rejected = chosen.detach(), rejected.detach()
    return loss, {"loss": loss.detach().sum(), "rewards/chosen": chosen.sum(), "rewards/rejected": rejected.sum(),
                  "rewards/accuracies": (chosen > rejected).float().sum(),
                  "rewards/margins": (chosen - rejected).sum(), **logps}


def run_pairs(model, ref, pairs: list[tuple], cfg: PreferenceConfig, dist, pad_id: int, scale: float,
              backward: bool) -> dict:
    """The metrics' sums over this rank's pairs, a token-budget micro-batch at a time (pairs kept whole); with
    backward, each micro-batch's loss sum * scale is backpropagated. Collective (the micro-batch count, FSDP2)."""
    tokens = torch.tensor([2 * len(p) + len(c) + len(r) for p, c, r, _ in pairs])  # [n]
    sums = {}
    for rows in micro_batches(tokens, cfg.max_token_len, dist):
        batch, margin = pair_batch([pairs[i] for i in rows], pad_id)
        batch, margin = batch.to(dist.device), margin.to(dist.device)
        loss, metrics = pair_losses(model, ref, batch, margin, cfg)
        if backward:
            (loss.sum() * scale).backward()
        for k, v in metrics.items():
            sums[k] = sums.get(k, 0.0) + v.float().cpu()
    return sums


def reduced(sums: dict, n_local: int, dist, prefix: str = "") -> dict:
    """The metrics' means over every rank's pairs (sums and counts added up over the dp ranks)."""
    keys = sorted(sums)
    t = torch.tensor([float(sums[k]) for k in keys] + [n_local], dtype=torch.float64)
    all_sum = all_sum_fn(dist)
    t = all_sum(t) if all_sum else t
    return {prefix + k: (v / t[-1]).item() for k, v in zip(keys, t[:-1])}


@torch.no_grad()
def evaluate(model, ref, val: list[tuple], cfg: PreferenceConfig, dist, pad_id: int) -> dict:
    """TRL's eval_* metrics over the held-out pairs (each dp rank its share). Collective."""
    mine = val[dist.dp_rank :: dist.dp_size]
    return reduced(run_pairs(model, ref, mine, cfg, dist, pad_id, 0.0, backward=False), len(mine), dist, "eval_")


# ---- The loop -------------------------------------------------------------------------------------


def train(cfg: PreferenceConfig, dist, tokenizer, train_pairs: list[tuple], val: list[tuple]) -> dict:
    """AdamW on the preference loss for cfg.epochs; every eval_every steps an evaluation, the best one's model
    exported to out_dir. Returns the result that preference_result.json holds."""
    if cfg.batch_size % dist.dp_size or len(val) and len(val) < dist.dp_size:
        raise ValueError(f"batch_size={cfg.batch_size} must divide by the {dist.dp_size} data-parallel ranks, and the "
                         f"held-out pairs ({len(val)}) be at least as many")
    model, ref = load_models(cfg, dist)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=cfg.lr, weight_decay=0.0)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / cfg.warmup_steps))
    per_epoch = len(train_pairs) // cfg.batch_size
    if per_epoch == 0:
        raise ValueError(f"train_files: {len(train_pairs)} pairs < batch_size={cfg.batch_size}")
    total, local = per_epoch * cfg.epochs, cfg.batch_size // dist.dp_size
    history, best, skipped = [], None, 0
    rng = random.Random(cfg.seed)
    order = []
    bar = tqdm(range(1, total + 1), desc=cfg.loss, disable=not dist.is_main)
    for step in bar:
        if (step - 1) % per_epoch == 0:
            order = rng.sample(range(len(train_pairs)), len(train_pairs))  # a fresh permutation each epoch
        first = ((step - 1) % per_epoch) * cfg.batch_size + dist.dp_rank * local
        mine = [train_pairs[i] for i in order[first : first + local]]
        # each rank's loss is its sum / its share: FSDP2 averages the gradients over the dp ranks
        record = reduced(run_pairs(model, ref, mine, cfg, dist, tokenizer.pad_token_id, 1.0 / local, True), local,
                         dist)
        if math.isfinite(record["loss"]):
            record["grad_norm"] = clip_grad_norm(model, 1.0)
            opt.step()
        else:  # a poisoned step never reaches the weights (every rank saw the same reduced loss)
            skipped += 1
        opt.zero_grad(set_to_none=True)
        sched.step()
        record.update(step=step, lr=sched.get_last_lr()[0], skipped_steps=skipped)
        if val and (step % cfg.eval_every == 0 or step == total):
            record.update(evaluate(model, ref, val, cfg, dist, tokenizer.pad_token_id))
            merit = (record["eval_rewards/accuracies"], -record["eval_loss"])
            if best is None or merit >= best[0]:
                best = (merit, dict(record))
                export_hf(model, tokenizer, best_dir(cfg), dist)  # collective; atomic (a .tmp folder, a rename)
        history.append(record)
        bar.set_postfix(loss=f"{record['loss']:.3f}", **({"acc": f"{record['eval_rewards/accuracies']:.3f}"}
                                                        if "eval_rewards/accuracies" in record else {}))
    if best is None:  # no held-out pairs: the last model
        export_hf(model, tokenizer, best_dir(cfg), dist)
        best = (None, history[-1])
    return {"kept": best[1], "steps": total, "skipped_steps": skipped, "config": json.loads(json.dumps(asdict(cfg))),
            "history": history}


def best_dir(cfg: PreferenceConfig) -> str:
    """Where the best model so far waits; it becomes out_dir when training ends."""
    return os.path.normpath(cfg.out_dir) + ".best"


def run(cfg: PreferenceConfig) -> dict:
    """Under torchrun or in one process: fit, then leave the process group. No --model-path: the built-in task
    (its inputs made on rank 0 first)."""
    dist = init_distributed(cfg.dist_timeout_s, tp=cfg.fsdp.tp_size)
    if cfg.model_path is None:
        cfg = broadcast_object(with_builtin(cfg) if dist.is_main else None, dist)
    result = fit(cfg, dist)
    shutdown(dist)
    return result


def fit(cfg: PreferenceConfig, dist) -> dict:
    """Check and tokenize the pairs (before any model loads), train, write the result; returns it."""
    tokenizer = load_tokenizer(cfg.model_path)
    train_pairs, same = read_pairs(cfg.train_files, cfg)
    train_pairs = encode_pairs(tokenizer, train_pairs, cfg.max_length)
    val = encode_pairs(tokenizer, read_pairs(cfg.val_files, cfg)[0], cfg.max_length) if cfg.val_files else []
    if os.path.isdir(cfg.out_dir) and os.listdir(cfg.out_dir) and not os.path.exists(
            os.path.join(cfg.out_dir, PREF_RESULT)):
        raise FileExistsError(f"out_dir={cfg.out_dir} holds files but no {PREF_RESULT}: not a folder this trainer "
                              "wrote, so it is not replaced; pick another --out-dir")
    result = train(cfg, dist, tokenizer, train_pairs, val)
    result["identical_pairs_skipped"] = same
    if dist.is_main:  # the kept model and its record together, then in place: out_dir is never half-written
        kept_dir = best_dir(cfg)
        with open(os.path.join(kept_dir, "metrics.jsonl"), "w") as f:
            f.writelines(json.dumps(r) + "\n" for r in result["history"])
        with open(os.path.join(kept_dir, PREF_RESULT), "w") as f:
            json.dump(result, f, indent=1)
        values = recorded_values(cfg.model_path)
        if values and cfg.loss != "bt":  # a policy from sft.py's tiny one: RL from it takes the same values
            with open(os.path.join(kept_dir, SFT_RESULT), "w") as f:
                json.dump({"rl_values": values, "trained_by": f"reward_model.py --loss {cfg.loss}"}, f, indent=1)
        shutil.rmtree(cfg.out_dir, ignore_errors=True)
        os.replace(kept_dir, cfg.out_dir)
        kept = result["kept"]
        score = f"held-out pair accuracy {kept['eval_rewards/accuracies']:.3f}" if "eval_loss" in kept else \
            f"training loss {kept['loss']:.4f}"
        print(f"{cfg.loss}: {result['steps']} steps; kept step {kept['step']} ({score}) -> {cfg.out_dir}")
    barrier(dist)
    return result


# ---- The built-in RLHF task (--task arith-rlhf): pairs from the warm start's own samples, noisy labels ----


@torch.no_grad()
def sample_answers(model, tokenizer, items: list[dict], samples: int) -> list[list[str]]:
    """`samples` answers of the policy to each of items' prompts (RLDataset rows), at temperature 1, as RL samples
    the built-in task (8 new tokens at most)."""
    input_ids, attention_mask = pad([r["prompt_ids"] for r in items], tokenizer.pad_token_id, left=True)
    out = model.generate(input_ids=input_ids, attention_mask=attention_mask, do_sample=True, top_k=0, max_new_tokens=8,
                         num_return_sequences=samples, eos_token_id=tokenizer.eos_token_id,
                         pad_token_id=tokenizer.pad_token_id)  # [b * samples, T + new]
    texts = tokenizer.batch_decode(out[:, input_ids.shape[1]:], skip_special_tokens=True)
    return [texts[i * samples : (i + 1) * samples] for i in range(len(items))]


def builtin_pairs(policy_path: str, train_file: str, out_dir: str, samples: int = 8, flip: float = 0.2,
                  seed: int = 0) -> tuple[str, str]:
    """(train, val) preference parquet from the policy's own sampled answers to the arith prompts: a prompt whose
    samples the verifier finds both right and wrong gives up to 2 pairs (a right one chosen), and a share `flip` of the
    labels is swapped, as noisy raters would. Val: the last tenth of the pairs, labelled the same way."""
    tokenizer = load_tokenizer(policy_path)
    model = AutoModelForCausalLM.from_pretrained(policy_path).eval()
    ds = RLDataset([train_file], tokenizer, 64)
    rng, rows = random.Random(seed), []
    torch.manual_seed(seed)
    for start in tqdm(range(0, len(ds), 256), desc="sampling pairs"):
        items = [ds[i] for i in range(start, min(start + 256, len(ds)))]
        for item, answers in zip(items, sample_answers(model, tokenizer, items, samples)):
            right = [a for a in answers if default_compute_score(item["data_source"], a, item["ground_truth"])]
            wrong = [a for a in answers if a not in right and a.strip()]
            for rejected in rng.sample(sorted(set(wrong)), min(2, len(set(wrong)))) if right else []:
                chosen = rng.choice(right)  # up to 2 pairs a prompt: a right answer against 2 distinct wrong ones
                if rng.random() < flip:
                    chosen, rejected = rejected, chosen
                rows.append(dict(prompt=list(item["messages"]), chosen=chosen, rejected=rejected))
    os.makedirs(out_dir, exist_ok=True)
    cut = len(rows) - len(rows) // 10
    paths = os.path.join(out_dir, "pairs_train.parquet"), os.path.join(out_dir, "pairs_val.parquet")
    pd.DataFrame(rows[:cut]).to_parquet(paths[0])
    pd.DataFrame(rows[cut:]).to_parquet(paths[1])
    return paths


# The built-in task's training values (a 1M-parameter policy, answers of a few tokens), for the fields a run without
# --model-path leaves at their defaults, as config.TASK_VALUES does for RL (DPO's evaluations, two forwards of 1,731
# pairs each, cost 5 s apiece on 2 cores: every 100 steps)
BUILTIN_VALUES = {"bt": dict(lr=1e-3, batch_size=64, epochs=3, eval_every=20, max_length=64, seed=1),
                  "sigmoid": dict(lr=1e-4, batch_size=64, epochs=3, eval_every=100, max_length=64),
                  "ipo": dict(lr=1e-4, batch_size=64, epochs=3, eval_every=100, max_length=64)}
CACHE = "~/.cache/nanoverl/rlhf"  # the built-in task's pairs and reward model, in a folder named by the warm start


def builtin_inputs() -> tuple[str, str, str]:
    """(the built-in warm start, train pairs, val pairs) of the built-in RLHF task: sft.py's cached warm start, and
    builtin_pairs of its answers to the arith prompts, made once and cached beside the reward model."""
    from sft import SFTConfig, builtin_files, run as run_sft
    policy = run_sft(SFTConfig())
    root = builtin_root(policy)
    paths = os.path.join(root, "pairs_train.parquet"), os.path.join(root, "pairs_val.parquet")
    if not all(map(os.path.isfile, paths)):
        train_file = builtin_files(SFTConfig(), os.path.join(root, "data"))[0]
        paths = builtin_pairs(policy, train_file, root)
    return policy, *paths


def builtin_root(policy: str) -> str:
    return os.path.join(os.path.expanduser(CACHE), hashlib.sha1(os.path.abspath(policy).encode()).hexdigest()[:10])


def with_builtin(cfg: PreferenceConfig) -> PreferenceConfig:
    """Without --model-path and --train-files: the built-in RLHF task's warm start and pairs, and its training values
    (BUILTIN_VALUES) for the fields left at their defaults."""
    if cfg.model_path is not None:
        return cfg
    policy, train, val = builtin_inputs()
    defaults = {f.name: f.default for f in fields(type(cfg))}
    values = {k: v for k, v in BUILTIN_VALUES[cfg.loss].items() if getattr(cfg, k) == defaults[k]}
    print(f"the built-in RLHF task: {policy}, pairs {train}; " + ", ".join(f"{k}={v}" for k, v in values.items()))
    return replace(cfg, model_path=policy, train_files=train, val_files=cfg.val_files or val, **values)


def builtin_reward_model(kind: str) -> str:
    """The built-in RLHF task's reward model (what ppo.py --task arith-rlhf scores with; Config.rlhf_reward): dpo.py's
    defaults (dpo, scored by the implicit reward) or reward_model.py's (bt) on the built-in inputs, trained in this
    process the first time, then cached. Its path."""
    out = os.path.join(builtin_root(builtin_inputs()[0]), "dpo" if kind == "dpo" else "rm")
    if os.path.isfile(os.path.join(out, PREF_RESULT)):
        print(f"{out} already holds the built-in reward model: reused")
        return out
    device = torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")
    cfg = PreferenceConfig(loss="sigmoid" if kind == "dpo" else "bt")
    fit(replace(with_builtin(cfg), out_dir=out), Dist(0, 1, 0, device, None, True))
    return out


HELP = """A reward model (Bradley-Terry) on preference pairs: --model-path (the policy it starts from), --train-files
and --val-files (prompt / chosen / rejected parquet), --out-dir; then ppo.py --reward-model-path OUT_DIR. Without
them: the built-in RLHF task's pairs and warm start. The README's "Bring your preferences" shows it all. All fields:"""

if __name__ == "__main__":
    run(tyro.cli(PreferenceConfig, description=HELP))
