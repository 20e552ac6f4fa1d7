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
    nothing): the same rule as the API (`jaxspec.models.heads.shipped.resolve_head`)."""
    from jaxspec.config import SpecConfig
    from jaxspec.errors import InputError
    from jaxspec.models.heads.shipped import HEAD_METHODS, shipped_head, shipped_heads_dir

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
    return SpecConfig(
        method=args.spec, num_speculative_tokens=args.num_speculative_tokens, topk=args.topk, head=head
    )


def _add_generation_args(
    p: argparse.ArgumentParser, *, spec_default_help: str = "none", default_draft_length: int = 4
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
    p.add_argument("--no-chat", action="store_true", help="do not apply the chat template")


def _demo_default_spec(model: str) -> str | None:
    """EAGLE-3 when a head is shipped for `model` (the best shipped head on the dev prompts: README,
    "Shipped draft heads"; a chain of 3, the depth it was trained for), else autoregressive."""
    from jaxspec.models.heads.shipped import shipped_head

    return "eagle3" if shipped_head(model, "eagle3") is not None else None


def _run_prompts(args: argparse.Namespace, prompts: list[str]) -> None:
    import jaxspec

    model = jaxspec.load(args.model)
    sampling = jaxspec.SamplingParams(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p)
    spec = _spec_from_args(args)
    if spec is None:
        print("decoding: autoregressive\n")
    else:
        shape = f"chain of {spec.num_speculative_tokens}" if spec.topk == 1 else f"tree (top-{spec.topk})"
        print(f"decoding: speculative, {spec.method}{f' head {spec.head}' if spec.head else ''}, {shape}\n")
    if args.no_chat or model.tokenizer is None or model.tokenizer.chat_template is None:
        inputs = prompts
    else:
        inputs = [model.chat_prompt([{"role": "user", "content": p}]) for p in prompts]
    # A prompt's first call compiles for its length bucket; time a second identical call for the
    # steady-state figure.
    for inp in inputs:
        jaxspec.generate(model, [inp], max_new_tokens=args.max_new_tokens, sampling=sampling, spec=spec)
    for prompt, inp in zip(prompts, inputs, strict=True):
        start = time.perf_counter()
        (c,) = jaxspec.generate(
            model, [inp], max_new_tokens=args.max_new_tokens, sampling=sampling, seed=args.seed, spec=spec
        )
        elapsed = time.perf_counter() - start
        print(f"### prompt: {prompt}\n{c.text}\n")
        line = f"[{len(c.token_ids)} tokens in {elapsed:.2f}s = {len(c.token_ids) / elapsed:.1f} tokens/s"
        if spec is not None:
            line += f", mean accepted length {c.stats['mean_accepted_length']:.2f}"
        print(line + f", finish={c.finish_reason}]\n", flush=True)


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
    from jaxspec.batch_job import add_job_options

    add_job_options(gen.add_argument_group("batch job (with --input)"))
    demo = sub.add_parser(
        "demo", help="run the default model on a few built-in prompts, drafting with its best shipped head"
    )
    _add_generation_args(
        demo, spec_default_help="eagle3 with the model's shipped head if it has one", default_draft_length=3
    )
    args, rest = parser.parse_known_args(argv)
    try:
        if args.command == "generate" and args.input:
            from jaxspec.batch_job import main as batch_main

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
            _run_prompts(args, list(DEMO_PROMPTS))
    except Exception as exc:
        from jaxspec.errors import JaxspecError

        if isinstance(exc, JaxspecError):
            print(f"jaxspec: error: {exc}", file=sys.stderr)
            return 2
        raise
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
