"""Drafters: who proposes the draft tree each round.

A drafter is a frozen (hashable) dataclass, static to `jax.jit`, with pure methods; its trainable or
loaded weights travel separately as `draft_params` (a traced pytree), its per-request memory as a
state pytree in the loop carry:

  init(draft_params, target_params, prefill_result, requests, max_len) -> state
  propose(draft_params, target_params, state, ctx: RoundContext) -> (DraftTree with num_nodes nodes, state)
  update(draft_params, target_params, state, ctx, tree, verify_result, features, active) -> state

`features` holds the target's outputs along the accepted path (no second target pass):
  {"hidden": [B, P, d] final hidden states, "captured": tuple of [B, P, d] chosen layer outputs},
path entry j being the j-th committed node (root first).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Protocol

import jax
import jax.numpy as jnp
from flax import nnx

from jaxspec.cache import KVCache
from jaxspec.config import ModelConfig, SpecConfig
from jaxspec.forward import lm_logits, model_forward
from jaxspec.spec import sampling
from jaxspec.spec.ngram import ngram_tree
from jaxspec.spec.round_context import RoundContext
from jaxspec.spec.tree import DraftTree, chain_tree


class Drafter(Protocol):
    capture_layers: tuple[int, ...]

    @property
    def num_nodes(self) -> int: ...

    @property
    def max_depth(self) -> int: ...

    def init(self, draft_params, target_params, pre, requests, max_len: int) -> Any: ...

    def propose(self, draft_params, target_params, state, ctx: RoundContext) -> tuple[DraftTree, Any]: ...

    def update(self, draft_params, target_params, state, ctx, tree, result, features, active) -> Any: ...


@dataclasses.dataclass(frozen=True)
class NgramDrafter:
    """Prompt lookup: continuations of the longest matching n-gram in prompt + output (no training)."""

    num_tokens: int
    ngram_min: int
    ngram_max: int
    num_branches: int = 1
    capture_layers: tuple[int, ...] = ()

    @property
    def num_nodes(self) -> int:
        return 1 + self.num_branches * self.num_tokens

    @property
    def max_depth(self) -> int:
        return self.num_tokens

    def init(self, draft_params, target_params, pre, requests, max_len):
        return ()

    def propose(self, draft_params, target_params, state, ctx: RoundContext):
        tree = ngram_tree(
            ctx.history, ctx.history_len, num_tokens=self.num_tokens, ngram_min=self.ngram_min,
            ngram_max=self.ngram_max, num_branches=self.num_branches,
        )  # fmt: skip
        return tree, state

    def update(self, draft_params, target_params, state, ctx, tree, result, features, active):
        return state


@dataclasses.dataclass(frozen=True)
class DraftModelDrafter:
    """An independent smaller Llama with the target's vocabulary and its own KV cache; drafts a chain
    with `lax.scan`, sampling each token from its processed distribution (q recorded for exact
    verification). Its cache holds committed tokens only: each round it feeds root, d1 .. dK (K + 1
    steps, the last only to keep d_K's KV in case all drafts are accepted)."""

    graphdef: nnx.GraphDef
    config: ModelConfig
    num_tokens: int
    capture_layers: tuple[int, ...] = ()

    @property
    def num_nodes(self) -> int:
        return 1 + self.num_tokens

    @property
    def max_depth(self) -> int:
        return self.num_tokens

    def init(self, draft_params, target_params, pre, requests, max_len):
        batch, p = requests.prompt_tokens.shape
        dtype = jax.tree.leaves(draft_params)[0].dtype
        cache = KVCache.zeros(self.config, batch, max_len, dtype)
        positions = jnp.broadcast_to(jnp.arange(p, dtype=jnp.int32), (batch, p))
        mask = jnp.broadcast_to(jnp.tril(jnp.ones((p, p), bool)), (batch, p, p))
        _, _, cache = model_forward(
            self.graphdef, draft_params, requests.prompt_tokens, positions, cache, mask
        )
        return dataclasses.replace(cache, lengths=requests.prompt_lengths.astype(jnp.int32))

    def propose(self, draft_params, target_params, cache: KVCache, ctx: RoundContext):
        batch = ctx.history.shape[0]
        root = jnp.take_along_axis(ctx.history, (ctx.history_len - 1)[:, None], axis=1)[:, 0]
        one = jnp.ones((batch, 1, 1), bool)

        def step(carry, i):
            token, c = carry
            hidden, _, c = model_forward(
                self.graphdef, draft_params, token[:, None], c.lengths[:, None], c, one, attention="reference"
            )
            c = dataclasses.replace(c, lengths=c.lengths + 1)
            q = sampling.process_logits(lm_logits(self.graphdef, draft_params, hidden[:, 0]), ctx.sampling)
            keys = jax.vmap(jax.random.fold_in, in_axes=(0, None))(ctx.keys, i)
            nxt = sampling.sample_from_probs(q, keys)
            return (nxt, c), (nxt, q)

        start = cache.lengths
        (_, cache), (drafts, q) = jax.lax.scan(step, (root, cache), jnp.arange(self.num_tokens + 1))
        drafts = drafts[: self.num_tokens].T  # [B, K]
        q = jnp.swapaxes(q[: self.num_tokens], 0, 1)  # [B, K, V]
        cache = dataclasses.replace(cache, lengths=start)
        return chain_tree(root, drafts, q), cache

    def update(self, draft_params, target_params, cache: KVCache, ctx, tree, result, features, active):
        # Root and the accepted drafts are already in the draft cache at the right slots (a chain).
        committed = jnp.where(active, result.num_accepted + 1, 0)
        return dataclasses.replace(cache, lengths=cache.lengths + committed)


def make_drafter(model, spec: SpecConfig) -> tuple[Drafter, Any]:
    """Build the drafter (static) and its parameters (traced) for `spec`."""
    if spec.method == "ngram":
        drafter = NgramDrafter(
            num_tokens=spec.num_speculative_tokens, ngram_min=spec.ngram_min, ngram_max=spec.ngram_max,
            num_branches=spec.topk,
        )  # fmt: skip
        return drafter, ()
    if spec.method == "draft_model":
        from jaxspec.spec.draft_model import load_draft_model

        draft = load_draft_model(model, spec)
        drafter = DraftModelDrafter(
            graphdef=draft.graphdef, config=draft.config, num_tokens=spec.num_speculative_tokens
        )  # fmt: skip
        return drafter, draft.params
    from jaxspec.models.heads.registry import make_head_drafter

    return make_head_drafter(model, spec)
