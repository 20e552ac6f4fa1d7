"""DeepSeek-V3 checkpoints in the Hugging Face layout -> jaxspec parameters.

Layout (config.json + model.safetensors or sharded model-*.safetensors with
model.safetensors.index.json): `model.embed_tokens.weight`, `model.layers.{i}.{input_layernorm,
post_attention_layernorm}.weight`, `...self_attn.{q_a_proj, q_a_layernorm, q_b_proj | q_proj,
kv_a_proj_with_mqa, kv_a_layernorm, kv_b_proj, o_proj}.weight`, dense layers' `...mlp.{gate,up,down}_proj
.weight`, MoE layers' `...mlp.gate.weight`, `...mlp.gate.e_score_correction_bias`,
`...mlp.experts.{e}.{gate,up,down}_proj.weight`, `...mlp.shared_experts.{gate,up,down}_proj.weight`,
`model.norm.weight`, `lm_head.weight`. The MTP layer is `model.layers.{num_hidden_layers}.*` (read by
`load_mtp_head`, skipped by the target).

fp8: a `weight` stored as float8_e4m3fn comes with `weight_scale_inv` [ceil(out / b0), ceil(in / b1)]
(b = quantization_config.weight_block_size, [128, 128] in DeepSeek-V3); the weight is dequantised at
load as w[i, j] * scale_inv[i // b0, j // b1] (DeepSeek's `weight_dequant`). bf16 / fp32 tensors are
read as they are.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Callable
from pathlib import Path

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
from flax import nnx

from jaxspec.errors import ModelLoadError
from jaxspec.loading.checkpoint_io import TensorSource
from jaxspec.loading.hf_dir import SHARD_INDEX, SINGLE_FILE, read_json_object, read_weight_map
from jaxspec.model.deepseek_v3.config import DeepseekV3Config, config_from_hf, fp8_block_size
from jaxspec.model.deepseek_v3.model import DeepseekV3Model

_DTYPES = {
    "F64": np.float64, "F32": np.float32, "F16": np.float16, "BF16": ml_dtypes.bfloat16,
    "F8_E4M3": ml_dtypes.float8_e4m3fn, "I64": np.int64, "I32": np.int32, "BOOL": np.bool_,
}  # fmt: skip
_LAYER = re.compile(r"^model\.layers\.(\d+)\.")


def read_safetensors(file: Path, keep: Callable[[str], bool]) -> dict[str, np.ndarray]:
    """The kept tensors of one safetensors file, memory-mapped, fp8 included (safetensors' numpy reader
    has no float8 dtype). Errors name the file and the tensor."""
    try:
        with open(file, "rb") as handle:
            header_len = int.from_bytes(handle.read(8), "little")
            header = json.loads(handle.read(header_len))
    except (OSError, ValueError) as error:
        raise ModelLoadError(f"{file}: cannot read safetensors header ({error})") from None
    data = np.memmap(file, dtype=np.uint8, mode="r", offset=8 + header_len)
    out = {}
    for name, info in header.items():
        if name == "__metadata__" or not keep(name):
            continue
        dtype = _DTYPES.get(info.get("dtype"))
        if dtype is None:
            raise ModelLoadError(f"{file}: tensor {name!r} has unsupported dtype {info.get('dtype')!r}")
        start, end = info["data_offsets"]
        shape = tuple(info["shape"])
        if end - start != math.prod(shape) * np.dtype(dtype).itemsize or end > data.size:
            raise ModelLoadError(f"{file}: tensor {name!r}: data size does not match shape {shape}")
        out[name] = np.frombuffer(data[start:end], dtype=dtype).reshape(shape)
    return out


def weight_files(directory: Path) -> list[Path]:
    """The safetensors files of a model directory (from the shard index when there is one)."""
    index = directory / SHARD_INDEX
    if index.is_file():
        files = [directory / name for name in sorted(set(read_weight_map(index).values()))]
        absent = [str(f) for f in files if not f.is_file()]
        if absent:
            raise ModelLoadError(f"{index}: weight_map names missing file(s) {absent[:3]}")
        return files
    single = directory / SINGLE_FILE
    if not single.is_file():
        raise ModelLoadError(f"{directory}: neither {SINGLE_FILE} nor {SHARD_INDEX} found")
    return [single]


def dequantize_fp8(
    weight: np.ndarray, scale_inv: np.ndarray, block: tuple[int, int], name: str, source: str
) -> np.ndarray:
    """float8 weight [out, in] and its block scales -> float32 weight."""
    rows, cols = weight.shape
    want = (math.ceil(rows / block[0]), math.ceil(cols / block[1]))
    if tuple(scale_inv.shape) != want:
        raise ModelLoadError(
            f"{source}: tensor {name + '_scale_inv'!r} has shape {tuple(scale_inv.shape)}, expected {want} "
            f"for a {tuple(weight.shape)} weight in {list(block)} blocks"
        )
    scales = np.repeat(np.repeat(scale_inv.astype(np.float32), block[0], 0), block[1], 1)[:rows, :cols]
    return weight.astype(np.float32) * scales


def read_checkpoint(
    directory: Path, keep: Callable[[str], bool], block: tuple[int, int] | None
) -> dict[str, np.ndarray]:
    """Kept tensors of every weight file as float32 (fp8 weights dequantised, their scales consumed)."""
    raw: dict[str, np.ndarray] = {}
    for file in weight_files(directory):
        raw.update(read_safetensors(file, lambda n: keep(n.removesuffix("_scale_inv"))))
    out = {}
    for name, value in raw.items():
        if name.endswith("_scale_inv"):
            if name.removesuffix("_scale_inv") not in raw:
                raise ModelLoadError(f"{directory}: tensor {name!r} scales a weight that is not there")
            continue
        if value.dtype == ml_dtypes.float8_e4m3fn:
            scale = raw.get(name + "_scale_inv")
            if scale is None:
                raise ModelLoadError(f"{directory}: fp8 tensor {name!r} has no {name + '_scale_inv'!r}")
            if block is None:
                raise ModelLoadError(
                    f"{directory}: fp8 tensor {name!r} but config.json has no "
                    "quantization_config.weight_block_size"
                )
            value = dequantize_fp8(value, scale, block, name, str(directory))
        out[name] = np.asarray(value, dtype=np.float32)
    return out


def hf_key(path: tuple) -> str:
    """NNX path inside a decoder layer / the model -> the Hugging Face tensor name (without prefix)."""
    names = [str(p) for p in path]
    if names[-1] == "embedding":
        names[-1] = "weight"
    return ".".join(names)


def take_param(tensors: TensorSource, prefix: str, path: tuple, shape: tuple[int, ...]) -> np.ndarray:
    """The value of the parameter at `path` (shape `shape`) from HF tensors under `prefix`: experts and
    gate/up stacked, per-head projections reshaped [H * k, in] -> [H, k, in], Linear kernels transposed."""
    names = [str(p) for p in path]
    if names[-2:] == ["experts", "gate_up_proj"]:
        base = prefix + ".".join(names[:-1])
        e, _, i, d = shape
        return np.stack(
            [
                np.stack([tensors.take(f"{base}.{x}.{part}_proj.weight", (i, d)) for part in ("gate", "up")])
                for x in range(e)
            ]
        )
    if names[-2:] == ["experts", "down_proj"]:
        base = prefix + ".".join(names[:-1])
        e, d, i = shape
        return np.stack([tensors.take(f"{base}.{x}.down_proj.weight", (d, i)) for x in range(e)])
    if names[-2:] == ["gate_up_proj", "weight"]:
        base = prefix + ".".join(names[:-2])
        return np.stack([tensors.take(f"{base}.{part}_proj.weight", shape[1:]) for part in ("gate", "up")])
    if names[-1] == "kernel":
        return tensors.take(prefix + ".".join(names[:-1]) + ".weight", shape, transpose=True)
    if len(shape) == 3 and names[-1] == "weight":  # q_b_proj / q_proj / kv_b_proj [H, k, in]
        return tensors.take(prefix + hf_key(path), (shape[0] * shape[1], shape[2])).reshape(shape)
    return tensors.take(prefix + hf_key(path), shape)


def fill_state(
    abstract: nnx.State,
    key_of: Callable[[tuple], tuple[str, tuple]],
    tensors: TensorSource,
    dtype: jnp.dtype,
    place: Callable[[tuple, np.ndarray], jax.Array] | None = None,
) -> nnx.State:
    """A concrete copy of `abstract`, every leaf taken from `tensors` (key_of(path) = (prefix, path
    relative to that prefix)) and put on the devices by `place` (None: default device)."""
    state = jax.tree.map(lambda x: x, abstract)
    flat = nnx.to_flat_state(state)
    for path, variable in flat:
        prefix, rel = key_of(path)
        value = take_param(tensors, prefix, rel, tuple(variable.get_value().shape))
        if not np.isfinite(value).all():
            raise ModelLoadError(f"{tensors.source}: parameter {'.'.join(map(str, path))} has NaN/Inf values")
        variable.set_value(place(path, value) if place is not None else jnp.asarray(value, dtype))
    return nnx.from_flat_state(flat)


def _target_key(path: tuple) -> tuple[str, tuple]:
    if path[0] == "lm_head":
        return "", path
    return "model.", path


def load_deepseek_dir(
    directory: str | Path, dtype: jnp.dtype, place: Callable[[tuple, np.ndarray], jax.Array] | None = None
) -> tuple[DeepseekV3Config, nnx.GraphDef, nnx.State]:
    """(config, graphdef, params) of the target in a DeepSeek-V3 Hugging Face directory (MTP layers
    skipped); errors name the file, tensor or config field."""
    directory = Path(directory)
    config_path = directory / "config.json"
    raw = read_json_object(config_path)
    config = config_from_hf(raw, str(config_path))
    block = fp8_block_size(raw, str(config_path))

    def is_target(name: str) -> bool:
        match = _LAYER.match(name)
        return (match is None or int(match.group(1)) < config.num_layers) and "rotary_emb" not in name

    tensors = TensorSource(read_checkpoint(directory, is_target, block), str(directory))
    graphdef, abstract = nnx.split(nnx.eval_shape(lambda: DeepseekV3Model(config, dtype, rngs=nnx.Rngs(0))))
    params = fill_state(abstract, _target_key, tensors, dtype, place)
    tied = (lambda name: name == "lm_head.weight") if config.tie_word_embeddings else (lambda name: False)
    tensors.check_all_used(ignore=tied)
    return config, graphdef, params
