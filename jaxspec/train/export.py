"""A trained head as a shippable checkpoint directory (`SpecConfig(method=..., head=path)`).

The head itself is written in jaxspec's own head format (`jaxspec.drafters.heads.orbax_io`:
jaxspec_head.json + Orbax `params/`), floating parameters stored in `dtype` (bfloat16 by default; the
loader casts them to the model's dtype), integer tables (EAGLE-3's d2t/t2d) unchanged. Next to it:
  training.json  how it was trained: {"target", "command", "steps", "sequences" (rows of the
                 distilled data), "train_sequences" / "val_sequences" (the featured ones trained on / held
                 out), "*_s" timings, ...}
  curves.png     training curves (copied from the run directory), when present.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from jaxspec.drafters.heads.configs import HeadConfig
from jaxspec.drafters.heads.head import DraftHead
from jaxspec.drafters.heads.orbax_io import load_own_head
from jaxspec.drafters.heads.orbax_io import save_head as save_own_head

TRAINING_FILE = "training.json"


def cast_floating(tree: Any, dtype: jnp.dtype) -> Any:
    return jax.tree.map(lambda x: x.astype(dtype) if jnp.issubdtype(x.dtype, jnp.floating) else x, tree)


def save_head(
    directory: str | Path,
    config: HeadConfig,
    graphdef: nnx.GraphDef,
    params: nnx.State,
    *,
    dtype: str = "bfloat16",
    info: dict[str, Any] | None = None,
    curves: str | Path | None = None,
) -> Path:
    """Write a head (full nnx.State, trained and fixed variables) to `directory`, replacing its content."""
    directory = Path(directory).absolute()
    if directory.exists():
        shutil.rmtree(directory)
    head = DraftHead(config=config, graphdef=graphdef, params=cast_floating(params, jnp.dtype(dtype)))
    save_own_head(head, directory)
    (directory / TRAINING_FILE).write_text(json.dumps({"dtype": dtype, **(info or {})}, indent=1) + "\n")
    if curves is not None and Path(curves).exists():
        shutil.copy(curves, directory / "curves.png")
    return directory


def load_saved_head(directory: str | Path, dtype: jnp.dtype = jnp.float32) -> DraftHead:
    """The head in `directory` with floating parameters in `dtype` (what SpecConfig(head=...) loads)."""
    return load_own_head(directory, dtype)
