"""Loaders for draft heads: jaxspec's own Orbax checkpoints and the published layouts people download.

`load_head(path, method, target_config, dtype, extra)` picks the format:
  * a directory with jaxspec_head.json: jaxspec's own head (`jaxspec.models.heads.orbax_io`);
  * method "medusa": FasterDecoding layout. medusa_lm_head.safetensors (or medusa_lm_head.pt) holds the
    `nn.ModuleList` of heads, head i = Sequential(ResBlock x L, Linear(d, V, bias=False)):
    `{i}.{j}.linear.weight` [d, d], `{i}.{j}.linear.bias` [d] (block j), `{i}.{L}.weight` [V, d];
    config.json: medusa_num_heads, medusa_num_layers.
    (FasterDecoding/Medusa medusa/model/medusa_model.py @ 60eeab92e98adb0e787987493b11fa38535a8260,
    the safetensors file name as written by huggingface/text-generation-inference's Medusa loader.)
  * method "eagle": SafeAILab EAGLE-1/2 layout. pytorch_model.bin or model.safetensors with fc.weight
    [d, 2d], fc.bias [d], layers.0.self_attn.{q,k,v,o}_proj.weight, layers.0.post_attention_layernorm
    .weight, layers.0.mlp.{gate,up,down}_proj.weight (no input_layernorm on layer 0), optionally
    embed_tokens.weight (the target's, frozen); config.json: a Llama config of one layer, "bias" for fc.
    (SafeAILab/EAGLE eagle/model/cnets1.py @ 2174a790d71a41a2e7549e14fef7d277435894b9: Model.fc,
    LlamaDecoderLayer(index=0) skips input_layernorm; eagle/model/ea_model.py loads pytorch_model.bin.)
  * method "eagle3": SafeAILab / SpecForge EAGLE-3 layout. fc.weight [d, 3 d_target],
    midlayer.{input_layernorm,hidden_norm,post_attention_layernorm}.weight,
    midlayer.self_attn.{q,k,v}_proj.weight [*, 2d], midlayer.self_attn.o_proj.weight, midlayer.mlp.*,
    norm.weight, lm_head.weight [V_draft, d], d2t [V_draft] (target id - draft id), t2d [V] (bool),
    optionally embed_tokens.weight; config.json: draft_vocab_size, optional target_hidden_size and
    eagle_aux_hidden_state_layer_ids (vLLM's layer-input numbering, = our layer outputs + 1).
    (SafeAILab/EAGLE eagle/traineagle3/cnets.py @ 09fe6a050421cc4dfb1e3f4dfbe4f65aa9b9f63c: Model,
    LlamaDecoderLayeremb, d2t/t2d; sgl-project/SpecForge specforge/modeling/draft/llama3_eagle.py
    @ 89241ea0299e4ac48a22d27d649182627d0e5e53: LlamaForCausalLMEagle3.)
  * method "mtp": MiMo-style MTP layers stored in the target model's checkpoint (*.safetensors +
    config.json with num_hidden_layers L and num_nextn_predict_layers D):
    MiMo: model.mtp_layers.{i}.{token_layernorm,hidden_layernorm,final_layernorm}.weight,
      .input_proj.weight [d, 2d] over [hidden; embedding], and a Qwen2 block (.input_layernorm,
      .self_attn.* with q/k/v biases, .post_attention_layernorm, .mlp.*).
      (vllm-project/vllm vllm/model_executor/models/mimo_mtp.py @ 0bb55d60cb667d2f4e263b55304a30b38fe2e55c)
    DeepSeek-V3 stores its MTP layers as model.layers.{L+i}.* with MLA attention and a mixture-of-experts
    MLP (vllm-project/vllm vllm/model_executor/models/deepseek_mtp.py): read for a DeepSeek-V3 target
    by `jaxspec.models.deepseek_v3.mtp.load_mtp_head`, refused for any other target.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import jax.numpy as jnp
import numpy as np

from jaxspec.config import ModelConfig
from jaxspec.errors import ModelLoadError
from jaxspec.models.deepseek_v3.config import DeepseekV3Config
from jaxspec.models.heads.checkpoint_io import TensorSource, fill_params, layout_key, read_tensors
from jaxspec.models.heads.configs import (
    Eagle3Config,
    EagleConfig,
    MedusaConfig,
    MtpConfig,
    default_eagle3_layers,
    method_of,
)
from jaxspec.models.heads.head import DraftHead, abstract_head
from jaxspec.models.heads.mtp import abstract_module, stack_modules
from jaxspec.models.heads.orbax_io import OWN_FORMAT_FILE, load_own_head


def load_head(
    path: str | Path, method: str, target: ModelConfig, dtype: jnp.dtype, extra: dict[str, Any] | None = None
) -> DraftHead:
    """Load the head of `method` from `path` (see the module docstring for the formats)."""
    directory = Path(path)
    if not directory.is_dir():
        raise ModelLoadError(f"{directory}: no such draft head directory")
    extra = extra or {}
    if (directory / OWN_FORMAT_FILE).is_file():
        head = load_own_head(directory, dtype)
        if method_of(head.config) != method:
            raise ModelLoadError(
                f"{directory}: a {method_of(head.config)} head, SpecConfig asks for {method}"
            )
        return head
    loaders = {"medusa": load_medusa, "eagle": load_eagle, "eagle3": load_eagle3, "mtp": load_mtp}
    if method not in loaders:
        raise ModelLoadError(f"{directory}: no loader for method {method!r}")
    return loaders[method](directory, target, dtype, extra)


# ---------------------------------------------------------------------------------------------------
# Shared pieces
# ---------------------------------------------------------------------------------------------------


def _read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        raise ModelLoadError(f"{path}: missing")
    try:
        data = json.loads(path.read_text())
    except json.JSONDecodeError as err:
        raise ModelLoadError(f"{path}: invalid JSON at line {err.lineno}: {err.msg}") from err
    if not isinstance(data, dict):
        raise ModelLoadError(f"{path}: expected a JSON object")
    return data


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


# ---------------------------------------------------------------------------------------------------
# Medusa (FasterDecoding)
# ---------------------------------------------------------------------------------------------------


def load_medusa(directory: Path, target: ModelConfig, dtype: jnp.dtype, extra: dict[str, Any]) -> DraftHead:
    raw = _read_json(directory / "config.json")
    file = _first_existing(directory, ("medusa_lm_head.safetensors", "medusa_lm_head.pt"))
    tensors = TensorSource(read_tensors([file]), str(file))
    num_layers = int(raw.get("medusa_num_layers", 1))
    num_heads = raw.get("medusa_num_heads")
    if num_heads is None:
        raise ModelLoadError(f"{directory / 'config.json'}: required field 'medusa_num_heads' is missing")
    own_lm_head = f"0.{num_layers}.weight" in tensors
    config = MedusaConfig(
        num_heads=int(num_heads),
        num_layers=num_layers,
        hidden_size=target.hidden_size,
        vocab_size=target.vocab_size,
        own_lm_head=own_lm_head,
    )
    abstract = abstract_head(config, dtype)
    d, v = config.hidden_size, config.vocab_size
    res_kernel = np.zeros((config.num_heads, num_layers, d, d), np.float32)
    res_bias = np.zeros((config.num_heads, num_layers, d), np.float32)
    lm_kernel = np.zeros((config.num_heads, d, v), np.float32)
    for i in range(config.num_heads):
        for j in range(num_layers):
            res_kernel[i, j] = tensors.take(f"{i}.{j}.linear.weight", (d, d), transpose=True)
            res_bias[i, j] = tensors.take(f"{i}.{j}.linear.bias", (d,))
        if own_lm_head:
            lm_kernel[i] = tensors.take(f"{i}.{num_layers}.weight", (d, v), transpose=True)
    tensors.check_all_used()
    arrays = {("res_kernel",): res_kernel, ("res_bias",): res_bias, ("lm_kernel",): lm_kernel}
    local = TensorSource({".".join(k): a for k, a in arrays.items()}, str(file))
    params = fill_params(abstract.params, local, lambda path: (".".join(map(str, path)), False), dtype)
    return DraftHead(config=config, graphdef=abstract.graphdef, params=params, source=str(directory))


# ---------------------------------------------------------------------------------------------------
# EAGLE-1/2 and EAGLE-3 (SafeAILab, SpecForge)
# ---------------------------------------------------------------------------------------------------


def _eagle_weight_files(directory: Path) -> list[Path]:
    safetensors = sorted(directory.glob("*.safetensors"))
    if safetensors:
        return safetensors
    return [_first_existing(directory, ("pytorch_model.bin",))]


def load_eagle(directory: Path, target: ModelConfig, dtype: jnp.dtype, extra: dict[str, Any]) -> DraftHead:
    raw = _read_json(directory / "config.json")
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
    raw = _read_json(config_path)
    files = _eagle_weight_files(directory)
    tensors = TensorSource(read_tensors(files), str(files[0]))
    if raw.get("draft_vocab_size") is None:
        raise ModelLoadError(f"{config_path}: required field 'draft_vocab_size' is missing")
    bias = _has_attention_bias(tensors, "midlayer.")
    layer = layer_config_from_json(raw, config_path, target, attention_bias=bias)
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
    params = fill_params(abstract.params, tensors, lambda p: layout_key(p, {"layer": "midlayer"}), dtype)
    if not own_embedding:
        _check_shared_tensor(tensors, "embed_tokens.weight", (target.vocab_size, target.hidden_size))
    tensors.check_all_used(ignore=_is_rotary_buffer)
    _check_vocab_maps(params, config, str(files[0]))
    return DraftHead(config=config, graphdef=abstract.graphdef, params=params, source=str(directory))


def _check_vocab_maps(params, config: Eagle3Config, source: str) -> None:
    d2t = np.asarray(params["d2t"].get_value())
    t2d = np.asarray(params["t2d"].get_value())
    ids = np.arange(config.draft_vocab_size) + d2t
    if ids.min() < 0 or ids.max() >= config.layer.vocab_size or not t2d[ids].all() or t2d.sum() != len(ids):
        raise ModelLoadError(f"{source}: tensors 'd2t' and 't2d' disagree (d2t must map onto t2d's tokens)")


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
        from jaxspec.models.deepseek_v3.mtp import load_mtp_head

        return load_mtp_head(directory, target, dtype)
    config_path = directory / "config.json"
    raw = _read_json(config_path)
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
