"""Mean accepted length (τ) of draft heads on a prompt set, batched greedy, without timing.

    python scripts/head_tau.py --prompts ../shared/prompts_dev.jsonl \
        --heads shipped=configs/heads/smollm2-135m/eagle3 new=../runs/h33/head_eagle3 [--datastore shipped]
    python scripts/head_tau.py --method eagle --prompts ../shared/prompts_dev.jsonl \
        --heads shipped=configs/heads/smollm2-135m/eagle new=../runs/h36/head_eagle

The quick check between training runs: greedy rows are independent, so a batch of prompts gives the τ
that `jaxspec bench` measures one prompt at a time (the same SpecConfigs: a chain of 3, the tree of 22
(top-8, depth 6) and that tree with the prompt-lookup (≥ 2) / datastore chain of 10 merged into it;
Medusa: its calibrated trees of 15, 31 and 63 paths, top-20, depth 3),
in a few minutes instead of a quarter of an hour. Every variant's tokens are checked against
autoregressive decoding; a row that differs is reported (and the exit status is 1). Prints τ per prompt
category and overall, and writes them as JSON with --out.
"""

from __future__ import annotations

import argparse
import collections
import json
import sys
from pathlib import Path

# (tree sizes, top-k, depth) per method: the shipped EAGLE-3 shapes (README, "Shipped draft heads"), and
# Medusa's calibrated trees over its three heads (the README's Medusa trees benchmark), over the 20 ranks
# its shipped calibration covers since the 36th session (top-10 before).
TREE_SHAPES = {"medusa": ((15, 31, 63), 20, 3)}
DEFAULT_TREE_SHAPE = ((22,), 8, 6)


def variants(
    method: str, head: str, datastore: str | None, lookup_min_match: int, branch_tokens: int,
    tree_topk: int | None = None,
) -> dict:  # fmt: skip
    """Label -> SpecConfig, built by the bench (`jaxspec.bench.runner.build_variants`) with `method`'s
    head: the chain of 3, the trees of TREE_SHAPES (EAGLE-3's shapes for the other methods: the tree of 22,
    top-8, depth 6), and each tree with the lookup-else-datastore chain merged in (the bench's variants
    with only one of the two are left out; a method that drafts chains only, or merges no chain into its
    tree, has fewer)."""
    from jaxspec.bench.runner import build_variants

    sizes, topk, depth = TREE_SHAPES.get(method, DEFAULT_TREE_SHAPE)
    topk = tree_topk or topk
    built, _ = build_variants(
        [(method, (3,))], tree_sizes=sizes, tree_topk=topk, tree_depth=depth,
        lookup_min_matches=(lookup_min_match,), datastore=datastore, branch_tokens=(branch_tokens,),
        heads={method: head},
    )  # fmt: skip
    specs = {v.label: v.spec for v in built if v.spec is not None}
    # neither lookup nor datastore, or both
    return {k: s for k, s in specs.items() if (s.lookup_min_match == 0) == (s.datastore is None)}


def tau_by_category(completions, categories: list[str]) -> dict[str, float]:
    """τ = Σ(new_tokens − 1) / Σ rounds (`jaxspec.bench.metrics`), per category and "all"."""
    from jaxspec.bench.metrics import mean_accepted_length

    groups: dict[str, list[dict]] = collections.defaultdict(list)
    for c, category in zip(completions, categories, strict=True):
        groups[category].append(c.stats)
        groups["all"].append(c.stats)
    return {k: round(mean_accepted_length(v), 4) for k, v in sorted(groups.items())}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", required=True, help="JSONL {id, prompt}; category = id up to its last _")
    parser.add_argument("--heads", nargs="+", required=True, help="NAME=HEAD_DIR (heads of --method)")
    parser.add_argument("--method", default="eagle3", choices=("eagle3", "eagle", "mtp", "medusa"))
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--batch", type=int, default=8, help="prompts per generate call")
    parser.add_argument("--datastore", default="shipped", help="DIR, 'shipped' or 'none'")
    parser.add_argument("--lookup-min-match", type=int, default=2)
    parser.add_argument("--branch-tokens", type=int, default=10)
    parser.add_argument("--tree-topk", type=int, help="the trees' top-k (default: the method's shape)")
    parser.add_argument("--out", type=Path, help="write the figures here as JSON")
    args = parser.parse_args(argv)

    import jaxspec
    from jaxspec.bench.runner import read_prompts

    model = jaxspec.load(args.model)
    prompts = read_prompts(args.prompts, model, chat=True)
    token_lists = [list(t) for t in prompts.token_ids]
    n = len(token_lists)
    batches = [range(i, min(i + args.batch, n)) for i in range(0, n, args.batch)]

    def run(spec) -> list:
        out = []
        for rows in batches:
            out += jaxspec.generate(model, [token_lists[i] for i in rows], args.max_new_tokens, spec=spec)
        return out

    reference = [c.token_ids for c in run(None)]
    datastore = None if args.datastore == "none" else args.datastore
    results, differ = {}, 0
    for name, head in (h.split("=", 1) for h in args.heads):
        for label, spec in variants(
            args.method, head, datastore, args.lookup_min_match, args.branch_tokens, args.tree_topk
        ).items():
            completions = run(spec)
            wrong = [prompts.ids[i] for i, c in enumerate(completions) if c.token_ids != reference[i]]
            differ += len(wrong)
            taus = tau_by_category(completions, list(prompts.categories))
            results[f"{name}: {label}"] = {"tau": taus, "identical": len(completions) - len(wrong)}
            cells = " ".join(f"{k} {v:.3f}" for k, v in taus.items())
            print(f"{name}: {label}: {cells}; identical {len(completions) - len(wrong)}/{len(completions)}"
                  + (f" (differ: {', '.join(wrong)})" if wrong else ""), flush=True)  # fmt: skip
    if args.out:
        settings = vars(args) | {"out": str(args.out)}
        args.out.write_text(json.dumps({"settings": settings, "results": results}, indent=1))
    return 1 if differ else 0


if __name__ == "__main__":
    sys.exit(main())
