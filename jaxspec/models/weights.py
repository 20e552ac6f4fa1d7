"""Map Hugging Face-named tensors onto the NNX Llama model's parameters.

Loaders (GGUF, safetensors directories) return tensors under Hugging Face names and layouts
([out, in] for linear weights); this is the single place that knows how those names land in
`LlamaModel`'s parameter tree.
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


def _hf_name_to_path(name: str) -> tuple[tuple, bool]:
    """HF tensor name -> (NNX param path, transpose?)."""
    parts = name.split(".")
    if parts[0] == "model":
        parts = parts[1:]
    if parts == ["embed_tokens", "weight"]:
        return ("embed_tokens", "embedding"), False
    if parts == ["lm_head", "weight"]:
        return ("lm_head", "kernel"), True
    path: list = []
    for part in parts:
        path.append(int(part) if part.isdigit() else part)
    leaf = path[-1]
    is_linear = len(path) >= 2 and str(path[-2]).endswith("_proj")
    if is_linear and leaf == "weight":
        path[-1] = "kernel"
        return tuple(path), True
    return tuple(path), False


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
    for name, array in tensors.items():
        if name == "lm_head.weight" and config.tie_word_embeddings:
            continue
        if "rotary_emb" in name:
            continue
        path, transpose = _hf_name_to_path(name)
        if path not in expected:
            raise ModelLoadError(f"{source}: unexpected tensor {name!r} for a {config.architecture} model")
        value = np.asarray(array).T if transpose else np.asarray(array)
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
