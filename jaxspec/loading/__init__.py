"""Model files in, Hugging Face-named float32 tensors + ModelConfig + Tokenizer out.

- `read_gguf(path)`: llama.cpp GGUF (llama / qwen2 / qwen3), dequantized, Q/K rows un-permuted.
- `read_hf_dir(path)`: Hugging Face directory (config.json + safetensors, single or sharded).
- `Tokenizer.from_gguf(metadata)` / `Tokenizer.from_dir(path)`: tokenizer with chat template
  (rendered in a sandbox under `TemplateLimits`: time and size).
- `resolve_model_path(name_or_path)`, `load_model_files(name_or_path)`: names like "smollm2-135m".
"""

from jaxspec.loading.chat_template import TemplateLimits, render_chat_template, validate_messages
from jaxspec.loading.gguf_reader import read_gguf, read_gguf_metadata
from jaxspec.loading.hf_dir import hf_tensor_shapes, read_hf_dir
from jaxspec.loading.registry import load_model_files, resolve_model_path
from jaxspec.loading.tokenizer import Tokenizer

__all__ = [
    "TemplateLimits",
    "Tokenizer",
    "hf_tensor_shapes",
    "load_model_files",
    "read_gguf",
    "read_gguf_metadata",
    "read_hf_dir",
    "render_chat_template",
    "resolve_model_path",
    "validate_messages",
]
