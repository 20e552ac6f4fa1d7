"""Prompt lookup beside a head: a row whose history ends with an n-gram that occurred before drafts that
occurrence's continuation (`ngram.ngram_chain`). With a head's chain, that row verifies the lookup's
chain instead of the head's (the other rows draft the head's chain); with a head's tree (EAGLE-2-style
dynamic trees), the lookup's chain is merged into the tree as a trie in nodes appended after the head's
(`append_branch`), and a row without a match leaves those nodes invalid.

Text that repeats (a summary quoting its passage, code reusing names, a list's parallel items) is where
a lookup continuation is accepted most often: on the dev prompts' greedy answers, positions whose last 4
tokens occurred before accept 1.76 of 3 lookup drafts on average, against 0.75 for the EAGLE-3 head's
chain over all rounds. Everywhere else the head drafts as before (`SpecConfig.lookup_min_match`).

With a tree, the branch can also come from the datastore (`drafters.datastore`, the target's own
answers as an n-gram table; `SpecConfig.datastore`): a row without a prompt-lookup match (or every row,
when prompt lookup is off) gets the table's chain there instead, and with `separate` both chains are
merged in (2K appended nodes). The draft parameters are then (the head's, the table).

A tree's appended chains may be longer than the head's depth (`branch_tokens` L > K: they cost no draft
forward, and a long match is often right for many tokens); a round can then accept up to L drafts, and
the head is built to commit that many (`make_drafter`).

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

from jaxspec.drafters.datastore import datastore_chain
from jaxspec.drafters.ngram import ngram_chain
from jaxspec.drafters.protocol import Drafter, RoundContext
from jaxspec.sampling.tree import DraftTree


@dataclasses.dataclass(frozen=True)
class LookupFirstDrafter:
    """A head's drafter (`head`, depth K) with prompt lookup beside it: a row whose last n tokens,
    min_match <= n <= max_match, occurred earlier in its history drafts the continuation of the most
    recent occurrence of the longest such n-gram, up to K tokens: instead of the head's chain, or
    (branch=True, a head tree of N nodes) merged into the tree in K more nodes (N + K; `append_branch`).
    min_match 0: no prompt lookup. datastore (branch only): rows without a lookup match take the
    datastore's chain in those nodes; separate: the datastore's chain gets K nodes of its own (N + 2K).
    branch_tokens (branch only): the appended chains' length L instead of K (N + L or N + 2L nodes,
    depth max(K, L)); the head must then commit up to L + 1 tokens a round."""

    head: Drafter
    min_match: int
    max_match: int
    branch: bool = False
    datastore: bool = False
    separate: bool = False
    branch_tokens: int | None = None

    def __post_init__(self) -> None:
        if self.branch_tokens is not None and not self.branch:
            raise ValueError("LookupFirstDrafter: branch_tokens is the length of a tree's appended chains")
        if self.datastore and not self.branch:
            raise ValueError("LookupFirstDrafter: the datastore is a branch of a head's tree (branch=True)")
        if not (self.min_match or self.datastore):
            raise ValueError("LookupFirstDrafter: needs prompt lookup (min_match >= 1), a datastore, or both")
        if self.separate and not (self.datastore and self.min_match):
            raise ValueError("LookupFirstDrafter: separate needs both prompt lookup and a datastore")

    def _head_params(self, draft_params):
        return draft_params[0] if self.datastore else draft_params

    @property
    def capture_layers(self) -> tuple[int, ...]:
        return self.head.capture_layers

    @property
    def chain_tokens(self) -> int:
        """Drafts in the lookup / datastore chain: the head's depth, or branch_tokens."""
        return self.branch_tokens or self.head.max_depth

    @property
    def num_nodes(self) -> int:
        return self.head.num_nodes + (self.chain_tokens * (1 + self.separate) if self.branch else 0)

    @property
    def max_depth(self) -> int:
        return max(self.head.max_depth, self.chain_tokens)

    def init(self, draft_params, target_params, pre, requests, max_len: int) -> Any:
        return self.head.init(self._head_params(draft_params), target_params, pre, requests, max_len)

    def propose(self, draft_params, target_params, state, ctx: RoundContext) -> tuple[DraftTree, Any]:
        """The head's chain [B, K + 1] with the rows that have a lookup match replaced by the lookup's
        chain (q one-hot on its tokens); with branch=True the head's tree [B, N] and the lookup's chain
        after it [B, N + L] (the datastore's after that with `separate`: [B, N + 2L]; L = chain_tokens)."""
        drafted, state = self.head.propose(self._head_params(draft_params), target_params, state, ctx)
        if self.datastore:
            stored = datastore_chain(draft_params[1], ctx.history, ctx.history_len, self.chain_tokens)
            if not self.min_match:
                return append_branch(drafted, *stored), state
        looked_up = ngram_chain(
            ctx.history, ctx.history_len, num_tokens=self.chain_tokens, ngram_min=self.min_match,
            ngram_max=self.max_match,
        )  # fmt: skip
        if self.separate:
            return append_branch(append_branch(drafted, looked_up.tokens, looked_up.valid), *stored), state
        if self.datastore:
            matched = looked_up.valid[:, 1:2]  # [B, 1]: prompt lookup found a continuation
            tokens = jnp.where(matched, looked_up.tokens, stored[0])
            return append_branch(drafted, tokens, jnp.where(matched, looked_up.valid, stored[1])), state
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
        head_params = self._head_params(draft_params)
        return self.head.update(head_params, target_params, state, ctx, tree, result, features, active)


def append_branch(tree: DraftTree, chain_tokens: jax.Array, chain_valid: jax.Array) -> DraftTree:
    """`tree` [B, N] with a chain [B, K + 1] (root first, as `ngram_chain` returns it) merged in as a
    trie, in K appended nodes N..N + K - 1: while the chain's tokens follow a path of the tree's own
    valid nodes (from the root), its nodes there are left invalid (duplicates); its first token off that
    path hangs under the path's last node, and each next one under the one before. So the chain is a
    branch of the root where the tree has nothing of it, and a continuation of the tree's path where it
    has (the exact walk, which only descends into the first accepted child, reaches it either way).
    Parents precede children, depths are the parents' + 1, and q is one-hot on the chain's tokens (when
    the tree carries q). K is static and small: the loop over depths is unrolled."""
    b, n = tree.tokens.shape
    k = chain_tokens.shape[1] - 1
    attach = jnp.zeros((b,), tree.parent.dtype)  # the tree node the chain follows so far (the root)
    following = jnp.ones((b,), bool)  # the chain's tokens so far are a path of the tree
    parents, valids = [], []
    for d in range(1, k + 1):
        token, valid = chain_tokens[:, d], chain_valid[:, d]
        same = tree.valid & (tree.parent == attach[:, None]) & (tree.tokens == token[:, None])  # [B, N]
        found = following & valid & jnp.any(same, axis=1)
        parents.append(jnp.where(following, attach, n + d - 2).astype(tree.parent.dtype))
        valids.append(valid & ~found)
        attach = jnp.where(found, jnp.argmax(same, axis=1).astype(attach.dtype), attach)
        following = found
    q_probs = tree.q_probs
    if q_probs is not None:
        one_hot = jax.nn.one_hot(chain_tokens[:, 1:], q_probs.shape[-1], dtype=q_probs.dtype)
        q_probs = jnp.concatenate([q_probs, one_hot], axis=1)
    depth = jnp.broadcast_to(jnp.arange(1, k + 1, dtype=tree.depth.dtype), (b, k))
    return DraftTree(
        tokens=jnp.concatenate([tree.tokens, chain_tokens[:, 1:]], axis=1),
        parent=jnp.concatenate([tree.parent, jnp.stack(parents, axis=1)], axis=1),
        depth=jnp.concatenate([tree.depth, depth], axis=1),
        valid=jnp.concatenate([tree.valid, jnp.stack(valids, axis=1)], axis=1),
        q_probs=q_probs,
    )
