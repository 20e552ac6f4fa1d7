"""Prompt lookup beside a head: a row whose history ends with an n-gram that occurred before drafts that
occurrence's continuation (`ngram.ngram_chain`). With a head's chain, that row verifies the lookup's
chain instead of the head's (the other rows draft the head's chain); with a head's tree (EAGLE-2-style
dynamic trees), the lookup's chain is one more branch of the root, appended after the head's nodes, and
a row without a match leaves those nodes invalid.

Text that repeats (a summary quoting its passage, code reusing names, a list's parallel items) is where
a lookup continuation is accepted most often: on the dev prompts' greedy answers, positions whose last 4
tokens occurred before accept 1.76 of 3 lookup drafts on average, against 0.75 for the EAGLE-3 head's
chain over all rounds. Everywhere else the head drafts as before (`SpecConfig.lookup_min_match`).

Lossless: which chain a row verifies depends only on its history, never on a sampled draft or the
target; lookup drafts are deterministic, so their draft distribution is one-hot on the drafted token,
and the head's drafts keep their own q (a tree's verification treats siblings as separate drafts, each
with its own q, and rejects a sibling repeating an already rejected token). The heads' `update` reads
only the accepted path's tokens and target features, so it works whichever path was accepted.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp

from jaxspec.drafters.ngram import ngram_chain
from jaxspec.drafters.protocol import Drafter, RoundContext
from jaxspec.sampling.tree import DraftTree


@dataclasses.dataclass(frozen=True)
class LookupFirstDrafter:
    """A head's drafter (`head`, depth K) with prompt lookup beside it: a row whose last n tokens,
    min_match <= n <= max_match, occurred earlier in its history drafts the continuation of the most
    recent occurrence of the longest such n-gram, up to K tokens: instead of the head's chain, or
    (branch=True, a head tree of N nodes) as K more nodes, a branch of the root (N + K nodes)."""

    head: Drafter
    min_match: int
    max_match: int
    branch: bool = False

    @property
    def capture_layers(self) -> tuple[int, ...]:
        return self.head.capture_layers

    @property
    def num_nodes(self) -> int:
        return self.head.num_nodes + (self.max_depth if self.branch else 0)

    @property
    def max_depth(self) -> int:
        return self.head.max_depth

    def init(self, draft_params, target_params, pre, requests, max_len: int) -> Any:
        return self.head.init(draft_params, target_params, pre, requests, max_len)

    def propose(self, draft_params, target_params, state, ctx: RoundContext) -> tuple[DraftTree, Any]:
        """The head's chain [B, K + 1] with the rows that have a lookup match replaced by the lookup's
        chain (q one-hot on its tokens); with branch=True the head's tree [B, N] and the lookup's chain
        after it [B, N + K]."""
        drafted, state = self.head.propose(draft_params, target_params, state, ctx)
        looked_up = ngram_chain(
            ctx.history, ctx.history_len, num_tokens=self.max_depth, ngram_min=self.min_match,
            ngram_max=self.max_match,
        )  # fmt: skip
        if self.branch:
            return append_branch(drafted, looked_up.tokens, looked_up.valid), state
        use = looked_up.valid[:, 1]  # [B]: a match with at least one continuation token

        def pick(lookup: jax.Array, head: jax.Array) -> jax.Array:
            return jnp.where(use.reshape((-1,) + (1,) * (lookup.ndim - 1)), lookup, head)

        q_probs = drafted.q_probs
        if q_probs is not None:
            one_hot = jax.nn.one_hot(looked_up.tokens, q_probs.shape[-1], dtype=q_probs.dtype)
            q_probs = pick(one_hot.at[:, 0].set(0.0), q_probs)
        tree = DraftTree(
            tokens=pick(looked_up.tokens, drafted.tokens),
            parent=drafted.parent,
            depth=drafted.depth,
            valid=pick(looked_up.valid, drafted.valid),
            q_probs=q_probs,
        )
        return tree, state

    def update(self, draft_params, target_params, state, ctx, tree, result, features, active) -> Any:
        return self.head.update(draft_params, target_params, state, ctx, tree, result, features, active)


def append_branch(tree: DraftTree, chain_tokens: jax.Array, chain_valid: jax.Array) -> DraftTree:
    """`tree` [B, N] with a chain [B, K + 1] (root first, as `ngram_chain` returns it) appended as a
    branch of the root: nodes N..N + K - 1, the first one's parent the root, each next one's the one
    before; q one-hot on the chain's tokens (when the tree carries q)."""
    b, n = tree.tokens.shape
    k = chain_tokens.shape[1] - 1
    steps = jnp.arange(k, dtype=jnp.int32)
    parent = jnp.broadcast_to(jnp.where(steps == 0, 0, n + steps - 1), (b, k))
    depth = jnp.broadcast_to(steps + 1, (b, k))
    q_probs = tree.q_probs
    if q_probs is not None:
        one_hot = jax.nn.one_hot(chain_tokens[:, 1:], q_probs.shape[-1], dtype=q_probs.dtype)
        q_probs = jnp.concatenate([q_probs, one_hot], axis=1)
    return DraftTree(
        tokens=jnp.concatenate([tree.tokens, chain_tokens[:, 1:]], axis=1),
        parent=jnp.concatenate([tree.parent, parent.astype(tree.parent.dtype)], axis=1),
        depth=jnp.concatenate([tree.depth, depth.astype(tree.depth.dtype)], axis=1),
        valid=jnp.concatenate([tree.valid, chain_valid[:, 1:]], axis=1),
        q_probs=q_probs,
    )
