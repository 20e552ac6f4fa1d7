"""Frozen, hashable configuration dataclasses.

Every config here is a frozen dataclass so it can be a static argument of `jax.jit` (hashable) and
so a compiled program is keyed by exactly the settings that change its shape.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any

import numpy as np

INT32_MAX = 2**31 - 1  # seeds, top_k and request ids travel as int32


@dataclass(frozen=True)
class SamplingParams:
    """Logits processing applied identically to draft and target distributions.

    temperature == 0 means greedy (argmax). top_k == 0 disables top-k; top_p == 1.0 disables top-p.
    """

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0

    def __post_init__(self) -> None:
        if not (isinstance(self.temperature, (int, float)) and 0.0 <= self.temperature < math.inf):
            raise ValueError(
                f"SamplingParams.temperature must be a finite number >= 0, got {self.temperature!r}"
            )
        top_k = self.top_k
        if not (
            isinstance(top_k, (int, np.integer)) and not isinstance(top_k, bool) and 0 <= top_k <= INT32_MAX
        ):
            raise ValueError(f"SamplingParams.top_k must be an integer in [0, {INT32_MAX}], got {top_k!r}")
        if not (0.0 < self.top_p <= 1.0):
            raise ValueError(f"SamplingParams.top_p must be in (0, 1], got {self.top_p}")


def _as_tuples(value: Any) -> Any:
    """JSON lists (nested) -> tuples, so that a value read back from JSON is hashable again."""
    return tuple(_as_tuples(v) for v in value) if isinstance(value, list) else value


# The drafting methods; every one runs in `jaxspec.generate` and in continuous batching.
SPEC_METHODS = ("ngram", "draft_model", "medusa", "eagle", "eagle3", "mtp")
HEAD_METHODS = ("medusa", "eagle", "eagle3", "mtp")
TOKEN_MAP_METHODS = ("eagle", "mtp")  # heads whose drafts go through the target's LM head each step
LOOKUP_TREE_METHODS = ("eagle", "eagle3", "mtp")  # heads whose trees are built per row each round


@dataclass(frozen=True)
class SpecConfig:
    """How speculation runs. `method=None` means plain autoregressive decoding.

    method: "ngram" | "draft_model" | "medusa" | "eagle" | "eagle3" | "mtp" | None
    num_speculative_tokens: draft depth (chain length).
    topk: children per node when drafting a tree (1 = chain).
    num_draft_tokens: tree size kept for verification (dynamic trees); None = chain.
    acceptance: "exact" (lossless, default), "greedy" (argmax match) or "typical_lossy" (Medusa's
        typical acceptance: faster, *not* distribution preserving).
    posterior_threshold, posterior_alpha: typical_lossy accepts a draft token x iff
        p(x) > min(posterior_threshold, posterior_alpha * exp(-entropy(p))): Medusa's names and defaults.
    attention: "auto" | "reference" | "pallas" verify attention implementation.
    lookup_min_match: 0 (default) = off. n >= 1: a row whose last n..max(n, ngram_max) tokens occurred
        earlier in its prompt + output drafts the continuation of that occurrence (prompt lookup):
        with a head's chain, instead of the head's chain that round; with an EAGLE / EAGLE-3 / MTP
        tree (topk > 1), merged into the tree in num_speculative_tokens more nodes (a branch of the
        root, or a continuation of the tree's path that holds its first tokens;
        `drafters.lookup_first.append_branch`). Lossless: the choice reads only the row's history.
        With a chain, 3 drafts best on the dev prompts (a weak match displaces the head's chain); with
        a tree, whose lookup nodes displace nothing, 1 does (README, "Wider EAGLE-3 trees").
    datastore: None (default) = off. A distilled data set directory (or "shipped": the model's
        configs/distilled/MODEL, the target's own answers) read as an n-gram table
        (`drafters.datastore`): with an EAGLE / EAGLE-3 / MTP dynamic tree, a row without a prompt-lookup
        match (every row when lookup_min_match is 0) gets the table's chain of num_speculative_tokens
        merged into its tree instead (the same appended nodes). Lossless: the chain reads only the row's
        history and the fixed table. Built on the host when the drafter is made (~15 s for the shipped
        3 M tokens; cached per process).
    datastore_max_match: the longest n-gram the table holds (8; more context, more keys).
    branch_tokens: with a dynamic tree, the length of the appended prompt-lookup / datastore chain
        (and of the path a round can accept); None (default) = num_speculative_tokens. Those chains
        cost no draft forward, so they may reach deeper than the head's tree: on the dev prompts a
        chain of 10 beside a tree of 22 accepts more than a chain of 6 beside a tree of 26 (both 32 nodes)
        (README, "Deeper lookup branches").
    token_map: eagle (EAGLE-1) and mtp, which draft through the target's LM head: a .npy file of
        target token ids (or "shipped": the model's shipped map, configs/heads/MODEL/token_map.npy) that
        the draft ranks and samples over, FR-Spec's frequency-ranked draft vocabulary (SGLang's
        --speculative-token-map). A draft step then reads those rows of the LM head only. Lossless:
        the chain's q is zero outside the map and the verify is unchanged. None (default) = the whole
        vocabulary. EAGLE-3 heads always draft over their own draft vocabulary.
    """

    method: str | None = None
    num_speculative_tokens: int = 4
    topk: int = 1
    num_draft_tokens: int | None = None
    acceptance: str = "exact"
    posterior_threshold: float = 0.09
    posterior_alpha: float = 0.3
    ngram_min: int = 1
    ngram_max: int = 4
    # head methods: a head checkpoint dir, None = the head shipped for the model, "random" = seeded random
    # head; draft_model: a draft model name/path (None = the target itself)
    head: str | None = None
    draft_num_layers: int | None = None  # draft_model: keep only the first N layers (self-drafting)
    tree_choices: tuple[tuple[int, ...], ...] | None = None  # static (Medusa-style) tree
    attention: str = "auto"
    lookup_min_match: int = 0
    token_map: str | None = None
    datastore: str | None = None
    datastore_max_match: int = 8
    branch_tokens: int | None = None
    extra: tuple[tuple[str, Any], ...] = field(default=())

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> SpecConfig:
        """Accept vLLM-style dicts: {"method": "ngram", "num_speculative_tokens": 5, ...}, and the
        JSON form of `dataclasses.asdict(spec)` (lists back to the tuples a hashable config holds)."""
        aliases = {
            "prompt_lookup_min": "ngram_min",
            "prompt_lookup_max": "ngram_max",
            "model": "head",
            "draft_tree_size": "num_draft_tokens",
            # reports written before the rename held min(typical_epsilon, typical_delta * exp(-H))
            "typical_epsilon": "posterior_threshold",
            "typical_delta": "posterior_alpha",
        }
        known = {f.name for f in dataclasses.fields(cls)}
        kwargs: dict[str, Any] = {}
        for key, value in d.items():
            name = aliases.get(key, key)
            if name not in known:
                raise ValueError(f"SpecConfig: unknown field {key!r} (known: {sorted(known)})")
            if name == "tree_choices" and value is not None:
                value = tuple(tuple(int(i) for i in path) for path in value)
            if name == "extra":  # a mapping, or (key, value) pairs as `dataclasses.asdict` + JSON give
                pairs = value.items() if isinstance(value, dict) else value
                value = tuple((str(key), _as_tuples(item)) for key, item in pairs)
            kwargs[name] = value
        return cls(**kwargs)

    def __post_init__(self) -> None:
        if self.method is not None and self.method not in SPEC_METHODS:
            raise ValueError(f"SpecConfig.method must be None or one of {SPEC_METHODS}, got {self.method!r}")
        if self.acceptance not in ("exact", "greedy", "typical_lossy"):
            raise ValueError(
                f"SpecConfig.acceptance must be 'exact', 'greedy' or 'typical_lossy', got {self.acceptance!r}"
            )
        if self.attention not in ("auto", "reference", "pallas"):
            raise ValueError(f"SpecConfig.attention must be auto|reference|pallas, got {self.attention!r}")
        if self.num_speculative_tokens < 1:
            raise ValueError("SpecConfig.num_speculative_tokens must be >= 1")
        if self.topk < 1:
            raise ValueError("SpecConfig.topk must be >= 1")
        if self.lookup_min_match < 0:
            raise ValueError(f"SpecConfig.lookup_min_match must be >= 0, got {self.lookup_min_match}")
        if self.token_map is not None and self.method not in TOKEN_MAP_METHODS:
            raise ValueError(
                f"SpecConfig.token_map restricts the drafts of heads that draft through the target's LM "
                f"head ({', '.join(TOKEN_MAP_METHODS)}), not method {self.method!r}"
            )
        is_chain = self.topk == 1 and self.num_draft_tokens is None and self.tree_choices is None
        dynamic_tree = self.topk > 1 and self.tree_choices is None and self.method in LOOKUP_TREE_METHODS
        if self.datastore is not None and not dynamic_tree:
            raise ValueError(
                f"SpecConfig.datastore merges the datastore's chain into a head's dynamic tree: method must "
                f"be one of {LOOKUP_TREE_METHODS} with topk > 1 and no tree_choices, got method "
                f"{self.method!r}, "
                f"topk {self.topk}, tree_choices {'set' if self.tree_choices else None}"
            )
        if self.datastore_max_match < 1:
            raise ValueError(f"SpecConfig.datastore_max_match must be >= 1, got {self.datastore_max_match}")
        if self.branch_tokens is not None and not (
            dynamic_tree and (self.lookup_min_match or self.datastore is not None)
        ):
            raise ValueError(
                f"SpecConfig.branch_tokens sets the length of the prompt-lookup / datastore chain merged "
                f"into a head's dynamic tree: it needs lookup_min_match >= 1 or a datastore, and method "
                f"one of {LOOKUP_TREE_METHODS} with topk > 1; got method {self.method!r}, topk {self.topk}, "
                f"lookup_min_match {self.lookup_min_match}, datastore {self.datastore!r}"
            )
        if self.branch_tokens is not None and self.branch_tokens < 1:
            raise ValueError(f"SpecConfig.branch_tokens must be >= 1 (or None), got {self.branch_tokens}")
        if self.lookup_min_match and not ((is_chain and self.method in HEAD_METHODS) or dynamic_tree):
            raise ValueError(
                f"SpecConfig.lookup_min_match puts prompt lookup beside a head's draft: method must be one "
                f"of {HEAD_METHODS} with a chain (topk 1, no num_draft_tokens, no tree_choices), or one of "
                f"{LOOKUP_TREE_METHODS} with a dynamic tree (topk > 1, no tree_choices), got method "
                f"{self.method!r}, topk {self.topk}, num_draft_tokens {self.num_draft_tokens}, "
                f"tree_choices {'set' if self.tree_choices else None}"
            )
