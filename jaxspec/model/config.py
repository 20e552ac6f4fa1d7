"""The target model's architecture config (frozen, hashable: a static argument of `jax.jit`)."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any, ClassVar


@dataclass(frozen=True)
class ModelConfig:
    """Architecture of a Llama-family decoder (Llama 2/3, Mistral, Qwen2, Qwen3, SmolLM2)."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rope_theta: float = 10000.0
    # Llama-3 style rope scaling as a hashable tuple:
    # (factor, low_freq_factor, high_freq_factor, original_max_position_embeddings) or None.
    rope_scaling: tuple[float, float, float, int] | None = None
    rms_norm_eps: float = 1e-5
    tie_word_embeddings: bool = False
    attention_bias: bool = False  # Qwen2: bias on q/k/v projections
    qk_norm: bool = False  # Qwen3: RMSNorm over each head of q and k
    max_position_embeddings: int = 2048
    architecture: str = "llama"
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    # The SpecConfig.attention implementations this architecture's layers run ("auto" picks among them).
    attention_impls: ClassVar[tuple[str, ...]] = ("auto", "reference", "pallas")

    def __post_init__(self) -> None:
        """Range checks (ValueError naming the field; loaders add the file)."""
        positive = ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads")
        for name in (*positive, "num_kv_heads", "head_dim", "max_position_embeddings"):
            value = getattr(self, name)
            if not (isinstance(value, int) and not isinstance(value, bool) and value >= 1):
                raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_heads ({self.num_heads}) must be a multiple of num_kv_heads ({self.num_kv_heads})"
            )
        for name in ("rope_theta", "rms_norm_eps"):
            value = getattr(self, name)
            if not (isinstance(value, (int, float)) and math.isfinite(value) and value > 0):
                raise ValueError(f"{name} must be a finite number > 0, got {value!r}")

    def replace(self, **changes: Any) -> ModelConfig:
        return dataclasses.replace(self, **changes)

    def kv_cache_dims(self) -> tuple[tuple[int, int], tuple[int, int]]:
        """(heads, features) of one layer's key buffer and of its value buffer [B, heads, S, features]
        (MLA models cache other things: `jaxspec.model.deepseek_v3.config`)."""
        return (self.num_kv_heads, self.head_dim), (self.num_kv_heads, self.head_dim)
