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

protocol     the Drafter protocol, RoundContext (what a drafter sees each round), root_token
make         make_drafter(model, spec) -> (drafter, draft_params): the one entry the engine calls
ngram        prompt lookup (n-gram) drafting, NgramDrafter
draft_model  an independent smaller Llama as drafter, DraftModelDrafter
lookup_first prompt lookup beside a head's chain or tree (SpecConfig.lookup_min_match), LookupFirstDrafter
tree_build   static (Medusa) and dynamic (EAGLE-2) tree builders, tree presets
policy       batch-aware speculation policy (how much to draft at a batch size, and when not to)
heads/       draft heads: one subpackage per family (medusa, eagle, mtp), their registry
"""
