"""One command for a GPU (or TPU) host: step costs, AR tok/s vs transformers, speculative round times,
kernel sweep, predicted speedups, written to OUT/{results.json,report.md} within ~8 minutes. Installs
nothing; run from the checkout with the host's own jax:

    PYTHONPATH=. python scripts/accelerator_check.py --out docs/bench/accelerator
    PYTHONPATH=. python scripts/accelerator_check.py --smoke --out /tmp/accel   # CPU, tiny shapes, < 90 s

See jaxspec/bench/accelerator.py for what is measured and how.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
from pathlib import Path

# jax must not take 75% of the GPU up front: transformers (torch) shares the device in the same run.
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default="docs/bench/accelerator", help="report folder")
    p.add_argument("--smoke", action="store_true", help="tiny shapes on CPU: the same code path, < 90 s")
    p.add_argument("--budget-s", type=float, default=None, help="wall-clock budget (default 420; smoke 75)")
    p.add_argument("--bench-dir", default="docs/bench", help="CPU benchmarks (*/bench.json) to take τ from")
    p.add_argument("--sections", default=None, help="comma-separated subset of the sections (default: all)")
    p.add_argument("--step-batches", default=None, help="e.g. 1,8,32 (the first is the batch-1 section's)")
    p.add_argument("--step-nodes", default=None, help="tree sizes of the step-time sections, e.g. 1,4,16,64")
    p.add_argument("--kernel-batches", default=None, help="kernel sweep batches, e.g. 1,8,32")
    p.add_argument("--kernel-prefixes", default=None, help="kernel sweep prefixes, e.g. 8192,32768")
    p.add_argument("--kernel-nodes", default=None, help="kernel sweep tree sizes, e.g. 1,4,16,64")
    args = p.parse_args(argv)
    if args.smoke:  # CPU, and cheap compiles: smoke timings mean nothing anyway
        os.environ["JAX_PLATFORMS"] = "cpu"
        fast = "--xla_backend_optimization_level=0 --xla_llvm_disable_expensive_passes=true"
        os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " " + fast).strip()

    import jax

    from jaxspec.bench.accelerator import FULL_PLAN, SECTIONS, SMOKE_PLAN, run_check, write_report

    plan = SMOKE_PLAN if args.smoke else FULL_PLAN
    if args.budget_s is not None:
        plan = dataclasses.replace(plan, budget_s=args.budget_s)
    if args.sections is not None:
        sections = tuple(x for x in args.sections.split(",") if x)
        unknown = sorted(set(sections) - set(SECTIONS))
        if unknown:
            p.error(f"--sections: unknown {unknown}; choose from {', '.join(SECTIONS)}")
        plan = dataclasses.replace(plan, sections=sections)
    for flag in ("step_batches", "step_nodes", "kernel_batches", "kernel_prefixes", "kernel_nodes"):
        value = getattr(args, flag)
        if value is not None:
            try:
                plan = dataclasses.replace(plan, **{flag: tuple(int(x) for x in value.split(",") if x)})
            except ValueError:
                p.error(f"--{flag.replace('_', '-')}: expected comma-separated integers, got {value!r}")
    if not args.smoke and jax.default_backend() == "cpu":
        print("accelerator_check: jax sees no GPU/TPU here; use --smoke for the CPU run", file=sys.stderr)
        return 2
    results = run_check(plan, Path(args.bench_dir))
    command = "python scripts/accelerator_check.py " + " ".join(argv if argv is not None else sys.argv[1:])
    write_report(results, Path(args.out), command.strip())
    print(f"wrote {args.out}/results.json and report.md in {results['elapsed_s']:.0f} s")
    return 1 if results["errors"] else 0


if __name__ == "__main__":
    sys.exit(main())
