"""Loading the independent draft model of `method="draft_model"`."""

from __future__ import annotations

import dataclasses
import functools

from jaxspec.config import SpecConfig
from jaxspec.errors import InputError
from jaxspec.model import Model


@functools.lru_cache(maxsize=4)
def _load_cached(name_or_path: str, dtype_name: str) -> Model:
    from jaxspec.load import load

    return load(name_or_path, dtype=dtype_name)


@functools.lru_cache(maxsize=8)
def truncate_layers(model: Model, num_layers: int) -> Model:
    """A draft made of the first `num_layers` decoder layers + the final norm and LM head."""
    if not 1 <= num_layers <= model.config.num_layers:
        raise InputError(f"draft_num_layers must be in [1, {model.config.num_layers}], got {num_layers}")
    from flax import nnx

    full = nnx.merge(model.graphdef, model.params)
    full.layers = nnx.List(list(full.layers)[:num_layers])
    config = model.config.replace(num_layers=num_layers)
    full.config = config
    for layer in full.layers:
        layer.self_attn.config = config
    graphdef, params = nnx.split(full)
    return dataclasses.replace(model, config=config, graphdef=graphdef, params=params)


def load_draft_model(target: Model, spec: SpecConfig) -> Model:
    """The draft model named by spec.head (default: the target itself), optionally truncated."""
    source = spec.head or target.source
    draft = target if source == target.source else _load_cached(source, target.dtype.name)
    if draft.config.vocab_size != target.config.vocab_size:
        raise InputError(
            f"draft model {source}: vocabulary {draft.config.vocab_size} "
            f"!= target's {target.config.vocab_size}"
        )
    if spec.draft_num_layers is not None:
        draft = truncate_layers(draft, spec.draft_num_layers)
    return draft
