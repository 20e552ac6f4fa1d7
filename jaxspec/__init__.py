"""jaxspec: JAX-native speculative decoding.

`generate`, `Model` and `Completion` import jax on first use (PEP 562 `__getattr__`; `load` imports it
when called), so the command line answers `--help` without paying for jax.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from jaxspec.config import SamplingParams, SpecConfig
from jaxspec.errors import InputError, JaxspecError, ModelLoadError, TemplateError
from jaxspec.loading.loader import load  # eager (it imports jax when called): the submodule never shadows it
from jaxspec.model.config import ModelConfig

if TYPE_CHECKING:
    from jaxspec.decoding.generate import Completion, generate
    from jaxspec.model.target import Model

_LAZY = {
    "Completion": "jaxspec.decoding.generate",
    "generate": "jaxspec.decoding.generate",
    "Model": "jaxspec.model.target",
}

__all__ = [
    "Completion",
    "InputError",
    "JaxspecError",
    "Model",
    "ModelConfig",
    "ModelLoadError",
    "SamplingParams",
    "SpecConfig",
    "TemplateError",
    "generate",
    "load",
]


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'jaxspec' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value
