"""Medusa drafting: every head reads the target's hidden state at the last committed token.

State: that hidden state [B, d] (the post-norm final hidden whose LM head produced the root). Head i
predicts the draft at depth i + 1. Chain: each depth sampled from its head's processed distribution
(heads are independent of the parent draft, so q is exactly what was sampled from). Static tree: node
(r_1..r_d) is head d-1's rank-r_d token (`tree_build.fill_static_tree`), deterministic drafts.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from jaxspec import sampling
from jaxspec.drafters.heads.configs import MedusaConfig
from jaxspec.drafters.heads.drafting import apply_hook, top_tokens
from jaxspec.drafters.heads.medusa.module import medusa_logits
from jaxspec.drafters.protocol import RoundContext, root_token
from jaxspec.drafters.tree_build import StaticTree, fill_static_tree
from jaxspec.model.forward import last_valid
from jaxspec.sampling.tree import DraftTree, chain_tree


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class MedusaState:
    """hidden: [B, d] target final hidden state at the last committed token."""

    hidden: jax.Array


@dataclasses.dataclass(frozen=True)
class MedusaDrafter:
    target_graphdef: nnx.GraphDef
    head_graphdef: nnx.GraphDef
    config: MedusaConfig
    depth: int  # chain length (ignored with a static tree)
    static_tree: StaticTree | None = None
    logits_hook: Any = None
    capture_layers: tuple[int, ...] = ()

    @property
    def num_nodes(self) -> int:
        return self.static_tree.num_nodes if self.static_tree is not None else self.depth + 1

    @property
    def max_depth(self) -> int:
        return self.static_tree.max_depth if self.static_tree is not None else self.depth

    def init(self, draft_params, target_params, pre, requests, max_len) -> MedusaState:
        return MedusaState(hidden=last_valid(pre.hidden, requests.prompt_lengths))

    def head_logits(self, draft_params, target_params, hidden: jax.Array, ctx: RoundContext) -> jax.Array:
        """[B, D, V] logits of the first D = max_depth heads, hook applied."""
        target = nnx.merge(self.target_graphdef, target_params)
        logits = medusa_logits(self.head_graphdef, draft_params["head"], hidden, target.lm_logits)
        logits = logits[:, : self.max_depth]
        index = ctx.cache_lengths[:, None] + 1 + jnp.arange(self.max_depth)[None, :]
        return apply_hook(self.logits_hook, draft_params, logits, index)

    def propose(self, draft_params, target_params, state: MedusaState, ctx: RoundContext):
        logits = self.head_logits(draft_params, target_params, state.hidden, ctx)
        root = root_token(ctx)
        if self.static_tree is not None:
            tokens = top_tokens(logits, ctx.sampling, self.static_tree.top_k)  # [B, D, K]
            return fill_static_tree(self.static_tree, root, tokens), state
        q = sampling.process_logits(logits, ctx.sampling)  # [B, D, V]
        batch, depth, vocab = q.shape
        keys = jax.vmap(sampling.fold_in_rows, in_axes=(None, 0), out_axes=1)(
            ctx.keys, jnp.arange(1, depth + 1)
        )
        drafts = sampling.sample_from_probs(q.reshape(batch * depth, vocab), keys.reshape(-1)).reshape(
            batch, depth
        )
        tree: DraftTree = chain_tree(root, drafts, q)
        return tree, state

    def update(self, draft_params, target_params, state: MedusaState, ctx, tree, result, features, active):
        last = jnp.take_along_axis(features["hidden"], result.num_accepted[:, None, None], axis=1)[:, 0]
        return MedusaState(hidden=jnp.where(active[:, None], last.astype(state.hidden.dtype), state.hidden))
