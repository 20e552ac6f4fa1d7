"""Model files in, a ready `Model` out: readers, tokenizer, the name registry and `load()`.

- `load(name_or_path, dtype, mesh)` (loader.py): the public `jaxspec.load`.
- `read_gguf(path)`: llama.cpp GGUF (llama / qwen2 / qwen3), dequantized, Q/K rows un-permuted.
- `read_hf_dir(path)`: Hugging Face directory (config.json + safetensors, single or sharded); hf_dir.py
  also holds the JSON-object reader every loader uses.
- `state_from_hf_tensors` (weights.py): Hugging Face-named tensors -> the target's params.
- deepseek_v3.py: DeepSeek-V3 checkpoints (sharded safetensors, fp8 + block scales dequantised).
- checkpoint_io.py: tensors from safetensors / torch files into a module's abstract params (heads).
- `Tokenizer.from_gguf(metadata)` / `Tokenizer.from_dir(path)`: tokenizer with chat template
  (rendered in a sandbox under `TemplateLimits`: time and size).
- `resolve_model_path(name_or_path)`, `load_model_files(name_or_path)`: names like "smollm2-135m".
- dataset.py: the distilled data set kept in the repository (the target's own answers as token shards),
  written by `jaxspec train` and read by head training and the n-gram datastore drafter.

Only `load` is imported eagerly (it imports jax when called); the other names import their module on
first use (PEP 562), so `import jaxspec` and `jaxspec --help` stay free of jax.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from jaxspec.loading.loader import load

if TYPE_CHECKING:
    from jaxspec.loading.chat_template import TemplateLimits, render_chat_template, validate_messages
    from jaxspec.loading.gguf_reader import read_gguf, read_gguf_metadata
    from jaxspec.loading.hf_dir import hf_tensor_shapes, read_hf_dir
    from jaxspec.loading.registry import load_model_files, resolve_model_path
    from jaxspec.loading.tokenizer import Tokenizer

_LAZY = {
    "TemplateLimits": "jaxspec.loading.chat_template",
    "render_chat_template": "jaxspec.loading.chat_template",
    "validate_messages": "jaxspec.loading.chat_template",
    "read_gguf": "jaxspec.loading.gguf_reader",
    "read_gguf_metadata": "jaxspec.loading.gguf_reader",
    "hf_tensor_shapes": "jaxspec.loading.hf_dir",
    "read_hf_dir": "jaxspec.loading.hf_dir",
    "load_model_files": "jaxspec.loading.registry",
    "resolve_model_path": "jaxspec.loading.registry",
    "Tokenizer": "jaxspec.loading.tokenizer",
}

__all__ = [
    "TemplateLimits",
    "Tokenizer",
    "hf_tensor_shapes",
    "load",
    "load_model_files",
    "read_gguf",
    "read_gguf_metadata",
    "read_hf_dir",
    "render_chat_template",
    "resolve_model_path",
    "validate_messages",
]


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'jaxspec.loading' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value
