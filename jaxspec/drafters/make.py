"""Drafters: who proposes the draft tree each round.

A drafter is a frozen (hashable) dataclass, static to `jax.jit`, with pure methods; its trainable or
loaded weights travel separately as `draft_params` (a traced pytree), its per-request memory as a
state pytree in the loop carry:

  init(draft_params, target_params, prefill_result, requests, max_len) -> state
  propose(draft_params, target_params, state, ctx: RoundContext) -> (DraftTree with num_nodes nodes, state)
  update(draft_params, target_params, state, ctx, tree, verify_result, features, active) -> state

`features` holds the target's outputs along the accepted path (no second target pass):
  {"hidden": [B, P, d] final hidden states, "captured": tuple of [B, P, d] chosen layer outputs},
path entry j being the j-th committed node (root first).
"""

from __future__ import annotations

from typing import Any

from jaxspec.config import SpecConfig
from jaxspec.drafters.draft_model import DraftModelDrafter, load_draft_model
from jaxspec.drafters.heads import registry
from jaxspec.drafters.ngram import NgramDrafter
from jaxspec.drafters.protocol import Drafter


def make_drafter(model, spec: SpecConfig) -> tuple[Drafter, Any]:
    """Build the drafter (static) and its parameters (traced) for `spec`."""
    if spec.method == "ngram":
        drafter = NgramDrafter(
            num_tokens=spec.num_speculative_tokens, ngram_min=spec.ngram_min, ngram_max=spec.ngram_max,
            num_branches=spec.topk,
        )  # fmt: skip
        return drafter, ()
    if spec.method == "draft_model":
        draft = load_draft_model(model, spec)
        drafter = DraftModelDrafter(
            graphdef=draft.graphdef, config=draft.config, num_tokens=spec.num_speculative_tokens
        )  # fmt: skip
        return drafter, draft.params
    return registry.make_head_drafter(model, spec)
