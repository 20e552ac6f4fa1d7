"""`jaxspec generate | demo | bench | advise | train`."""

from __future__ import annotations

import argparse
import json
import sys
import time

DEMO_PROMPTS = (
    "Summarize in two sentences: The James Webb Space Telescope is a space telescope designed to conduct "
    "infrared astronomy. Its high-resolution instruments allow it to view objects too old, distant, or "
    "faint for the Hubble Space Telescope.",
    "Write a Python function that checks whether a number is prime.",
    "Rewrite this sentence in a formal tone: hey, the meeting got moved to 3pm, don't be late!",
)


def _spec_from_args(args: argparse.Namespace):
    """SpecConfig from --spec / --head / --num-speculative-tokens / --topk (None: autoregressive).

    A head method (medusa, eagle, eagle3, mtp) without --head uses the head shipped for --model in
    configs/heads/ (found from the package); with neither it is an error (a random head would accept
    nothing): the same rule as the API (`jaxspec.drafters.heads.shipped.resolve_head`)."""
    from jaxspec.config import HEAD_METHODS, LOOKUP_TREE_METHODS, SpecConfig
    from jaxspec.drafters.heads.shipped import shipped_head, shipped_heads_dir
    from jaxspec.errors import InputError

    if args.spec is None or args.spec.strip().lower() in ("none", "off", "ar"):
        return None
    if args.spec.strip().startswith("{"):
        return SpecConfig.from_dict(json.loads(args.spec))
    head = args.head
    if args.spec in HEAD_METHODS and head is None:
        head = shipped_head(args.model, args.spec)
        if head is None:
            raise InputError(
                f"--spec {args.spec}: no trained head for model {args.model!r} in "
                f"{shipped_heads_dir() / args.model / args.spec}; pass --head DIR (see `jaxspec train`)"
            )
    # prompt lookup: in front of any head's chain, or beside an EAGLE / EAGLE-3 / MTP tree (SpecConfig)
    chain_or_tree = args.topk == 1 or args.spec in LOOKUP_TREE_METHODS
    lookup = args.lookup_min_match if args.spec in HEAD_METHODS and chain_or_tree else 0
    return SpecConfig(
        method=args.spec, num_speculative_tokens=args.num_speculative_tokens, topk=args.topk, head=head,
        lookup_min_match=lookup, token_map=args.token_map, datastore=getattr(args, "datastore", None),
        branch_tokens=getattr(args, "branch_tokens", None),
    )  # fmt: skip


def _add_generation_args(
    p: argparse.ArgumentParser,
    *,
    spec_default_help: str = "none",
    default_draft_length: int = 4,
    default_lookup_min_match: int = 0,
) -> None:
    p.add_argument("--model", default="smollm2-135m", help="model name, .gguf file or HF directory")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--spec",
        help="method name (ngram, draft_model, eagle3, ...), a JSON dict, or none (autoregressive); "
        f"default: {spec_default_help}",
    )
    p.add_argument("--head", help="draft head directory (default: the head shipped for --model)")
    p.add_argument("--num-speculative-tokens", type=int, default=default_draft_length)
    p.add_argument("--topk", type=int, default=1, help="branches per node (tree drafting)")
    p.add_argument(
        "--lookup-min-match", type=int, default=default_lookup_min_match,
        help="heads: a row whose last N or more tokens occurred before drafts their continuation "
        "(prompt lookup) instead of the head's chain, or merged into its tree (eagle / eagle3 / mtp, "
        f"--topk > 1); 0 = off (default {default_lookup_min_match})",
    )  # fmt: skip
    p.add_argument(
        "--token-map", metavar="FILE|shipped",
        help="eagle / mtp: draft over these token ids only (a .npy; 'shipped' = the model's, FR-Spec)",
    )  # fmt: skip
    p.add_argument(
        "--datastore", metavar="DIR|shipped",
        help="eagle / eagle3 / mtp trees (--topk > 1): merge the n-gram chain of this distilled data set "
        "(the target's own answers; 'shipped' = configs/distilled/MODEL) into the tree where prompt lookup "
        "finds nothing (SpecConfig.datastore)",
    )  # fmt: skip
    p.add_argument(
        "--branch-tokens", type=int, metavar="L",
        help="eagle / eagle3 / mtp trees with --lookup-min-match or --datastore: the merged chain's length "
        "(default --num-speculative-tokens; SpecConfig.branch_tokens)",
    )  # fmt: skip
    p.add_argument("--no-chat", action="store_true", help="do not apply the chat template")


def _demo_default_spec(model: str) -> str | None:
    """EAGLE-3 when a head is shipped for `model` (the best shipped head on the dev prompts: README,
    "Shipped draft heads"; a chain of 3, the depth it was trained for, with prompt lookup first at
    matches of 3 tokens: `--lookup-min-match`), else autoregressive."""
    from jaxspec.drafters.heads.shipped import shipped_head

    return "eagle3" if shipped_head(model, "eagle3") is not None else None


def _prepare(args: argparse.Namespace, prompts: list[str]):
    """(model, sampling, spec, model inputs) for --prompt / the demo; prints what it loads."""
    import jaxspec

    print(f"loading {args.model} ...", flush=True)
    model = jaxspec.load(args.model)
    try:
        sampling = jaxspec.SamplingParams(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p)
    except ValueError as exc:  # names the parameter: SamplingParams.top_k must be ...
        raise jaxspec.InputError(str(exc)) from None
    try:
        spec = _spec_from_args(args)
    except ValueError as exc:  # names the field: SpecConfig.token_map restricts ...
        raise jaxspec.InputError(str(exc)) from None
    if args.no_chat or model.tokenizer is None or model.tokenizer.chat_template is None:
        inputs = list(prompts)
    else:
        inputs = [model.chat_prompt([{"role": "user", "content": p}]) for p in prompts]
    return model, sampling, spec, inputs


def _describe(spec) -> str:
    if spec is None:
        return "autoregressive"
    shape = f"chain of {spec.num_speculative_tokens}" if spec.topk == 1 else f"tree (top-{spec.topk})"
    where = "first" if spec.topk == 1 else "beside the tree"
    lookup = f", prompt lookup {where} (match >= {spec.lookup_min_match})" if spec.lookup_min_match else ""
    token_map = f", token map {spec.token_map}" if spec.token_map else ""
    datastore = f", datastore {spec.datastore}" if spec.datastore else ""
    branch = f", branch of {spec.branch_tokens}" if spec.branch_tokens else ""
    return f"{spec.method} {shape}{lookup}{token_map}{datastore}{branch}"


class _Printer:
    """Streams a generation to the terminal: `__call__` gets the new tokens so far (from the compiled
    loop's host callback) and prints the text not printed yet."""

    def __init__(self, tokenizer) -> None:
        self.tokenizer, self.ids, self.text = tokenizer, [], ""

    def __call__(self, ids: list[int]) -> None:
        if len(ids) <= len(self.ids):
            return  # a repeated or late (out of order) snapshot
        self.ids = ids
        text = self.tokenizer.decode(ids) if self.tokenizer is not None else " ".join(map(str, ids))
        if text.startswith(self.text):  # else a merge changed earlier text: print once the tail settles
            print(text[len(self.text) :], end="", flush=True)
            self.text = text


def _run_prompts(args: argparse.Namespace, prompts: list[str]) -> None:
    """`jaxspec generate --prompt`: one generation per prompt (no hidden warm-up run), its tokens
    streamed as the compiled loop's steps / rounds finish; the first call of a shape includes its
    compilation, which the printed time says."""
    import jaxspec

    model, sampling, spec, inputs = _prepare(args, prompts)
    head = f", head {spec.head}" if spec is not None and spec.head else ""
    print(f"decoding: {_describe(spec)}{head}\n", flush=True)
    for prompt, inp in zip(prompts, inputs, strict=True):
        print(f"### prompt: {prompt}", flush=True)
        start = time.perf_counter()
        printer = _Printer(model.tokenizer)
        (c,) = jaxspec.generate(
            model, [inp], max_new_tokens=args.max_new_tokens, sampling=sampling, seed=args.seed, spec=spec,
            stream=printer,
        )  # fmt: skip
        elapsed = time.perf_counter() - start
        print(c.text[len(printer.text) :] if c.text.startswith(printer.text) else f"\n{c.text}", end="\n\n")
        line = f"[{len(c.token_ids)} tokens in {elapsed:.2f}s, compilation included"
        if spec is not None:
            line += f", mean accepted length {c.stats['mean_accepted_length']:.2f}"
        print(line + f", finish={c.finish_reason}]\n", flush=True)


def _timed_run(
    model, inp, args: argparse.Namespace, sampling, spec, warm: set
) -> tuple[object, float, float]:
    """(completion, time to first token s, decode tokens/s) of one prompt, compiled programs warmed first.

    TTFT: a one-token call (prefill + first token). Decode rate: the tokens after the first over the
    full call's time minus the TTFT, so prompt processing and compilation are not folded into it."""
    import jaxspec
    from jaxspec.model.buckets import length_bucket

    def run(max_new: int):
        return jaxspec.generate(
            model, [inp], max_new_tokens=max_new, sampling=sampling, seed=args.seed, spec=spec
        )[0]

    key = (length_bucket(len(inp)), _describe(spec))
    if key not in warm:
        print(f"  compiling {key[1]} for prompts of up to {key[0]} tokens ...", flush=True)
        run(1)
        run(args.max_new_tokens)
        warm.add(key)
    start = time.perf_counter()
    run(1)
    ttft = time.perf_counter() - start
    start = time.perf_counter()
    c = run(args.max_new_tokens)
    total = time.perf_counter() - start
    decode = (len(c.token_ids) - 1) / max(total - ttft, 1e-9)
    return c, ttft, decode


def _run_demo(args: argparse.Namespace, prompts: list[str]) -> None:
    """`jaxspec demo`: per prompt, autoregressive decoding and the default drafter side by side (time to
    first token, decode tokens/s, mean accepted length tau, speedup), then a one-line summary."""
    model, sampling, spec, inputs = _prepare(args, prompts)
    methods = [None] if spec is None else [None, spec]
    head = f" (head {spec.head})" if spec is not None and spec.head else ""
    print(f"comparing: {' vs '.join(_describe(m) for m in methods)}{head}\n", flush=True)
    width = max(24, *(len(_describe(m)) for m in methods))
    warm: set = set()
    rows: list[list[tuple[float, float, float]]] = []
    same = 0
    for prompt, inp in zip(prompts, inputs, strict=True):
        print(f"### prompt: {prompt}", flush=True)
        results = [_timed_run(model, inp, args, sampling, m, warm) for m in methods]
        print(f"{results[-1][0].text}\n")
        same += results[0][0].token_ids == results[-1][0].token_ids
        print(f"  {'method':<{width}} {'TTFT':>8} {'decode tok/s':>13} {'tau':>6} {'speedup':>8}")
        row = []
        for m, (c, ttft, decode) in zip(methods, results, strict=True):
            tau = c.stats["mean_accepted_length"] if m is not None else 1.0
            speedup = decode / results[0][2]
            print(f"  {_describe(m):<{width}} {ttft:>7.3f}s {decode:>13.1f} {tau:>6.2f} {speedup:>7.2f}x")
            row.append((ttft, decode, tau))
        rows.append(row)
        print(flush=True)
    n = len(rows)
    prompts_text = f"{n} prompt{'s' if n != 1 else ''}"
    mean = [tuple(sum(r[i][j] for r in rows) / n for j in range(3)) for i in range(len(methods))]
    if spec is None:
        print(
            f"summary: autoregressive, {prompts_text}: TTFT {mean[0][0]:.3f}s, decode {mean[0][1]:.1f} tok/s"
        )
        return
    print(
        f"summary: {_describe(spec)} vs autoregressive, {prompts_text}: decode {mean[1][1]:.1f} vs "
        f"{mean[0][1]:.1f} tok/s ({mean[1][1] / mean[0][1]:.2f}x), mean tau {mean[1][2]:.2f}, TTFT "
        f"{mean[1][0]:.3f}s vs {mean[0][0]:.3f}s; identical outputs {same}/{n}"
        + (" (greedy: speculation is lossless)" if sampling.temperature == 0 else "")
    )


# Subcommands that live with their feature: module path -> that module has
# `add_parser(subparsers) -> None` (registering one or more commands) and `run(args) -> int`.
FEATURE_COMMANDS = {
    "bench": "jaxspec.bench.cli",
    "advise": "jaxspec.bench.cli",
    "train": "jaxspec.train.cli",
}


def main(argv: list[str] | None = None) -> int:
    import importlib

    parser = argparse.ArgumentParser(prog="jaxspec")
    sub = parser.add_subparsers(dest="command", required=True)
    feature_modules = {}
    for command, module_name in FEATURE_COMMANDS.items():
        try:
            module = feature_modules.get(module_name) or importlib.import_module(module_name)
        except ModuleNotFoundError:
            continue
        if module_name not in feature_modules:
            module.add_parser(sub)
            feature_modules[module_name] = module
        feature_modules[command] = module
    gen = sub.add_parser("generate", help="generate from --prompt, or a JSONL batch job with --input")
    _add_generation_args(gen)
    gen.add_argument("--prompt", action="append", help="prompt text (repeatable)")
    gen.add_argument("--input", help="JSONL requests: a resumable batch job (fields: README, Batch jobs)")
    gen.add_argument("--output", help="JSONL results (batch job; rerun with the same file to resume)")
    from jaxspec.batch.job import add_job_options

    add_job_options(gen.add_argument_group("batch job (with --input)"))
    demo = sub.add_parser(
        "demo", help="run the default model on a few built-in prompts, drafting with its best shipped head"
    )
    _add_generation_args(
        demo, spec_default_help="eagle3 with the model's shipped head if it has one", default_draft_length=3,
        default_lookup_min_match=3,
    )  # fmt: skip
    demo.add_argument("--prompt", action="append", help="your own prompt instead of the built-in ones")
    args, rest = parser.parse_known_args(argv)
    from jaxspec.compile_cache import enable_compile_cache

    enable_compile_cache(getattr(args, "compile_cache", None))
    try:
        if args.command == "generate" and args.input:
            from jaxspec.batch.job import main as batch_main

            return batch_main(sys.argv[2:] if argv is None else argv[1:])
        if args.command in feature_modules:
            if rest:
                parser.error(f"unrecognized arguments: {' '.join(rest)}")
            return int(feature_modules[args.command].run(args) or 0)
        if rest:
            parser.error(f"unrecognized arguments: {' '.join(rest)}")
        if args.command == "generate":
            if not args.prompt:
                parser.error("generate needs --prompt TEXT or --input FILE")
            _run_prompts(args, args.prompt)
        elif args.command == "demo":
            if args.spec is None:
                args.spec = _demo_default_spec(args.model)
            _run_demo(args, args.prompt or list(DEMO_PROMPTS))
    except KeyboardInterrupt:
        print(f"\njaxspec {args.command}: interrupted", file=sys.stderr)
        hint = getattr(feature_modules.get(args.command), "INTERRUPT_HINT", None)
        if hint:
            print(f"jaxspec {args.command}: {hint}", file=sys.stderr)
        return 130
    except Exception as exc:
        from jaxspec.errors import JaxspecError

        if isinstance(exc, JaxspecError):
            print(f"jaxspec: error: {exc}", file=sys.stderr)
            return 2
        raise
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
