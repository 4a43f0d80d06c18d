"""LoRA for RL (Hu et al. 2021; peft's adapters, injected in place): the trainer updates only the adapters, the
reference policy is the same model with them switched off (no second copy of the weights: verl's ref_in_actor),
and the rollout engine computes with merged weights (sharding.Merged: base + scale * B @ A, gathered per bucket).

    python grpo.py --lora-rank 8 --lr 2e-3                 # the built-in task with a rank-8 adapter
    python -m pytest tests/test_lora.py -q

The adapters wrap every linear layer but the LM head by default (peft's "all-linear"); their A is random and B
zero, so training starts from the base model exactly. The final export holds both a merged HF model (final/) and
the adapter alone in peft's layout (final/adapter: PeftModel.from_pretrained(base, folder) loads it).
"""

import json
import os
from contextlib import contextmanager

import torch

ADAPTER = "default"  # peft's name of the one adapter


def add_adapters(model: torch.nn.Module, rank: int, alpha: float, targets: str) -> torch.nn.Module:
    """Wrap the target linears (comma-separated module names, or "all-linear") with rank-`rank` adapters scaled by
    alpha / rank, in place; only the adapters train. Call before sharding: the adapters shard with their layer."""
    import peft

    modules = targets if targets == "all-linear" else [t.strip() for t in targets.split(",") if t.strip()]
    config = peft.LoraConfig(r=rank, lora_alpha=alpha, target_modules=modules, lora_dropout=0.0)
    with torch.random.fork_rng(devices=[]):  # A's random init: the same in every run, whatever ran before it
        torch.manual_seed(0)
        model = peft.inject_adapter_in_model(config, model)
    if not any(is_adapter(name) for name, _ in model.named_parameters()):
        raise ValueError(f"lora_target_modules={targets!r}: no module of the model matches")
    model.peft_config = {ADAPTER: config}  # what export_adapter writes (peft's adapter_config.json)
    return model


def is_adapter(name: str) -> bool:
    return ".lora_A." in name or ".lora_B." in name


def freeze_base(model: torch.nn.Module) -> None:
    """Gradients on the adapters only: the base weights keep no gradient and no optimizer state."""
    for name, param in model.named_parameters():
        param.requires_grad_(is_adapter(name))


@contextmanager
def adapters_off(model: torch.nn.Module):
    """The base model for the block (the reference policy). The flag peft's forward reads is set directly: its
    enable_adapters() would also flip the adapters' requires_grad, which FSDP2's parameter groups must not see."""
    from peft.tuners.lora import LoraLayer

    layers = [m for m in model.modules() if isinstance(m, LoraLayer)]
    for layer in layers:
        layer._disable_adapters = True
    try:
        yield
    finally:
        for layer in layers:
            layer._disable_adapters = False


def export_adapter(model: torch.nn.Module, adapters: dict[str, torch.Tensor], folder: str) -> None:
    """The adapter alone in peft's layout: adapter_config.json and adapter_model.safetensors, keys
    base_model.model.<module>.lora_A.weight (peft drops the adapter's name). adapters: full tensors by name."""
    from safetensors.torch import save_file

    os.makedirs(folder, exist_ok=True)
    state = {"base_model.model." + name.replace(f".{ADAPTER}.", "."): t.contiguous() for name, t in adapters.items()}
    save_file(state, os.path.join(folder, "adapter_model.safetensors"))
    config = model.peft_config[ADAPTER].to_dict()
    config["target_modules"] = sorted(config["target_modules"]) if isinstance(config["target_modules"], set) \
        else config["target_modules"]
    config["base_model_name_or_path"] = getattr(model.config, "_name_or_path", None)
    with open(os.path.join(folder, "adapter_config.json"), "w") as f:
        json.dump(config, f, indent=1, default=str)
