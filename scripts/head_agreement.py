"""Teacher-forced agreement of draft heads with the target on the target's own greedy responses.

    python scripts/head_agreement.py docs/bench/heads configs/heads/smollm2-135m/eagle3 [more heads]
    python scripts/head_agreement.py --by-category docs/bench/heads HEAD_DIR   # also per prompt category

Reads the autoregressive outputs that `jaxspec bench --out-dir OUT_DIR` recorded (the target's greedy
responses to the benchmark's prompts) and, for each head, runs its training objective over them in one
batch: depth-j top-1 agreement with the target's argmax, as the trainer logs it (EAGLE-3: within its
draft vocabulary). Also prints, for EAGLE-3 heads, the share of response tokens inside the draft
vocabulary (a token outside it can never be drafted). Separates what a head predicts from what a
verify round costs: acceptance at depth 1 is about agreement x coverage. --by-category adds one line per
prompt category (the dev prompt ids' prefix: chat, code, fact, summ).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out_dir", help="directory holding bench.json with an 'ar' variant")
    parser.add_argument("heads", nargs="+", help="head directories (jaxspec_head.json)")
    parser.add_argument("--by-category", action="store_true", help="also per prompt category (id prefix)")
    args = parser.parse_args(argv)

    import jax
    import jax.numpy as jnp
    import numpy as np

    import jaxspec
    from jaxspec.bench.runner import read_prompts
    from jaxspec.drafters.heads.configs import Eagle3Config, EagleConfig, MedusaConfig
    from jaxspec.model.kv_cache import KVCache
    from jaxspec.train.export import load_saved_head
    from jaxspec.train.features import pack_sequences, target_features
    from jaxspec.train.losses import Objective
    from jaxspec.train.trainer import split_trainable

    bench = json.loads((Path(args.out_dir) / "bench.json").read_text())["raw"]
    settings = bench["settings"]
    model = jaxspec.load(settings["model"])
    prompts = read_prompts(settings["prompts"], model, chat=True)
    prompt_ids = dict(zip(prompts.ids, prompts.token_ids, strict=True))
    rows = [
        {
            "prompt_ids": list(prompt_ids[pid]),
            "response_ids": stats["token_ids"],
            "category": pid.split("_")[0],
        }
        for run in bench["runs"]
        if run["label"] == "ar"
        for pid, stats in zip(run["prompt_ids"], run["stats"], strict=True)
    ]
    if not rows:
        print(f"{args.out_dir}/bench.json has no autoregressive ('ar') outputs", file=sys.stderr)
        return 2
    length = -(-max(len(r["prompt_ids"]) + len(r["response_ids"]) for r in rows) // 16) * 16
    packed = pack_sequences(rows, length)
    response_tokens = np.concatenate([r["response_ids"] for r in rows])
    features = jax.jit(target_features, static_argnames=("graphdef", "config", "capture_layers"))
    cache = KVCache.zeros(model.config, len(rows), length, model.dtype)
    target_outputs = {}  # capture layers -> (hidden, layers)
    print(f"{len(rows)} responses, {response_tokens.size} tokens ({args.out_dir}/bench.json)")
    for directory in args.heads:
        head = load_saved_head(directory, model.dtype)
        config = head.config
        # The depths each shipped head was trained for (EAGLE-1 predicts one step per pass).
        depth = {EagleConfig: 1, Eagle3Config: 3, MedusaConfig: getattr(config, "num_heads", 3)}.get(
            type(config), 2
        )
        objective = Objective(head.graphdef, config, model.graphdef, model.config, depth=depth,
                              num_positions=length)  # fmt: skip
        if objective.capture_layers not in target_outputs:  # one target forward per capture set
            target_outputs[objective.capture_layers] = features(
                model.graphdef, model.params, jnp.asarray(packed["tokens"]), config=model.config,
                capture_layers=objective.capture_layers, cache=cache,
            )  # fmt: skip
        hidden, layers = target_outputs[objective.capture_layers]
        batch = {k: jnp.asarray(v) for k, v in packed.items()} | {"hidden": hidden}
        if layers is not None:
            batch["layers"] = layers
        trainable, fixed_head = split_trainable(head.params)
        agree = jax.jit(
            lambda t, f, p, b, o=objective: o(
                {"head": t}, {"target": p, "head_fixed": f}, b, jax.random.key(0)
            )[1]["depth_acc"]
        )
        agreement = agree(trainable, fixed_head, model.params, batch)
        line = f"{directory}: agreement by depth {' / '.join(f'{a:.3f}' for a in np.asarray(agreement))}"
        if isinstance(config, Eagle3Config):
            from flax import nnx

            draft_ids = np.asarray(nnx.merge(head.graphdef, head.params).target_ids())
            coverage = np.isin(response_tokens, draft_ids).mean()
            vocab = config.draft_vocab_size
            line += f" (within the draft vocabulary of {vocab}; it holds {coverage:.3f} of the tokens)"
        print(line, flush=True)
        if args.by_category:
            categories = [r["category"] for r in rows]
            for category in sorted(set(categories)):
                take = np.asarray([i for i, c in enumerate(categories) if c == category])
                subset = jax.tree.map(lambda x, take=take: x[take], batch)
                by_depth = np.asarray(agree(trainable, fixed_head, model.params, subset))
                print(f"  {category} ({take.size} responses): {' / '.join(f'{a:.3f}' for a in by_depth)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
