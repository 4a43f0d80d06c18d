"""Preference training (reward_model.py, dpo.py): a reward model that learns separable pairs, DPO's metrics, and the
bad inputs, each named.

    python -m pytest tests/test_reward_model.py -q
"""

import json
import random
from dataclasses import replace

import pandas as pd
import pytest
import torch
from transformers import AutoModelForTokenClassification

from comm import init_distributed
from reward_model import PREF_RESULT, PreferenceConfig, load_models, pair_batch, read_pairs, run
from workers import response_scores

def digit_pairs(prompts: list, n: int, seed: int) -> pd.DataFrame:
    """Pairs a reward model can learn and a random head cannot rank: the chosen response is digits, the rejected
    letters and signs (random lengths), after the arith task's chat prompts. Their rule is tiny_rl_setup's reward."""
    rng = random.Random(seed)
    return pd.DataFrame([dict(prompt=list(p), chosen="".join(rng.choices("0123456789", k=rng.randint(1, 6))),
                              rejected="".join(rng.choices("abcdefxyz+=", k=rng.randint(1, 6))))
                         for p in rng.sample(prompts, n)])


@pytest.fixture(scope="module")
def pairs(tiny_rl_setup, tmp_path_factory):
    root = tmp_path_factory.mktemp("pairs")
    prompts = pd.read_parquet(tiny_rl_setup["train_files"])["prompt"].tolist()
    train, val = root / "train.parquet", root / "val.parquet"
    digit_pairs(prompts, 256, 0).to_parquet(train)
    digit_pairs(prompts, 64, 1).to_parquet(val)
    return str(train), str(val)


@pytest.fixture(scope="module")
def reward_model(tiny_rl_setup, pairs, tmp_path_factory):
    """reward_model.py on the digit pairs, from the tiny policy: (its folder, the result)."""
    out = tmp_path_factory.mktemp("rm") / "rm"
    return out, run(PreferenceConfig(model_path=tiny_rl_setup["model_path"], train_files=pairs[0],
                                     val_files=pairs[1], out_dir=str(out), lr=3e-3, batch_size=32, epochs=3,
                                     eval_every=8))


def test_a_reward_model_learns_separable_pairs(tiny_rl_setup, pairs, reward_model):
    """Bradley-Terry on pairs a random head cannot rank: held-out pair accuracy > 90% (the same new head before
    training: < 75%); the kept folder is an HF scalar-head model whose plain forward at the last token ranks the
    held-out pairs as the evaluation did."""
    out, result = reward_model
    kept = result["kept"]
    assert kept["eval_rewards/accuracies"] > 0.9, kept
    assert json.loads((out / PREF_RESULT).read_text())["kept"]["step"] == kept["step"]
    assert (out / "metrics.jsonl").read_text().count("\n") == result["steps"] == 24
    model = AutoModelForTokenClassification.from_pretrained(out)
    assert model.config.num_labels == 1
    from data import load_tokenizer
    from reward_model import encode_pairs
    tokenizer = load_tokenizer(str(out))
    cfg = PreferenceConfig(model_path=str(out), train_files=pairs[1])
    val = encode_pairs(tokenizer, read_pairs(pairs[1], cfg)[0], 1024)
    batch, _ = pair_batch(val, tokenizer.pad_token_id)
    with torch.no_grad():
        scores = response_scores(model, batch)  # [2n]
    assert (scores[: len(val)] > scores[len(val):]).float().mean().item() == pytest.approx(
        kept["eval_rewards/accuracies"], abs=1e-6)
    untrained, _ = load_models(replace(cfg, model_path=tiny_rl_setup["model_path"]), init_distributed())
    with torch.no_grad():
        scores = response_scores(untrained, batch)  # the same seeded new head, before training
    assert (scores[: len(val)] > scores[len(val):]).float().mean().item() < 0.75  # what training had to learn


def test_response_scores_read_the_head_at_the_last_response_token(tiny_rl_setup):
    """Left-padded prompts, right-padded responses of different lengths: each score is the head's value at that
    response's last token, as an unpadded forward of the one sequence gives it."""
    from transformers import AutoConfig
    from workers import pad_batch
    config = AutoConfig.from_pretrained(tiny_rl_setup["model_path"], num_labels=1)
    torch.manual_seed(0)
    model = AutoModelForTokenClassification.from_pretrained(tiny_rl_setup["model_path"], config=config).eval()
    prompts, responses = [[5, 6, 7], [8]], [[9], [10, 11, 12, 13]]
    batch = pad_batch(prompts, responses, [[], []], 0)
    with torch.no_grad():
        scores = response_scores(model, batch)
        alone = [model(input_ids=torch.tensor([p + r])).logits[0, -1, 0] for p, r in zip(prompts, responses)]
    assert scores.tolist() == pytest.approx([a.item() for a in alone], abs=1e-5)


@pytest.mark.parametrize("frame, kwargs, message", [
    (pd.DataFrame(dict(prompt=["q"], chosen=["a"])), {}, r"no column 'rejected' \(--rejected-key\); its columns: "
                                                         "prompt, chosen"),
    (pd.DataFrame(dict(prompt=["q", "q"], chosen=["a", " "], rejected=["b", "c"])), {},
     r"row 1: the chosen response \('chosen'\) is empty"),
    (pd.DataFrame(dict(prompt=["q"], chosen=["a"], rejected=["b"], m=["big"])), dict(margin_key="m"),
     r"row 0: the margin \('m'\) must be a finite number, got 'big'"),
    (pd.DataFrame(dict(prompt=["q"], chosen=["a"], rejected=["a"])), {},
     "no pair with different chosen and rejected responses"),
])
def test_bad_pairs_are_named(tiny_rl_setup, tmp_path, frame, kwargs, message):
    path = tmp_path / "pairs.parquet"
    frame.to_parquet(path)
    cfg = PreferenceConfig(model_path=tiny_rl_setup["model_path"], train_files=str(path), **kwargs)
    with pytest.raises(ValueError, match=message):
        read_pairs(str(path), cfg)


def test_identical_pairs_are_counted_and_skipped_and_a_long_row_is_named(tiny_rl_setup, tmp_path, capsys):
    path = tmp_path / "pairs.parquet"
    pd.DataFrame(dict(prompt=["q", "q", "q"], chosen=["a", "b", "x" * 80], rejected=["a", "c", "y"])).to_parquet(path)
    cfg = PreferenceConfig(model_path=tiny_rl_setup["model_path"], train_files=str(path), max_length=64)
    pairs, same = read_pairs(str(path), cfg)
    assert same == 1 and len(pairs) == 2
    assert "1 pairs whose chosen equals the rejected are not trained on (first: " in capsys.readouterr().out
    with pytest.raises(ValueError, match=r"pairs.parquet row 2: \d+ prompt \+ 81 chosen response tokens > "
                                         "max_length=64"):
        run(cfg)


@pytest.fixture(scope="module")
def dpo_models(tiny_rl_setup, pairs, tmp_path_factory):
    """dpo.py on the digit pairs from the tiny policy, with the sigmoid loss and with IPO: {loss: (folder, result)}."""
    from dpo import DPOConfig
    root = tmp_path_factory.mktemp("dpo")
    return {loss: (root / loss, run(DPOConfig(model_path=tiny_rl_setup["model_path"], train_files=pairs[0],
                                              val_files=pairs[1], out_dir=str(root / loss), loss=loss, lr=3e-3,
                                              batch_size=32, epochs=1, eval_every=4)))
            for loss in ("sigmoid", "ipo")}


def test_dpo_raises_the_chosen_over_the_rejected(dpo_models):
    """DPO (sigmoid) and IPO on the digit pairs: TRL's metrics; the held-out rewards/accuracies end above 90%
    and the margin grows; the export is a causal LM."""
    from transformers import AutoModelForCausalLM
    for loss, (out, result) in dpo_models.items():
        kept = result["kept"]
        assert {"eval_logps/chosen", "eval_logps/rejected", "eval_rewards/chosen", "eval_rewards/rejected",
                "eval_rewards/margins", "rewards/accuracies"} <= kept.keys()
        assert kept["eval_rewards/accuracies"] > 0.9, (loss, kept)
        assert kept["eval_rewards/margins"] > result["history"][0]["rewards/margins"], loss
        AutoModelForCausalLM.from_pretrained(out)


def test_a_dpo_policy_as_reward_model_scores_its_implicit_reward(tiny_rl_setup, dpo_models, pairs):
    """--reward-model-path at dpo.py's output: RewardWorker's score is beta * the sum (IPO: the mean) over the response
    tokens of log pi - log pi_ref, by hand from plain HF forwards of the DPO policy and the tiny policy it started
    from; and it ranks the held-out chosen above the rejected as DPO's evaluation did."""
    from transformers import AutoModelForCausalLM
    from conftest import toy_config
    from data import load_tokenizer, tokenize_prompt
    from workers import RewardWorker, pad_batch
    tok = load_tokenizer(tiny_rl_setup["model_path"])
    val = pd.read_parquet(pairs[1])[:16]
    prompts = [tokenize_prompt(tok, list(p)) for p in val["prompt"]] * 2
    texts = val["chosen"].tolist() + val["rejected"].tolist()
    responses = [tok(t, add_special_tokens=False)["input_ids"] + [tok.eos_token_id] for t in texts]
    batch = pad_batch(prompts, responses, [[] for _ in responses], tok.pad_token_id)  # chosen rows, then rejected
    ref = AutoModelForCausalLM.from_pretrained(tiny_rl_setup["model_path"]).eval()

    def log_ratio(model, p, r):  # sum over r's tokens of log model(token | before it), one unpadded sequence
        with torch.no_grad():
            logits = model(input_ids=torch.tensor([p + r])).logits[0, len(p) - 1 : -1]  # [len(r), V]
        return logits.log_softmax(-1).gather(1, torch.tensor(r)[:, None]).sum().item()

    for loss, (folder, result) in dpo_models.items():
        cfg = toy_config(**tiny_rl_setup, reward_model_path=str(folder), log_prob_max_token_len_per_gpu=40)
        scores = RewardWorker(cfg, init_distributed()).scores(batch)  # [32]
        policy = AutoModelForCausalLM.from_pretrained(folder).eval()
        beta = result["config"]["beta"]
        expected = [beta * (log_ratio(policy, p, r) - log_ratio(ref, p, r)) / (len(r) if loss == "ipo" else 1)
                    for p, r in zip(prompts, responses)]
        assert scores.tolist() == pytest.approx(expected, abs=1e-4), loss
        assert (scores[:16] > scores[16:]).float().mean() > 0.9, loss


def test_a_dpo_reward_model_without_its_reference_is_named(tiny_rl_setup, dpo_models, tmp_path):
    import shutil
    from conftest import toy_config
    folder = tmp_path / "dpo"
    shutil.copytree(dpo_models["sigmoid"][0], folder)
    record = json.loads((folder / PREF_RESULT).read_text())
    record["config"]["model_path"] = str(tmp_path / "gone")
    (folder / PREF_RESULT).write_text(json.dumps(record))
    with pytest.raises(FileNotFoundError, match=r"reward_model_path=.*dpo: its DPO reference model_path=.*gone "
                                                r"\(in preference_result.json\) is not an HF model folder"):
        toy_config(**tiny_rl_setup, reward_model_path=str(folder))


def other_tokenizer():
    """A second tokenizer: one token per byte too, but the bytes at other ids and another chat template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast
    special = ["<pad>", "<eos>", "<unk>"]
    tokens = special + sorted(pre_tokenizers.ByteLevel.alphabet(), reverse=True)
    tok = Tokenizer(models.BPE({t: i for i, t in enumerate(tokens)}, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<eos>", pad_token="<pad>", unk_token="<unk>")
    tokenizer.chat_template = ("{% for m in messages %}{{ m['role'] + ': ' + m['content'] + '<eos>' }}{% endfor %}"
                               "{% if add_generation_prompt %}{{ 'assistant: ' }}{% endif %}")
    return tokenizer


def scalar_head_model(tokenizer, folder, seed: int = 0):
    """A small random Qwen2 reward model (one label) on tokenizer, saved to folder."""
    from transformers import Qwen2Config, Qwen2ForTokenClassification
    config = Qwen2Config(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=512, num_labels=1,
                         pad_token_id=tokenizer.pad_token_id)
    torch.manual_seed(seed)
    model = Qwen2ForTokenClassification(config).eval()
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return model


@pytest.mark.parametrize("own_tokenizer", [True, False])
def test_the_reward_worker_scores_as_a_plain_forward_in_its_own_tokens(tiny_rl_setup, tmp_path, own_tokenizer):
    """RewardWorker's scores equal the reward model's plain HF forward of the chat (prompt + the response as the
    assistant's turn) in its own tokens, read at the last token: with the policy's tokenizer the batch's ids as they
    are; with another tokenizer (other ids, other template) the response decoded and re-tokenised (verl's rule)."""
    from comm import init_distributed
    from ppo import load_task, reward_model_batch
    from workers import RewardWorker, pad_batch
    from conftest import toy_config
    from data import load_tokenizer
    policy_tok = load_tokenizer(tiny_rl_setup["model_path"])
    rm_tok = policy_tok if own_tokenizer else other_tokenizer()
    model = scalar_head_model(rm_tok, tmp_path / "rm")
    cfg = toy_config(**tiny_rl_setup, reward_model_path=str(tmp_path / "rm"), log_prob_max_token_len_per_gpu=40)
    task = load_task(cfg, tiny_rl_setup["model_path"], tiny_rl_setup["train_files"], tiny_rl_setup["val_files"], 1)
    assert (task.rm_tokenizer is None) == own_tokenizer
    rows = [task.train_ds[i] for i in (3, 1, 4)]
    answers = ["12", "7", "123 and more"]
    responses = [policy_tok(a, add_special_tokens=False)["input_ids"] + [policy_tok.eos_token_id] for a in answers]
    batch = pad_batch([r["prompt_ids"] for r in rows], responses, [[] for _ in rows], policy_tok.pad_token_id)
    batch["index"] = torch.tensor([r["index"] for r in rows])
    scores = RewardWorker(cfg, init_distributed()).scores(reward_model_batch(batch, task))  # [3]
    expected = []
    for row, answer in zip(rows, answers):
        chat = row["messages"] + [{"role": "assistant", "content": answer}]
        ids = rm_tok(rm_tok.apply_chat_template(chat, tokenize=False), add_special_tokens=False)["input_ids"]
        with torch.no_grad():
            expected.append(model(input_ids=torch.tensor([ids])).logits[0, -1, 0].item())
    assert scores.tolist() == pytest.approx(expected, abs=1e-5)


def test_a_reward_models_tokenizer_without_pad_or_template_is_named(tiny_rl_setup, tmp_path):
    """Where the reward model's tokenizer is not the policy's, it needs a pad (or EOS) token and a chat template."""
    from conftest import toy_config
    from ppo import load_task
    bare = other_tokenizer()
    bare.pad_token = bare.eos_token = None
    scalar_head_model(bare, tmp_path / "no_pad")
    untemplated = other_tokenizer()
    untemplated.chat_template = None
    scalar_head_model(untemplated, tmp_path / "no_template")
    for folder, missing in (("no_pad", "a pad or EOS token"), ("no_template", "a chat template")):
        cfg = toy_config(**tiny_rl_setup, reward_model_path=str(tmp_path / folder))
        with pytest.raises(ValueError, match=f"reward_model_path=.*{folder}: its tokenizer has no {missing}"):
            load_task(cfg, tiny_rl_setup["model_path"], tiny_rl_setup["train_files"], tiny_rl_setup["val_files"], 1)


def test_reward_model_path_must_be_a_scalar_head(tiny_rl_setup, tmp_path):
    from conftest import toy_config
    with pytest.raises(ValueError, match=r"reward_model_path=.*model: not a scalar-head reward model \(architectures="
                                         r"\['Qwen2ForCausalLM'\], num_labels=2"):
        toy_config(**tiny_rl_setup, reward_model_path=tiny_rl_setup["model_path"])


def test_grpo_against_a_learned_reward_model_raises_the_rule_it_learned(tiny_rl_setup, reward_model, tmp_path):
    """The RLHF loop end to end: GRPO whose only reward is the reward model trained on the digit pairs (replace):
    the rule of those pairs, which the run never sees (reward_model/rule_score/mean: tiny_rl_setup's reward), rises,
    and critic/score is the model's score."""
    from conftest import assert_reward_rises, toy_config
    from ppo import train
    cfg = toy_config(**tiny_rl_setup, reward_model_path=str(reward_model[0]), train_batch_size=16,
                     ppo_mini_batch_size=8, rollout_n=8, max_response_length=6, lr=3e-3, total_steps=16,
                     eval_every=16, out_dir=str(tmp_path / "grpo"), adv_estimator="grpo")
    records = train(cfg)[1:]
    assert all(r["critic/score/mean"] == pytest.approx(r["reward_model/score/mean"], abs=1e-5) for r in records)
    assert_reward_rises([{"critic/score/mean": r["reward_model/rule_score/mean"]} for r in records], by=0.1)
    assert {"reward_model/score/max", "reward_model/score/min", "timing_s/reward_model"} <= records[0].keys()


def test_a_reward_model_shorter_than_prompt_and_response_is_refused(tiny_rl_setup, tmp_path):
    """A reward model's context below max_prompt_length + max_response_length: named at parse time, never truncated."""
    from conftest import toy_config
    from data import load_tokenizer
    model = scalar_head_model(load_tokenizer(tiny_rl_setup["model_path"]), tmp_path / "rm")
    model.config.max_position_embeddings = 16
    model.config.save_pretrained(tmp_path / "rm")
    with pytest.raises(ValueError, match="exceeds reward_model_path's max_position_embeddings=16"):
        toy_config(**tiny_rl_setup, reward_model_path=str(tmp_path / "rm"))
