"""Frozen, hashable configurations of the draft heads (static arguments of the compiled round).

A head is described by its config, its NNX graph (split once) and its parameters. Configs serialize to
plain JSON (`config_to_json` / `config_from_json`) for jaxspec's own Orbax checkpoints.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from jaxspec.model.config import ModelConfig
from jaxspec.model.deepseek_v3.config import MODEL_TYPES as DEEPSEEK_MODEL_TYPES
from jaxspec.model.deepseek_v3.config import DeepseekV3Config


@dataclass(frozen=True)
class MedusaConfig:
    """Medusa heads: `num_heads` heads of `num_layers` residual SiLU blocks each over the target's last
    (post-norm) hidden state; head i predicts the token two + i positions after that hidden state.

    own_lm_head: each head has its own [d, V] LM head (FasterDecoding layout); False = the target's.
    """

    num_heads: int
    num_layers: int
    hidden_size: int
    vocab_size: int
    own_lm_head: bool = True


@dataclass(frozen=True)
class EagleConfig:
    """EAGLE-1/2 head: fc over [token embedding; feature] (2d -> d) + one decoder layer, whose output
    feature goes through the target's frozen LM head.

    layer: dimensions of the decoder layer (num_layers = 1; vocab_size = the target's).
    fc_bias: the published EAGLE-1 fc has a bias.
    input_norm: EAGLE-1's only layer (index 0) has no input_layernorm; True adds one.
    """

    layer: ModelConfig
    fc_bias: bool = True
    input_norm: bool = False


@dataclass(frozen=True)
class Eagle3Config:
    """EAGLE-3 head: three target layers fused (3 * target_hidden -> d), a decoder layer whose
    attention reads [input_layernorm(embedding); hidden_norm(feature)] (2d wide), then layer.num_layers
    - 1 standard decoder layers (vLLM's multi-layer EAGLE-3; published heads have none), its own final
    norm and LM head over a reduced draft vocabulary (draft id i -> target id i + d2t[i]).

    target_layers: decoder layers whose outputs are fused (output-of-layer convention, 0-based).
    own_embedding: the head has its own token embedding (its width differs from the target's).
    """

    layer: ModelConfig
    target_hidden_size: int
    draft_vocab_size: int
    target_layers: tuple[int, ...]
    own_embedding: bool = False


@dataclass(frozen=True)
class MtpConfig:
    """MiMo-style multi-token prediction modules (the chained MTP of the DeepSeek-V3 paper, with a
    Llama / Qwen2 decoder block; DeepSeek-V3's own MLA / MoE layers are not supported).

    Module k at position i: proj([enorm(Emb(t_(i+k))); hnorm(h_i^(k-1))]) -> one decoder block ->
    final norm -> the target's LM head. `num_modules` distinct modules; more draft steps than modules
    reuse them cyclically (step k uses module k mod num_modules).

    embedding_first: concatenation order: [emb; hidden] (True: the DeepSeek-V3 paper's order, jaxspec's
        own trained heads), MiMo checkpoints [hidden; emb] (False).
    recycle_normed: h^k passed to the next module is the final-normed output (MiMo) or the block output
        before the final norm (True / False).
    """

    layer: ModelConfig
    num_modules: int
    embedding_first: bool = True
    recycle_normed: bool = False


HeadConfig = MedusaConfig | EagleConfig | Eagle3Config | MtpConfig

_CONFIG_CLASSES: dict[str, type] = {
    "medusa": MedusaConfig,
    "eagle": EagleConfig,
    "eagle3": Eagle3Config,
    "mtp": MtpConfig,
}


def method_of(config: HeadConfig) -> str:
    """The SpecConfig method a head config belongs to."""
    for method, cls in _CONFIG_CLASSES.items():
        if isinstance(config, cls):
            return method
    raise TypeError(f"not a head config: {config!r}")


def config_to_json(config: HeadConfig) -> dict[str, Any]:
    """{"method": ..., "config": {...}} with plain JSON values."""
    return {"method": method_of(config), "config": dataclasses.asdict(config)}


def _model_config_from_dict(raw: dict[str, Any]) -> ModelConfig:
    raw = dict(raw)
    for name in ("rope_scaling", "yarn"):  # DeepseekV3Config.yarn
        if raw.get(name) is not None:
            raw[name] = tuple(raw[name])
    raw["eos_token_ids"] = tuple(raw.get("eos_token_ids", ()))
    if raw.get("architecture") in DEEPSEEK_MODEL_TYPES:  # an MLA + MoE layer (DeepSeek-V3's MTP)
        return DeepseekV3Config(**raw)
    return ModelConfig(**raw)


def config_from_json(data: dict[str, Any]) -> HeadConfig:
    """Inverse of `config_to_json`."""
    method = data["method"]
    if method not in _CONFIG_CLASSES:
        raise ValueError(f"unknown head method {method!r} (known: {sorted(_CONFIG_CLASSES)})")
    raw = dict(data["config"])
    if "layer" in raw:
        raw["layer"] = _model_config_from_dict(raw["layer"])
    if "target_layers" in raw:
        raw["target_layers"] = tuple(int(i) for i in raw["target_layers"])
    return _CONFIG_CLASSES[method](**raw)


def head_layer_config(target: ModelConfig) -> ModelConfig:
    """The default decoder-layer config of a head drafting for `target`: the target's dimensions, one
    layer (EAGLE and MTP heads are published with the target's attention and MLP shapes)."""
    return target.replace(num_layers=1, tie_word_embeddings=False)


def default_eagle3_layers(num_layers: int) -> tuple[int, int, int]:
    """EAGLE-3's published choice: outputs of layers 1, L/2 - 1 and L - 4 (clipped for tiny models).

    vLLM's `eagle_aux_hidden_state_layer_ids` (2, L/2, L - 3) name the same tensors as layer inputs.
    """
    raw = (1, num_layers // 2 - 1, num_layers - 4)
    return tuple(min(max(i, 0), num_layers - 1) for i in raw)  # type: ignore[return-value]
