"""SafeAILab's published EAGLE-1/2 and EAGLE-3 layouts -> jaxspec heads."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import jax.numpy as jnp
import numpy as np

from jaxspec.drafters.heads.configs import (
    Eagle3Config,
    EagleConfig,
    default_eagle3_layers,
)
from jaxspec.drafters.heads.head import DraftHead, abstract_head
from jaxspec.drafters.heads.published import (
    _check_shared_tensor,
    _first_existing,
    _has_attention_bias,
    _is_rotary_buffer,
    layer_config_from_json,
)
from jaxspec.errors import ModelLoadError
from jaxspec.loading.checkpoint_io import TensorSource, fill_params, layout_key, read_tensors
from jaxspec.loading.hf_dir import read_json_object
from jaxspec.model.config import ModelConfig

# ---------------------------------------------------------------------------------------------------
# EAGLE-1/2 and EAGLE-3 (SafeAILab, SpecForge)
# ---------------------------------------------------------------------------------------------------


def _eagle_weight_files(directory: Path) -> list[Path]:
    safetensors = sorted(directory.glob("*.safetensors"))
    if safetensors:
        return safetensors
    return [_first_existing(directory, ("pytorch_model.bin",))]


def load_eagle(directory: Path, target: ModelConfig, dtype: jnp.dtype, extra: dict[str, Any]) -> DraftHead:
    raw = read_json_object(directory / "config.json")
    files = _eagle_weight_files(directory)
    tensors = TensorSource(read_tensors(files), str(files[0]))
    bias = _has_attention_bias(tensors, "layers.0.")
    layer = layer_config_from_json(raw, directory / "config.json", target, attention_bias=bias)
    config = EagleConfig(
        layer=layer,
        fc_bias=bool(raw.get("bias", "fc.bias" in tensors)),
        input_norm="layers.0.input_layernorm.weight" in tensors,
    )
    abstract = abstract_head(config, dtype)
    params = fill_params(abstract.params, tensors, lambda p: layout_key(p, {"layer": "layers.0"}), dtype)
    _check_shared_tensor(tensors, "embed_tokens.weight", (target.vocab_size, target.hidden_size))
    tensors.check_all_used(ignore=_is_rotary_buffer)
    return DraftHead(config=config, graphdef=abstract.graphdef, params=params, source=str(directory))


def eagle3_target_layers(raw: dict[str, Any], target: ModelConfig, extra: dict[str, Any]) -> tuple[int, ...]:
    """Fused layers: extra "eagle3_layers" > config (vLLM layer-input ids - 1) > the published default."""
    if extra.get("eagle3_layers"):
        return tuple(int(i) for i in extra["eagle3_layers"])
    ids = raw.get("eagle_aux_hidden_state_layer_ids") or (raw.get("eagle_config") or {}).get(
        "eagle_aux_hidden_state_layer_ids"
    )
    if ids:
        return tuple(int(i) - 1 for i in ids)
    return default_eagle3_layers(target.num_layers)


def load_eagle3(directory: Path, target: ModelConfig, dtype: jnp.dtype, extra: dict[str, Any]) -> DraftHead:
    config_path = directory / "config.json"
    raw = read_json_object(config_path)
    files = _eagle_weight_files(directory)
    tensors = TensorSource(read_tensors(files), str(files[0]))
    if raw.get("draft_vocab_size") is None:
        raise ModelLoadError(f"{config_path}: required field 'draft_vocab_size' is missing")
    first, num_layers = _eagle3_layer_names(tensors, raw, config_path)
    bias = _has_attention_bias(tensors, first + ".")
    layer = layer_config_from_json(raw, config_path, target, attention_bias=bias, num_layers=num_layers)
    own_embedding = (
        "embed_tokens.weight" in tensors
        and tensors.tensors["embed_tokens.weight"].shape[-1] != target.hidden_size
    )
    config = Eagle3Config(
        layer=layer,
        target_hidden_size=int(raw.get("target_hidden_size") or target.hidden_size),
        draft_vocab_size=int(raw["draft_vocab_size"]),
        target_layers=eagle3_target_layers(raw, target, extra),
        own_embedding=own_embedding,
    )
    abstract = abstract_head(config, dtype)
    params = fill_params(abstract.params, tensors, lambda p: _eagle3_key(p, first), dtype)
    if not own_embedding:
        _check_shared_tensor(tensors, "embed_tokens.weight", (target.vocab_size, target.hidden_size))
    tensors.check_all_used(ignore=_is_rotary_buffer)
    _check_vocab_maps(params, config, str(files[0]))
    return DraftHead(config=config, graphdef=abstract.graphdef, params=params, source=str(directory))


def _eagle3_layer_names(tensors: TensorSource, raw: dict[str, Any], config_path: Path) -> tuple[str, int]:
    """(name of the first decoder layer's tensors, decoder layers): SafeAILab / SpecForge store one layer
    as "midlayer"; vLLM's multi-layer EAGLE-3 reads "layers.0" (or "midlayer") then "layers.1".."layers.
    L-1", and config.json's num_hidden_layers must say L."""
    names = tensors.tensors
    first = "midlayer" if any(k.startswith("midlayer.") for k in names) else "layers.0"
    later = {int(k.split(".")[1]) for k in names if k.startswith("layers.") and k.split(".")[1].isdigit()}
    later.discard(0)
    num_layers = 1 + len(later)
    if later != set(range(1, num_layers)):
        raise ModelLoadError(f"{config_path}: decoder layers {sorted(later)} after the first are not 1..n")
    declared = raw.get("num_hidden_layers")
    if declared is not None and (not isinstance(declared, int) or declared != num_layers):
        raise ModelLoadError(
            f"{config_path}: num_hidden_layers is {declared}, the weights hold {num_layers} decoder layer(s)"
        )
    return first, num_layers


def _eagle3_key(path: tuple, first: str) -> tuple[str, bool]:
    """NNX path of an EAGLE-3 head -> published tensor name: layer -> `first`, later_layers.i ->
    layers.(i+1)."""
    if str(path[0]) == "later_layers":
        return layout_key((f"layers.{int(path[1]) + 1}",) + tuple(path[2:]), {})
    return layout_key(path, {"layer": first})


def _check_vocab_maps(params, config: Eagle3Config, source: str) -> None:
    d2t = np.asarray(params["d2t"].get_value())
    t2d = np.asarray(params["t2d"].get_value())
    ids = np.arange(config.draft_vocab_size) + d2t
    if ids.min() < 0 or ids.max() >= config.layer.vocab_size or not t2d[ids].all() or t2d.sum() != len(ids):
        raise ModelLoadError(f"{source}: tensors 'd2t' and 't2d' disagree (d2t must map onto t2d's tokens)")
