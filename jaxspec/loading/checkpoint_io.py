"""Reading published head checkpoints: tensors by name, and filling a head's parameter tree from them.

Every failure is a ModelLoadError naming the file and the checkpoint key at fault (missing key, wrong
shape, unexpected key).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from pathlib import Path

import jax
import jax.numpy as jnp
import ml_dtypes  # noqa: F401  (registers numpy's bfloat16 for safetensors' numpy reader)
import numpy as np
from flax import nnx

from jaxspec.errors import ModelLoadError


def read_tensors(
    files: Iterable[Path], keep: Callable[[str], bool] = lambda name: True
) -> dict[str, np.ndarray]:
    """name -> numpy array from safetensors files (or PyTorch .bin/.pt pickles, read with torch)."""
    tensors: dict[str, np.ndarray] = {}
    for file in files:
        if file.suffix == ".safetensors":
            from safetensors import SafetensorError, safe_open

            try:
                with safe_open(str(file), framework="np") as f:
                    for name in f.keys():
                        if keep(name):
                            tensors[name] = f.get_tensor(name)
            except (SafetensorError, OSError) as err:
                raise ModelLoadError(f"{file}: cannot read safetensors file: {err}") from err
        else:
            tensors.update({k: v for k, v in _read_torch_file(file).items() if keep(k)})
    return tensors


def _read_torch_file(file: Path) -> dict[str, np.ndarray]:
    try:
        import torch
    except ImportError as err:
        raise ModelLoadError(f"{file}: reading a PyTorch checkpoint needs torch (pip install torch)") from err
    try:
        state = torch.load(str(file), map_location="cpu", weights_only=True)
    except Exception as err:  # noqa: BLE001 (torch raises many kinds)
        raise ModelLoadError(
            f"{file}: cannot read PyTorch checkpoint (only plain tensor state dicts are read): "
            f"{_torch_reason(err)}"
        ) from None
    if not isinstance(state, dict) or not all(isinstance(v, torch.Tensor) for v in state.values()):
        raise ModelLoadError(f"{file}: not a PyTorch state dict of tensors (got {type(state).__name__})")
    out = {}
    for name, value in state.items():
        if value.dtype.is_floating_point:
            value = value.float()
        out[name] = value.numpy()
    return out


def _torch_reason(err: Exception) -> str:
    """What torch.load found wrong, without its advice to pass weights_only=False (which would run
    the file's pickled code: jaxspec never does that with a downloaded file)."""
    text = str(err).strip()
    marker = "WeightsUnpickler error:"
    if marker in text:
        text = text.split(marker, 1)[1].split("Check the documentation", 1)[0]
    elif text.startswith("Weights only load failed"):
        text = "the file holds more than tensors (loading it would run its pickled code)"
    text = " ".join(text.split())
    return text[:300] or type(err).__name__


class TensorSource:
    """Tensors of one checkpoint; `take` checks presence and shape and records what was used."""

    def __init__(self, tensors: dict[str, np.ndarray], source: str):
        self.tensors = tensors
        self.source = source
        self.used: set[str] = set()

    def __contains__(self, key: str) -> bool:
        return key in self.tensors

    def take(self, key: str, shape: tuple[int, ...], transpose: bool = False) -> np.ndarray:
        if key not in self.tensors:
            raise ModelLoadError(f"{self.source}: missing tensor {key!r}")
        value = np.asarray(self.tensors[key])
        if transpose:
            value = value.T
        if tuple(value.shape) != tuple(shape):
            found = value.T.shape if transpose else value.shape
            want = tuple(reversed(shape)) if transpose else tuple(shape)
            raise ModelLoadError(f"{self.source}: tensor {key!r} has shape {tuple(found)}, expected {want}")
        self.used.add(key)
        return value

    def check_all_used(self, ignore: Callable[[str], bool] = lambda name: False) -> None:
        unexpected = sorted(k for k in self.tensors if k not in self.used and not ignore(k))
        if unexpected:
            raise ModelLoadError(
                f"{self.source}: unexpected tensor {unexpected[0]!r} ({len(unexpected)} unexpected)"
            )


def layout_key(path: tuple, renames: dict[str, str], prefix: str = "") -> tuple[str, bool]:
    """NNX parameter path -> (published key, transpose?).

    The first path element is renamed by `renames` ("" drops it); linear kernels [in, out] are stored
    as `weight` [out, in]; embeddings as `weight`.
    """
    names = [str(p) for p in path]
    head = renames.get(names[0], names[0])
    names = ([head] if head else []) + names[1:]
    transpose = names[-1] == "kernel"
    if names[-1] in ("kernel", "embedding"):
        names[-1] = "weight"
    return prefix + ".".join(names), transpose


def fill_params(
    abstract: nnx.State, tensors: TensorSource, key_of: Callable[[tuple], tuple[str, bool]], dtype: jnp.dtype
) -> nnx.State:
    """A concrete copy of `abstract` whose every leaf is read from `tensors` at key_of(path).

    Floating parameters are cast to `dtype`; integer / boolean tables keep theirs (as int32 / bool).
    """
    state = jax.tree.map(lambda x: x, abstract)
    flat = nnx.to_flat_state(state)
    for path, variable in flat:
        key, transpose = key_of(path)
        want = variable.get_value()
        value = tensors.take(key, tuple(want.shape), transpose)
        if jnp.issubdtype(want.dtype, jnp.floating):
            variable.set_value(jnp.asarray(value, dtype))
        else:
            variable.set_value(jnp.asarray(value).astype(want.dtype))
    return nnx.from_flat_state(flat)
