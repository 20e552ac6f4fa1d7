"""`make_drafter(model, spec)`: the drafter (static) and its parameters (traced) for a SpecConfig; the
drafter protocol is in `jaxspec.drafters.protocol` (and the package docstring)."""

from __future__ import annotations

import dataclasses
from typing import Any

from jaxspec.config import SpecConfig
from jaxspec.drafters.datastore import load_table
from jaxspec.drafters.draft_model import DraftModelDrafter, load_draft_model
from jaxspec.drafters.heads import registry
from jaxspec.drafters.heads.eagle.drafter import EagleDrafter
from jaxspec.drafters.heads.shipped import resolve_datastore
from jaxspec.drafters.lookup_first import LookupFirstDrafter
from jaxspec.drafters.ngram import NgramDrafter
from jaxspec.drafters.protocol import Drafter
from jaxspec.errors import InputError


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
    drafter, params = registry.make_head_drafter(model, spec)
    if spec.lookup_min_match or spec.datastore:
        branch = spec.topk > 1  # a dynamic tree (SpecConfig checked the method): the lookup is a branch
        if not branch and drafter.num_nodes != drafter.max_depth + 1:  # a Medusa tree from 'tree_preset'
            raise InputError(
                f"SpecConfig.lookup_min_match needs a head chain; this {spec.method} spec drafts a tree of "
                f"{drafter.num_nodes} nodes"
            )
        shortest = spec.lookup_min_match
        longest = max(shortest, spec.ngram_max)
        separate = bool(dict(spec.extra).get("datastore_separate", False))
        if isinstance(drafter, EagleDrafter) and (spec.branch_tokens or 0) > drafter.depth:
            drafter = dataclasses.replace(drafter, max_accept=spec.branch_tokens)  # commits the longer paths
        drafter = LookupFirstDrafter(
            head=drafter, min_match=shortest, max_match=longest, branch=branch,
            datastore=spec.datastore is not None, separate=separate, branch_tokens=spec.branch_tokens,
        )  # fmt: skip
        if spec.datastore is not None:
            path = resolve_datastore(model.source, spec.datastore)
            table = load_table(path, spec.datastore_max_match, model.config.vocab_size)
            params = (params, table)
    return drafter, params
