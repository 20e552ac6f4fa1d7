"""Tiny random Llama-family models saved by Hugging Face transformers, for parity and engine tests."""

from __future__ import annotations

from pathlib import Path

import torch

TINY_COMMON = dict(
    vocab_size=320,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=512,
    bos_token_id=None,
    eos_token_id=None,
    pad_token_id=0,
)


def save_tiny(kind: str, directory: Path, seed: int = 0, **overrides) -> torch.nn.Module:
    """Create a tiny random `kind` ("llama" | "qwen2" | "qwen3" | "mistral") model, save it as
    safetensors into `directory` and return the torch model (float32, eval mode)."""
    import transformers

    classes = {
        "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
        "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM),
        "qwen3": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM),
        "mistral": (transformers.MistralConfig, transformers.MistralForCausalLM),
    }
    config_cls, model_cls = classes[kind]
    kwargs = dict(TINY_COMMON, **overrides)
    if kind == "qwen3":
        kwargs.setdefault("head_dim", 16)
    torch.manual_seed(seed)
    model = model_cls(config_cls(**kwargs)).eval()
    # Random init of a tiny model gives near-uniform logits; scale weights up for decisive greedy steps.
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" not in name:
                p.mul_(3.0)
    model.save_pretrained(directory, safe_serialization=True)
    return model
