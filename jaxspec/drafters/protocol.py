"""The Drafter protocol (see `jaxspec.drafters`) and what a drafter sees each round: `RoundContext`
(committed history, lengths, keys, sampling parameters) and its root token."""

from __future__ import annotations

import dataclasses
from typing import Any, Protocol

import jax
import jax.numpy as jnp

from jaxspec.sampling.processors import SamplingArrays
from jaxspec.sampling.tree import DraftTree


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class RoundContext:
    """history: [B, H] int32 prompt + emitted tokens; history[b, history_len[b] - 1] is the root (the
    last emitted token, KV not yet in the target cache). cache_lengths: [B] committed target tokens
    (= history_len - 1). keys: [B] draft keys of this round. sampling: per-row processor parameters."""

    history: jax.Array
    history_len: jax.Array
    cache_lengths: jax.Array
    keys: jax.Array
    sampling: SamplingArrays


def last_token(history: jax.Array, length: jax.Array) -> jax.Array:
    """history [B, H], length [B] -> [B] history[b, length[b] - 1] (index clamped at 0)."""
    return jnp.take_along_axis(history, jnp.maximum(length - 1, 0)[:, None], axis=1)[:, 0]


def root_token(ctx: RoundContext) -> jax.Array:
    """[B] the round's root: the pending token (last emitted, not yet in the target cache)."""
    return last_token(ctx.history, ctx.history_len)


class Drafter(Protocol):
    capture_layers: tuple[int, ...]

    @property
    def num_nodes(self) -> int: ...

    @property
    def max_depth(self) -> int: ...

    def init(self, draft_params, target_params, pre, requests, max_len: int) -> Any: ...

    def propose(self, draft_params, target_params, state, ctx: RoundContext) -> tuple[DraftTree, Any]: ...

    def update(self, draft_params, target_params, state, ctx, tree, result, features, active) -> Any: ...
