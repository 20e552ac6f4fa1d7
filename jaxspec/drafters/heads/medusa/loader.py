"""FasterDecoding's published Medusa layout -> a jaxspec Medusa head."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import jax.numpy as jnp
import numpy as np

from jaxspec.drafters.heads.configs import (
    MedusaConfig,
)
from jaxspec.drafters.heads.head import DraftHead, abstract_head
from jaxspec.drafters.heads.published import _first_existing
from jaxspec.errors import ModelLoadError
from jaxspec.loading.checkpoint_io import TensorSource, fill_params, read_tensors
from jaxspec.loading.hf_dir import read_json_object
from jaxspec.model.config import ModelConfig

# ---------------------------------------------------------------------------------------------------
# Medusa (FasterDecoding)
# ---------------------------------------------------------------------------------------------------


def load_medusa(directory: Path, target: ModelConfig, dtype: jnp.dtype, extra: dict[str, Any]) -> DraftHead:
    raw = read_json_object(directory / "config.json")
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
