"""The draft tree: one representation for chains, static (Medusa) trees and dynamic (EAGLE-2) trees.

Node 0 is the root: the last emitted token, whose KV is not in the cache yet. Nodes 1..N-1 are draft
tokens. Parents always come before children (parent[i] < i), so a single forward sweep over the node
index visits every ancestor before its descendants. A chain is a tree with one child per node.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class DraftTree:
    """A batch of draft trees with a fixed node budget N.

    tokens:  [B, N] int32   node tokens; tokens[:, 0] is the root (last emitted token).
    parent:  [B, N] int32   parent index, -1 for the root; parent[i] < i.
    depth:   [B, N] int32   0 for the root, parent's depth + 1 otherwise.
    valid:   [B, N] bool    False for padding nodes (never attended to, never accepted).
    q_probs: [B, N, V] float32 or None: the processed draft distribution node i was *sampled* from
             (the draft distribution at its parent). None means drafts were chosen deterministically
             (top-k, n-gram lookup): verification then treats q as one-hot on the drafted token.
    """

    tokens: jax.Array
    parent: jax.Array
    depth: jax.Array
    valid: jax.Array
    q_probs: jax.Array | None = None

    @property
    def num_nodes(self) -> int:
        return self.tokens.shape[1]


def ancestor_mask(tree: DraftTree) -> jax.Array:
    """[B, N, N] bool: mask[b, i, j] is True iff j == i or j is an ancestor of i (both valid).

    Built in one place for the verify attention and for acceptance bookkeeping. Because parents come
    before children, row i is row parent[i] plus the diagonal; a scan over i fills it in order.
    """
    b, n = tree.tokens.shape
    eye = jnp.eye(n, dtype=bool)

    def add_node(mask: jax.Array, i: jax.Array) -> tuple[jax.Array, None]:
        par = tree.parent[:, i]  # [B]
        par_row = jnp.take_along_axis(mask, jnp.maximum(par, 0)[:, None, None], axis=1)[:, 0]  # [B, N]
        par_row = jnp.where((par >= 0)[:, None], par_row, False)
        row = par_row | eye[i][None, :]
        return mask.at[:, i].set(row), None

    mask0 = jnp.zeros((b, n, n), dtype=bool)
    mask, _ = jax.lax.scan(add_node, mask0, jnp.arange(n))
    return mask & tree.valid[:, :, None] & tree.valid[:, None, :]


def tree_positions(tree: DraftTree, prefix_len: jax.Array) -> jax.Array:
    """[B, N] int32 position ids: prefix_len + depth (never the flattened node index)."""
    return prefix_len[:, None].astype(jnp.int32) + tree.depth


def chain_tree(root: jax.Array, drafts: jax.Array, q_probs: jax.Array | None = None) -> DraftTree:
    """A chain as a tree: root [B], drafts [B, K] -> N = K + 1 nodes; q_probs [B, K, V] or None."""
    b, k = drafts.shape
    n = k + 1
    tokens = jnp.concatenate([root[:, None], drafts], axis=1).astype(jnp.int32)
    parent = jnp.broadcast_to(jnp.arange(-1, n - 1, dtype=jnp.int32), (b, n))
    depth = jnp.broadcast_to(jnp.arange(n, dtype=jnp.int32), (b, n))
    valid = jnp.ones((b, n), dtype=bool)
    if q_probs is not None:
        pad = jnp.zeros_like(q_probs[:, :1])
        q_probs = jnp.concatenate([pad, q_probs], axis=1)
    return DraftTree(tokens=tokens, parent=parent, depth=depth, valid=valid, q_probs=q_probs)


def gather_nodes(x: jax.Array, index: jax.Array) -> jax.Array:
    """x [B, N, ...], index [B, K] (-1 = padding, read as node 0) -> [B, K, ...]: per-node values at the
    given node indices of each row (the accepted path's entries, a frontier's slots)."""
    idx = jnp.maximum(index, 0).reshape(index.shape + (1,) * (x.ndim - 2))
    return jnp.take_along_axis(x, idx, axis=1)
