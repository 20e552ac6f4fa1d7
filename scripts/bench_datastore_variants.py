"""`jaxspec bench` over a hand-picked list of EAGLE-3 tree variants with the n-gram datastore
(SpecConfig.datastore), as run for docs/bench/heads_tree25_datastore (27th session):

    .venv/bin/python scripts/bench_datastore_variants.py --prompts ../shared/prompts_dev.jsonl \
        --methods ar --max-new-tokens 64 --repeats 1 --no-peer --out-dir docs/bench/heads_tree25_datastore

Arguments are those of `jaxspec bench`; its variant list is replaced by VARIANTS (the datastore chain
as its own branch, "separate", is a drafter option without a SpecConfig field yet: extra).
"""

from __future__ import annotations

import sys
from pathlib import Path

from jaxspec.bench import runner
from jaxspec.bench.runner import Variant
from jaxspec.cli import main
from jaxspec.config import SpecConfig

HEAD = str(Path(__file__).resolve().parent.parent / "configs" / "heads" / "smollm2-135m" / "eagle3")


def tree(size: int, **kw) -> SpecConfig:
    shape = dict(num_speculative_tokens=6, topk=8, num_draft_tokens=size)
    return SpecConfig(method="eagle3", head=HEAD, **shape, **kw)


SHAPE = "eagle3 tree {} (top-8, depth 6)"
VARIANTS = [
    (SHAPE.format(25) + ", lookup ≥ 1", tree(25, lookup_min_match=1), 25),
    (SHAPE.format(25) + ", datastore", tree(25, datastore="shipped"), 25),
    (SHAPE.format(25) + ", lookup ≥ 2, datastore", tree(25, lookup_min_match=2, datastore="shipped"), 25),
    (
        SHAPE.format(19) + ", lookup ≥ 1, datastore separate",
        tree(19, lookup_min_match=1, datastore="shipped", extra=(("datastore_separate", True),)),
        19,
    ),
]


def build_variants(methods, **_):
    variants = [Variant(label="ar", method="ar")]
    for label, spec, size in VARIANTS:
        variants.append(Variant(label, "eagle3", spec, draft_length=6, tree_size=size))
    return variants, []


if __name__ == "__main__":
    runner.build_variants = build_variants
    sys.exit(main(["bench", *sys.argv[1:]]))
