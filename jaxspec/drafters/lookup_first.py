"""Prompt lookup first, the head otherwise: a row whose history ends with an n-gram that occurred before
drafts that occurrence's continuation (`ngram.ngram_chain`); the other rows draft the head's chain.

Text that repeats (a summary quoting its passage, code reusing names, a list's parallel items) is where
a lookup continuation is accepted most often: on the dev prompts' greedy answers, positions whose last 4
tokens occurred before accept 1.76 of 3 lookup drafts on average, against 0.75 for the EAGLE-3 head's
chain over all rounds. Everywhere else the head drafts as before (`SpecConfig.lookup_min_match`).

Lossless: which chain a row verifies depends only on its history, never on a sampled draft or the
target; lookup drafts are deterministic, so their draft distribution is one-hot on the drafted token,
and the head's drafts keep their own q. The heads' `update` reads only the accepted path's tokens and
target features, so it works whichever chain was verified.
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
    """A head's chain drafter (`head`, K drafts) with prompt lookup in front: a row whose last n tokens,
    min_match <= n <= max_match, occurred earlier in its history drafts the continuation of the most
    recent occurrence of the longest such n-gram, up to K tokens."""

    head: Drafter
    min_match: int
    max_match: int

    @property
    def capture_layers(self) -> tuple[int, ...]:
        return self.head.capture_layers

    @property
    def num_nodes(self) -> int:
        return self.head.num_nodes

    @property
    def max_depth(self) -> int:
        return self.head.max_depth

    def init(self, draft_params, target_params, pre, requests, max_len: int) -> Any:
        return self.head.init(draft_params, target_params, pre, requests, max_len)

    def propose(self, draft_params, target_params, state, ctx: RoundContext) -> tuple[DraftTree, Any]:
        """The head's chain [B, K + 1] with the rows that have a lookup match replaced by the lookup's
        chain (q one-hot on its tokens)."""
        drafted, state = self.head.propose(draft_params, target_params, state, ctx)
        looked_up = ngram_chain(
            ctx.history, ctx.history_len, num_tokens=self.max_depth, ngram_min=self.min_match,
            ngram_max=self.max_match,
        )  # fmt: skip
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
