"""Read a llama.cpp GGUF file into a ModelConfig and Hugging Face-named float32 tensors.

GGUF names (`blk.3.attn_q.weight`) become Hugging Face names (`model.layers.3.self_attn.q_proj.weight`);
quantized blocks are dequantized with `gguf.quants.dequantize`; for the llama architecture the Q and K
projection rows, which llama.cpp's converter interleaves for its rotary layout, are put back in
Hugging Face's "rotate half" order.
"""

from __future__ import annotations

import re
import struct
from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGMLQuantizationType, GGUFReader
from gguf.quants import dequantize

from jaxspec.errors import ModelLoadError
from jaxspec.loading.hf_dir import hf_tensor_shapes
from jaxspec.model.config import ModelConfig
from jaxspec.model.rope import inverse_frequencies

SUPPORTED_ARCHITECTURES = ("llama", "qwen2", "qwen3")
_Q = GGMLQuantizationType
SUPPORTED_TENSOR_TYPES = frozenset(
    (_Q.F32, _Q.F16, _Q.BF16, _Q.Q8_0, _Q.Q4_0, _Q.Q4_1, _Q.Q5_0, _Q.Q5_1)
    + (_Q.Q2_K, _Q.Q3_K, _Q.Q4_K, _Q.Q5_K, _Q.Q6_K)
)

_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_LAYER_NAMES = {
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_q.bias": "self_attn.q_proj.bias",
    "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.bias": "self_attn.v_proj.bias",
    "attn_output.weight": "self_attn.o_proj.weight",
    "attn_q_norm.weight": "self_attn.q_norm.weight",
    "attn_k_norm.weight": "self_attn.k_norm.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
_LAYER_PATTERN = re.compile(r"blk\.(\d+)\.(.+)")
_ROPE_FREQS = "rope_freqs.weight"


def read_gguf(path: str | Path) -> tuple[ModelConfig, dict[str, np.ndarray], dict[str, Any]]:
    """Read a GGUF model file.

    Returns (config, tensors, metadata): tensors are float32 under Hugging Face names and layouts
    (linear weights [out, in]; `lm_head.weight` only when the file has an untied output matrix);
    metadata holds every GGUF key-value field decoded to Python values (what `Tokenizer.from_gguf`
    reads).
    """
    file = Path(path)
    reader = _open_reader(file)
    metadata = _decode_metadata(reader, file)
    gguf_tensors = {tensor.name: tensor for tensor in reader.tensors}
    try:
        config = _config_from_metadata(metadata, gguf_tensors, file)
    except (TypeError, ValueError) as error:  # a metadata value of the wrong type or out of range
        raise ModelLoadError(f"{file}: invalid model metadata: {error}") from None
    expected = hf_tensor_shapes(config)
    tensors: dict[str, np.ndarray] = {}
    for gguf_name, tensor in gguf_tensors.items():
        if gguf_name == _ROPE_FREQS:
            continue
        hf_name = _hf_name(gguf_name, file)
        if hf_name not in expected:
            raise ModelLoadError(
                f"{file}: tensor {gguf_name!r} ({hf_name}) is not used by a {config.architecture} model"
            )
        array = _dequantized(tensor, file)
        if array.shape != expected[hf_name]:
            raise ModelLoadError(
                f"{file}: tensor {gguf_name!r} has shape {array.shape}, metadata implies {expected[hf_name]}"
            )
        if config.architecture == "llama" and hf_name.endswith(("q_proj.weight", "k_proj.weight")):
            heads = config.num_heads if hf_name.endswith("q_proj.weight") else config.num_kv_heads
            array = unpermute_rotary_rows(array, heads)
        tensors[hf_name] = array
    missing = [name for name in expected if name not in tensors]
    if missing:
        raise ModelLoadError(f"{file}: tensor for {missing[0]!r} not found ({len(missing)} missing)")
    return config, {name: tensors[name] for name in expected}, metadata


def read_gguf_metadata(path: str | Path) -> dict[str, Any]:
    """Only the key-value metadata of a GGUF file (no tensor data is dequantized)."""
    file = Path(path)
    return _decode_metadata(_open_reader(file), file)


def unpermute_rotary_rows(weight: np.ndarray, num_heads: int) -> np.ndarray:
    """Undo llama.cpp's Q/K row interleaving: [heads * head_dim, in] -> same shape, HF row order.

    llama.cpp's converter stores, within each head, rows (0, D/2, 1, D/2+1, ...) so that rotary pairs
    are adjacent; Hugging Face keeps the two halves of each head apart ("rotate half").
    """
    rows = weight.shape[0]
    half = rows // num_heads // 2
    interleaved = weight.reshape(num_heads, half, 2, *weight.shape[1:])
    return np.ascontiguousarray(interleaved.swapaxes(1, 2).reshape(weight.shape))


def _open_reader(file: Path) -> GGUFReader:
    if not file.is_file():
        raise ModelLoadError(f"{file}: no such GGUF file")
    with file.open("rb") as handle:
        magic = handle.read(4)
    if magic != b"GGUF":
        raise ModelLoadError(f"{file}: not a GGUF file (first bytes {magic!r}, expected b'GGUF')")
    try:
        return GGUFReader(file, "r")
    except (ValueError, IndexError, KeyError, struct.error, OSError, UnicodeDecodeError) as error:
        size = file.stat().st_size
        raise ModelLoadError(
            f"{file}: truncated or corrupt GGUF file ({size} bytes); the reader failed with "
            f"{type(error).__name__}: {error}"
        ) from None


def _decode_metadata(reader: GGUFReader, file: Path) -> dict[str, Any]:
    try:
        return {key: field.contents() for key, field in reader.fields.items() if not key.startswith("GGUF.")}
    except (ValueError, IndexError, UnicodeDecodeError) as error:
        raise ModelLoadError(f"{file}: corrupt GGUF metadata ({type(error).__name__}: {error})") from None


def _config_from_metadata(metadata: dict[str, Any], tensors: dict[str, Any], file: Path) -> ModelConfig:
    arch = metadata.get("general.architecture")
    if arch not in SUPPORTED_ARCHITECTURES:
        raise ModelLoadError(
            f"{file}: GGUF architecture {arch!r} is not supported; supported: {list(SUPPORTED_ARCHITECTURES)}"
        )

    def field(key: str, default: Any = None) -> Any:
        value = metadata.get(f"{arch}.{key}", default)
        if value is None:
            raise ModelLoadError(f"{file}: metadata field {arch}.{key!r} is missing")
        return value

    if "token_embd.weight" not in tensors:
        raise ModelLoadError(f"{file}: tensor 'token_embd.weight' not found")
    hidden_size = int(field("embedding_length"))
    num_heads = int(field("attention.head_count"))
    kv_key = f"{arch}.attention.head_count_kv"
    num_kv_heads = _uniform(field("attention.head_count_kv", num_heads), kv_key, file)
    head_dim = int(field("attention.key_length", hidden_size // num_heads))
    rope_theta = float(field("rope.freq_base", 10000.0))
    scaling_type = field("rope.scaling.type", "none")
    if scaling_type != "none":
        raise ModelLoadError(
            f"{file}: rope scaling type {scaling_type!r} ({arch}.rope.scaling.type) is not supported"
        )
    rope_scaling = None
    if _ROPE_FREQS in tensors:
        freq_factors = _dequantized(tensors[_ROPE_FREQS], file).reshape(-1)
        rope_scaling = llama3_scaling_from_freq_factors(freq_factors, head_dim, rope_theta, file)
    eos_ids = [metadata.get(f"tokenizer.ggml.{key}") for key in ("eos_token_id", "eot_token_id")]
    return ModelConfig(
        vocab_size=int(tensors["token_embd.weight"].shape[1]),
        hidden_size=hidden_size,
        intermediate_size=int(field("feed_forward_length")),
        num_layers=int(field("block_count")),
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        rope_theta=rope_theta,
        rope_scaling=rope_scaling,
        rms_norm_eps=float(field("attention.layer_norm_rms_epsilon", 1e-5)),
        tie_word_embeddings="output.weight" not in tensors,
        attention_bias=arch == "qwen2",
        qk_norm=arch == "qwen3",
        max_position_embeddings=int(field("context_length", 2048)),
        architecture=arch,
        bos_token_id=metadata.get("tokenizer.ggml.bos_token_id"),
        eos_token_ids=tuple(dict.fromkeys(int(i) for i in eos_ids if i is not None)),
    )


def llama3_scaling_from_freq_factors(
    freq_factors: np.ndarray, head_dim: int, rope_theta: float, file: Path | str = "<gguf>"
) -> tuple[float, float, float, int] | None:
    """Recover ModelConfig.rope_scaling from llama.cpp's `rope_freqs.weight` ([head_dim // 2] divisors).

    llama.cpp stores Llama-3 scaling as per-frequency divisors instead of its four parameters. The
    divisors depend on (low_freq_factor, high_freq_factor, original_max) only through
    original_max / (high - low) and low / (high - low), so fixing original_max = 8192 loses nothing.
    The standard (factor, 1, 4, 8192) is tried first, else the two ratios are fitted from the
    in-between frequencies; either way the result must reproduce the tensor.
    """
    factors = np.asarray(freq_factors, dtype=np.float64)
    if factors.shape != (head_dim // 2,):
        expected = (head_dim // 2,)
        raise ModelLoadError(f"{file}: tensor {_ROPE_FREQS!r} has shape {factors.shape}, expected {expected}")
    factor = float(factors.max())
    if np.allclose(factors, 1.0):
        return None
    original_max = 8192
    candidates = [(factor, 1.0, 4.0, original_max)]
    base = ModelConfig(1, 1, 1, 1, 1, 1, head_dim, rope_theta=rope_theta)
    wavelength = 2 * np.pi / inverse_frequencies(base).astype(np.float64)
    between = (factors > 1 + 1e-4) & (factors < factor * (1 - 1e-4))
    if between.sum() >= 2:
        smooth = (1 / factors[between] - 1 / factor) / (1 - 1 / factor)
        slope, intercept = np.polyfit(1 / wavelength[between], smooth, 1)  # smooth = a / wavelen - b
        span = original_max / slope
        candidates.append((factor, float(-intercept * span), float(-intercept * span + span), original_max))
    for scaling in candidates:
        implied = inverse_frequencies(base) / inverse_frequencies(base.replace(rope_scaling=scaling))
        if np.allclose(implied, factors, rtol=1e-3):
            return scaling
    raise ModelLoadError(f"{file}: tensor {_ROPE_FREQS!r} does not match a Llama-3 rope scaling")


def _uniform(value: Any, key: str, file: Path) -> int:
    """A per-layer list that must hold one value, or a plain int."""
    if isinstance(value, list):
        if len(set(value)) != 1:
            raise ModelLoadError(f"{file}: metadata field {key!r} varies per layer ({value}); not supported")
        return int(value[0])
    return int(value)


def _hf_name(gguf_name: str, file: Path) -> str:
    if gguf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[gguf_name]
    match = _LAYER_PATTERN.fullmatch(gguf_name)
    if match and match.group(2) in _LAYER_NAMES:
        return f"model.layers.{match.group(1)}.{_LAYER_NAMES[match.group(2)]}"
    raise ModelLoadError(f"{file}: tensor {gguf_name!r} has no Hugging Face counterpart (unsupported model)")


def _dequantized(tensor: Any, file: Path) -> np.ndarray:
    """GGUF tensor -> float32 array in numpy order (GGUF lists dims innermost first)."""
    if tensor.tensor_type not in SUPPORTED_TENSOR_TYPES:
        supported = sorted(t.name for t in SUPPORTED_TENSOR_TYPES)
        raise ModelLoadError(
            f"{file}: tensor {tensor.name!r} has type {tensor.tensor_type.name}, not supported "
            f"(supported: {supported})"
        )
    shape = tuple(int(d) for d in reversed(tensor.shape))
    try:
        values = dequantize(np.asarray(tensor.data), tensor.tensor_type)
        return values.reshape(shape).astype(np.float32, copy=True)
    except ValueError as error:
        raise ModelLoadError(f"{file}: tensor {tensor.name!r} is corrupt or truncated ({error})") from None
