"""Tree-masked attention, plain jnp: the oracle every kernel is tested against.

A verify step attends N tree-node queries per row to (a) the row's committed KV prefix, positions
[0, lengths[b]) of the cache, all visible, and (b) the tree's own N keys/values, node i seeing node j
iff tree_mask[b, i, j] (j is i or an ancestor of i).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def tree_attention_reference(
    q: jax.Array,
    k_cache: jax.Array,
    v_cache: jax.Array,
    lengths: jax.Array,
    k_tree: jax.Array,
    v_tree: jax.Array,
    tree_mask: jax.Array,
    *,
    scale: float,
) -> jax.Array:
    """Attention of tree queries over prefix + tree.

    Args:
      q: [B, Hq, N, D] queries of the N tree nodes.
      k_cache, v_cache: [B, Hkv, S, D] the row's cache; only [0, lengths[b]) is read.
      lengths: [B] int32 committed prefix length per row (0 <= lengths <= S).
      k_tree, v_tree: [B, Hkv, N, D] keys / values of the tree nodes.
      tree_mask: [B, N, N] bool, True where node i may attend to node j.
      scale: softmax scale (usually head_dim ** -0.5).
    Returns:
      [B, Hq, N, D] in q's dtype; softmax accumulated in float32.
    """
    b, hq, n, d = q.shape
    hkv, s = k_cache.shape[1], k_cache.shape[2]
    group = hq // hkv
    qg = q.reshape(b, hkv, group, n, d).astype(jnp.float32) * scale
    # The cache is the dot's left operand ([S, D] rows times the G * N query vectors), then the small
    # [S, G * N] result is transposed: XLA:CPU runs "keys as rows" ~5x faster than q @ k.T at decode
    # shapes (30 layers at 64 rows, S = 256: ~35 ms against ~200 ms), the same values.
    s_prefix = jnp.einsum("bhsd,bhgnd->bhsgn", k_cache.astype(jnp.float32), qg).transpose(0, 1, 3, 4, 2)
    s_tree = jnp.einsum("bhgnd,bhmd->bhgnm", qg, k_tree.astype(jnp.float32))
    prefix_ok = jnp.arange(s)[None, :] < lengths[:, None]  # [B, S]
    neg = jnp.finfo(jnp.float32).min
    s_prefix = jnp.where(prefix_ok[:, None, None, None, :], s_prefix, neg)
    s_tree = jnp.where(tree_mask[:, None, None, :, :], s_tree, neg)
    scores = jnp.concatenate([s_prefix, s_tree], axis=-1)
    probs = jax.nn.softmax(scores, axis=-1)
    out = jnp.einsum("bhgns,bhsd->bhgnd", probs[..., :s], v_cache.astype(jnp.float32))
    out = out + jnp.einsum("bhgnm,bhmd->bhgnd", probs[..., s:], v_tree.astype(jnp.float32))
    return out.reshape(b, hq, n, d).astype(q.dtype)
