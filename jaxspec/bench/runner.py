"""Run every requested method on a prompt set in one process: warm-up (compile excluded), step
costs, then repeats in which the methods take turns on each batch of prompts, so that machine noise
hits them alike. Produces the raw result that `summary.summarize` reduces.
"""

from __future__ import annotations

import dataclasses
import json
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from jaxspec.config import HEAD_METHODS, LOOKUP_TREE_METHODS, TOKEN_MAP_METHODS, SamplingParams, SpecConfig
from jaxspec.drafters.heads.shipped import RANDOM_HEAD
from jaxspec.errors import InputError, JaxspecError
from jaxspec.model.buckets import batch_bucket, length_bucket

SPEC_METHODS = ("ngram", "draft_model", "medusa", "eagle", "eagle3", "mtp")
CHAIN_ONLY = ("draft_model",)
BASELINE = "ar"
PEER_AR = "transformers"


@dataclasses.dataclass(frozen=True)
class Variant:
    """One benchmarked configuration. engine "jaxspec" (spec None = autoregressive) or "transformers"
    (lookup_tokens None = greedy, else prompt lookup with that many tokens)."""

    label: str
    method: str
    spec: SpecConfig | None = None
    draft_length: int | None = None
    tree_size: int | None = None
    engine: str = "jaxspec"
    lookup_tokens: int | None = None

    def describe(self) -> dict[str, Any]:
        return {
            "label": self.label,
            "method": self.method,
            "engine": self.engine,
            "draft_length": self.draft_length,
            "tree_size": self.tree_size,
            "spec": dataclasses.asdict(self.spec) if self.spec else None,
            "own_baseline": PEER_AR if self.engine == "transformers" else BASELINE,
        }


@dataclasses.dataclass(frozen=True)
class PromptSet:
    """Prompts as token ids (chat template already applied), their ids and categories."""

    ids: tuple[str, ...]
    token_ids: tuple[tuple[int, ...], ...]
    categories: tuple[str, ...]


def category_of(prompt_id: str) -> str:
    """Category of a prompt id: up to its last underscore ("summ_03" -> "summ"), else the whole id."""
    return prompt_id.rsplit("_", 1)[0] if "_" in prompt_id else prompt_id


def read_prompts(path: str | Path, model, *, chat: bool = True, limit: int | None = None) -> PromptSet:
    """JSONL lines {"id": ..., "prompt": ...}; the model's chat template is applied unless chat=False."""
    path = Path(path)
    if not path.is_file():
        raise InputError(f"{path}: prompt file not found")
    ids, tokens = [], []
    for line_no, line in enumerate(path.read_text(encoding="utf-8").splitlines(), start=1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
            prompt_id, text = str(row["id"]), row["prompt"]
        except (json.JSONDecodeError, KeyError, TypeError) as exc:
            raise InputError(
                f"{path}:{line_no}: expected a JSON object with 'id' and 'prompt' ({exc})"
            ) from exc
        if not isinstance(text, str) or not text:
            raise InputError(f"{path}:{line_no}: 'prompt' must be a non-empty string")
        if chat and model.tokenizer is not None and model.tokenizer.chat_template is not None:
            tokens.append(tuple(model.chat_prompt([{"role": "user", "content": text}])))
        else:
            tokens.append(tuple(model.tokenizer.encode(text)))
        ids.append(prompt_id)
        if limit is not None and len(ids) >= limit:
            break
    if not ids:
        raise InputError(f"{path}: no prompts")
    return PromptSet(ids=tuple(ids), token_ids=tuple(tokens), categories=tuple(category_of(i) for i in ids))


def parse_methods(text: str, draft_lengths: Sequence[int]) -> list[tuple[str, tuple[int, ...]]]:
    """Parse --methods: "ar,ngram,draft_model:4/6" ->
    [("ar", ()), ("ngram", draft_lengths), ("draft_model", (4, 6))]."""
    out = []
    for item in (t.strip() for t in text.split(",")):
        if not item:
            continue
        name, _, lengths = item.partition(":")
        if name not in (BASELINE, *SPEC_METHODS):
            raise InputError(
                f"--methods: unknown method {name!r} (known: {BASELINE}, {', '.join(SPEC_METHODS)})"
            )
        if name == BASELINE:
            out.append((name, ()))
            continue
        try:
            own = tuple(int(x) for x in lengths.split("/")) if lengths else tuple(draft_lengths)
        except ValueError as exc:
            raise InputError(f"--methods: bad draft lengths in {item!r} (use e.g. ngram:2/4)") from exc
        out.append((name, own))
    return out


def build_variants(
    methods: Sequence[tuple[str, Sequence[int]]],
    *,
    tree_sizes: Sequence[int] = (),
    tree_topk: int = 4,
    tree_depth: int = 4,
    draft_num_layers: int | None = None,
    acceptance: str = "exact",
    lookup_min_matches: Sequence[int] = (),
    token_map: str | None = None,
    datastore: str | None = None,
    branch_tokens: Sequence[int] = (),
    peer_lookup_tokens: Sequence[int] = (),
    peer: bool = False,
    draft_model: str | None = None,
    heads: dict[str, str] | None = None,
) -> tuple[list[Variant], list[dict[str, str]]]:
    """Variants in run order (the autoregressive baseline first) and the skipped ones with reasons.

    draft_model: name or path of the draft_model method's model (None: the target itself, truncated to
    draft_num_layers layers). heads: method -> head checkpoint for medusa / eagle / eagle3 / mtp (a
    method without one runs a seeded random head: its c is real, its acceptance is not).
    lookup_min_matches: each head chain and EAGLE / EAGLE-3 / MTP tree also runs with
    `SpecConfig.lookup_min_match` at each of these (labels "METHOD γ=K, lookup ≥ n", "METHOD tree N (...),
    lookup ≥ n": the tree then has K more nodes, the lookup's chain merged in). token_map: every eagle / mtp
    variant also runs drafting over this token map (SpecConfig.token_map; label suffix ", token map").
    datastore: each EAGLE / EAGLE-3 / MTP tree also runs with this datastore's chain merged in, alone and
    beside each lookup minimum (SpecConfig.datastore; label suffix ", datastore"). branch_tokens: those
    lookup / datastore tree variants run with their merged chain at each of these lengths instead of
    the tree's depth (SpecConfig.branch_tokens; label suffix ", branch L")."""
    heads = heads or {}
    variants = [Variant(label=BASELINE, method=BASELINE)]
    skipped: list[dict[str, str]] = []
    for name, lengths in methods:
        if name == BASELINE:
            continue
        if name == "draft_model":
            extra = {"draft_num_layers": draft_num_layers, "head": draft_model}
            suffix = (f", {draft_model}" if draft_model else "") + (
                f", {draft_num_layers} layers" if draft_num_layers else ""
            )
        elif name == "ngram":
            extra, suffix = {}, ""
        else:
            extra = {"head": heads.get(name) or RANDOM_HEAD}
            suffix = "" if heads.get(name) else " (random head)"
        for gamma in lengths:
            spec = SpecConfig(method=name, num_speculative_tokens=gamma, acceptance=acceptance, **extra)
            variants.append(Variant(f"{name} γ={gamma}{suffix}", name, spec, draft_length=gamma))
            for match in lookup_min_matches if name in HEAD_METHODS else ():
                hybrid = dataclasses.replace(spec, lookup_min_match=match)
                variants.append(
                    Variant(f"{name} γ={gamma}, lookup ≥ {match}{suffix}", name, hybrid, draft_length=gamma)
                )
        for size in tree_sizes:
            shape = f"{name} tree {size} (top-{tree_topk}, depth {tree_depth})"
            label = f"{shape}{suffix}"
            if name in CHAIN_ONLY:
                skipped.append({"label": label, "reason": f"{name} drafts chains only"})
                continue
            spec = SpecConfig(
                method=name, num_speculative_tokens=tree_depth, topk=tree_topk, num_draft_tokens=size,
                acceptance=acceptance, **extra,
            )  # fmt: skip
            variants.append(Variant(label, name, spec, draft_length=tree_depth, tree_size=size))
            merged = [(match, None) for match in lookup_min_matches]  # (lookup minimum, datastore)
            merged += [(match, datastore) for match in [0, *lookup_min_matches]] if datastore else []
            for match, store in merged if name in LOOKUP_TREE_METHODS else ():
                for length in branch_tokens or [None]:
                    hybrid = dataclasses.replace(
                        spec, lookup_min_match=match, datastore=store, branch_tokens=length
                    )  # fmt: skip
                    what = (f", lookup ≥ {match}" if match else "") + (", datastore" if store else "")
                    what += f", branch {length}" if length else ""
                    label = f"{shape}{what}{suffix}"
                    variants.append(Variant(label, name, hybrid, draft_length=tree_depth, tree_size=size))
        if token_map is not None and name in TOKEN_MAP_METHODS:
            mine = [v for v in variants if v.method == name and v.spec is not None]
            variants.extend(
                dataclasses.replace(
                    v, label=v.label + ", token map", spec=dataclasses.replace(v.spec, token_map=token_map)
                )
                for v in mine
            )
    if peer:
        variants.append(Variant(label=PEER_AR, method="transformers", engine="transformers"))
        for k in peer_lookup_tokens:
            variants.append(
                Variant(
                    f"transformers prompt lookup {k}",
                    "transformers_lookup",
                    draft_length=k,
                    engine="transformers",
                    lookup_tokens=k,
                )  # fmt: skip
            )
    return variants, skipped


def available(model, variant: Variant) -> str | None:
    """None when the variant can run, else why not (e.g. its draft head module does not exist yet)."""
    if variant.spec is None:
        return None
    from jaxspec.drafters.make import make_drafter

    try:
        make_drafter(model, variant.spec)
    except (ImportError, NotImplementedError, JaxspecError, FileNotFoundError, ValueError) as exc:
        return f"{type(exc).__name__}: {exc}"
    return None


def batches_of(prompts: PromptSet, batch_size: int) -> list[list[int]]:
    """Consecutive prompt indices in groups of batch_size (the last group may be smaller)."""
    n = len(prompts.ids)
    return [list(range(i, min(i + batch_size, n))) for i in range(0, n, batch_size)]


def shape_key(prompts: PromptSet, indices: Sequence[int]) -> tuple[int, int]:
    """(batch bucket, prompt-length bucket): calls with equal keys share a compiled program."""
    return batch_bucket(len(indices)), length_bucket(max(len(prompts.token_ids[i]) for i in indices))


def run_benchmark(
    model,
    prompts: PromptSet,
    variants: Sequence[Variant],
    *,
    batch_sizes: Sequence[int] = (1,),
    max_new_tokens: int = 128,
    repeats: int = 3,
    sampling: SamplingParams | None = None,
    peer=None,
    step_iters: int = 10,
    log: Callable[[str], None] = print,
    checkpoint: Callable[[dict[str, Any]], None] | None = None,
) -> dict[str, Any]:
    """Warm up every (variant, shape bucket), measure step costs, then `repeats` interleaved passes.

    Returns the raw result (see summary.py): variants with step costs and warm-up (compile) seconds,
    one run record per generate call, the baseline label and the settings. `checkpoint`, if given,
    receives the raw result so far after every repeat (a long run killed midway keeps its data).
    """
    import jaxspec

    sampling = sampling or SamplingParams()
    if any(v.engine == "transformers" for v in variants) and peer is None:
        raise ValueError("run_benchmark: transformers variants need a loaded peer")

    def call(variant: Variant, indices: Sequence[int]) -> list[dict[str, Any]]:
        if variant.engine == "transformers":
            (i,) = indices
            return [peer.generate(prompts.token_ids[i], max_new_tokens, variant.lookup_tokens)]
        completions = jaxspec.generate(
            model, [list(prompts.token_ids[i]) for i in indices], max_new_tokens=max_new_tokens,
            sampling=sampling, spec=variant.spec,
        )  # fmt: skip
        return [{**c.stats, "token_ids": c.token_ids} for c in completions]

    def sizes_for(variant: Variant) -> list[int]:
        # transformers batches need padding-aware generation: the peer runs at batch size 1 only
        return [1] if variant.engine == "transformers" else list(batch_sizes)

    described = {v.label: {**v.describe(), "compile_s": 0.0, "step_costs": None} for v in variants}
    for variant in variants:
        for b in sizes_for(variant):
            seen: set[tuple[int, int]] = set()
            for indices in batches_of(prompts, b):
                key = shape_key(prompts, indices)
                if key in seen:
                    continue
                seen.add(key)
                start = time.perf_counter()
                call(variant, indices)
                took = time.perf_counter() - start
                described[variant.label]["compile_s"] += took
                log(f"warm-up {variant.label} batch {key[0]} prompt bucket {key[1]}: {took:.1f}s")

    by_length = sorted(range(len(prompts.ids)), key=lambda i: len(prompts.token_ids[i]))
    median_prompt = by_length[len(by_length) // 2]
    for variant in variants:
        if variant.engine != "jaxspec":
            continue
        from jaxspec.bench.step_costs import measure_step_costs

        costs = measure_step_costs(
            model, variant.spec, prompts.token_ids[median_prompt], max_new_tokens=max_new_tokens,
            sampling_params=sampling, iters=step_iters,
        )  # fmt: skip
        described[variant.label]["step_costs"] = costs.to_dict()
        log(
            f"step costs {variant.label}: decode {1e3 * costs.decode_s:.1f} ms, verify "
            f"{1e3 * costs.verify_s:.1f} ms ({costs.num_nodes} nodes), draft {1e3 * costs.draft_s:.2f} ms, "
            f"c = {costs.c:.3f}"
        )

    runs: list[dict[str, Any]] = []
    raw = {
        "baseline": BASELINE,
        "variants": list(described.values()),
        "runs": runs,
        "settings": {
            "batch_sizes": list(batch_sizes),
            "max_new_tokens": max_new_tokens,
            "repeats": repeats,
            "sampling": dataclasses.asdict(sampling),
            "num_prompts": len(prompts.ids),
            "step_cost_prompt": prompts.ids[median_prompt],
        },
    }
    for repeat in range(repeats):
        for b in batch_sizes:
            for chunk_no, indices in enumerate(batches_of(prompts, b)):
                order = [v for v in variants if b in sizes_for(v)]
                shift = (repeat + chunk_no) % len(order)  # rotate who goes first
                for variant in order[shift:] + order[:shift]:
                    stats = call(variant, indices)
                    runs.append({
                        "label": variant.label, "batch_size": b, "repeat": repeat,
                        "prompt_ids": [prompts.ids[i] for i in indices],
                        "categories": [prompts.categories[i] for i in indices], "stats": stats,
                    })  # fmt: skip
            log(f"repeat {repeat + 1}/{repeats} batch size {b} done")
        if checkpoint is not None:
            checkpoint(raw)
    return raw
