"""Re-measure the per-step costs (decode, verify, draft: the c and v columns) of a saved benchmark.

    python scripts/bench_step_costs.py docs/bench/heads

Reads OUT_DIR/bench.json as `jaxspec bench --out-dir OUT_DIR` wrote it, times each jaxspec variant's
steps again on the same prompt (`jaxspec.bench.step_costs.measure_step_costs`), replaces their
`step_costs`, and rewrites the report (bench.md, bench.json, PNGs). Tokens/s, τ and the outputs stay
those of the saved run. Use it when only the step timing changed, e.g. after a fix to how steps are
timed; the report's command line gains a note that says so.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out_dir", help="directory holding bench.json from `jaxspec bench --out-dir`")
    parser.add_argument("--step-iters", type=int, default=10)
    args = parser.parse_args(argv)

    import jaxspec
    from jaxspec.bench.report import write_report
    from jaxspec.bench.runner import read_prompts
    from jaxspec.bench.step_costs import measure_step_costs
    from jaxspec.bench.summary import summarize
    from jaxspec.config import SamplingParams, SpecConfig

    path = Path(args.out_dir) / "bench.json"
    if not path.is_file():
        raise SystemExit(f"{path}: not found (run `jaxspec bench --out-dir {args.out_dir}` first)")
    saved = json.loads(path.read_text())
    raw, settings = saved["raw"], saved["raw"]["settings"]
    model = jaxspec.load(settings["model"])
    prompts = read_prompts(settings["prompts"], model)
    prompt = prompts.token_ids[prompts.ids.index(settings["step_cost_prompt"])]
    sampling = SamplingParams(**settings["sampling"])
    for variant in raw["variants"]:
        if variant["engine"] != "jaxspec":
            continue
        spec = variant["spec"] and SpecConfig.from_dict(variant["spec"])
        costs = measure_step_costs(
            model, spec, prompt, max_new_tokens=settings["max_new_tokens"], sampling_params=sampling,
            iters=args.step_iters,
        )  # fmt: skip
        variant["step_costs"] = costs.to_dict()
        timings = f"decode {1e3 * costs.decode_s:.1f} ms, verify {1e3 * costs.verify_s:.1f} ms"
        shape = f"{costs.num_nodes} nodes, draft {1e3 * costs.draft_s:.2f} ms"
        print(f"{variant['label']}: {timings} ({shape}), v = {costs.verify_over_decode:.2f}", file=sys.stderr)
    command = f"{saved['command']}; step costs re-measured: python scripts/bench_step_costs.py {args.out_dir}"
    write_report(raw, summarize(raw), args.out_dir, command)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
