"""Prompt lookup (n-gram) drafting: continue the longest suffix n-gram that already occurred in the history.

Everything is vectorised over the history (fixed shapes, no host code), so it runs inside the jitted
generate loop. For a row with history h and length L:

1. The suffix n-grams are h[L-n:L] for n in [ngram_min, ngram_max]. A match is an earlier window
   h[e-n+1:e+1] equal to the suffix, ending at e <= L-2 (so at least one continuation token exists).
   The longest n with at least one match wins.
2. Among that n's matches, most recent (largest e) first, up to `num_branches` distinct continuations
   are kept: the K tokens h[e+1:e+1+K], truncated to the tokens before L. A continuation is skipped
   when it is a prefix of (or equal to) one already kept, because it would add no node to the trie.
3. The kept continuations become a trie rooted at h[L-1] (the pending token).

Node layout (N = 1 + num_branches * K): node 1 + i*K + d holds branch i's token at depth d + 1. When
branch i shares its first d + 1 tokens with an earlier branch, that node is a merged duplicate: it is
invalid and the next node of branch i hangs off the earlier branch's node. Truncated or missing tokens
are invalid too. Every node keeps depth = d + 1 and parent = the node of its depth-d prefix, so the
layout is static, parents come before children, and num_branches = 1 is exactly `chain_tree`'s shape.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp

from jaxspec.drafters.protocol import RoundContext, last_token
from jaxspec.sampling.tree import DraftTree


def _shift_right(x: jax.Array, shift: int) -> jax.Array:
    """[B, T] -> [B, T] with out[:, e] = x[:, e - shift] (zeros where e < shift)."""
    if shift == 0:
        return x
    return jnp.pad(x, ((0, 0), (shift, 0)))[:, : x.shape[1]]


def _longest_match_ends(history: jax.Array, length: jax.Array, ngram_min: int, ngram_max: int) -> jax.Array:
    """[B, T] bool: the end positions e of every match of the longest matching suffix n-gram.

    run[b, e] after step j is True iff h[e-j:e+1] == h[L-1-j:L]; it only needs one new comparison per
    step, so all n in [1, ngram_max] cost O(B * T * ngram_max) comparisons in total.
    """
    batch, width = history.shape
    ends = jnp.arange(width, dtype=jnp.int32)[None, :]  # [1, T]
    suffix_index = jnp.clip(length[:, None] - 1 - jnp.arange(ngram_max), 0, width - 1)
    suffix = jnp.take_along_axis(history, suffix_index, axis=1)  # [B, nmax]; suffix[:, j] = h[L-1-j]

    run = ends <= (length[:, None] - 2)  # [B, T]: a match must end before the suffix does
    best = jnp.zeros((batch, width), dtype=bool)
    for j in range(ngram_max):
        run = run & (ends >= j) & (_shift_right(history, j) == suffix[:, j : j + 1])
        if j + 1 >= ngram_min:
            found = jnp.any(run, axis=1, keepdims=True)  # longer n overrides shorter ones
            best = jnp.where(found, run, best)
    return best


def _pick_branches(
    history: jax.Array, length: jax.Array, match_ends: jax.Array, num_tokens: int, num_branches: int
) -> tuple[jax.Array, jax.Array]:
    """Greedy, most recent first: up to num_branches continuations, none a prefix of a kept one.

    Returns tokens [B, num_branches, K] and valid lengths [B, num_branches] (0 for a missing branch).
    """
    batch, width = history.shape
    ends = jnp.arange(width, dtype=jnp.int32)[None, :]  # [1, T]
    padded = jnp.pad(history, ((0, 0), (0, num_tokens + 1)))
    # continuation[b, e, d] = h[e + 1 + d]; valid while e + 1 + d < L.
    continuation = jnp.stack([padded[:, 1 + d : 1 + d + width] for d in range(num_tokens)], axis=-1)
    cont_len = jnp.clip(length[:, None] - 1 - ends, 0, num_tokens)  # [B, T]
    cont_valid = jnp.arange(num_tokens)[None, None, :] < cont_len[:, :, None]  # [B, T, K]

    available = match_ends
    branch_tokens, branch_lens = [], []
    for _ in range(num_branches):
        latest = jnp.max(jnp.where(available, ends, -1), axis=1)  # [B], -1 when nothing is left
        has = latest >= 0
        at = jnp.maximum(latest, 0)[:, None]
        tokens = jnp.take_along_axis(continuation, at[:, :, None], axis=1)[:, 0]  # [B, K]
        tok_len = jnp.where(has, jnp.take_along_axis(cont_len, at, axis=1)[:, 0], 0)  # [B]
        # Drop every candidate whose valid tokens are a prefix of (or equal to) this branch.
        same_prefix = jnp.all((continuation == tokens[:, None, :]) | ~cont_valid, axis=-1)  # [B, T]
        available = available & ~(same_prefix & (cont_len <= tok_len[:, None]))
        branch_tokens.append(tokens)
        branch_lens.append(tok_len)
    return jnp.stack(branch_tokens, axis=1), jnp.stack(branch_lens, axis=1)


def _branches_to_trie(root: jax.Array, tokens: jax.Array, lens: jax.Array) -> DraftTree:
    """root [B], tokens [B, R, K], lens [B, R] -> DraftTree with N = 1 + R*K nodes (layout: module doc)."""
    batch, num_branches, num_tokens = tokens.shape
    depth_index = jnp.arange(num_tokens)
    token_valid = depth_index[None, None, :] < lens[:, :, None]  # [B, R, K]
    # shared[b, i, j, d]: branches i and j agree (and are valid) on depths 0..d.
    agree = (tokens[:, :, None, :] == tokens[:, None, :, :]) & token_valid[:, :, None] & token_valid[:, None]
    shared = jnp.cumsum(~agree, axis=-1) == 0  # [B, R, R, K]
    owner = jnp.argmax(shared, axis=2)  # [B, R, K]: first branch with the same prefix (itself if valid)
    branch_index = jnp.arange(num_branches)[None, :, None]
    node_valid = token_valid & (owner == branch_index)

    node_of = 1 + owner * num_tokens + depth_index  # node index that holds each (branch, depth) prefix
    own_slot = 1 + branch_index * num_tokens + depth_index
    prefix_node = jnp.where(token_valid, node_of, own_slot)  # invalid tails keep their own slot
    parent = jnp.concatenate(
        [jnp.zeros((batch, num_branches, 1), jnp.int32), prefix_node[:, :, :-1].astype(jnp.int32)], axis=2
    )

    flat = (batch, num_branches * num_tokens)
    depth = jnp.broadcast_to(depth_index + 1, (batch, num_branches, num_tokens))
    ones = jnp.ones((batch, 1), jnp.int32)
    return DraftTree(
        tokens=jnp.concatenate([root[:, None], jnp.where(node_valid, tokens, 0).reshape(flat)], axis=1),
        parent=jnp.concatenate([-ones, parent.reshape(flat)], axis=1),
        depth=jnp.concatenate([0 * ones, depth.reshape(flat).astype(jnp.int32)], axis=1),
        valid=jnp.concatenate([ones.astype(bool), node_valid.reshape(flat)], axis=1),
        q_probs=None,
    )


@functools.partial(jax.jit, static_argnames=("num_tokens", "ngram_min", "ngram_max", "num_branches"))
def ngram_tree(
    history: jax.Array,
    length: jax.Array,
    *,
    num_tokens: int,
    ngram_min: int,
    ngram_max: int,
    num_branches: int,
) -> DraftTree:
    """Prompt-lookup draft tree.

    history: [B, T] int32 prompt + emitted tokens; entries at index >= length are ignored.
    length:  [B] int32, >= 1; history[b, length[b] - 1] is the root (pending token).
    num_tokens: K, the draft depth. ngram_min..ngram_max: suffix lengths tried, longest first.
    num_branches: distinct continuations kept (1 = chain).
    Returns a DraftTree with N = 1 + num_branches * K nodes, q_probs None. No match: only the root
    is valid.
    """
    if not 1 <= ngram_min <= ngram_max:
        raise ValueError(f"ngram_tree: need 1 <= ngram_min <= ngram_max, got {ngram_min}, {ngram_max}")
    if num_tokens < 1 or num_branches < 1:
        raise ValueError(
            f"ngram_tree: num_tokens and num_branches must be >= 1, got {num_tokens}, {num_branches}"
        )
    history = history.astype(jnp.int32)
    length = length.astype(jnp.int32)
    match_ends = _longest_match_ends(history, length, ngram_min, ngram_max)
    tokens, lens = _pick_branches(history, length, match_ends, num_tokens, num_branches)
    root = last_token(history, length)
    return _branches_to_trie(root, tokens, lens)


def ngram_chain(
    history: jax.Array, length: jax.Array, *, num_tokens: int, ngram_min: int, ngram_max: int
) -> DraftTree:
    """`ngram_tree` with one branch: a chain of N = 1 + K nodes (node i's parent is i - 1)."""
    return ngram_tree(
        history, length, num_tokens=num_tokens, ngram_min=ngram_min, ngram_max=ngram_max, num_branches=1
    )


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
