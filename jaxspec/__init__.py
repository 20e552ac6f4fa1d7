"""jaxspec: JAX-native speculative decoding."""

from jaxspec.config import ModelConfig, SamplingParams, SpecConfig
from jaxspec.errors import InputError, JaxspecError, ModelLoadError, TemplateError
from jaxspec.generation import Completion, generate
from jaxspec.load import load
from jaxspec.model import Model

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
