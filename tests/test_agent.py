"""The agent loop (agent.py): multi-turn rollouts with tools, token in and token out.

    python -m pytest tests/test_agent.py -q

A tiny random policy made to call a tool now and then (conftest.calling_setup: "[" opens a call, "]" ends it, the
tool answers "ok" as "(ok)"). The masks are 0 exactly on the tools' tokens, the ids trained on are the ids the engine
produced, the trainer's log-probs on the model's tokens are the engine's, packed and padded updates agree, and a
tool that raises or hangs becomes an observation that counts as an error, and dynamic sampling's regrouping keeps the
tool spans. (Under torchrun and Ray: test_ray.py's runs use this policy and tool.)
"""

import time
from dataclasses import replace

import pytest
import torch
from dist_batching import capture_gradients, with_rl_fields

from agent import AgentConfig, AgentLoop, load_tools, parse_call, run_calls
from batching import response_lengths
from comm import init_distributed
from config import Config
from conftest import toy_config
from data import tokenize_prompt
from ppo import TorchrunController, repad
from workers import ActorWorker, pad_batch

QUESTIONS = ["1+2=", "33-4=", "7+8=", "9-9=", "12+34=", "5-1="]


def prompts_of(tokenizer) -> list[list[int]]:
    return [tokenize_prompt(tokenizer, [{"role": "user", "content": q}]) for q in QUESTIONS]


def agent_config(setup: dict, **overrides) -> Config:
    return toy_config(**{**setup, "rollout_backend": "hf", "rollout_n": 4, "train_batch_size": len(QUESTIONS),
                         "ppo_mini_batch_size": len(QUESTIONS), "max_response_length": 24, **overrides})


def segments(mask: list[int]) -> list[tuple[int, int, int]]:
    """(value, start, end) of each run of equal values."""
    runs, start = [], 0
    for i in range(1, len(mask) + 1):
        if i == len(mask) or mask[i] != mask[start]:
            runs.append((mask[start], start, i))
            start = i
    return runs


def expected_observation(turn_text: str, cfg: AgentConfig) -> str:
    """What the probe tool's observation must be after a model turn: "(ok)", or the parse error's."""
    if cfg.call_start not in turn_text:
        return cfg.observation.format(result="error: the call ends with ']' but has no '['")
    return cfg.observation.format(result="ok")


# ---- calls ----


def test_calls_parse_as_json_python_or_bare_text(tmp_path):
    (tmp_path / "tools.py").write_text("import math\n\ndef add(a, b=0):\n    return a + b\n\n"
                                       "def neg(x):\n    return -x\n\ndef _helper():\n    pass\n")
    tools = load_tools(str(tmp_path / "tools.py"))
    assert sorted(tools) == ["add", "neg"]  # public functions defined there: no import, no _helper
    fn, args, kwargs = parse_call('{"name": "add", "arguments": {"a": 2, "b": 3}}', tools)
    assert fn(*args, **kwargs) == 5
    fn, args, kwargs = parse_call(" add(2, b=3) ", tools)
    assert (fn.__name__, args, kwargs) == ("add", (2,), {"b": 3})
    with pytest.raises(ValueError, match=r"no tool named 'mul' \(tools: \['add', 'neg'\]\)"):
        parse_call('{"name": "mul", "arguments": {}}', tools)
    with pytest.raises(ValueError, match=r"cannot parse the call '2 \+'"):
        parse_call("2 +", tools)
    one = {"neg": tools["neg"]}  # one tool: the bare text is its argument
    assert parse_call("12*3", one)[1] == ("12*3",)


def test_a_raising_or_hanging_tool_returns_its_error():
    def boom(x):
        raise ValueError(f"bad {x}")

    def hang(x):
        time.sleep(30)

    results = run_calls([(boom, (1,), {}), (hang, (2,), {}), (len, ("abc",), {}), ValueError("no such call")], 0.5)
    assert results == [("error: ValueError: bad 1", True), ("error: timed out after 0.5 s", True), ("3", False),
                       ("error: no such call", True)]


# ---- the loop ----


class Recorder:
    """An engine that records every generate call: (its prompts, the responses it returned)."""

    def __init__(self, engine):
        self.engine, self.calls = engine, []

    def generate(self, prompts, **kwargs):
        out = self.engine.generate(prompts, **kwargs)
        n = kwargs["n"]
        self.calls.append(([p for p in prompts for _ in range(n)], out.responses))
        return out


@pytest.fixture(scope="module")
def loop_run(calling_setup):
    """One multi-turn generate on the calling policy with its recorded engine calls."""
    cfg = agent_config(calling_setup)
    worker = ActorWorker(cfg, cfg.model_path, init_distributed())
    recorder = Recorder(worker.rollout)
    loop = AgentLoop(recorder, worker.tokenizer, cfg.agent)
    prompts = prompts_of(worker.tokenizer)
    out = loop.generate(prompts, n=4, max_tokens=24, temperature=1.0, seeds=list(range(len(prompts))))
    return worker, recorder, prompts, out


def test_masks_are_zero_exactly_on_the_tools_tokens(loop_run):
    """Each run of mask 0 is the tool's observation of the model turn before it (which ends with the call's end),
    tokenized alone; the model's tokens carry log-probs, the tool's none."""
    worker, _, _, out = loop_run
    tok, cfg, end = worker.tokenizer, worker.cfg.agent, worker.tokenizer.encode("]", add_special_tokens=False)[0]
    assert sum(out.counts["tool_calls"]) >= 8 and sum(out.counts["num_turns"]) > len(out.responses)  # it does call
    assert 0 < sum(out.counts["tool_errors"]) < sum(out.counts["tool_calls"])  # some calls parse, some do not
    for b, (tokens, log_probs, mask) in enumerate(zip(out.responses, out.log_probs, out.masks)):
        assert len(tokens) == len(log_probs) == len(mask) <= 24
        runs = segments(mask)
        assert runs[0][0] == 1  # the model speaks first
        observations = [r for r in runs if r[0] == 0]
        assert out.counts["tool_calls"][b] == len(observations) == out.counts["num_turns"][b] - (runs[-1][0] == 1)
        for (_, start, end_), (_, o_start, o_end) in zip(runs[::2], runs[1::2]):
            turn = tokens[start:end_]
            assert turn[-1] == end
            expected = tok.encode(expected_observation(tok.decode(turn), cfg), add_special_tokens=False)
            assert tokens[o_start:o_end] == expected[: o_end - o_start]  # cut only by the response budget
            assert o_end - o_start == len(expected) or o_end == 24
        assert all(lp == 0.0 for lp, m in zip(log_probs, mask) if not m)
        assert all(lp < 0.0 for lp, m in zip(log_probs, mask) if m)


def test_the_ids_trained_on_are_the_ids_generated(loop_run):
    """Every turn after the first is generated from the prompt and the response so far as ids, and what the engine
    returned is appended as it was: the history is never re-tokenized."""
    worker, recorder, prompts, out = loop_run
    finals = [p + r for p, r in zip([p for p in prompts for _ in range(4)], out.responses)]
    first_prompts, first = recorder.calls[0]
    for b, (prompt, response) in enumerate(zip(first_prompts, first)):
        assert finals[b][: len(prompt) + len(response)] == prompt + response
    for prompts_in, responses in recorder.calls[1:]:
        for prompt, response in zip(prompts_in, responses):
            assert any(f[: len(prompt) + len(response)] == prompt + response for f in finals)
    batch, _ = worker.generate(prompts, seeds=list(range(len(prompts))))  # the same seeds replay the same rows
    for b, response in enumerate(out.responses):
        assert batch["responses"][b, : len(response)].tolist() == response
        assert batch["response_mask"][b, : len(response)].tolist() == out.masks[b]
        assert batch["rollout_log_probs"][b, : len(response)].tolist() == pytest.approx(out.log_probs[b])
    assert response_lengths(batch).tolist() == [len(r) for r in out.responses]
    assert batch["tool_calls"].tolist() == out.counts["tool_calls"]


@pytest.mark.parametrize("tool", ["raise", "hang"])
def test_a_failing_tool_is_an_observation_and_the_run_goes_on(calling_setup, tmp_path, tool):
    body = "raise RuntimeError('down')" if tool == "raise" else "import time; time.sleep(30)"
    (tmp_path / "tools.py").write_text(f"def probe(text):\n    {body}\n")
    cfg = agent_config(calling_setup, agent=replace(calling_setup["agent"], tools_path=str(tmp_path / "tools.py"),
                                                     tool_timeout_s=0.3), max_response_length=64)
    worker = ActorWorker(cfg, cfg.model_path, init_distributed())
    batch, _ = worker.generate(prompts_of(worker.tokenizer), seeds=list(range(len(QUESTIONS))))
    assert batch["tool_calls"].sum() > 0 and torch.equal(batch["tool_errors"], batch["tool_calls"])
    texts = worker.tokenizer.batch_decode(batch["responses"])
    message = "(error: RuntimeError: down)" if tool == "raise" else "(error: timed out after 0.3 s)"
    assert any(message in t for t in texts)


# ---- the trainer on multi-turn rows ----


def test_trainer_log_probs_equal_the_engines_on_the_models_tokens(calling_setup):
    """vLLM generates (stopping on the call's end and resuming from ids); the trainer's log-probs on the model's
    tokens are the engine's."""
    cfg = agent_config(calling_setup, rollout_backend="vllm")
    worker = ActorWorker(cfg, cfg.model_path, init_distributed())
    try:
        batch, _ = worker.generate(prompts_of(worker.tokenizer), seeds=list(range(len(QUESTIONS))))
        mask = batch["response_mask"].bool()  # [B, R]
        tools = (response_lengths(batch).unsqueeze(1) > torch.arange(mask.shape[1])) & ~mask  # [B, R]
        assert batch["tool_calls"].sum() >= 4 and tools.sum() > 0
        trainer = worker.log_probs(batch)  # [B, R]
        gap = (trainer - batch["rollout_log_probs"])[mask].abs().max().item()
        assert gap < 1e-4, gap
    finally:
        worker.close()


def test_packed_and_padded_updates_agree_on_multi_turn_rows(calling_setup):
    """Remove-padding with token-budget micro-batches against one padded whole-batch pass: the same log-probs,
    losses and gradients on rows with tool spans."""
    results = []
    for overrides in (dict(ppo_micro_batch_size=24),
                      dict(use_dynamic_bsz=True, ppo_max_token_len_per_gpu=80, use_remove_padding=True)):
        cfg = agent_config(calling_setup, use_kl_loss=True, entropy_coeff=0.01, grad_clip=1e9, **overrides)
        worker = ActorWorker(cfg, cfg.model_path, init_distributed())
        batch, _ = worker.generate(prompts_of(worker.tokenizer), seeds=list(range(len(QUESTIONS))))
        batch = with_rl_fields(batch, torch.Generator().manual_seed(0))
        grads = capture_gradients(worker)
        results.append((batch, worker.log_probs(batch), worker.update(batch), grads[0]))
    (padded, logp_whole, m_whole, g_whole), (packed, logp_dyn, m_dyn, g_dyn) = results
    assert torch.equal(padded["responses"], packed["responses"])
    mask = padded["response_mask"].bool()  # [B, R]
    assert ((response_lengths(padded).unsqueeze(1) > torch.arange(mask.shape[1])) & ~mask).any()  # tools' tokens
    assert m_dyn["actor/num_micro_batches"] > 1
    torch.testing.assert_close(logp_dyn[mask], logp_whole[mask], atol=1e-5, rtol=0)
    for name in g_whole:
        torch.testing.assert_close(g_dyn[name], g_whole[name], atol=1e-5, rtol=1e-4, msg=lambda m: f"{name}: {m}")
    for k in ("actor/pg_loss", "actor/entropy", "actor/kl_loss"):
        assert m_dyn[k] == pytest.approx(m_whole[k], rel=1e-4, abs=1e-6), k


def test_dynamic_samplings_repad_keeps_the_tool_spans():
    """Groups from two generate calls (different widths, one wider than it needs) as one batch: masks, lengths and
    counts travel with rows, and the batch equals the one pad_batch lays out from the rows' tokens."""
    prompts, responses, log_probs = [[7], [5, 6]], [[4, 4, 4, 4, 4], [1, 2, 3]], [[-1.0] * 5, [-1.0, 0.0, -1.0]]
    masks, counts = [[1, 1, 0, 0, 1], [1, 0, 1]], {"num_turns": [2, 2], "tool_calls": [1, 1], "tool_errors": [1, 0]}
    b, a = (pad_batch(prompts[i : i + 1], responses[i : i + 1], log_probs[i : i + 1], 0, widths, masks[i : i + 1],
                      {k: v[i : i + 1] for k, v in counts.items()}) for i, widths in ((0, None), (1, (4, 7))))
    for g, (i, s, v) in ((a, (0, 1.0, 3)), (b, (1, 0.0, 3))):
        g["index"], g["scores"], g["version"] = torch.tensor([i]), torch.tensor([s]), torch.tensor([v])
    batch = repad([b, a], TorchrunController(init_distributed()), 0)
    assert batch["response_mask"].tolist() == [[1, 1, 0, 0, 1], [1, 0, 1, 0, 0]]
    assert response_lengths(batch).tolist() == [5, 3] and batch["tool_errors"].tolist() == [1, 0]
    assert batch["prompts"].tolist() == [[0, 7], [5, 6]] and batch["index"].tolist() == [1, 0]
    expected = pad_batch(prompts, responses, log_probs, 0, masks=masks, counts=counts)
    assert all(batch[k].equal(expected[k]) for k in expected.keys()), [k for k in expected.keys()
                                                                       if not batch[k].equal(expected[k])]
