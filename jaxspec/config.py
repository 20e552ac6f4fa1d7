"""Frozen, hashable configuration dataclasses.

Every config here is a frozen dataclass so it can be a static argument of `jax.jit` (hashable) and
so a compiled program is keyed by exactly the settings that change its shape.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any

import numpy as np

INT32_MAX = 2**31 - 1  # seeds, top_k and request ids travel as int32


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
        (MLA models cache other things: `jaxspec.models.deepseek_v3.config`)."""
        return (self.num_kv_heads, self.head_dim), (self.num_kv_heads, self.head_dim)


@dataclass(frozen=True)
class SamplingParams:
    """Logits processing applied identically to draft and target distributions.

    temperature == 0 means greedy (argmax). top_k == 0 disables top-k; top_p == 1.0 disables top-p.
    """

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0

    def __post_init__(self) -> None:
        if not (isinstance(self.temperature, (int, float)) and 0.0 <= self.temperature < math.inf):
            raise ValueError(
                f"SamplingParams.temperature must be a finite number >= 0, got {self.temperature!r}"
            )
        top_k = self.top_k
        if not (
            isinstance(top_k, (int, np.integer)) and not isinstance(top_k, bool) and 0 <= top_k <= INT32_MAX
        ):
            raise ValueError(f"SamplingParams.top_k must be an integer in [0, {INT32_MAX}], got {top_k!r}")
        if not (0.0 < self.top_p <= 1.0):
            raise ValueError(f"SamplingParams.top_p must be in (0, 1], got {self.top_p}")


def _as_tuples(value: Any) -> Any:
    """JSON lists (nested) -> tuples, so that a value read back from JSON is hashable again."""
    return tuple(_as_tuples(v) for v in value) if isinstance(value, list) else value


@dataclass(frozen=True)
class SpecConfig:
    """How speculation runs. `method=None` means plain autoregressive decoding.

    method: "ngram" | "draft_model" | "medusa" | "eagle" | "eagle3" | "mtp" | None
    num_speculative_tokens: draft depth (chain length).
    topk: children per node when drafting a tree (1 = chain).
    num_draft_tokens: tree size kept for verification (dynamic trees); None = chain.
    acceptance: "exact" (lossless, default), "greedy" (argmax match) or "typical_lossy" (Medusa's
        typical acceptance: faster, *not* distribution preserving).
    posterior_threshold, posterior_alpha: typical_lossy accepts a draft token x iff
        p(x) > min(posterior_threshold, posterior_alpha * exp(-entropy(p))): Medusa's names and defaults.
    attention: "auto" | "reference" | "pallas" verify attention implementation.
    """

    method: str | None = None
    num_speculative_tokens: int = 4
    topk: int = 1
    num_draft_tokens: int | None = None
    acceptance: str = "exact"
    posterior_threshold: float = 0.09
    posterior_alpha: float = 0.3
    ngram_min: int = 1
    ngram_max: int = 4
    # head methods: a head checkpoint dir, None = the head shipped for the model, "random" = seeded random
    # head; draft_model: a draft model name/path (None = the target itself)
    head: str | None = None
    draft_num_layers: int | None = None  # draft_model: keep only the first N layers (self-drafting)
    tree_choices: tuple[tuple[int, ...], ...] | None = None  # static (Medusa-style) tree
    attention: str = "auto"
    extra: tuple[tuple[str, Any], ...] = field(default=())

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> SpecConfig:
        """Accept vLLM-style dicts: {"method": "ngram", "num_speculative_tokens": 5, ...}, and the
        JSON form of `dataclasses.asdict(spec)` (lists back to the tuples a hashable config holds)."""
        aliases = {
            "prompt_lookup_min": "ngram_min",
            "prompt_lookup_max": "ngram_max",
            "model": "head",
            "draft_tree_size": "num_draft_tokens",
            # reports written before the rename held min(typical_epsilon, typical_delta * exp(-H))
            "typical_epsilon": "posterior_threshold",
            "typical_delta": "posterior_alpha",
        }
        known = {f.name for f in dataclasses.fields(cls)}
        kwargs: dict[str, Any] = {}
        for key, value in d.items():
            name = aliases.get(key, key)
            if name not in known:
                raise ValueError(f"SpecConfig: unknown field {key!r} (known: {sorted(known)})")
            if name == "tree_choices" and value is not None:
                value = tuple(tuple(int(i) for i in path) for path in value)
            if name == "extra":  # a mapping, or (key, value) pairs as `dataclasses.asdict` + JSON give
                pairs = value.items() if isinstance(value, dict) else value
                value = tuple((str(key), _as_tuples(item)) for key, item in pairs)
            kwargs[name] = value
        return cls(**kwargs)

    def __post_init__(self) -> None:
        methods = (None, "ngram", "draft_model", "medusa", "eagle", "eagle3", "mtp")
        if self.method not in methods:
            raise ValueError(f"SpecConfig.method must be one of {methods}, got {self.method!r}")
        if self.acceptance not in ("exact", "greedy", "typical_lossy"):
            raise ValueError(
                f"SpecConfig.acceptance must be 'exact', 'greedy' or 'typical_lossy', got {self.acceptance!r}"
            )
        if self.attention not in ("auto", "reference", "pallas"):
            raise ValueError(f"SpecConfig.attention must be auto|reference|pallas, got {self.attention!r}")
        if self.num_speculative_tokens < 1:
            raise ValueError("SpecConfig.num_speculative_tokens must be >= 1")
        if self.topk < 1:
            raise ValueError("SpecConfig.topk must be >= 1")
