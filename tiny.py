"""The built-in policy: a byte-level tokenizer and a tiny Qwen2, made locally (no hub).

    python sft.py                                   # builds both, then warm-starts the policy on arith (cached)
    python -c "from tiny import build_byte_tokenizer; print(build_byte_tokenizer()('12+34=').input_ids)"

The tokenizer (one token per byte) is an HF tokenizer with a minimal chat template, so the prompt path is the one
real chat models use; the model is a `Qwen2ForCausalLM` made from a config, its shape sft.SFTConfig's fields.
"""

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM

SPECIAL_TOKENS = ["<|pad|>", "<|end|>", "<|unk|>", "<|system|>", "<|user|>", "<|assistant|>"]
# One turn is <|role|>content<|end|>; generation starts after <|assistant|> and stops at <|end|> (the EOS).
CHAT_TEMPLATE = ("{% for m in messages %}{{ '<|' + m['role'] + '|>' + m['content'] + '<|end|>' }}{% endfor %}"
                 "{% if add_generation_prompt %}{{ '<|assistant|>' }}{% endif %}")


def build_byte_tokenizer(vocab_size: int | None = None) -> PreTrainedTokenizerFast:
    """One token per byte, so any text encodes: a GPT-2/Qwen-style byte-level BPE with an empty merge list, from which
    transformers' Qwen2Tokenizer (AutoTokenizer's pick for a qwen2 model) and vLLM rebuild the very same tokenizer.
    vocab_size: filler tokens (never encoded) up to a real model's vocabulary, for benches at its shapes."""
    tokens = SPECIAL_TOKENS + sorted(pre_tokenizers.ByteLevel.alphabet())
    tokens += [f"<|filler{i}|>" for i in range(len(tokens), vocab_size or 0)]
    tok = Tokenizer(models.BPE({t: i for i, t in enumerate(tokens)}, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|end|>", pad_token="<|pad|>",
                                        unk_token="<|unk|>", additional_special_tokens=SPECIAL_TOKENS[3:])
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


def build_tiny_qwen2(tokenizer, cfg) -> Qwen2ForCausalLM:
    """A tiny Qwen2 (no download), shaped and seeded by cfg (an sft.SFTConfig); vLLM serves it as any Qwen2."""
    config = Qwen2Config(
        vocab_size=len(tokenizer), hidden_size=cfg.hidden_size, intermediate_size=cfg.intermediate_size,
        num_hidden_layers=cfg.num_layers, num_attention_heads=cfg.num_heads, num_key_value_heads=cfg.num_kv_heads,
        max_position_embeddings=512, tie_word_embeddings=True, rope_theta=10000.0, bos_token_id=tokenizer.eos_token_id,
        eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id, torch_dtype="float32")
    torch.manual_seed(cfg.seed)
    return Qwen2ForCausalLM(config)
