"""Pieces shared by the loaders of published draft-head layouts."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from jaxspec.errors import ModelLoadError
from jaxspec.loading.checkpoint_io import TensorSource
from jaxspec.model.config import ModelConfig

# ---------------------------------------------------------------------------------------------------
# Shared pieces
# ---------------------------------------------------------------------------------------------------


def _first_existing(directory: Path, names: tuple[str, ...]) -> Path:
    for name in names:
        if (directory / name).is_file():
            return directory / name
    raise ModelLoadError(f"{directory}: none of {list(names)} found")


def _rope_scaling(raw: dict[str, Any], source: Path, target: ModelConfig) -> tuple | None:
    scaling = raw.get("rope_scaling")
    if scaling is None:
        return None
    kind = scaling.get("rope_type", scaling.get("type"))
    if kind == "llama3":
        return (
            float(scaling["factor"]),
            float(scaling["low_freq_factor"]),
            float(scaling["high_freq_factor"]),
            int(scaling["original_max_position_embeddings"]),
        )
    if kind == "default":
        return None
    raise ModelLoadError(f"{source}: rope_scaling type {kind!r} is not supported")


def layer_config_from_json(
    raw: dict[str, Any], source: Path, target: ModelConfig, **overrides: Any
) -> ModelConfig:
    """The decoder-layer config of a head from a Hugging Face style config.json (missing fields: the
    target's). The vocabulary is always the target's."""

    def get(name: str, default: Any) -> Any:
        return raw[name] if raw.get(name) is not None else default

    try:
        hidden = int(get("hidden_size", target.hidden_size))
        heads = int(get("num_attention_heads", target.num_heads))
        config = ModelConfig(
            vocab_size=target.vocab_size,
            hidden_size=hidden,
            intermediate_size=int(get("intermediate_size", target.intermediate_size)),
            num_layers=1,
            num_heads=heads,
            num_kv_heads=int(get("num_key_value_heads", heads)),
            head_dim=int(get("head_dim", hidden // heads)),
            rope_theta=float(get("rope_theta", target.rope_theta)),
            rope_scaling=_rope_scaling(raw, source, target) if "rope_scaling" in raw else target.rope_scaling,
            rms_norm_eps=float(get("rms_norm_eps", target.rms_norm_eps)),
            attention_bias=bool(get("attention_bias", False)),
            max_position_embeddings=int(get("max_position_embeddings", target.max_position_embeddings)),
            architecture="head",
        )
        return config.replace(**overrides)
    except (TypeError, ValueError, ZeroDivisionError) as error:  # a field of the wrong type or range
        raise ModelLoadError(f"{source}: {error}") from None


def _has_attention_bias(tensors: TensorSource, prefix: str) -> bool:
    return any(f"{prefix}self_attn.{name}.bias" in tensors for name in ("q_proj", "k_proj", "v_proj"))


def _is_rotary_buffer(name: str) -> bool:
    return "rotary_emb" in name


def _check_shared_tensor(tensors: TensorSource, key: str, shape: tuple[int, ...]) -> None:
    """A copy of a target weight stored with the head (ignored, but its shape must fit the target)."""
    if key in tensors:
        tensors.take(key, shape)
