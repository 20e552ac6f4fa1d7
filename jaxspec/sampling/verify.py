"""Rejection sampling over draft trees: `verify_tree` returns the accepted path plus one
corrected-or-bonus token, in "greedy", "exact" (lossless) or "typical_lossy" mode."""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp

from jaxspec.sampling.keys import PURPOSE_ACCEPT, PURPOSE_BONUS, PURPOSE_RESIDUAL, fold_in_rows
from jaxspec.sampling.processors import first_argmax, sample_from_probs
from jaxspec.sampling.tree import DraftTree

VERIFY_MODES = ("greedy", "exact", "typical_lossy")


def _uniform_rows(keys: jax.Array) -> jax.Array:
    """keys [B] -> [B] float32 uniforms in [0, 1)."""
    return jax.vmap(jax.random.uniform)(keys)


# ----------------------------------------------------------------------------------------------------
# Tree verification
# ----------------------------------------------------------------------------------------------------


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class VerifyResult:
    """Outcome of one verification round, D = max_depth.

    path:            [B, D + 1] int32 node indices of the accepted path: path[:, 0] = 0 (root),
                     path[:, d] = accepted node at depth d for d <= num_accepted, -1 after.
    num_accepted:    [B] int32 accepted draft tokens, 0..D (= depth of the last accepted node).
    next_token:      [B] int32 the corrected (residual) token, or the bonus token drawn from the
                     processed target distribution at the last accepted node.
    accepted_tokens: [B, D] int32 draft tokens of path[:, 1:], -1 after num_accepted.
    """

    path: jax.Array
    num_accepted: jax.Array
    next_token: jax.Array
    accepted_tokens: jax.Array

    @property
    def last_node(self) -> jax.Array:
        """[B] int32 index of the last accepted node (0 = root when nothing was accepted)."""
        return jnp.take_along_axis(self.path, self.num_accepted[:, None], axis=1)[:, 0]

    @property
    def emitted_tokens(self) -> jax.Array:
        """[B, D + 1] int32 tokens this round emits: accepted drafts then next_token, -1 padded."""
        return emitted_tokens(self)


def emitted_tokens(
    result: VerifyResult, num_accepted: jax.Array | None = None, size: int | None = None, pad: int = -1
) -> jax.Array:
    """[B, size] int32 tokens a round commits: the accepted drafts, then the next token at index
    num_accepted, `pad` after. num_accepted [B] defaults to result.num_accepted (engines pass it zeroed
    for finished rows); size (>= D + 1) to D + 1."""
    num_accepted = result.num_accepted if num_accepted is None else num_accepted
    size = result.path.shape[1] if size is None else size
    slots = jnp.arange(size)[None, :]
    accepted = jnp.pad(result.accepted_tokens, ((0, 0), (0, size - result.accepted_tokens.shape[1])))
    after = jnp.where(slots == num_accepted[:, None], result.next_token[:, None], pad)
    return jnp.where(slots < num_accepted[:, None], accepted, after).astype(jnp.int32)


@functools.partial(jax.jit, static_argnames=("mode", "max_depth", "posterior_threshold", "posterior_alpha"))
def verify_tree(
    tree: DraftTree,
    target_probs: jax.Array,
    keys: jax.Array,
    *,
    mode: str,
    max_depth: int,
    posterior_threshold: float = 0.09,
    posterior_alpha: float = 0.3,
) -> VerifyResult:
    """Accept a path of the draft tree and pick the next token; fixed shapes, no host loops.

    tree: DraftTree with N nodes (node 0 = root); nodes deeper than max_depth are ignored.
    target_probs: [B, N, V] processed target distribution at node i (the distribution of the token
        that follows node i), from `process_logits`.
    keys: [B] round keys from `round_key(seed, request_id, round_idx)`; the draws use
        fold_in(PURPOSE_ACCEPT) -> fold_in(child index) for accept coins and fold_in(PURPOSE_RESIDUAL or
        PURPOSE_BONUS) for the next token, i.e. the keys `derive_key` gives for those purposes.
    mode:
      "greedy": a child is accepted iff its token is the argmax of target_probs at its parent; the
          deepest fully matching path wins (lowest index on ties); next_token = argmax at its end.
      "exact": lossless multi-candidate rejection sampling (SpecInfer / multi-round speculative
          sampling). At node u with residual r = p_u, the valid children c are tried in index order:
          accept with probability min(1, r(x_c) / q_c(x_c)) where q_c = tree.q_probs[:, c] (the
          distribution x_c was drawn from; siblings drawn i.i.d. from it) or a one-hot at x_c when
          q_probs is None (deterministic drafts, e.g. distinct top-k tokens). On acceptance move to c
          with r = p_c; on rejection r = norm(max(0, r - q_c)). When no child is accepted the next token
          is drawn from r (the residual, or p_u itself for a leaf: the bonus token). The emitted tokens
          are distributed exactly as sampling the target token by token. With one-hot p
          (temperature 0) it emits exactly the greedy tokens.
      "typical_lossy": Medusa's typical acceptance (its generate loop's evaluate_posterior): a child
          passes iff p_parent(x_c) > min(posterior_threshold, posterior_alpha * exp(-entropy(p_parent)))
          (Medusa's defaults 0.09 and 0.3: a hard cap of 0.09, lower at high entropy); the deepest
          path of passing nodes wins, ties broken by the largest sum of log p along it (then the lowest
          index); next_token ~ p at its last node. NOT distribution preserving: opt-in only. The
          entropy is the exact one of the processed p (Medusa adds 1e-5 inside the log).
    max_depth: static bound on the accepted depth, the size of the path / accepted_tokens outputs.
    """
    if mode not in VERIFY_MODES:
        raise ValueError(f"verify_tree: mode must be one of {VERIFY_MODES}, got {mode!r}")
    target_probs = target_probs.astype(jnp.float32)
    candidate = tree.valid & (tree.depth >= 1) & (tree.depth <= max_depth)
    if mode == "greedy":
        last, next_token = _verify_greedy(tree, target_probs, candidate)
    elif mode == "exact":
        last, next_token = _verify_exact(tree, target_probs, keys, candidate)
    else:
        last, next_token = _verify_typical(
            tree, target_probs, keys, candidate, posterior_threshold, posterior_alpha
        )
    return _result_from_last_node(tree, last, next_token, max_depth)


def _verify_exact(
    tree: DraftTree, target_probs: jax.Array, keys: jax.Array, candidate: jax.Array
) -> tuple[jax.Array, jax.Array]:
    """Sequential walk over child indices 1..N-1 (parents precede children) -> (last node, next token).

    A single pass suffices: the children of the current node u all have indices > u, and once a child
    c is accepted the remaining siblings (parent != c) are skipped while c's children come later.
    """
    num_nodes = tree.num_nodes
    accept_keys = fold_in_rows(keys, PURPOSE_ACCEPT)

    def visit(c: jax.Array, carry: tuple[jax.Array, jax.Array, jax.Array]):
        node, residual, rejected_here = carry
        is_child = candidate[:, c] & (tree.parent[:, c] == node)
        token = tree.tokens[:, c]
        draft_q = _draft_distribution(tree, c, residual.shape[-1])
        coin = _uniform_rows(fold_in_rows(accept_keys, c))
        accept = is_child & _accept_test(residual, draft_q, token, coin)
        reject = is_child & ~accept
        residual = jnp.where(
            accept[:, None],
            target_probs[:, c],
            jnp.where(reject[:, None], _residual_distribution(residual, draft_q), residual),
        )
        node = jnp.where(accept, c, node)
        rejected_here = jnp.where(accept, False, rejected_here | reject)
        return node, residual, rejected_here

    batch = tree.tokens.shape[0]
    init = (jnp.zeros((batch,), jnp.int32), target_probs[:, 0], jnp.zeros((batch,), bool))
    last, residual, rejected_here = jax.lax.fori_loop(1, num_nodes, visit, init)
    next_token = _sample_next_token(residual, keys, rejected_here)
    return last, next_token


def _draft_distribution(tree: DraftTree, c: jax.Array, vocab: int) -> jax.Array:
    """[B, V] distribution child c was drafted from: q_probs[:, c], or one-hot at its token if None."""
    if tree.q_probs is None:
        return jax.nn.one_hot(tree.tokens[:, c], vocab, dtype=jnp.float32)
    return tree.q_probs[:, c].astype(jnp.float32)


def _accept_test(residual: jax.Array, draft_q: jax.Array, token: jax.Array, coin: jax.Array) -> jax.Array:
    """[B] bool: coin < r(x) / q(x), written coin * q(x) < r(x) (no division; r(x) = 0 never accepts)."""
    r_tok = jnp.take_along_axis(residual, token[:, None], axis=1)[:, 0]
    q_tok = jnp.take_along_axis(draft_q, token[:, None], axis=1)[:, 0]
    return coin * q_tok < r_tok


def _residual_distribution(residual: jax.Array, draft_q: jax.Array) -> jax.Array:
    """norm(max(0, r - q)) [B, V]; keeps r where that mass is zero.

    Zero mass means r <= q everywhere, i.e. r == q; then min(1, r/q) = 1 on the support of q and a
    rejection has probability zero in exact arithmetic (it can only follow float rounding of r/q just
    below 1). Keeping r is the natural limit and costs at most that measure-zero event.
    """
    excess = jnp.maximum(residual - draft_q, 0.0)
    mass = jnp.sum(excess, axis=-1, keepdims=True)
    return jnp.where(mass > 0.0, excess / jnp.where(mass > 0.0, mass, 1.0), residual)


def _sample_next_token(dist: jax.Array, keys: jax.Array, from_residual: jax.Array) -> jax.Array:
    """[B] token ~ dist [B, V], key purpose RESIDUAL where from_residual [B] else BONUS."""
    purpose = jnp.where(from_residual, PURPOSE_RESIDUAL, PURPOSE_BONUS)
    return sample_from_probs(dist, fold_in_rows(keys, purpose))


def _probs_of_node_tokens_at_parents(tree: DraftTree, target_probs: jax.Array) -> jax.Array:
    """[B, N] p_parent(i)(token_i); 0 for the root."""
    parent = jnp.maximum(tree.parent, 0)
    at_parent = jnp.take_along_axis(target_probs, parent[:, :, None], axis=1)  # [B, N, V]
    probs = jnp.take_along_axis(at_parent, tree.tokens[:, :, None], axis=2)[:, :, 0]
    return jnp.where(tree.parent >= 0, probs, 0.0)


def _paths_that_pass(tree: DraftTree, passes: jax.Array, log_probs: jax.Array):
    """Prefix propagation in node order -> (on_path [B, N] bool, path_log_prob [B, N] f32).

    on_path[i] = on_path[parent] & passes[i] (root: True); path_log_prob sums log_probs from the root.
    """

    def visit(c: jax.Array, carry: tuple[jax.Array, jax.Array]):
        on_path, path_lp = carry
        parent = jnp.maximum(tree.parent[:, c], 0)[:, None]
        parent_on = jnp.take_along_axis(on_path, parent, axis=1)[:, 0]
        parent_lp = jnp.take_along_axis(path_lp, parent, axis=1)[:, 0]
        on_path = on_path.at[:, c].set(parent_on & passes[:, c])
        path_lp = path_lp.at[:, c].set(parent_lp + log_probs[:, c])
        return on_path, path_lp

    b, n = tree.tokens.shape
    init = (jnp.zeros((b, n), bool).at[:, 0].set(True), jnp.zeros((b, n), jnp.float32))
    return jax.lax.fori_loop(1, n, visit, init)


def _deepest_best(tree: DraftTree, on_path: jax.Array, path_log_prob: jax.Array) -> jax.Array:
    """[B] the deepest on-path node, ties by largest path_log_prob, then lowest index."""
    best_depth = jnp.max(jnp.where(on_path, tree.depth, -1), axis=1, keepdims=True)
    score = jnp.where(on_path & (tree.depth == best_depth), path_log_prob, -jnp.inf)
    return jnp.argmax(score, axis=1).astype(jnp.int32)


def _verify_greedy(
    tree: DraftTree, target_probs: jax.Array, candidate: jax.Array
) -> tuple[jax.Array, jax.Array]:
    argmax = first_argmax(target_probs)  # [B, N]
    parent_argmax = jnp.take_along_axis(argmax, jnp.maximum(tree.parent, 0), axis=1)
    passes = candidate & (tree.tokens == parent_argmax)
    on_path, _ = _paths_that_pass(tree, passes, jnp.zeros(passes.shape, jnp.float32))
    last = _deepest_best(tree, on_path, jnp.zeros(passes.shape, jnp.float32))
    return last, jnp.take_along_axis(argmax, last[:, None], axis=1)[:, 0]


def _verify_typical(
    tree: DraftTree,
    target_probs: jax.Array,
    keys: jax.Array,
    candidate: jax.Array,
    posterior_threshold: float,
    posterior_alpha: float,
) -> tuple[jax.Array, jax.Array]:
    plogp = jnp.where(target_probs > 0, target_probs * jnp.log(jnp.maximum(target_probs, 1e-38)), 0.0)
    entropy = -jnp.sum(plogp, axis=-1)  # [B, N]
    threshold = jnp.minimum(posterior_threshold, posterior_alpha * jnp.exp(-entropy))
    parent_threshold = jnp.take_along_axis(threshold, jnp.maximum(tree.parent, 0), axis=1)
    token_probs = _probs_of_node_tokens_at_parents(tree, target_probs)
    passes = candidate & (token_probs > parent_threshold)
    log_probs = jnp.log(jnp.maximum(token_probs, 1e-38))
    on_path, path_log_prob = _paths_that_pass(tree, passes, log_probs)
    last = _deepest_best(tree, on_path, path_log_prob)
    probs_at_last = jnp.take_along_axis(target_probs, last[:, None, None], axis=1)[:, 0]
    next_token = _sample_next_token(probs_at_last, keys, jnp.zeros(last.shape, bool))
    return last, next_token


def _result_from_last_node(
    tree: DraftTree, last: jax.Array, next_token: jax.Array, max_depth: int
) -> VerifyResult:
    """Climb from the last accepted node [B] to the root and lay the path out by depth."""
    batch = last.shape[0]
    slots = jnp.arange(max_depth + 1, dtype=jnp.int32)[None, :]

    def climb(_: jax.Array, carry: tuple[jax.Array, jax.Array]):
        path, node = carry
        safe = jnp.maximum(node, 0)[:, None]
        depth = jnp.take_along_axis(tree.depth, safe, axis=1)
        path = jnp.where((slots == depth) & (node >= 0)[:, None], node[:, None], path)
        parent = jnp.take_along_axis(tree.parent, safe, axis=1)[:, 0]
        return path, jnp.where(node >= 0, parent, -1)

    path0 = jnp.full((batch, max_depth + 1), -1, jnp.int32)
    path, _ = jax.lax.fori_loop(0, max_depth + 1, climb, (path0, last.astype(jnp.int32)))
    num_accepted = jnp.take_along_axis(tree.depth, last[:, None], axis=1)[:, 0].astype(jnp.int32)
    drafted = path[:, 1:]
    tokens = jnp.take_along_axis(tree.tokens, jnp.maximum(drafted, 0), axis=1)
    accepted_tokens = jnp.where(drafted >= 0, tokens, -1).astype(jnp.int32)
    return VerifyResult(
        path=path,
        num_accepted=num_accepted,
        next_token=next_token.astype(jnp.int32),
        accepted_tokens=accepted_tokens,
    )
