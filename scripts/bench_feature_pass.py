"""Time the features stage's target pass with and without the full-vocabulary argmax.

    .venv/bin/python scripts/bench_feature_pass.py [--width 256] [--batches 8,16] [--repeats 3]

One compiled program per (batch, variant), random tokens at one width, median of `repeats` timed calls
after a warm-up: "with argmax" is what `write_features` runs by default (features + the target's LM
head over its whole vocabulary at every position), "no argmax" what it runs with `argmax_from_data`
(`jaxspec train --feature-argmax data`, the default for a greedy data set).
"""

from __future__ import annotations

import argparse
import time


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--width", type=int, default=256)
    parser.add_argument("--batches", default="8,16")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()

    import jax
    import jax.numpy as jnp
    import numpy as np

    import jaxspec
    from jaxspec.drafters.heads.configs import default_eagle3_layers
    from jaxspec.model.kv_cache import KVCache
    from jaxspec.train.features import _jit_features, _jit_features_and_argmax

    model = jaxspec.load(args.model)
    capture = tuple(default_eagle3_layers(model.config.num_layers))
    for batch in (int(b) for b in args.batches.split(",")):
        cache = KVCache.zeros(model.config, batch, args.width, model.dtype)
        rng = np.random.default_rng(0)
        tokens = jnp.asarray(rng.integers(0, model.config.vocab_size, (batch, args.width)), jnp.int32)
        for name, program in (("with argmax", _jit_features_and_argmax), ("no argmax", _jit_features)):

            def call(program=program, tokens=tokens, cache=cache):
                return jax.block_until_ready(
                    program(model.graphdef, model.params, tokens, config=model.config,
                            capture_layers=capture, cache=cache)
                )  # fmt: skip

            call()
            times = []
            for _ in range(args.repeats):
                start = time.perf_counter()
                call()
                times.append(time.perf_counter() - start)
            median = sorted(times)[len(times) // 2]
            print(f"batch {batch} width {args.width} {name}: {median:.2f} s per batch, "
                  f"{batch / median * 60:.0f} sequences/min, {batch * args.width / median:.0f} tokens/s",
                  flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
