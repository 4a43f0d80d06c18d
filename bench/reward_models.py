"""How well the built-in RLHF task's two reward models rank the warm start's own answers, side by side in one run:
reward_model.py's Bradley-Terry scalar head (--rlhf-reward bt) and dpo.py's implicit reward (--rlhf-reward dpo), both
learned from the same noisy pairs, scored here on the same held-out prompts and sampled answers against the
verifier's truth (no flipped labels).

    python bench/reward_models.py                      # trains a built-in model that is not cached yet (~2-4 min)
    python bench/reward_models.py --samples 8 --best-of 4 8   # fewer samples a prompt

Printed per model:
  true pair accuracy  the share of (right, wrong) answer pairs to the same prompt where the right one scores higher
  best-of-n           the verifier's accuracy on the answer the model ranks first among a prompt's first n samples
beside a random sample's accuracy and the most any pick could reach (some sample right). Best-of-n is what RL against
a reward model can aim for; the scores come from workers.response_scores / workers.implicit_scores, as in RL.
"""

import os
import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import tyro
from transformers import AutoModelForCausalLM, AutoModelForTokenClassification

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repo's modules, not bench/
from batching import split_by_tokens  # noqa: E402
from config import implicit_reward  # noqa: E402
from data import RLDataset, default_compute_score, load_tokenizer  # noqa: E402
from reward_model import builtin_inputs, builtin_reward_model, builtin_root, sample_answers  # noqa: E402
from sft import SFTConfig, builtin_files  # noqa: E402
from workers import implicit_scores, pad_batch, response_scores  # noqa: E402


@dataclass
class RewardBench:
    samples: int = 16
    """Answers sampled per held-out prompt (temperature 1, as RL samples)."""
    prompts: int = 400
    """Held-out prompts: the first ones of the built-in task's val split."""
    best_of: tuple[int, ...] = (4, 8, 16)
    """The n of each best-of-n column (at most samples)."""
    seed: int = 0
    """Sampling seed."""


@torch.no_grad()
def scores(kind: str, path: str, batch, tokens_per_pass: int = 16384) -> torch.Tensor:
    """Each row's score [B] under the reward model at path, in token-budget passes."""
    if kind == "dpo":
        ref_path, beta, token_mean = implicit_reward(path)
        model, ref = (AutoModelForCausalLM.from_pretrained(p).eval() for p in (path, ref_path))
        fn = lambda mb: implicit_scores(model, ref, mb, beta, token_mean)  # noqa: E731
    else:
        model = AutoModelForTokenClassification.from_pretrained(path).eval()
        fn = lambda mb: response_scores(model, mb)  # noqa: E731
    rows = split_by_tokens(batch["attention_mask"].sum(-1).tolist(), tokens_per_pass)
    out = torch.cat([fn(batch[torch.tensor(r)]) for r in rows])
    return out[torch.tensor([i for r in rows for i in r]).argsort()]


def main(cfg: RewardBench) -> None:
    policy = builtin_inputs()[0]
    models = {kind: builtin_reward_model(kind) for kind in ("bt", "dpo")}
    tok = load_tokenizer(policy)
    val = RLDataset([builtin_files(SFTConfig(), os.path.join(builtin_root(policy), "data"))[1]], tok, 64)
    items = [val[i] for i in range(min(cfg.prompts, len(val)))]
    torch.manual_seed(cfg.seed)
    lm = AutoModelForCausalLM.from_pretrained(policy).eval()
    answers = [a for s in range(0, len(items), 100) for a in sample_answers(lm, tok, items[s:s + 100], cfg.samples)]
    right = np.array([[float(default_compute_score(it["data_source"], a, it["ground_truth"])) for a in row]
                      for it, row in zip(items, answers)])  # [P, N]
    prompts = [list(it["prompt_ids"]) for it in items for _ in range(cfg.samples)]
    responses = [tok(a, add_special_tokens=False)["input_ids"] + [tok.eos_token_id] for row in answers for a in row]
    batch = pad_batch(prompts, responses, [[] for _ in responses], tok.pad_token_id)
    print(f"{len(items)} held-out prompts x {cfg.samples} samples of the warm start: a random sample is right "
          f"{right.mean():.3f}, some sample of {cfg.samples} is right {right.max(1).mean():.3f}")
    print(f"{'reward model':<40} {'true pair acc':>13} " + " ".join(f"{f'best-of-{n}':>10}" for n in cfg.best_of))
    for kind, path in models.items():
        sc = scores(kind, path, batch).numpy().reshape(right.shape)  # [P, N]
        won = sum(((sc[i][right[i] == 1][:, None] > sc[i][right[i] == 0][None, :]).sum()) for i in range(len(items)))
        pairs = sum((right[i] == 1).sum() * (right[i] == 0).sum() for i in range(len(items)))
        best = [right[np.arange(len(items)), sc[:, :n].argmax(1)].mean() for n in cfg.best_of]
        name = f"{kind} ({os.path.basename(path)})"
        print(f"{name:<40} {won / pairs:>13.3f} " + " ".join(f"{b:>10.3f}" for b in best))


if __name__ == "__main__":
    main(tyro.cli(RewardBench))
