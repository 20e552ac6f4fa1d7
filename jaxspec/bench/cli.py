"""`jaxspec bench` and `jaxspec advise` (registered through FEATURE_COMMANDS in jaxspec/cli.py)."""

from __future__ import annotations

import argparse
import json
import os
import platform
import shlex
import sys
from pathlib import Path
from typing import Any


def _ints(text: str) -> list[int]:
    try:
        return [int(x) for x in text.split(",") if x.strip()]
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from exc


def _heads(text: str) -> dict[str, str]:
    out = {}
    for item in (t.strip() for t in text.split(",")):
        method, sep, path = item.partition("=")
        if item and (not sep or not path):
            raise argparse.ArgumentTypeError(f"expected METHOD=PATH, got {item!r}")
        if item:
            out[method] = path
    return out


def _add_common(p: argparse.ArgumentParser, *, methods: str, lengths: str, batches: str, new: int, reps: int):
    p.add_argument("--model", default="smollm2-135m", help="model name, .gguf file or HF directory")
    p.add_argument("--prompts", required=True, help="JSONL file, one {'id': ..., 'prompt': ...} per line")
    p.add_argument("--limit", type=int, default=None, help="use only the first N prompts")
    p.add_argument("--no-chat", action="store_true", help="do not apply the chat template")
    p.add_argument(
        "--methods", default=methods,
        help="comma list of ar,ngram,draft_model,medusa,eagle,eagle3,mtp; METHOD:2/4 = own draft lengths",
    )  # fmt: skip
    p.add_argument("--draft-lengths", type=_ints, default=_ints(lengths), help="chain lengths γ, e.g. 2,4,6")
    p.add_argument("--tree-sizes", type=_ints, default=[], help="tree node budgets for tree drafting")
    p.add_argument(
        "--lookup-min-match", type=_ints, default=[],
        help="also run each head chain (and eagle / eagle3 / mtp tree) with prompt lookup beside the head "
        "(SpecConfig.lookup_min_match) at each of these minimum match lengths, e.g. 2,3",
    )  # fmt: skip
    p.add_argument(
        "--token-map", default=None, metavar="FILE|shipped",
        help="also run each eagle / mtp variant drafting over this token map (SpecConfig.token_map, "
        "FR-Spec; 'shipped' = the model's configs/heads/MODEL/token_map.npy)",
    )  # fmt: skip
    p.add_argument(
        "--datastore", default=None, metavar="DIR|shipped",
        help="also run each eagle / eagle3 / mtp tree with this distilled data set's n-gram chain merged "
        "in, alone and beside each --lookup-min-match (SpecConfig.datastore; 'shipped' = "
        "configs/distilled/MODEL)",
    )  # fmt: skip
    p.add_argument(
        "--branch-tokens", type=_ints, default=[], metavar="L,...",
        help="run each lookup / datastore tree variant with its merged chain at each of these lengths "
        "(SpecConfig.branch_tokens; label suffix ', branch L'); default: the tree's depth",
    )  # fmt: skip
    p.add_argument("--tree-topk", type=int, default=4, help="children per node for tree variants")
    p.add_argument("--tree-depth", type=int, default=4, help="draft depth for tree variants")
    p.add_argument(
        "--draft-num-layers", type=int, default=4,
        help="draft_model without --draft-model: the target truncated to its first N layers",
    )  # fmt: skip
    p.add_argument("--draft-model", default=None, help="draft_model: another same-vocabulary model")
    p.add_argument(
        "--heads", type=_heads, default={},
        help="head checkpoints, e.g. eagle=DIR,medusa=DIR (default: configs/heads/MODEL/METHOD when it "
        "exists; otherwise a method runs a random head)",
    )  # fmt: skip
    p.add_argument("--acceptance", default="exact", choices=("exact", "greedy", "typical_lossy"))
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--batch-sizes", type=_ints, default=_ints(batches))
    p.add_argument("--max-new-tokens", type=int, default=new)
    p.add_argument("--repeats", type=int, default=reps)
    p.add_argument("--step-iters", type=int, default=10, help="steps per timed compiled loop")
    p.add_argument("--out-dir", default=None, help="write bench.md, bench.json and PNG plots here")
    p.add_argument(
        "--compile-cache", default=None,
        help="JAX persistent compilation cache directory, or 'off' (default: $JAXSPEC_COMPILE_CACHE, else "
        "~/.cache/jaxspec/xla; `jaxspec.compile_cache`)",
    )  # fmt: skip


def add_parser(subparsers) -> None:
    """Register `bench` and `advise`."""
    bench = subparsers.add_parser("bench", help="measure τ, acceptance, draft cost and speedup per method")
    _add_common(bench, methods="ar,ngram", lengths="2,4,6", batches="1", new=128, reps=3)
    bench.add_argument(
        "--peer", action=argparse.BooleanOptionalAction, default=None,
        help="also run Hugging Face transformers (greedy and prompt lookup); default: when installed",
    )  # fmt: skip
    bench.add_argument(
        "--peer-threads",
        type=int,
        default=None,
        help="torch threads (default: 1 or all CPUs, whichever is faster now)",
    )
    bench.add_argument(
        "--peer-lookup-tokens", type=_ints, default=None,
        help="prompt_lookup_num_tokens values for transformers (default: the ngram draft lengths)",
    )  # fmt: skip
    advise = subparsers.add_parser(
        "advise", help="short calibration run -> method, draft length, batch cut-off"
    )
    every_method = "ar,ngram,draft_model,medusa,eagle,eagle3,mtp"
    _add_common(advise, methods=every_method, lengths="2,4", batches="1,4", new=64, reps=1)
    advise.set_defaults(peer=False, peer_threads=None, peer_lookup_tokens=[])
    advise.add_argument(
        "--min-gain", type=float, default=1.05, help="speedup a method must reach to be advised"
    )


def _command_line(args: argparse.Namespace) -> str:
    tail = sys.argv[1:]
    if tail[:1] != [args.command]:
        tail = [args.command, *tail]
    return "jaxspec " + " ".join(shlex.quote(a) for a in tail)


def _environment(peer: bool) -> str:
    import jax

    cpus = len(os.sched_getaffinity(0))
    text = f"jax {jax.__version__} on {jax.default_backend()} ({platform.machine()}, {cpus} CPUs visible)"
    if peer:
        import torch
        import transformers

        threads = torch.get_num_threads()
        text += f"; transformers {transformers.__version__}, torch {torch.__version__} ({threads} threads)"
    return text + "."


def _default_heads(model: str, given: dict[str, str]) -> dict[str, str]:
    """--heads, completed with the heads shipped in configs/heads/MODEL/METHOD (found from the package)."""
    from jaxspec.config import HEAD_METHODS
    from jaxspec.drafters.heads.shipped import shipped_head

    heads = dict(given)
    for method in HEAD_METHODS:
        shipped = shipped_head(model, method)
        if method not in heads and shipped is not None:
            heads[method] = shipped
    return heads


def _partial_writer(out_dir: str | None):
    """After each repeat: the raw result so far to OUT_DIR/bench.partial.json (None without out_dir)."""
    if not out_dir:
        return None

    def write(raw: dict[str, Any]) -> None:
        path = Path(out_dir) / "bench.partial.json"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(raw, default=str), encoding="utf-8")

    return write


def _benchmark(args: argparse.Namespace) -> tuple[dict[str, Any], dict[str, Any]]:
    import jaxspec
    from jaxspec.bench import runner
    from jaxspec.bench.peer import load_peer, peer_available
    from jaxspec.bench.summary import summarize
    from jaxspec.loading.registry import resolve_model_path

    log = lambda msg: print(msg, file=sys.stderr, flush=True)  # noqa: E731
    model = jaxspec.load(args.model)
    prompts = runner.read_prompts(args.prompts, model, chat=not args.no_chat, limit=args.limit)
    methods = runner.parse_methods(args.methods, args.draft_lengths)
    use_peer = peer_available() if args.peer is None else args.peer
    if use_peer and not peer_available():
        raise SystemExit("jaxspec bench: --peer needs torch, transformers and accelerate installed")
    lookup = args.peer_lookup_tokens
    if lookup is None:
        lookup = next((list(lengths) for name, lengths in methods if name == "ngram"), [])
    variants, skipped = runner.build_variants(
        methods, tree_sizes=args.tree_sizes, tree_topk=args.tree_topk, tree_depth=args.tree_depth,
        draft_num_layers=None if args.draft_model else args.draft_num_layers, acceptance=args.acceptance,
        lookup_min_matches=args.lookup_min_match, token_map=args.token_map, datastore=args.datastore,
        branch_tokens=args.branch_tokens,
        peer_lookup_tokens=lookup, peer=use_peer, draft_model=args.draft_model,
        heads=_default_heads(args.model, args.heads),
    )  # fmt: skip
    runnable = []
    for variant in variants:
        reason = runner.available(model, variant)
        if reason is None and args.command == "advise" and variant.label.endswith("(random head)"):
            reason = f"no trained head given (--heads {variant.method}=DIR); a random head cannot be advised"
        if reason is None:
            runnable.append(variant)
        else:
            skipped.append({"label": variant.label, "reason": reason})
            log(f"skipping {variant.label}: {reason}")
    peer = (
        load_peer(resolve_model_path(args.model), model.eos_token_ids, args.peer_threads)
        if use_peer
        else None
    )
    raw = runner.run_benchmark(
        model, prompts, runnable, batch_sizes=args.batch_sizes, max_new_tokens=args.max_new_tokens,
        repeats=args.repeats, sampling=jaxspec.SamplingParams(temperature=args.temperature), peer=peer,
        step_iters=args.step_iters, log=log, checkpoint=_partial_writer(args.out_dir),
    )  # fmt: skip
    raw["skipped"] = skipped
    raw["environment"] = _environment(use_peer)
    raw["settings"]["model"] = args.model
    raw["settings"]["prompts"] = str(args.prompts)
    return raw, summarize(raw)


def run(args: argparse.Namespace) -> int:
    """Dispatch on args.command ("bench" or "advise")."""
    from jaxspec.bench.report import markdown, write_report

    raw, summary = _benchmark(args)
    command = _command_line(args)
    if args.command == "advise":
        from jaxspec.bench.advise import advise

        print(advise(summary, min_gain=args.min_gain).text())
    else:
        print(markdown(raw, summary, command))
    if args.out_dir:
        paths = write_report(raw, summary, args.out_dir, command)
        (Path(args.out_dir) / "bench.partial.json").unlink(missing_ok=True)
        print("wrote " + ", ".join(str(p) for p in paths.values()), file=sys.stderr)
    return 0
