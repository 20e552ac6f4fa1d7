"""A loaded target model: config, split NNX graph + parameters, tokenizer, chat template."""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxspec.errors import InputError
from jaxspec.model.buckets import length_bucket
from jaxspec.model.config import ModelConfig
from jaxspec.model.forward import causal_mask, lm_logits, model_forward
from jaxspec.model.kv_cache import KVCache


@dataclasses.dataclass(frozen=True, eq=False)
class Model:
    """What `jaxspec.load` returns. `graphdef` and `params` come from one `nnx.split` at load time."""

    config: ModelConfig
    graphdef: nnx.GraphDef
    params: nnx.State
    tokenizer: Any
    source: str
    # Device mesh the params are sharded over (`jaxspec.load(..., mesh=)`); None = one device.
    mesh: jax.sharding.Mesh | None = None

    @property
    def dtype(self) -> jnp.dtype:
        return jax.tree.leaves(self.params)[0].dtype

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        ids = tuple(self.config.eos_token_ids)
        if self.tokenizer is not None:
            ids = ids + tuple(i for i in self.tokenizer.eos_token_ids if i not in ids)
        return ids

    def chat_prompt(self, messages: list[dict[str, str]]) -> list[int]:
        """Token ids of `messages` rendered with the model's own chat template, generation prompt added."""
        return list(self.tokenizer.apply_chat_template(messages, add_generation_prompt=True))

    def logits(self, ids: list[int] | np.ndarray) -> np.ndarray:
        """One full forward over `ids` -> float32 logits [len(ids), vocab]."""
        ids = np.asarray(ids, dtype=np.int32).reshape(-1)
        if ids.size == 0:
            raise InputError("Model.logits: ids is empty")
        if ids.size > self.config.max_position_embeddings:
            raise InputError(
                f"Model.logits: {ids.size} tokens exceed the context of {self.config.max_position_embeddings}"
            )
        if ids.min() < 0 or ids.max() >= self.config.vocab_size:
            raise InputError(f"Model.logits: token ids must be in [0, {self.config.vocab_size})")
        # Pad to a length bucket (causal attention: padding after the prompt cannot change its logits).
        padded = np.zeros((length_bucket(ids.size),), np.int32)
        padded[: ids.size] = ids
        out = _full_logits(self.graphdef, self.params, jnp.asarray(padded)[None], config=self.config)
        return np.asarray(out[0, : ids.size], dtype=np.float32)


@functools.partial(jax.jit, static_argnames=("graphdef", "config"))
def _full_logits(graphdef: nnx.GraphDef, params: nnx.State, ids: jax.Array, *, config: ModelConfig):
    b, n = ids.shape
    cache = KVCache.zeros(config, b, n, jax.tree.leaves(params)[0].dtype)
    positions = jnp.broadcast_to(jnp.arange(n, dtype=jnp.int32), (b, n))
    hidden, _, _ = model_forward(
        graphdef, params, ids, positions, cache, causal_mask(b, n), attention="reference"
    )
    return lm_logits(graphdef, params, hidden)
