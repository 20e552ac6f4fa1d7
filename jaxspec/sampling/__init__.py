"""Sampling: logits processing, stateless PRNG keys, rejection sampling over draft trees, the tree.

processors  `process_logits`, `sample_from_probs`, `sample_logits`, `first_argmax`, `SamplingArrays`
keys        `round_key`, `derive_key`, `fold_in_rows`, the PURPOSE_* constants
verify      `verify_tree`, `VerifyResult`, `VERIFY_MODES`
tree        `DraftTree` (tokens, parents, depths, q), its ancestor mask and positions

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

from jaxspec.sampling.keys import (
    PURPOSE_ACCEPT,
    PURPOSE_BONUS,
    PURPOSE_DRAFT,
    PURPOSE_RESIDUAL,
    derive_key,
    fold_in_rows,
    round_key,
)
from jaxspec.sampling.processors import (
    SamplingArrays,
    first_argmax,
    process_logits,
    sample_from_probs,
    sample_logits,
)
from jaxspec.sampling.verify import VERIFY_MODES, VerifyResult, verify_tree

__all__ = [
    "PURPOSE_ACCEPT",
    "PURPOSE_BONUS",
    "PURPOSE_DRAFT",
    "PURPOSE_RESIDUAL",
    "VERIFY_MODES",
    "SamplingArrays",
    "VerifyResult",
    "derive_key",
    "first_argmax",
    "fold_in_rows",
    "process_logits",
    "round_key",
    "sample_from_probs",
    "sample_logits",
    "verify_tree",
]
