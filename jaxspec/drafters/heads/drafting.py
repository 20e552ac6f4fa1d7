"""What every head drafter shares: draft distributions, the sampled-chain and dynamic-tree draft loops,
and the logits hook.

Draft distributions always come from `sampling.process_logits` with the request's own parameters (the
processor the target side uses, DESIGN invariant 2):
  * chains sample each draft from its processed distribution q with the key
    fold_in(round draft key, depth) and record q in the tree (q_probs), so exact verification is lossless;
  * trees (static Medusa trees, EAGLE-2 dynamic trees) pick drafts deterministically (top-k), q_probs
    None. Their ranking scores are log q for sampled rows (tokens the processor removes score -inf and
    are never drafted) and the raw log-softmax for greedy rows (whose q is one-hot).

Draft parameters: {"head": the head's parameters, "hook": the hook's parameters (() without hook),
"token_map": `token_map_params` (() without a token map)}.

Logits hook: a drafter may carry a static, hashable `logits_hook(hook_params, logits, predicted_index)
-> logits`, applied to every draft logits array before processing; predicted_index holds, with the
shape of logits[..., 0], the history index of the token those logits predict (the root sits at index
cache_lengths, a depth-d draft at cache_lengths + d). Its data lives in draft_params["hook"], so new
data never recompiles. `ForcedTokens` plants an oracle (tests, acceptance upper bounds); pass hooks to
`jaxspec.drafters.heads.registry.make_head_drafter`.

Draft vocabulary: a head whose LM head covers a subset of the target vocabulary (EAGLE-3) drafts over
that subset (`DraftVocabulary`): processing, ranking, top-k and sampling run over its V_d entries and
the chosen indices map to target ids, as EAGLE-3's reference drafts with `d2t`; a chain's q is put
back on the target vocabulary (zero outside) for verification. The same distributions and, with
ascending ids, the same greedy tokens and tie-breaks as processing the target-vocabulary logits that
are -inf outside the subset, without V-wide passes per draft step. Heads that draft through the
target's LM head (EAGLE-1, MTP) can draft over a token map the same way (SpecConfig.token_map,
FR-Spec): their logits are the LM head's rows of the map's tokens only (`token_map_logits`).

The drafter classes live in the families' subpackages: medusa/drafter.py, eagle/drafter.py, mtp/drafter.py.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol

import jax
import jax.numpy as jnp
import numpy as np

from jaxspec import sampling
from jaxspec.drafters.protocol import RoundContext
from jaxspec.drafters.tree_build import (
    FrontierExpansion,
    expand_frontier,
    root_frontier,
    select_dynamic_tree,
    stack_candidates,
)
from jaxspec.errors import InputError
from jaxspec.model.llama import project
from jaxspec.sampling.tree import DraftTree, chain_tree


class LogitsHook(Protocol):
    def __call__(self, params: Any, logits: jax.Array, predicted_index: jax.Array) -> jax.Array: ...


def apply_hook(
    hook: LogitsHook | None, draft_params: dict, logits: jax.Array, predicted_index: jax.Array
) -> jax.Array:
    """logits [B, ..., V]; predicted_index broadcastable to [B, ...]."""
    if hook is None:
        return logits
    index = jnp.broadcast_to(predicted_index, logits.shape[:-1]).astype(jnp.int32)
    return hook(draft_params["hook"], logits, index)


@dataclasses.dataclass(frozen=True)
class DraftVocabulary:
    """The entries of a head's draft logits as target tokens: ids [V_d] int32, ascending target ids
    (draft index i is target token ids[i]), out of a target vocabulary of `size` tokens."""

    ids: jax.Array
    size: int

    def tokens(self, index: jax.Array) -> jax.Array:
        """Draft indices [...] -> target token ids [...] int32."""
        return self.ids[index].astype(jnp.int32)

    def on_target(self, probs: jax.Array) -> jax.Array:
        """probs [..., V_d] -> [..., size]: the same distribution over the target vocabulary."""
        full = jnp.zeros(probs.shape[:-1] + (self.size,), probs.dtype)
        return full.at[..., self.ids].set(probs)


def read_token_map(path: str | Path, vocab_size: int) -> np.ndarray:
    """A token map file (SpecConfig.token_map): a .npy of distinct target token ids in [0, vocab_size)
    -> those ids sorted ascending, int32 (ascending ids keep greedy tie-breaks as the whole vocabulary
    has them). Raises InputError naming the file and what is wrong."""
    try:
        ids = np.load(path, allow_pickle=False)
    except (OSError, ValueError) as error:
        raise InputError(f"token map {path}: not a readable .npy file ({error})") from None
    if ids.ndim != 1 or ids.size == 0 or not np.issubdtype(ids.dtype, np.integer):
        raise InputError(
            f"token map {path}: need a non-empty 1-D array of token ids, got {ids.dtype} {ids.shape}"
        )
    if ids.min() < 0 or ids.max() >= vocab_size:
        raise InputError(f"token map {path}: ids must lie in [0, {vocab_size}), got {ids.min()}..{ids.max()}")
    if np.unique(ids).size != ids.size:
        raise InputError(f"token map {path}: {ids.size - np.unique(ids).size} repeated ids")
    return np.sort(ids).astype(np.int32)


def token_map_params(ids: np.ndarray, lm_head_rows: jax.Array) -> dict[str, jax.Array]:
    """draft_params["token_map"] for a drafter with token_map=True: ids [V_d] int32 and the LM head's
    rows of those tokens [V_d, d] (gathered once, so a draft step reads only them)."""
    index = jnp.asarray(ids, jnp.int32)
    return {"ids": index, "rows": jnp.take(lm_head_rows, index, axis=0)}


def token_map_logits(draft_params: dict, hidden: jax.Array) -> jax.Array:
    """hidden [..., d] (after the final norm) -> float32 logits [..., V_d] over the token map's rows."""
    return project(draft_params["token_map"]["rows"], hidden, jnp.float32)


def candidate_scores(logits: jax.Array, params: sampling.SamplingArrays) -> jax.Array:
    """Ranking scores for deterministic (top-k) drafts, logits [B, ..., V] -> [B, ..., V] (see module doc)."""
    probs = sampling.process_logits(logits, params)
    greedy = (params.temperature <= 0.0).reshape((-1,) + (1,) * (logits.ndim - 1))
    raw = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
    return jnp.where(greedy, raw, jnp.log(probs))


def top_tokens(logits: jax.Array, params: sampling.SamplingArrays, k: int) -> jax.Array:
    """[B, ..., k] int32 best tokens by `candidate_scores`, best first."""
    return jax.lax.top_k(candidate_scores(logits, params), k)[1].astype(jnp.int32)


ChainStep = Callable[[Any, jax.Array, jax.Array], tuple[jax.Array, Any]]
TreeStep = Callable[[Any, jax.Array, jax.Array, jax.Array], tuple[jax.Array, Any]]


def sampled_chain(
    root: jax.Array,
    first_logits: jax.Array,
    step: ChainStep,
    carry: Any,
    *,
    depth: int,
    ctx: RoundContext,
    vocab: DraftVocabulary | None = None,
) -> tuple[DraftTree, Any]:
    """Draft a chain of `depth` tokens, each sampled from its processed distribution.

    first_logits [B, V]: the head's logits for the depth-1 draft. step(carry, token [B], k) runs the head
    on the depth-k draft `token` (k = 1..depth-1, traced) and returns (logits [B, V] of depth k + 1,
    carry). The depth-d draft uses key fold_in(ctx.keys, d). Returns (DraftTree with q_probs, carry).
    vocab: the logits are over this draft vocabulary ([B, V_d]); tokens handed to `step` and drafted are
    target ids, q_probs are over the target vocabulary.
    """

    def draw(logits: jax.Array, depth_index) -> tuple[jax.Array, jax.Array]:
        q = sampling.process_logits(logits, ctx.sampling)
        token = sampling.sample_from_probs(q, sampling.fold_in_rows(ctx.keys, depth_index))
        return (token, q) if vocab is None else (vocab.tokens(token), q)

    first, q_first = draw(first_logits, 1)
    drafts, q_probs = first[:, None], q_first[:, None]
    if depth > 1:

        def body(state, k):
            token, inner = state
            logits, inner = step(inner, token, k)
            nxt, q = draw(logits, k + 1)
            return (nxt, inner), (nxt, q)

        (_, carry), (tokens, qs) = jax.lax.scan(body, (first, carry), jnp.arange(1, depth, dtype=jnp.int32))
        drafts = jnp.concatenate([drafts, tokens.T], axis=1)
        q_probs = jnp.concatenate([q_probs, jnp.swapaxes(qs, 0, 1)], axis=1)
    return chain_tree(root, drafts, q_probs if vocab is None else vocab.on_target(q_probs)), carry


def dynamic_tree(
    root: jax.Array,
    root_scores: jax.Array,
    step: TreeStep,
    carry: Any,
    *,
    topk: int,
    num_steps: int,
    num_draft_tokens: int,
    vocab: DraftVocabulary | None = None,
) -> tuple[DraftTree, Any]:
    """EAGLE-2 dynamic tree over `num_steps` expansions (depth = num_steps), `lax.scan` over steps.

    root_scores [B, V]: scores of the root's children. step(carry, tokens [B, topk], source [B, topk], s)
    runs the head on the depth-s frontier (`source`: the depth-(s-1) frontier slot each node descends
    from) and returns (scores of their children [B, topk, V], carry). Returns (DraftTree with
    1 + num_draft_tokens nodes and q_probs None, carry). vocab: the scores are over this draft
    vocabulary ([..., V_d]); the tokens handed to `step` and drafted are target ids.
    """

    def expand(score, pool, scores, s) -> FrontierExpansion:
        grown = expand_frontier(score, pool, scores, topk=topk, step=s)
        if vocab is None:
            return grown
        return dataclasses.replace(
            grown, cand_tokens=vocab.tokens(grown.cand_tokens), next_tokens=vocab.tokens(grown.next_tokens)
        )

    score0, pool0 = root_frontier(root.shape[0])
    first = expand(score0, pool0, root_scores[:, None], 0)
    later = None
    if num_steps > 1:

        def body(state, s):
            tokens, score, pool, source, inner = state
            scores, inner = step(inner, tokens, source, s)
            grown = expand(score, pool, scores, s)
            return (
                grown.next_tokens,
                grown.next_score,
                grown.next_pool_index,
                grown.next_source,
                inner,
            ), grown

        init = (first.next_tokens, first.next_score, first.next_pool_index, first.next_source, carry)
        (*_, carry), later = jax.lax.scan(body, init, jnp.arange(1, num_steps, dtype=jnp.int32))
    tokens, parent, score = stack_candidates(first, later)
    tree = select_dynamic_tree(root, tokens, parent, score, num_draft_tokens, cand_valid=jnp.isfinite(score))
    return tree, carry


class ChainOrDynamicTreeShape:
    """Shape properties of a drafter that drafts a chain of `depth` tokens, or an EAGLE-2 dynamic tree of
    `num_draft_tokens` nodes over `depth` levels (fields of the dataclass that mixes this in)."""

    depth: int
    num_draft_tokens: int | None

    @property
    def is_tree(self) -> bool:
        return self.num_draft_tokens is not None

    @property
    def num_nodes(self) -> int:
        return 1 + (self.num_draft_tokens if self.is_tree else self.depth)

    @property
    def max_depth(self) -> int:
        return self.depth


@dataclasses.dataclass(frozen=True)
class ForcedTokens:
    """A logits hook that makes the head draft given tokens: logits become `margin` * one_hot(table[b, i])
    for predicted index i. With the target's own greedy continuation in the table (history
    coordinates: prompt, then the generated tokens) it is an oracle: every draft is accepted.

    Parameters (`forced_tokens_params`): table [B, T] int32; period: indices divisible by a period > 1
    are left to the head (partial acceptance, for tests); enabled: False leaves every logit alone.
    """

    margin: float = 30.0

    def __call__(self, params: dict, logits: jax.Array, predicted_index: jax.Array) -> jax.Array:
        table = params["table"]
        batch, vocab = logits.shape[0], logits.shape[-1]
        index = jnp.clip(predicted_index.reshape(batch, -1), 0, table.shape[1] - 1)
        forced = jnp.take_along_axis(table, index, axis=1).reshape(predicted_index.shape)
        replaced = self.margin * jax.nn.one_hot(forced, vocab, dtype=jnp.float32)
        period = params["period"]
        own = (period > 1) & (predicted_index % jnp.maximum(period, 1) == 0)
        keep = ~params["enabled"] | own
        return jnp.where(keep[..., None], logits, replaced)


def forced_tokens_params(table, period: int = 0, enabled: bool = True) -> dict:
    """Parameters of `ForcedTokens`: table [B, T] (rows = the batch bucket)."""
    return {
        "table": jnp.asarray(table, jnp.int32),
        "period": jnp.asarray(period, jnp.int32),
        "enabled": jnp.asarray(enabled, bool),
    }
