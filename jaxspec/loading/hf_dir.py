"""Read a Hugging Face model directory: config.json + safetensors weights (single file or sharded).

Tensors come back under their Hugging Face names, as float32 numpy arrays in Hugging Face layouts
(linear weights [out, in]). Only the tensors the model uses are returned (see `hf_tensor_shapes`).
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import ml_dtypes  # noqa: F401  (registers numpy's "bfloat16" dtype, which safetensors' numpy reader needs)
import numpy as np
from safetensors import SafetensorError, safe_open

from jaxspec.errors import ModelLoadError
from jaxspec.model.config import ModelConfig

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3")
SINGLE_FILE = "model.safetensors"
SHARD_INDEX = "model.safetensors.index.json"


def read_hf_dir(path: str | Path) -> tuple[ModelConfig, dict[str, np.ndarray]]:
    """Read config.json and the safetensors weights of a Hugging Face Llama-family model directory."""
    directory = Path(path)
    if not directory.is_dir():
        raise ModelLoadError(f"{directory}: no such model directory")
    config = read_hf_config(directory / "config.json")
    shapes = hf_tensor_shapes(config)
    by_file: dict[Path, dict[str, tuple[int, ...]]] = {}
    for name, file in _locate_tensors(directory, shapes, config.num_layers).items():
        by_file.setdefault(file, {})[name] = shapes[name]
    tensors: dict[str, np.ndarray] = {}
    for file, file_shapes in by_file.items():
        tensors.update(_read_file_tensors(file, file_shapes))
    return config, {name: tensors[name] for name in shapes}


def read_hf_config(config_path: Path) -> ModelConfig:
    """ModelConfig from a Hugging Face config.json (plus generation_config.json's eos ids if present)."""
    raw = read_json_object(config_path)
    model_type = raw.get("model_type")
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise ModelLoadError(
            f"{config_path}: model_type {model_type!r} (architectures {raw.get('architectures')}) is not "
            f"supported; supported model_type values: {list(SUPPORTED_MODEL_TYPES)}"
        )
    if raw.get("mlp_bias"):
        raise ModelLoadError(f"{config_path}: mlp_bias=true is not supported")
    if raw.get("attention_bias") and model_type in ("llama", "mistral"):
        raise ModelLoadError(f"{config_path}: attention_bias=true (o_proj bias) is not supported for llama")

    def field(name: str, default: Any = None) -> Any:
        value = raw.get(name, default)
        if value is None:
            raise ModelLoadError(f"{config_path}: required field {name!r} is missing")
        return value

    def integer(name: str, default: Any = None) -> int:
        value = field(name, default)
        if not isinstance(value, int) or isinstance(value, bool):
            raise ModelLoadError(f"{config_path}: field {name!r} must be an integer, got {json.dumps(value)}")
        return value

    def number(name: str, default: float) -> float:
        value = field(name, default)
        if not isinstance(value, (int, float)) or isinstance(value, bool):
            raise ModelLoadError(f"{config_path}: field {name!r} must be a number, got {json.dumps(value)}")
        return float(value)

    hidden_size = integer("hidden_size")
    num_heads = integer("num_attention_heads")
    try:
        rope_theta, rope_scaling = _rope_settings(raw, config_path)
    except (TypeError, ValueError, AttributeError) as error:
        raise ModelLoadError(f"{config_path}: invalid rope settings ({error})") from None
    try:
        eos_ids = _token_id_tuple(raw.get("eos_token_id"))
        generation_config = config_path.parent / "generation_config.json"
        if generation_config.is_file():
            extra_eos = _token_id_tuple(read_json_object(generation_config).get("eos_token_id"))
            eos_ids = tuple(dict.fromkeys(eos_ids + extra_eos))
    except (TypeError, ValueError):
        raise ModelLoadError(
            f"{config_path}: eos_token_id must be an integer or a list of integers"
        ) from None
    bos = raw.get("bos_token_id")
    names = {
        "num_layers": "num_hidden_layers",
        "num_kv_heads": "num_key_value_heads",
        "num_heads": "num_attention_heads",
    }
    try:
        return ModelConfig(
            vocab_size=integer("vocab_size"),
            hidden_size=hidden_size,
            intermediate_size=integer("intermediate_size"),
            num_layers=integer("num_hidden_layers"),
            num_heads=num_heads,
            num_kv_heads=integer("num_key_value_heads", num_heads),
            head_dim=integer("head_dim", hidden_size // num_heads if num_heads > 0 else 0),
            rope_theta=rope_theta,
            rope_scaling=rope_scaling,
            rms_norm_eps=number("rms_norm_eps", 1e-6),
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
            attention_bias=model_type == "qwen2" or bool(raw.get("attention_bias", False)),
            qk_norm=model_type == "qwen3",
            max_position_embeddings=integer("max_position_embeddings", 2048),
            architecture=model_type,
            bos_token_id=int(bos) if isinstance(bos, int) else None,
            eos_token_ids=eos_ids,
        )
    except ValueError as error:  # a range check of ModelConfig: name the config.json field
        message = str(error)
        for ours, theirs in names.items():
            message = message.replace(ours, theirs)
        raise ModelLoadError(f"{config_path}: {message}") from None


def hf_tensor_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor a model of this config needs: Hugging Face name -> shape ([out, in] for linears)."""
    hidden, head_dim = config.hidden_size, config.head_dim
    q_out, kv_out = config.num_heads * head_dim, config.num_kv_heads * head_dim
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (config.vocab_size, hidden)}
    for layer in range(config.num_layers):
        attn, mlp = f"model.layers.{layer}.self_attn", f"model.layers.{layer}.mlp"
        shapes[f"model.layers.{layer}.input_layernorm.weight"] = (hidden,)
        shapes[f"{attn}.q_proj.weight"] = (q_out, hidden)
        shapes[f"{attn}.k_proj.weight"] = (kv_out, hidden)
        shapes[f"{attn}.v_proj.weight"] = (kv_out, hidden)
        if config.attention_bias:
            shapes[f"{attn}.q_proj.bias"] = (q_out,)
            shapes[f"{attn}.k_proj.bias"] = (kv_out,)
            shapes[f"{attn}.v_proj.bias"] = (kv_out,)
        if config.qk_norm:
            shapes[f"{attn}.q_norm.weight"] = (head_dim,)
            shapes[f"{attn}.k_norm.weight"] = (head_dim,)
        shapes[f"{attn}.o_proj.weight"] = (hidden, q_out)
        shapes[f"model.layers.{layer}.post_attention_layernorm.weight"] = (hidden,)
        shapes[f"{mlp}.gate_proj.weight"] = (config.intermediate_size, hidden)
        shapes[f"{mlp}.up_proj.weight"] = (config.intermediate_size, hidden)
        shapes[f"{mlp}.down_proj.weight"] = (hidden, config.intermediate_size)
    shapes["model.norm.weight"] = (hidden,)
    if not config.tie_word_embeddings:
        shapes["lm_head.weight"] = (config.vocab_size, hidden)
    return shapes


def _rope_settings(raw: dict[str, Any], config_path: Path) -> tuple[float, tuple | None]:
    """(rope_theta, llama3 rope_scaling tuple or None) from either the v4 or the v5 config layout.

    transformers 4.x writes `rope_theta` + `rope_scaling`; 5.x writes `rope_parameters`.
    """
    params = raw.get("rope_parameters") or {}
    scaling = raw.get("rope_scaling") or params
    theta = raw.get("rope_theta", params.get("rope_theta", 10000.0))
    rope_type = scaling.get("rope_type", scaling.get("type", "default"))
    if rope_type == "default":
        return float(theta), None
    if rope_type != "llama3":
        raise ModelLoadError(
            f"{config_path}: rope scaling type {rope_type!r} is not supported (supported: default, llama3)"
        )
    try:
        return float(theta), (
            float(scaling["factor"]),
            float(scaling["low_freq_factor"]),
            float(scaling["high_freq_factor"]),
            int(scaling["original_max_position_embeddings"]),
        )
    except KeyError as missing:
        raise ModelLoadError(f"{config_path}: llama3 rope scaling lacks field {missing}") from None


def _token_id_tuple(value: Any) -> tuple[int, ...]:
    if value is None:
        return ()
    if isinstance(value, int):
        return (value,)
    return tuple(int(v) for v in value)


def read_json_object(path: Path) -> dict[str, Any]:
    """A model directory's JSON file (config.json, the shard index, ...) as a dict; errors name the file."""
    if not path.is_file():
        raise ModelLoadError(f"{path}: file not found")
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError, UnicodeDecodeError) as error:
        raise ModelLoadError(f"{path}: not valid JSON ({error})") from None
    if not isinstance(data, dict):
        raise ModelLoadError(f"{path}: expected a JSON object, got {type(data).__name__}")
    return data


_LAYER_INDEX = re.compile(r"(?:^|\.)layers\.(\d+)\.")


def read_weight_map(index_path: Path) -> dict[str, str]:
    """A shard index's weight_map (model.safetensors.index.json: tensor name -> file name)."""
    weight_map = read_json_object(index_path).get("weight_map")
    if not isinstance(weight_map, dict):
        raise ModelLoadError(f"{index_path}: field 'weight_map' is missing or not an object")
    return weight_map


def _check_no_extra_layers(names: list[str], num_layers: int, where: Path) -> None:
    """A tensor of a layer the config does not have means config and weights disagree: refuse it."""
    for name in names:
        match = _LAYER_INDEX.search(name)
        if match and int(match.group(1)) >= num_layers:
            raise ModelLoadError(
                f"{where}: tensor {name!r} belongs to layer {match.group(1)} but config.json's "
                f"num_hidden_layers is {num_layers}"
            )


def _locate_tensors(directory: Path, shapes: dict[str, tuple[int, ...]], num_layers: int) -> dict[str, Path]:
    """Tensor name -> the safetensors file holding it, from the shard index or the single file."""
    index_path = directory / SHARD_INDEX
    if index_path.is_file():
        weight_map = read_weight_map(index_path)
        _check_no_extra_layers(list(weight_map), num_layers, index_path)
        missing = [name for name in shapes if name not in weight_map]
        if missing:
            count = len(missing)
            raise ModelLoadError(f"{index_path}: weight_map lacks tensor {missing[0]!r} ({count} missing)")
        return {name: directory / weight_map[name] for name in shapes}
    single = directory / SINGLE_FILE
    if not single.is_file():
        raise ModelLoadError(f"{directory}: neither {SINGLE_FILE} nor {SHARD_INDEX} found")
    keys = set(_file_keys(single))
    _check_no_extra_layers(sorted(keys), num_layers, single)
    missing = [name for name in shapes if name not in keys]
    if missing:
        raise ModelLoadError(f"{single}: tensor {missing[0]!r} not found ({len(missing)} missing)")
    return dict.fromkeys(shapes, single)


def _file_keys(file: Path) -> list[str]:
    try:
        with safe_open(str(file), framework="numpy") as handle:
            return list(handle.keys())
    except (SafetensorError, OSError) as error:
        raise ModelLoadError(f"{file}: cannot read safetensors header ({error})") from None


def _read_file_tensors(file: Path, shapes: dict[str, tuple[int, ...]]) -> dict[str, np.ndarray]:
    """The named tensors of one safetensors file as float32, each checked against its expected shape."""
    tensors = {}
    try:
        with safe_open(str(file), framework="numpy") as handle:
            present = set(handle.keys())
            for name, shape in shapes.items():
                if name not in present:
                    raise ModelLoadError(f"{file}: tensor {name!r} not found")
                tensors[name] = _as_float32(handle.get_tensor(name), file, name, shape)
    except (SafetensorError, OSError) as error:
        raise ModelLoadError(f"{file}: cannot read safetensors data ({error})") from None
    return tensors


def _as_float32(array: np.ndarray, file: Path, name: str, shape: tuple[int, ...]) -> np.ndarray:
    if not (np.issubdtype(array.dtype, np.floating) or array.dtype == ml_dtypes.bfloat16):
        raise ModelLoadError(f"{file}: tensor {name!r} has non-float dtype {array.dtype}")
    if tuple(array.shape) != shape:
        got = tuple(array.shape)
        raise ModelLoadError(f"{file}: tensor {name!r} has shape {got}, config implies {shape}")
    return array.astype(np.float32)
