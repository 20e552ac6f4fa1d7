"""Map Hugging Face-named tensors onto the NNX Llama model's parameters.

Loaders (GGUF, safetensors directories) return tensors under Hugging Face names and layouts
([out, in] for linear weights); this is the single place that knows how those names land in
`LlamaModel`'s parameter tree. Linear weights keep the [out, in] layout (`llama.Projection`); each
layer's q/k/v become one qkv_proj weight [Hkv, G + 2, D, d] and gate/up one gate_up_proj weight
[2, f, d].
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxspec.errors import ModelLoadError
from jaxspec.loading.hf_dir import hf_tensor_shapes
from jaxspec.model.config import ModelConfig
from jaxspec.model.llama import LlamaModel

# Fused parameter (module name) -> the Hugging Face projections packed into it, in packing order.
_FUSED_PARTS = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}
_FUSED_OF = {part: fused for fused, parts in _FUSED_PARTS.items() for part in parts}


def _hf_name_to_path(name: str) -> tuple:
    """HF tensor name (fused projections already renamed, see `_fused_from_hf`) -> NNX param path."""
    parts = name.split(".")
    if parts[0] == "model":
        parts = parts[1:]
    if parts == ["embed_tokens", "weight"]:
        return ("embed_tokens", "embedding")
    return tuple(int(part) if part.isdigit() else part for part in parts)


def _pack_qkv(config: ModelConfig, q: np.ndarray, k: np.ndarray, v: np.ndarray) -> np.ndarray:
    """HF q [Hq*D, ...], k and v [Hkv*D, ...] -> [Hkv, G + 2, D, ...] (each kv head's query group, its
    key, its value)."""
    c = config
    group, rest = c.num_heads // c.num_kv_heads, q.shape[1:]
    q = q.reshape(c.num_kv_heads, group, c.head_dim, *rest)
    k = k.reshape(c.num_kv_heads, 1, c.head_dim, *rest)
    v = v.reshape(c.num_kv_heads, 1, c.head_dim, *rest)
    return np.concatenate([q, k, v], axis=1)


def unpack_qkv(qkv):
    """The inverse of `_pack_qkv`: fused [Hkv, G + 2, D, ...] (numpy or jax) -> HF-order
    (q [Hq*D, ...], k [Hkv*D, ...], v [Hkv*D, ...])."""
    group, rest = qkv.shape[1] - 2, qkv.shape[3:]
    return tuple(part.reshape((-1, *rest)) for part in (qkv[:, :group], qkv[:, group], qkv[:, group + 1]))


def _fused_from_hf(config: ModelConfig, tensors: dict[str, np.ndarray], source: str) -> dict[str, np.ndarray]:
    """Replace each layer's HF q/k/v and gate/up tensors by the fused tensors under the fused names
    (`...self_attn.qkv_proj.weight`, `...mlp.gate_up_proj.weight`); errors name the HF tensor."""
    shapes = hf_tensor_shapes(config)
    out: dict[str, np.ndarray] = {}
    groups: dict[tuple[str, str], dict[str, np.ndarray]] = {}  # (fused name, fused module) -> parts
    for name, array in tensors.items():
        parts = name.split(".")
        fused_module = _FUSED_OF.get(parts[-2]) if len(parts) >= 2 else None
        if fused_module is None:
            out[name] = array
            continue
        value = np.asarray(array)
        want = shapes.get(name if name.startswith("model.") else f"model.{name}")
        if want is not None and value.shape != want:
            raise ModelLoadError(f"{source}: tensor {name!r} has shape {value.shape}, expected {want}")
        fused = ".".join([*parts[:-2], fused_module, parts[-1]])
        groups.setdefault((fused, fused_module), {})[parts[-2]] = value
    for (fused, fused_module), found in groups.items():
        wanted = _FUSED_PARTS[fused_module]
        absent = [fused.replace(fused_module, part) for part in wanted if part not in found]
        if absent:
            raise ModelLoadError(f"{source}: missing tensors {absent} (needed with {sorted(found)})")
        if fused_module == "qkv_proj":
            out[fused] = _pack_qkv(config, *(found[part] for part in wanted))
        else:
            out[fused] = np.stack([found[part] for part in wanted])
    return out


def _check_finite(value: np.ndarray, name: str, source: str) -> None:
    """Refuse NaN / Inf weights (corrupt file data), naming the tensor. The common case is one fast
    pass (a finite sum means every element is finite; 0.04 s for SmolLM2-135M's 135M weights); only
    a non-finite sum, which finite but huge weights can also give, counts the bad elements."""
    if np.isfinite(np.sum(value)):
        return
    bad = int(np.count_nonzero(~np.isfinite(value)))
    if not bad:
        return
    raise ModelLoadError(
        f"{source}: tensor {name!r} has {bad} NaN/Inf values of {value.size}: the file is corrupt"
    )


def abstract_model(config: ModelConfig, dtype: jnp.dtype) -> tuple[nnx.GraphDef, nnx.State]:
    """GraphDef and shape-only State of a LlamaModel (no memory allocated)."""
    model = nnx.eval_shape(lambda: LlamaModel(config, dtype, rngs=nnx.Rngs(0)))
    return nnx.split(model)


def state_from_hf_tensors(
    config: ModelConfig,
    tensors: dict[str, np.ndarray],
    dtype: jnp.dtype,
    source: str = "<tensors>",
    place: Callable[[tuple, np.ndarray], jax.Array] | None = None,
) -> tuple[nnx.GraphDef, nnx.State]:
    """Build (graphdef, params) for `config` from HF-named tensors; errors name the missing/bad key.

    place(param path, host array) -> device array puts each parameter on the devices (e.g. sharded
    over a mesh, see `jaxspec.sharding.param_placer`); None = `jnp.asarray` on the default device.
    """
    graphdef, abstract = abstract_model(config, dtype)
    expected = dict(nnx.to_flat_state(abstract))
    filled: dict[tuple, jax.Array] = {}
    tensors = {
        name: array
        for name, array in tensors.items()
        if "rotary_emb" not in name and not (name == "lm_head.weight" and config.tie_word_embeddings)
    }
    for name, array in tensors.items():
        _check_finite(np.asarray(array), name, source)
    for name, array in _fused_from_hf(config, tensors, source).items():
        path = _hf_name_to_path(name)
        if path not in expected:
            raise ModelLoadError(f"{source}: unexpected tensor {name!r} for a {config.architecture} model")
        value = np.asarray(array)
        want = tuple(expected[path].shape) if hasattr(expected[path], "shape") else expected[path][...].shape
        if value.shape != want:
            raise ModelLoadError(f"{source}: tensor {name!r} has shape {value.shape}, expected {want}")
        filled[path] = place(path, value) if place is not None else jnp.asarray(value, dtype=dtype)
    missing = [p for p in expected if p not in filled]
    if missing:
        names = [".".join(str(x) for x in p) for p in missing[:5]]
        raise ModelLoadError(f"{source}: missing tensors for parameters {names} ({len(missing)} missing)")
    state = jax.tree.map(lambda x: x, abstract)
    flat = nnx.to_flat_state(state)
    for path, variable in flat:
        variable.set_value(filled[path])
    return graphdef, nnx.from_flat_state(flat)
