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

from jaxspec.config import ModelConfig
from jaxspec.errors import ModelLoadError
from jaxspec.models.llama import LlamaModel

# Hugging Face linear weights that land inside a fused projection: (module, HF projection) -> slot.
_QKV_PARTS = ("q_proj", "k_proj", "v_proj")
_GATE_UP_PARTS = ("gate_proj", "up_proj")


def _hf_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Expected shapes of one decoder layer's HF projection tensors (suffix after 'layers.i.')."""
    c = config
    q_out, kv_out = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
    d, f = c.hidden_size, c.intermediate_size
    return {
        "self_attn.q_proj.weight": (q_out, d), "self_attn.k_proj.weight": (kv_out, d),
        "self_attn.v_proj.weight": (kv_out, d), "self_attn.q_proj.bias": (q_out,),
        "self_attn.k_proj.bias": (kv_out,), "self_attn.v_proj.bias": (kv_out,),
        "mlp.gate_proj.weight": (f, d), "mlp.up_proj.weight": (f, d),
    }  # fmt: skip


def _hf_name_to_path(name: str) -> tuple:
    """HF tensor name -> NNX param path (fused parts map to their fused parameter's path)."""
    parts = name.split(".")
    if parts[0] == "model":
        parts = parts[1:]
    if parts == ["embed_tokens", "weight"]:
        return ("embed_tokens", "embedding")
    path = [int(part) if part.isdigit() else part for part in parts]
    if len(path) >= 2 and path[-2] in _QKV_PARTS:
        path[-2] = "qkv_proj"
    elif len(path) >= 2 and path[-2] in _GATE_UP_PARTS:
        path[-2] = "gate_up_proj"
    return tuple(path)


def _pack_qkv(config: ModelConfig, q: np.ndarray, k: np.ndarray, v: np.ndarray) -> np.ndarray:
    """HF q [Hq*D, ...], k and v [Hkv*D, ...] -> [Hkv, G + 2, D, ...] (each kv head's query group, its
    key, its value)."""
    c = config
    group, rest = c.num_heads // c.num_kv_heads, q.shape[1:]
    q = q.reshape(c.num_kv_heads, group, c.head_dim, *rest)
    k = k.reshape(c.num_kv_heads, 1, c.head_dim, *rest)
    v = v.reshape(c.num_kv_heads, 1, c.head_dim, *rest)
    return np.concatenate([q, k, v], axis=1)


def _fused_from_hf(config: ModelConfig, tensors: dict[str, np.ndarray], source: str) -> dict[str, np.ndarray]:
    """Replace each layer's HF q/k/v and gate/up tensors by the fused tensors under the fused names
    (`...self_attn.qkv_proj.weight`, `...mlp.gate_up_proj.weight`); errors name the HF tensor."""
    shapes = _hf_shapes(config)
    out: dict[str, np.ndarray] = {}
    groups: dict[str, dict[str, np.ndarray]] = {}
    for name, array in tensors.items():
        parts = name.split(".")
        proj = parts[-2] if len(parts) >= 2 else ""
        if proj not in _QKV_PARTS + _GATE_UP_PARTS:
            out[name] = array
            continue
        suffix = ".".join(parts[-3:])
        want = shapes.get(suffix)
        value = np.asarray(array)
        if want is not None and value.shape != want:
            raise ModelLoadError(f"{source}: tensor {name!r} has shape {value.shape}, expected {want}")
        fused = ".".join(parts[:-2] + ["qkv_proj" if proj in _QKV_PARTS else "gate_up_proj", parts[-1]])
        groups.setdefault(fused, {})[proj] = value
    for fused, parts in groups.items():
        wanted = _QKV_PARTS if ".qkv_proj." in fused else _GATE_UP_PARTS
        absent = [p for p in wanted if p not in parts]
        if absent:
            names = [fused.replace("qkv_proj" if p in _QKV_PARTS else "gate_up_proj", p) for p in absent]
            raise ModelLoadError(f"{source}: missing tensors {names} (needed with {sorted(parts)})")
        if wanted == _QKV_PARTS:
            out[fused] = _pack_qkv(config, *(parts[p] for p in _QKV_PARTS))
        else:
            out[fused] = np.stack([parts["gate_proj"], parts["up_proj"]])
    return out


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
