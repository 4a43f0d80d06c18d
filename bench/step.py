"""One GRPO step, phase by phase, against plain references on the same tokens, fp32 and bf16 side by side.

    python bench/step.py                                          # both sizes, both dtypes (~10 min on 2 cores)
    python bench/step.py --sizes gen --dtypes float32 --steps 1   # one quick row

One process: leave OMP_NUM_THREADS unset, so that torch uses every core (with OMP_NUM_THREADS=1, as the 2-rank
benches set, the update runs at half the speed).

Sizes: "default" is python grpo.py's run (the warm-started 1M-parameter policy, 32 prompts x 8, responses of a few
tokens); "gen" is a generation-bound size made here: a 25M-parameter Qwen2 (hidden 512, 8 layers, 8 heads, 4 KV
heads, tied embeddings, random weights), 16 prompts x 8, every response forced to 128 tokens (--ignore-eos), one
optimizer step a step, micro-batches of 16 sequences (2.2k tokens: on CPU 1.4x faster than 64, whose 54 MB
temporaries glibc maps and unmaps at every call; a plain HF update timed once by a scratch script: 12.4 s against
17.5 s). One process, the in-process vLLM engine, the prompts of the built-in task.

For each size and dtype the bench times `steps` RL steps (ppo.rl_step, after one untimed step) with the old
log-probs recomputed (Config.old_log_probs="recompute") and then without that pass: from the update's own forward
("update") where the update is one optimizer step, else the engine's ("rollout"); and prints per phase: seconds,
tokens/s, MFU (perf.py's model FLOPs over the phase's timer and the device's peak, perf.peak_flops; beside it the
run's own perf/mfu/actor, which times the update inside the worker), and the ratio to a plain
reference on the same tokens:
- gen:          the engine's own LLM.generate, one SamplingParams for all prompts (no seeds, no log-probs); also
                printed: seeded per prompt, and with log-probs, as rollout.py asks
- old_log_prob: a plain no-grad HF forward over the same micro-batches
- update_actor: a plain HF forward + backward (the mean log-prob of the response tokens) + AdamW step, the same
                micro-batches, on a copy of the model
"""

import os
import sys
import time
from dataclasses import dataclass, replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repo's modules, not bench/

import torch  # noqa: E402
import tyro  # noqa: E402
from transformers import AutoModelForCausalLM, AutoTokenizer  # noqa: E402

from comm import init_distributed  # noqa: E402
from perf import model_flops, model_shape, peak_flops  # noqa: E402
from config import Config, with_task_values  # noqa: E402
from ppo import Run, TorchrunController, load_task, prompt_indices, rl_step, warm_start_and_task_files  # noqa: E402
from sft import SFTConfig  # noqa: E402
from tiny import build_tiny_qwen2  # noqa: E402
from sharding import DTYPES  # noqa: E402
from workers import ActorWorker  # noqa: E402

GEN_MODEL = SFTConfig(hidden_size=512, num_layers=8, num_heads=8, num_kv_heads=4, intermediate_size=1536)
PHASES = ("gen", "reshard", "reward", "old_log_prob", "adv", "update_actor", "step")


@dataclass
class BenchConfig:
    sizes: tuple[str, ...] = ("default", "gen")
    """default (python grpo.py's run) and/or gen (the generation-bound 25M model, 128-token responses)."""
    dtypes: tuple[str, ...] = ("float32", "bfloat16")
    """Trainer compute dtypes (--fsdp.param-dtype, also the engine's)."""
    steps: int = 2
    """Timed RL steps per setting, after one untimed step."""
    out_dir: str = "out/bench_step"
    """Where the runs' files (task, generation-bound model) go."""


def phase_mfu(metrics: dict, batch, shape: dict, peak: float, phase: str = "update_actor", epochs: int = 1) -> float:
    """A phase's MFU as this bench counts it: the batch's model FLOPs (perf.model_flops) over the controller's timer
    of the phase (timing_s/<phase>) and the device's peak; the run's own perf/mfu/actor times the update inside the
    worker."""
    backward = phase.startswith("update")
    return epochs * model_flops(batch["attention_mask"].sum(-1), shape, backward) / metrics[f"timing_s/{phase}"] / peak


def size_config(size: str, dtype: str, out_dir: str) -> Config:
    cfg = with_task_values(Config(adv_estimator="grpo", out_dir=os.path.join(out_dir, f"{size}-{dtype}"),
                                  overwrite=True), is_main=False)  # python grpo.py's lengths
    cfg.fsdp.param_dtype = dtype
    if size == "gen":
        cfg = replace(cfg, train_batch_size=16, ppo_mini_batch_size=16, rollout_n=8, max_response_length=128,
                      max_prompt_length=32, ignore_eos=True, lr=1e-6, ppo_micro_batch_size=16)
    return cfg


def gen_model(tokenizer_path: str, out_dir: str) -> str:
    """The generation-bound model (random weights), saved with the built-in task's tokenizer."""
    path = os.path.join(out_dir, "gen_model")
    if not os.path.isfile(os.path.join(path, "config.json")):
        tokenizer = AutoTokenizer.from_pretrained(tokenizer_path)
        build_tiny_qwen2(tokenizer, GEN_MODEL).save_pretrained(path)
        tokenizer.save_pretrained(path)
    return path


def timed(fn, repeats: int = 1) -> float:
    start = time.perf_counter()
    for _ in range(repeats):
        fn()
    return (time.perf_counter() - start) / repeats


def generation_refs(run, prompts: list[list[int]], cfg: Config) -> dict:
    """Seconds of the engine's own generate on the step's prompts: plain, seeded per prompt, with log-probs."""
    from vllm import SamplingParams

    llm = run.actor.rollout.llm
    inputs = [{"prompt_token_ids": p} for p in prompts]
    common = dict(n=cfg.rollout_n, temperature=cfg.temperature, max_tokens=cfg.max_response_length,
                  ignore_eos=cfg.ignore_eos, detokenize=False)
    variants = {"engine": SamplingParams(**common),
                "engine+seeds": [SamplingParams(**common, seed=i) for i in range(len(prompts))],
                "engine+seeds+logprobs": [SamplingParams(**common, seed=i, logprobs=0) for i in range(len(prompts))]}
    return {name: timed(lambda: llm.generate(inputs, params, use_tqdm=False)) for name, params in variants.items()}


def pass_refs(model_path: str, batch, cfg: Config, dtype: torch.dtype) -> dict:
    """Seconds of a plain no-grad forward and of a plain forward + backward + AdamW over the step's micro-batches,
    on a fresh HF copy of the model in the trainer's dtype."""
    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=dtype)
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr)
    R = batch["responses"].shape[1]
    micro = [batch[i : i + cfg.ppo_micro_batch_size] for i in range(0, batch.batch_size[0], cfg.ppo_micro_batch_size)]

    def forward(mb):
        return model(input_ids=mb["input_ids"], attention_mask=mb["attention_mask"],
                     position_ids=mb["position_ids"], use_cache=False).logits[:, -R - 1 : -1]  # [b, R, V]

    def no_grad():
        with torch.no_grad():
            for mb in micro:
                forward(mb)

    def update():
        for mb in micro:
            logp = torch.log_softmax(forward(mb).float(), -1).gather(-1, mb["responses"].unsqueeze(-1)).squeeze(-1)
            (-(logp * mb["response_mask"]).sum() / batch["response_mask"].sum()).backward()  # [b, R] -> scalar
        opt.step()
        opt.zero_grad(set_to_none=True)

    return {"old_log_prob": timed(no_grad), "update_actor": timed(update)}


def measure(size: str, dtype: str, bench: BenchConfig) -> dict:
    """The phases of `steps` RL steps per old_log_probs mode, and the references, for one size and dtype."""
    dist = init_distributed()
    cfg = size_config(size, dtype, bench.out_dir)
    model_path, train_files, val_files = warm_start_and_task_files(cfg, dist)
    if size == "gen":
        model_path = gen_model(model_path, bench.out_dir)
    out = {"params": None, "modes": {}}
    one_step = cfg.ppo_mini_batch_size == cfg.train_batch_size  # else the update's own forward is not on-policy
    for mode in ("recompute", "update" if one_step else "rollout"):
        mode_cfg = replace(cfg, old_log_probs=mode, model_path=model_path)
        actor = ActorWorker(mode_cfg, model_path, dist)
        task = load_task(mode_cfg, model_path, train_files, val_files, 1)
        run = Run(mode_cfg, task, actor, None, TorchrunController(dist))
        out["params"] = sum(p.numel() for p in actor.model.parameters())
        shape, peak = model_shape(actor.model), peak_flops(dist.device, DTYPES[dtype])
        times, mfu = {}, {}
        for step in range(1, bench.steps + 2):
            rows = [run.task.train_ds[i] for i in prompt_indices(step, mode_cfg, len(run.task.train_ds))]
            metrics, batch, _ = rl_step(step, rows, run, 0.0)
            if step > 1:  # the first step warms up
                for phase in PHASES:
                    times[phase] = times.get(phase, 0.0) + metrics.get(f"timing_s/{phase}", 0.0) / bench.steps
                figures = {p: phase_mfu(metrics, batch, shape, peak, p) for p in ("old_log_prob", "update_actor")
                           if f"timing_s/{p}" in metrics}
                for key, value in {**figures, "perf/mfu/actor": metrics["perf/mfu/actor"]}.items():
                    mfu[key] = mfu.get(key, 0.0) + value / bench.steps
        tokens = {"response": batch["response_mask"].sum().item(), "all": batch["attention_mask"].sum().item()}
        out["modes"][mode] = times
        if mode == "recompute":  # the references, on the last step's tokens
            out["tokens"], out["mfu"], out["peak"] = tokens, mfu, peak
            out["refs"] = {**generation_refs(run, [r["prompt_ids"] for r in rows], mode_cfg),
                           **pass_refs(model_path, batch, mode_cfg, DTYPES[dtype])}
        actor.close()
        del run, actor
    return out


def report(size: str, dtype: str, m: dict) -> None:
    n, toks, mfu = m["params"], m["tokens"], m["mfu"]
    (_, rec), (other, upd) = m["modes"].items()
    refs = m["refs"]
    ref_of = {"gen": refs["engine"], "old_log_prob": refs["old_log_prob"], "update_actor": refs["update_actor"]}
    print(f"\n{size}, {dtype}: {n / 1e6:.1f}M parameters, {toks['response']:.0f} response tokens of {toks['all']:.0f}; "
          f"peak {m['peak'] / 1e9:.0f} GFLOP/s (perf.peak_flops)")
    print(f"{'phase':<14} {'s':>8} {'tokens/s':>9} {'MFU':>6} {'ref s':>8} {'/ ref':>6}")
    for phase in PHASES:
        s = rec[phase]
        per_s = (toks["response"] if phase == "gen" else toks["all"]) / s if s else 0.0
        ref = ref_of.get(phase)
        print(f"{phase:<14} {s:>8.3f} {per_s:>9.0f} {f'{mfu[phase]:6.1%}' if phase in mfu else '':>6} "
              f"{'' if ref is None else f'{ref:8.3f}':>8} {'' if ref is None else f'{s / ref:6.2f}':>6}")
    print(f"the run's own perf/mfu/actor (the update timed inside the worker): {mfu['perf/mfu/actor']:.1%}")
    print("engine's own generate: " + ", ".join(f"{k} {v:.3f} s" for k, v in refs.items() if k.startswith("engine")))
    print(f"step with old_log_probs=recompute {rec['step']:.3f} s, ={other} {upd['step']:.3f} s "
          f"({rec['step'] / upd['step']:.2f}x)")


def main(bench: BenchConfig) -> None:
    results = {(size, dtype): measure(size, dtype, bench) for size in bench.sizes for dtype in bench.dtypes}
    print(f"\nOne GRPO step per phase, one process, mean of {bench.steps} steps after a warm-up; MFU counts the model "
          "FLOPs of every token (prompt + response) as perf.py does")
    for (size, dtype), m in results.items():
        report(size, dtype, m)


if __name__ == "__main__":
    main(tyro.cli(BenchConfig))
