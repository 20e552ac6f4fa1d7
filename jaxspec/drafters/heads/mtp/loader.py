"""MTP layers stored in a target's checkpoint -> a jaxspec MTP head.

MiMo: `model.mtp_layers.{i}.*` (see `loaders` for the names). DeepSeek-V3 stores module i at
`model.layers.{num_hidden_layers + i}.`: enorm, hnorm (RMSNorm), eh_proj [d, 2 d], a full decoder block
(input_layernorm, MLA self_attn, post_attention_layernorm, the MoE mlp), shared_head.norm, and copies of
the target's embedding (embed_tokens) and LM head (shared_head.head), whose shapes are checked and which
are shared with the target, as in DeepSeek's and vLLM's inference code. At position i, with h = the
target's final-normed hidden state (or the previous module's block output):
  x = eh_proj([enorm(Emb(t_(i+k))); hnorm(h_i)]),  h' = block(x),  logits = lm_head(shared_head.norm(h'))
and h' (before the norm) is what the next draft step reads.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import jax.numpy as jnp

from jaxspec.drafters.heads.configs import MtpConfig
from jaxspec.drafters.heads.head import DraftHead
from jaxspec.drafters.heads.mtp.module import abstract_module, stack_modules
from jaxspec.drafters.heads.published import (
    _check_shared_tensor,
    _has_attention_bias,
    _is_rotary_buffer,
    layer_config_from_json,
)
from jaxspec.errors import ModelLoadError
from jaxspec.loading.checkpoint_io import TensorSource, fill_params, layout_key, read_tensors
from jaxspec.loading.deepseek_v3 import fill_state, read_checkpoint
from jaxspec.loading.hf_dir import read_json_object
from jaxspec.model.config import ModelConfig
from jaxspec.model.deepseek_v3.config import DeepseekV3Config, fp8_block_size

# ---------------------------------------------------------------------------------------------------
# MTP (MiMo mtp_layers; DeepSeek-V3's MLA / MoE layers for a DeepSeek-V3 target)
# ---------------------------------------------------------------------------------------------------

_MIMO_NAMES = {
    "enorm": "token_layernorm",
    "hnorm": "hidden_layernorm",
    "eh_proj": "input_proj",
    "final_norm": "final_layernorm",
    "block": "",
}


def _safetensors_files(directory: Path) -> list[Path]:
    files = sorted(directory.glob("*.safetensors"))
    if not files:
        raise ModelLoadError(f"{directory}: no *.safetensors files")
    return files


def load_mtp(directory: Path, target: ModelConfig, dtype: jnp.dtype, extra: dict[str, Any]) -> DraftHead:
    if isinstance(target, DeepseekV3Config):  # MLA + MoE modules at model.layers.{L + i}
        return load_mtp_head(directory, target, dtype)
    config_path = directory / "config.json"
    raw = read_json_object(config_path)
    num_layers = raw.get("num_hidden_layers")
    if num_layers is None:
        raise ModelLoadError(f"{config_path}: required field 'num_hidden_layers' is missing")
    count = int(raw.get("num_nextn_predict_layers") or 1)

    def mimo_prefix(i: int) -> str:
        return f"model.mtp_layers.{i}."

    deepseek_prefix = f"model.layers.{int(num_layers)}."  # DeepSeek-V3: MTP layers after the target's
    candidates = (deepseek_prefix,) + tuple(mimo_prefix(i) for i in range(count))
    files = _safetensors_files(directory)
    tensors = TensorSource(read_tensors(files, keep=lambda name: name.startswith(candidates)), str(directory))
    if not any(k.startswith(mimo_prefix(0)) for k in tensors.tensors):
        if any(k.startswith(deepseek_prefix) for k in tensors.tensors):
            raise ModelLoadError(
                f"{directory}: DeepSeek-V3 MTP layers ('{deepseek_prefix}*': MLA attention, "
                f"mixture-of-experts MLP) need a DeepSeek-V3 target, not a {target.architecture} one"
            )
        raise ModelLoadError(f"{directory}: no MTP tensors (expected '{mimo_prefix(0)}*', MiMo-style MTP)")
    names, prefix_of = _MIMO_NAMES, mimo_prefix
    bias = _has_attention_bias(tensors, prefix_of(0))
    layer = layer_config_from_json(raw, config_path, target, attention_bias=bias)
    config = MtpConfig(layer=layer, num_modules=count, embedding_first=False, recycle_normed=True)
    graphdef, module_abstract = abstract_module(config, dtype)
    states = [
        fill_params(module_abstract, tensors, lambda p, i=i: layout_key(p, names, prefix_of(i)), dtype)
        for i in range(count)
    ]
    prefixes = tuple(prefix_of(i) for i in range(count))
    for prefix in prefixes:
        for shared in ("embed_tokens.weight", "shared_head.head.weight"):
            _check_shared_tensor(tensors, prefix + shared, (target.vocab_size, target.hidden_size))
    tensors.check_all_used(ignore=lambda name: _is_rotary_buffer(name) or not name.startswith(prefixes))
    return DraftHead(config=config, graphdef=graphdef, params=stack_modules(states), source=str(directory))


def load_mtp_head(directory: Path, target: DeepseekV3Config, dtype: jnp.dtype):
    """The MTP layers of a DeepSeek-V3 checkpoint directory as a DraftHead (stacked modules)."""
    config_path = directory / "config.json"
    raw = read_json_object(config_path)
    count = int(raw.get("num_nextn_predict_layers") or 0)
    if count < 1:
        raise ModelLoadError(f"{config_path}: field 'num_nextn_predict_layers' is {count}: no MTP layers")
    prefixes = tuple(f"model.layers.{target.num_layers + i}." for i in range(count))
    block = fp8_block_size(raw, str(config_path))
    tensors = TensorSource(
        read_checkpoint(directory, lambda n: n.startswith(prefixes), block), str(directory)
    )
    if not tensors.tensors:
        raise ModelLoadError(f"{directory}: no MTP tensors ('{prefixes[0]}*')")
    config = MtpConfig(layer=target, num_modules=count, embedding_first=True, recycle_normed=False)
    graphdef, abstract = abstract_module(config, dtype)

    def key_of(prefix: str):
        def key(path: tuple) -> tuple[str, tuple]:
            if path[0] == "block":
                return prefix, path[1:]
            if path[0] == "final_norm":
                return prefix, ("shared_head", "norm", *path[1:])
            return prefix, path

        return key

    states = [fill_state(abstract, key_of(prefix), tensors, dtype) for prefix in prefixes]
    for prefix in prefixes:  # copies of the target's embedding and LM head: shared, shapes checked
        for name in ("embed_tokens.weight", "shared_head.head.weight"):
            if prefix + name in tensors:
                tensors.take(prefix + name, (target.vocab_size, target.hidden_size))
    tensors.check_all_used()
    return DraftHead(config=config, graphdef=graphdef, params=stack_modules(states), source=str(directory))
