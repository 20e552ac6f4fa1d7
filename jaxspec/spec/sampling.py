"""Logits processing, stateless PRNG keys and rejection sampling over draft trees.

One home for every random decision of a generation:

* `process_logits` turns logits into the processed distribution (temperature, top-k, top-p). Draft and
  target both call it, so every acceptance test compares like with like (DESIGN invariant 2).
* `round_key` / `derive_key` / `fold_in_rows` derive every key with `fold_in` from
  (seed, request, round, purpose[, node]) (invariant 4).
* `verify_tree` walks a `DraftTree` and returns the accepted path plus one corrected-or-bonus token:
  "greedy" (argmax match), "exact" (lossless multi-candidate rejection sampling, invariant 1) or
  "typical_lossy" (Medusa's typical acceptance: faster, NOT distribution preserving).

Key discipline (no key is ever reused). The key of one random draw is

    key(seed) -> fold_in(request_id) -> fold_in(round_idx) -> fold_in(PURPOSE_*) [-> fold_in(node)]

* seed and request_id separate requests, so a row draws the same numbers alone or in any batch;
* round_idx separates rounds of one request (the caller gives every round its own index);
* the purpose separates the kinds of draw inside a round (drafting, accept coins, the next token);
* the node index separates draws of one purpose inside a round: drafters fold in the node (or depth)
  they sample, `verify_tree` folds in the child index of each accept coin. Every child is tested at
  most once per round and exactly one next token is drawn per round (with PURPOSE_RESIDUAL if the last
  accepted node had a rejected child, else PURPOSE_BONUS), so each derived key feeds one draw.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp

from jaxspec.config import SamplingParams
from jaxspec.spec.tree import DraftTree

# Purposes: the last fold_in before an (optional) node index. Distinct small ints, never reused.
PURPOSE_DRAFT = 1  # draft tokens sampled by a drafter (fold in the node / depth index next)
PURPOSE_ACCEPT = 2  # accept coins of exact verification (the child index is folded in next)
PURPOSE_RESIDUAL = 3  # next token drawn from the residual after a rejection
PURPOSE_BONUS = 4  # next token drawn from the full target distribution (no rejection at the last node)

VERIFY_MODES = ("greedy", "exact", "typical_lossy")


# ----------------------------------------------------------------------------------------------------
# Per-row sampling parameters
# ----------------------------------------------------------------------------------------------------


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class SamplingArrays:
    """Per-row logits-processing parameters, so one compiled program serves mixed requests.

    temperature: [B] float32, 0 = greedy (one-hot at the argmax).
    top_k:       [B] int32, 0 = disabled.
    top_p:       [B] float32 in (0, 1], 1 = disabled.
    """

    temperature: jax.Array
    top_k: jax.Array
    top_p: jax.Array

    @classmethod
    def from_params(cls, params: SamplingParams | Sequence[SamplingParams], batch: int) -> SamplingArrays:
        """One SamplingParams for every row, or a list with exactly `batch` entries (one per row)."""
        rows = [params] * batch if isinstance(params, SamplingParams) else list(params)
        if len(rows) != batch:
            raise ValueError(f"SamplingArrays.from_params: got {len(rows)} SamplingParams for batch {batch}")
        return cls(
            temperature=jnp.asarray([p.temperature for p in rows], jnp.float32).reshape(batch),
            top_k=jnp.asarray([p.top_k for p in rows], jnp.int32).reshape(batch),
            top_p=jnp.asarray([p.top_p for p in rows], jnp.float32).reshape(batch),
        )


# ----------------------------------------------------------------------------------------------------
# Logits processing
# ----------------------------------------------------------------------------------------------------


@jax.jit
def process_logits(logits: jax.Array, sampling: SamplingArrays) -> jax.Array:
    """Logits [B, ..., V] -> processed probabilities [B, ..., V] float32 (rows sum to 1).

    Per row b (parameters broadcast over the middle axes): divide by temperature, keep the top_k
    largest logits (all tokens tied with the k-th are kept), then keep the nucleus: the smallest set of
    most probable tokens whose probability (under the top-k renormalised distribution) reaches top_p;
    the most probable token is always kept and tokens tied with the last kept one are kept too.
    Renormalise. Rows with temperature 0 give a one-hot at the argmax of the raw logits (first index on
    ties). Parameters are traced: no recompilation for new values.

    Batch invariance by construction (DESIGN invariant 4): a row's output depends only on its own
    logits and parameters, never on which path the batch takes. For speed, batch-wide `lax.cond`s pick
    the work (on CPU a full sort of a 49152-wide vocabulary costs ~20 ms per row): no top-k / top-p in
    the batch -> a softmax only; every filtering row decided within the 64 largest values -> one
    `lax.top_k` per filter; otherwise an exact 32-step radix search over the float bit patterns. The
    paths give bit-identical rows: top-k thresholds are the k-th largest value on both, and the nucleus
    mass is summed in 2^-30 fixed point (integer sums, exact in any order) on both, so a nucleus that
    lands within float rounding of top_p is decided the same way. Do not `vmap` this function: under
    vmap the conds run both branches.
    """
    batch, vocab = logits.shape[0], logits.shape[-1]
    flat = logits.astype(jnp.float32).reshape(batch, -1, vocab)
    per_row = flat.shape[1]
    flat = flat.reshape(batch * per_row, vocab)

    def per_flat_row(values: jax.Array) -> jax.Array:
        return jnp.repeat(values, per_row, total_repeat_length=batch * per_row)

    temperature = per_flat_row(sampling.temperature.astype(jnp.float32))
    greedy = temperature <= 0.0
    top_k = jnp.where(greedy, 0, per_flat_row(sampling.top_k.astype(jnp.int32)))
    top_p = jnp.where(greedy, 1.0, per_flat_row(sampling.top_p.astype(jnp.float32)))

    scaled = flat / jnp.where(greedy, 1.0, temperature)[:, None]
    probs = _filtered_softmax(scaled, top_k, top_p)
    one_hot = jax.nn.one_hot(first_argmax(flat), vocab, dtype=jnp.float32)
    probs = jnp.where(greedy[:, None], one_hot, probs)
    return probs.reshape(logits.shape)


def _filtered_softmax(scaled: jax.Array, top_k: jax.Array, top_p: jax.Array) -> jax.Array:
    """scaled [R, V] f32, top_k [R] (0 = off), top_p [R] (1 = off) -> probs [R, V]."""
    vocab = scaled.shape[-1]
    use_top_k = (top_k > 0) & (top_k < vocab)
    keep_k = jax.lax.cond(
        jnp.any(use_top_k),
        lambda: _top_k_keep(scaled, top_k, use_top_k),
        lambda: jnp.ones(scaled.shape, dtype=bool),
    )
    probs = jax.nn.softmax(jnp.where(keep_k, scaled, -jnp.inf), axis=-1)
    use_top_p = top_p < 1.0
    keep_p = jax.lax.cond(
        jnp.any(use_top_p),
        lambda: _top_p_keep(probs, top_p, use_top_p),
        lambda: jnp.ones(scaled.shape, dtype=bool),
    )
    probs = jnp.where(keep_p, probs, 0.0)
    return probs / jnp.sum(probs, axis=-1, keepdims=True)


# Thresholds come from the `_CANDIDATES` largest values (one `lax.top_k`) when every filtering row of
# the batch is decided inside them, else from an exact radix search over the whole vocabulary.
_CANDIDATES = 64


def _top_k_keep(scaled: jax.Array, top_k: jax.Array, use: jax.Array) -> jax.Array:
    """[R, V] bool: logits >= the k-th largest logit of the row (ties kept); all True where ~use."""
    num_candidates = min(_CANDIDATES, scaled.shape[-1])

    def from_candidates() -> jax.Array:
        largest = jax.lax.top_k(scaled, num_candidates)[0]  # [R, C] descending
        index = jnp.clip(top_k - 1, 0, num_candidates - 1)[:, None]
        return scaled >= jnp.take_along_axis(largest, index, axis=1)

    def from_radix_search() -> jax.Array:
        bits = _order_preserving_bits(scaled)
        threshold = _largest_threshold(bits, lambda keep: jnp.sum(keep, axis=-1) >= top_k)
        return bits >= threshold[:, None]

    fits = jnp.all(~use | (top_k <= num_candidates))
    return jax.lax.cond(fits, from_candidates, from_radix_search) | ~use[:, None]


# Nucleus masses are summed as integers in units of 2^-30 (a probability <= 1 is <= 2^30, a row's total
# stays below 2^31): integer addition is exact in any order, so every path reaches the same decision.
_MASS_UNIT = 2.0**30


def _top_p_keep(probs: jax.Array, top_p: jax.Array, use: jax.Array) -> jax.Array:
    """[R, V] bool: the nucleus, probs >= the largest threshold whose kept mass reaches top_p [R].

    Masses are fixed point (`_MASS_UNIT`): a row's nucleus reaches top_p when its mass is at least
    ceil(top_p * the row's total mass), the same integers on the candidate path and the radix path.
    """
    num_candidates = min(_CANDIDATES, probs.shape[-1])
    mass = jnp.round(probs * _MASS_UNIT).astype(jnp.int32)  # [R, V]
    need = jnp.ceil(top_p * jnp.sum(mass, axis=-1).astype(jnp.float32)).astype(jnp.int32)  # [R]
    largest = jax.lax.top_k(probs, num_candidates)[0]  # [R, C] descending
    largest_mass = jnp.round(largest * _MASS_UNIT).astype(jnp.int32)
    mass_through = jnp.cumsum(largest_mass, axis=-1)

    def from_candidates() -> jax.Array:
        kept = jnp.sum(mass_through - largest_mass < need[:, None], axis=-1)  # mass before a token < need
        index = jnp.clip(kept - 1, 0, num_candidates - 1)[:, None]
        return probs >= jnp.take_along_axis(largest, index, axis=1)

    def from_radix_search() -> jax.Array:
        bits = jax.lax.bitcast_convert_type(probs, jnp.uint32)  # non-negative floats keep their order

        def enough(keep: jax.Array) -> jax.Array:
            return jnp.sum(jnp.where(keep, mass, 0), axis=-1) >= need

        return bits >= _largest_threshold(bits, enough)[:, None]

    fits = jnp.all(~use | (mass_through[:, -1] >= need))
    return jax.lax.cond(fits, from_candidates, from_radix_search) | ~use[:, None]


def _order_preserving_bits(x: jax.Array) -> jax.Array:
    """float32 -> uint32 with the same order (negative floats flipped, positive ones shifted up).

    -0.0 is mapped like +0.0 first, so `bits >= t` keeps exactly what the float comparison keeps.
    """
    bits = jax.lax.bitcast_convert_type(jnp.where(x == 0.0, 0.0, x), jnp.uint32)
    negative = (bits >> 31) == 1
    return jnp.where(negative, ~bits, bits | jnp.uint32(0x80000000))


def _largest_threshold(bits: jax.Array, enough: Callable[[jax.Array], jax.Array]) -> jax.Array:
    """Largest t [R] uint32 with enough(bits >= t) true, bit by bit from the top (radix select).

    bits: [R, V] uint32; enough: keep mask [R, V] -> [R] bool, monotone (true for the full mask).
    """

    def try_bit(i: jax.Array, threshold: jax.Array) -> jax.Array:
        candidate = threshold | (jnp.uint32(1) << (31 - i).astype(jnp.uint32))
        return jnp.where(enough(bits >= candidate[:, None]), candidate, threshold)

    return jax.lax.fori_loop(0, 32, try_bit, jnp.zeros(bits.shape[:1], jnp.uint32))


# ----------------------------------------------------------------------------------------------------
# Keys and sampling
# ----------------------------------------------------------------------------------------------------


@jax.jit
def fold_in_rows(keys: jax.Array, data: jax.Array | int) -> jax.Array:
    """keys [B] (typed key array), data [B] or scalar int -> [B] keys, row b = fold_in(keys[b], data[b])."""
    data = jnp.broadcast_to(jnp.asarray(data, jnp.int32), keys.shape)
    return jax.vmap(jax.random.fold_in)(keys, data)


@jax.jit
def round_key(seed: jax.Array, request_id: jax.Array, round_idx: jax.Array | int) -> jax.Array:
    """[B] keys of one round: key(seed[b]) -> fold_in(request_id[b]) -> fold_in(round_idx[b]).

    seed, request_id: [B] int32; round_idx: [B] or scalar int32. `verify_tree` takes these round keys.
    """
    seed = jnp.asarray(seed, jnp.int32)
    request_id = jnp.broadcast_to(jnp.asarray(request_id, jnp.int32), seed.shape)
    round_idx = jnp.broadcast_to(jnp.asarray(round_idx, jnp.int32), seed.shape)
    base = jax.vmap(jax.random.key)(seed)
    return fold_in_rows(fold_in_rows(base, request_id), round_idx)


@jax.jit
def derive_key(seed: jax.Array, request_id: jax.Array, round_idx: jax.Array | int, purpose: int) -> jax.Array:
    """[B] keys for one purpose of one round: fold_in(round_key(seed, request_id, round_idx), purpose).

    Sub-keys per node / depth: `fold_in_rows(derive_key(...), node_index)`.
    """
    return fold_in_rows(round_key(seed, request_id, round_idx), purpose)


def first_argmax(x: jax.Array) -> jax.Array:
    """x [..., V] -> [...] int32 index of the largest value along the last axis, first one on ties
    (`jnp.argmax` for finite x). Two plain reductions (max, then the lowest index holding it): XLA:CPU
    vectorises them, where its fused (value, index) argmax reduction took ~1 ms per 49152-wide row."""
    top = jnp.max(x, axis=-1, keepdims=True)
    index = jnp.arange(x.shape[-1], dtype=jnp.int32)
    return jnp.min(jnp.where(x == top, index, x.shape[-1]), axis=-1)


@jax.jit
def sample_from_probs(probs: jax.Array, keys: jax.Array) -> jax.Array:
    """probs [B, V] (rows sum to 1), keys [B] -> [B] int32 tokens, exact (Gumbel-max on log probs).

    Zero-probability tokens have log prob -inf and are never drawn, so a one-hot row returns its token.
    When every row of the batch has a single nonzero entry (greedy rows, one-hot residuals) a batch-wide
    `lax.cond` returns those tokens without drawing Gumbel noise over the vocabulary: the same tokens.
    """
    probs = probs.astype(jnp.float32)
    all_one_hot = jnp.all(jnp.sum(probs > 0.0, axis=-1) == 1)
    return jax.lax.cond(
        all_one_hot,
        lambda: first_argmax(probs),
        lambda: jax.vmap(jax.random.categorical)(keys, jnp.log(probs)).astype(jnp.int32),
    )


def sample_logits(logits: jax.Array, sampling: SamplingArrays, keys: jax.Array) -> jax.Array:
    """logits [B, V], keys [B] -> [B] int32 tokens: `sample_from_probs(process_logits(logits,
    sampling), keys)`, the same tokens.

    When every row of the batch is greedy (temperature 0), a batch-wide `lax.cond` takes the first
    argmax of the raw logits directly, which is the token that path gives a greedy row (its processed
    row is the one-hot at that argmax): no softmax, one-hot or second argmax over the [B, V] vocabulary
    (~14 ms of a 64-row SmolLM2 decode step on this CPU). A batch with any sampled row takes the full
    path, so a row's token never depends on its neighbours.
    """
    return jax.lax.cond(
        jnp.all(sampling.temperature <= 0.0),
        lambda: first_argmax(logits),
        lambda: sample_from_probs(process_logits(logits, sampling), keys),
    )


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
        slots = jnp.arange(self.path.shape[1])[None, :]
        padded = jnp.concatenate([self.accepted_tokens, jnp.full_like(self.next_token[:, None], -1)], 1)
        return jnp.where(slots == self.num_accepted[:, None], self.next_token[:, None], padded)


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
