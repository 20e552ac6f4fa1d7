"""`jaxspec train`: self-distil data, write target features, train a draft head, export it.

Every stage is resumable and skips work already done (rerun the same command, with --resume for the
train stage after a kill). Work files live in --workdir and are shared by all methods of one target:
  distill.jsonl     the target's own responses to the training prompts
  features/         tensorstore feature store (final hidden + EAGLE-3 layers)
  run_<method>/     Orbax checkpoints, metrics.jsonl, curves.png
  magpie_s<seed>.jsonl  user turns sampled by the model (--prompt-source magpie; resumable), kept in
                    the data set's prompts/ folder instead when --dataset is given
With --dataset DIR the distilled responses go to (and are read from) a repository data set
(`jaxspec.loading.dataset`: compact shards + manifest) instead of distill.jsonl, so they outlive the
machine and grow run by run. The exported head goes to --output (`SpecConfig(method=..., head=OUTPUT)`).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import shlex
import sys
import time
from pathlib import Path

STAGES = ("distill", "features", "train", "export")
DEFAULT_NUM_POSITIONS = 32
DEFAULT_DEPTH = 4  # Medusa heads, EAGLE-3 training-time-test steps, MTP depths
DEFAULT_DRAFT_VOCAB = 8192
MIN_RESPONSE_TOKENS = 48  # a derived prompt must leave this many of --max-len for its response
# What `jaxspec` prints after "interrupted" when Ctrl-C stops this command (jaxspec.cli.main).
INTERRUPT_HINT = (
    "what each stage committed is kept (distilled records, feature rows, checkpoints); rerun the same "
    "command to continue, with --resume once training had started"
)


def add_parser(subparsers) -> None:
    p = subparsers.add_parser("train", help="train a draft head (medusa | eagle | eagle3 | mtp) for a model")
    p.add_argument("--method", required=True, choices=("medusa", "eagle", "eagle3", "mtp"))
    p.add_argument("--model", default="smollm2-135m", help="target: model name, .gguf file or HF directory")
    p.add_argument("--workdir", required=True, help="data, features and checkpoints (shared by methods)")
    p.add_argument("--output", help="exported head directory (default WORKDIR/head_<method>)")
    p.add_argument("--stages", default=",".join(STAGES), help=f"comma-separated subset of {','.join(STAGES)}")
    p.add_argument(
        "--prompts",
        help="JSONL of {id, prompt[, category]} to distil instead of jaxspec's templated set (e.g. the "
        "human-written configs/prompts/questions_en.jsonl); a data set records it as prompt source 'file'",
    )  # fmt: skip
    p.add_argument(
        "--prompt-source", choices=("templated", "magpie", "passages"), default="templated",
        help="templated: jaxspec's task x topic set (or --prompts); magpie: user turns written by the "
        "model itself (--magpie-per-category per category), kept in DATASET/prompts/magpie_s<seed>.jsonl "
        "(WORKDIR/ without --dataset); passages: every human-written passage of --passages x every "
        "summarise / rewrite / extract task of jaxspec.train.passages",
    )  # fmt: skip
    p.add_argument("--passages", help="JSONL of {id, genre, text} (default: the shipped passages_en.jsonl)")
    p.add_argument("--magpie-per-category", type=int, default=256)
    p.add_argument("--magpie-categories", default="all", help="comma-separated (default all)")
    p.add_argument("--magpie-max-new-tokens", type=int, default=128, help="budget of a sampled user turn")
    p.add_argument(
        "--dataset",
        help="distilled data set directory (e.g. configs/distilled/smollm2-135m): the distill stage "
        "appends a run to it, the later stages train on all of it (instead of WORKDIR/distill.jsonl)",
    )  # fmt: skip
    p.add_argument(
        "--dataset-runs", metavar="RUNS",
        help="features and training on these runs of --dataset only: run indices (= shard numbers) and "
        "ranges, e.g. 9-14 or 0,3,11-14; EAGLE-3's draft vocabulary is still selected from every run (see "
        "--draft-vocab-runs), and a feature store holding more runs serves (training reads the selected "
        "runs' sequences from it)",
    )  # fmt: skip
    p.add_argument(
        "--draft-vocab-runs", metavar="RUNS",
        help="EAGLE-3: select the draft vocabulary from these runs of --dataset only (the --dataset-runs "
        "syntax; default every run), so that a head's recipe keeps its vocabulary as the data set grows",
    )  # fmt: skip
    p.add_argument("--exclude", help="JSONL whose prompts must not be trained on (e.g. a dev set)")
    p.add_argument(
        "--num-prompts", type=int, default=512,
        help="templated / passages: distill at most this many prompts (with --dataset: of those that no "
        "other run of the data set answered)",
    )  # fmt: skip
    p.add_argument(
        "--derived-prompts", type=int, default=0,
        help="after the first round, distill up to N prompts built from its answers (passages, code)",
    )  # fmt: skip
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--gen-batch", type=int, default=16, help="distillation batch size")
    p.add_argument("--max-len", type=int, default=256, help="prompt + response tokens kept per sequence")
    p.add_argument("--feature-batch", type=int, default=8)
    p.add_argument("--feature-mode", choices=("offline", "online"), default="offline")
    p.add_argument(
        "--feature-argmax", choices=("auto", "target", "data"), default="auto",
        help="the stored target argmax (EAGLE-3's position mask): 'data' = the data's next token, exact for "
        "greedy self-distillation and without the target's full-vocabulary LM head (the features stage "
        "1.1-1.3x faster on a CPU); 'target' runs the LM head; auto = data when every run of the --dataset "
        "manifest is greedy (jaxspec train's own distillation always is), else target",
    )  # fmt: skip
    p.add_argument("--window", type=int, default=None, help="train on random windows of this many tokens")
    p.add_argument(
        "--depth", type=int, default=None,
        help="Medusa heads / EAGLE-3 and EAGLE-1 training-time-test steps / MTP depths (default: EAGLE-1 1, "
        "the reference training; others 4)",
    )  # fmt: skip
    p.add_argument(
        "--num-positions", type=int, default=None,
        help="loss positions per sequence (default: 32; EAGLE-3 all, its draft vocabulary is small)",
    )  # fmt: skip
    p.add_argument(
        "--draft-vocab", type=int, default=None,
        help=f"EAGLE-3 draft vocabulary size (default {DEFAULT_DRAFT_VOCAB}); with --init-from-head, a new "
        "vocabulary of this size is selected from the training data, the head's trained LM-head columns "
        "of the tokens it keeps are kept and the new tokens start from the target's LM head",
    )  # fmt: skip
    p.add_argument(
        "--init-from-target", choices=("none", "lm-head", "all"), default="none",
        help="start the head from the target (EAGLE-3, MTP; EAGLE-1 refuses it, Medusa ignores it): "
        "lm-head = EAGLE-3's draft LM head (the target's rows of the draft vocabulary) and final norm; "
        "all = also every head decoder layer from the target's last layer",
    )  # fmt: skip
    p.add_argument(
        "--init-from-head", metavar="DIR",
        help="fine-tune an exported head (jaxspec_head.json + params/): its parameters, config and EAGLE-3 "
        "draft vocabulary instead of fresh ones (--init-from-target does not apply; --draft-vocab "
        "re-selects the vocabulary)",
    )  # fmt: skip
    p.add_argument(
        "--head-layers", type=int, default=None,
        help="EAGLE-3: decoder layers of the head (default 1, or the --init-from-head head's); more than "
        "the --init-from-head head has grows it: the added layers start as the identity (zeroed residual "
        "branches), so training starts from exactly the head it grows",
    )  # fmt: skip
    p.add_argument(
        "--medusa-layers", type=int, default=None,
        help="Medusa: residual blocks per head (default 1, or the --init-from-head head's); more than the "
        "--init-from-head head has grows it: the added blocks start as the identity (zero kernel and bias)",
    )  # fmt: skip
    p.add_argument("--mtp-modules", type=int, default=1)
    p.add_argument("--backbone-weight", type=float, default=0.0, help="MTP: >0 trains the target jointly")
    p.add_argument(
        "--soft-weight", type=float, default=0.0,
        help="Medusa/MTP: weight of the soft CE to the target's distribution (1 - it: CE to the token)",
    )  # fmt: skip
    p.add_argument(
        "--argmax-weight", type=float, default=0.0,
        help="EAGLE-3: weight of the CE to the target's argmax (1 - it: the soft CE over the draft "
        "vocabulary, the reference training's only loss); greedy chains accept only the argmax",
    )  # fmt: skip
    p.add_argument("--steps", type=int, default=1000)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--warmup", type=int, default=50)
    p.add_argument("--weight-decay", type=float, default=0.01)
    p.add_argument("--clip-norm", type=float, default=0.5)
    p.add_argument("--checkpoint-every", type=int, default=100)
    p.add_argument("--keep-checkpoints", type=int, default=2)
    p.add_argument("--log-every", type=int, default=10)
    p.add_argument(
        "--val-fraction", type=float, default=0.0,
        help="hold out this fraction of the non-templated sequences (Magpie, derived) for validation",
    )  # fmt: skip
    p.add_argument("--eval-every", type=int, default=100, help="validation interval in steps")
    p.add_argument(
        "--eval-batches", type=int, default=4,
        help="validation batches of --batch-size held-out sequences (the first ones); Medusa's tree "
        "calibration (tree_calibration.json in the exported head) comes from them",
    )  # fmt: skip
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--mesh", default=None, metavar="DATAxMODEL",
        help="train on a (data x model) device mesh, e.g. 4x2: the target sharded by jaxspec's rules, the "
        "head replicated, each batch split over data (--batch-size is global; a multiple of DATA)",
    )  # fmt: skip
    from jaxspec.distributed import add_distributed_flags

    add_distributed_flags(p)
    p.add_argument("--resume", action="store_true", help="continue training from the latest checkpoint")
    p.add_argument("--save-dtype", default="bfloat16")
    p.add_argument("--no-progress", action="store_true")


def _prompt_rows(args: argparse.Namespace) -> list[dict]:
    from jaxspec.train.prompts import load_prompt_texts, training_prompts

    exclude = load_prompt_texts(args.exclude) if args.exclude else []
    if args.prompts:
        from jaxspec.train.prompts import NearDuplicateIndex, load_prompt_rows

        index = NearDuplicateIndex(exclude)
        rows = [r for r in load_prompt_rows(args.prompts) if not index.contains(r["prompt"])]
    else:
        rows = training_prompts(exclude=exclude, seed=args.seed)
    return rows


def _passage_rows(args: argparse.Namespace) -> list[dict]:
    from jaxspec.train.passages import default_passage_file, load_passages, passage_prompts
    from jaxspec.train.prompts import load_prompt_texts

    passages = load_passages(args.passages or default_passage_file())
    exclude = load_prompt_texts(args.exclude) if args.exclude else []
    return passage_prompts(passages, exclude=exclude, seed=args.seed)


def _capped(prompts: list[dict], limit: int, writer) -> list[dict]:
    """The first `limit` prompts that no other run of the data set answered (`writer`: this run's
    DatasetWriter; None for a JSONL output, where the first `limit` of all). Counting only the prompts new
    to the data set lets a grown prompt file be distilled with the same --num-prompts; counting this run's
    own answers keeps a resumed run to the prompts it began with."""
    if writer is None:
        return prompts[:limit]
    answered = writer.ids_of_other_runs()
    fresh = [p for p in prompts if p["id"] not in answered]
    taken, answered_here = min(limit, len(fresh)), len(prompts) - len(fresh)
    print(f"jaxspec train: distill: {taken} prompts for this run ({answered_here} "
          f"of the {len(prompts)} already answered in other runs of {writer.dataset.path}, "
          f"{max(0, len(fresh) - limit)} beyond --num-prompts {limit})", file=sys.stderr)  # fmt: skip
    return fresh[:limit]


def _depth(args: argparse.Namespace) -> int:
    if args.depth is not None:
        return args.depth
    return 1 if args.method == "eagle" else DEFAULT_DEPTH


def _num_positions(args: argparse.Namespace) -> int:
    if args.num_positions is not None:
        return args.num_positions
    return args.max_len if args.method == "eagle3" else DEFAULT_NUM_POSITIONS


def _derived_rows(args: argparse.Namespace, model, distilled: list[dict]) -> list[dict]:
    """The first --derived-prompts prompts derived from the first round's answers (the `distilled` rows
    not derived themselves) whose chat-rendered prompt leaves at least MIN_RESPONSE_TOKENS of --max-len
    for the response."""
    from jaxspec.train.derived_prompts import derived_prompts
    from jaxspec.train.distill import chat_prompt_ids
    from jaxspec.train.prompts import load_prompt_texts

    answers = [
        {"id": r["id"], "category": r.get("category", ""), "text": model.tokenizer.decode(r["response_ids"])}
        for r in distilled
        if not r.get("category", "").startswith("derived_")
    ]
    exclude = load_prompt_texts(args.exclude) if args.exclude else []
    rows = []
    for row in derived_prompts(answers, exclude=exclude):
        ids = chat_prompt_ids(model, row["prompt"])
        if len(ids) + MIN_RESPONSE_TOKENS <= args.max_len:
            rows.append(dict(row, prompt_ids=ids))
        if len(rows) >= args.derived_prompts:
            break
    return rows


def _magpie_rows(args: argparse.Namespace, model, folder: Path) -> list[dict]:
    """Magpie user turns for the distill stage, sampled batch by batch into a resumable file in `folder`
    (the data set's prompts/ folder, so they outlive the machine, or the work directory)."""
    from jaxspec.train.distill import append_jsonl_rows, read_jsonl_rows
    from jaxspec.train.magpie import CATEGORIES, MagpieConfig, magpie_prompts
    from jaxspec.train.prompts import load_prompt_texts

    names = tuple(CATEGORIES) if args.magpie_categories == "all" else tuple(args.magpie_categories.split(","))
    folder.mkdir(parents=True, exist_ok=True)
    cache = folder / f"magpie_s{args.seed}.jsonl"
    return magpie_prompts(
        model, args.magpie_per_category, categories=names, seed=args.seed,
        config=MagpieConfig(max_new_tokens=args.magpie_max_new_tokens),
        exclude=load_prompt_texts(args.exclude) if args.exclude else [], batch_size=args.gen_batch,
        slots=args.gen_batch,
        done=read_jsonl_rows(cache), on_batch=lambda rows: append_jsonl_rows(cache, rows),
    )  # fmt: skip


def run(args: argparse.Namespace) -> int:
    import jax
    import numpy as np

    import jaxspec
    from jaxspec.train.distill import distill, read_jsonl_rows

    stages = [s.strip() for s in args.stages.split(",") if s.strip()]
    bad = [s for s in stages if s not in STAGES]
    if bad:
        print(f"jaxspec train: unknown stage(s) {bad}; choose from {STAGES}", file=sys.stderr)
        return 2
    if args.method == "eagle" and args.init_from_target != "none":
        from jaxspec.train.head_setup import EAGLE1_FROM_TARGET

        print(f"jaxspec train: --init-from-target {args.init_from_target}: {EAGLE1_FROM_TARGET}",
              file=sys.stderr)  # fmt: skip
        return 2
    if args.head_layers is not None and (args.method != "eagle3" or args.head_layers < 1):
        print(f"jaxspec train: --head-layers {args.head_layers}: an EAGLE-3 head's decoder layers (>= 1); "
              f"a {args.method} head has no such choice" if args.method != "eagle3" else
              f"jaxspec train: --head-layers {args.head_layers}: a head needs at least one decoder layer",
              file=sys.stderr)  # fmt: skip
        return 2
    if args.medusa_layers is not None and (args.method != "medusa" or args.medusa_layers < 1):
        print(f"jaxspec train: --medusa-layers {args.medusa_layers}: a Medusa head's residual blocks "
              f"per head (>= 1)" + ("" if args.method == "medusa" else f"; a {args.method} head has none"),
              file=sys.stderr)  # fmt: skip
        return 2
    for flag, value in (("--dataset-runs", args.dataset_runs), ("--draft-vocab-runs", args.draft_vocab_runs)):
        if value and not args.dataset:
            print(f"jaxspec train: {flag} selects runs of a --dataset; give --dataset", file=sys.stderr)
            return 2
    if args.draft_vocab_runs and args.method != "eagle3":
        print(f"jaxspec train: --draft-vocab-runs: only EAGLE-3 heads have a draft vocabulary, not "
              f"{args.method}", file=sys.stderr)  # fmt: skip
        return 2
    if args.argmax_weight and (args.method != "eagle3" or not 0.0 <= args.argmax_weight <= 1.0):
        print(f"jaxspec train: --argmax-weight {args.argmax_weight}: " + (
            f"an EAGLE-3 loss weight, not {args.method}'s (Medusa/MTP: --soft-weight)"
            if args.method != "eagle3" else "a weight in [0, 1]"), file=sys.stderr)  # fmt: skip
        return 2
    workdir = Path(args.workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    output = Path(args.output or workdir / f"head_{args.method}")
    progress = not args.no_progress
    from jaxspec.distributed import barrier, initialize_from_args

    multi = initialize_from_args(args)
    if multi and ("distill" in stages or not args.mesh):
        if jax.process_index() == 0:
            print("jaxspec train: with several processes the features, train and export stages run on one "
                  "global --mesh DATAxMODEL (every process writes its own feature rows, process 0 the head); "
                  "run --stages distill once on one host before", file=sys.stderr)  # fmt: skip
        return 2
    mesh = None
    if args.mesh:
        from jaxspec.sharding import make_mesh, parse_mesh_shape

        try:
            mesh = make_mesh(*parse_mesh_shape(args.mesh))
        except ValueError as error:
            print(f"jaxspec train: --mesh {args.mesh}: {error}", file=sys.stderr)
            return 2
        for flag, value in (("--batch-size", args.batch_size), ("--feature-batch", args.feature_batch)):
            if value % mesh.shape["data"]:
                print(f"jaxspec train: {flag} {value} is not a multiple of the data axis of --mesh "
                      f"{args.mesh}", file=sys.stderr)  # fmt: skip
                return 2
    prompts = None  # checked before the model loads, so a bad prompt file fails fast
    if "distill" in stages and args.prompt_source == "passages":
        prompts = _passage_rows(args)
    elif "distill" in stages and args.prompt_source == "templated":
        prompts = _prompt_rows(args)
    model = jaxspec.load(args.model, mesh=mesh)
    timings: dict[str, float] = {}

    dataset = None
    if args.dataset:
        from jaxspec.loading.dataset import DistilledDataset

        dataset = DistilledDataset.open_or_create(
            args.dataset, model=args.model, vocab_size=model.config.vocab_size
        )
    start = time.perf_counter()
    if "distill" in stages:
        sink = workdir / "distill.jsonl"
        if dataset is not None:
            run_info = {"prompt_source": args.prompt_source}
            if args.prompt_source == "templated" and args.prompts:
                run_info = {"prompt_source": "file", "prompt_file": Path(args.prompts).name}
            sink = dataset.writer(
                **run_info, seed=args.seed, max_new_tokens=args.max_new_tokens,
                derived_prompts=args.derived_prompts, sampling="greedy",
            )  # fmt: skip
        if args.prompt_source == "magpie":
            prompts = _magpie_rows(args, model, dataset.path / "prompts" if dataset is not None else workdir)
        else:
            prompts = _capped(prompts, args.num_prompts, sink if dataset is not None else None)
        distilled = distill(
            model, prompts, sink, max_new_tokens=args.max_new_tokens, batch_size=args.gen_batch,
            seed=args.seed, progress=progress,
        )  # fmt: skip
        if args.derived_prompts > 0:
            distill(
                model, _derived_rows(args, model, distilled), sink, max_new_tokens=args.max_new_tokens,
                batch_size=args.gen_batch, seed=args.seed, progress=progress,
            )  # fmt: skip
        if dataset is not None:
            sink.finish()
        timings["distill_s"] = time.perf_counter() - start
    source = dataset.path if dataset is not None else workdir / "distill.jsonl"
    rows = list(dataset.rows()) if dataset is not None else read_jsonl_rows(source)
    if not rows:
        print(f"jaxspec train: no distilled data in {source} (run the distill stage)", file=sys.stderr)
        return 2
    # Training reads the --dataset-runs rows; EAGLE-3's draft vocabulary, the --draft-vocab-runs rows;
    # each the whole data set when its flag is absent.
    selected = {}
    for flag, spec in (("--dataset-runs", args.dataset_runs), ("--draft-vocab-runs", args.draft_vocab_runs)):
        if spec:
            from jaxspec.errors import DatasetError

            try:
                selected[flag] = list(dataset.rows(dataset.select_runs(spec)))
            except DatasetError as error:
                print(f"jaxspec train: {flag}: {error}", file=sys.stderr)
                return 2
    vocab_rows = selected.get("--draft-vocab-runs", rows)
    rows = selected.get("--dataset-runs", rows)

    from jaxspec.drafters.heads.configs import default_eagle3_layers
    from jaxspec.train.features import FeatureStore, write_features

    capture = tuple(default_eagle3_layers(model.config.num_layers))
    store_path = workdir / "features"
    if "features" in stages and args.feature_mode == "offline":
        sampled = [] if dataset is None else [
            f"{run.get('shard')} ({run.get('sampling')})"
            for run in dataset.manifest["runs"] if run.get("sampling") != "greedy"
        ]  # fmt: skip
        if args.feature_argmax == "data" and sampled:
            print(f"jaxspec train: --feature-argmax data needs greedy responses; {dataset.path} has runs "
                  f"{', '.join(sampled)}", file=sys.stderr)  # fmt: skip
            return 2
        from_data = args.feature_argmax == "data" or (
            args.feature_argmax == "auto" and dataset is not None and not sampled
        )
        t0 = time.perf_counter()
        store = write_features(
            model, rows, store_path, max_len=args.max_len, capture_layers=capture,
            batch_size=args.feature_batch, progress=progress, argmax_from_data=from_data,
        )  # fmt: skip
        timings["features_s"] = time.perf_counter() - t0
        if multi:  # which rows this process wrote (merged ranges [lo, hi) of the store)
            ranges: list[list[int]] = []
            for lo, hi in sorted(store.written):
                if ranges and ranges[-1][1] == lo:
                    ranges[-1][1] = hi
                else:
                    ranges.append([lo, hi])
            print(json.dumps({"features_written": {"process": jax.process_index(), "rows": ranges}}))

    result = None
    head = None
    if "train" in stages or "export" in stages:
        from jaxspec.train.head_setup import draft_vocabulary, head_config_for, new_head
        from jaxspec.train.losses import Objective
        from jaxspec.train.trainer import TrainConfig, split_trainable, train

        start_head = None
        if args.init_from_head:
            from jaxspec.errors import InputError, ModelLoadError
            from jaxspec.train.head_setup import draft_ids_of, head_from_directory, with_draft_vocabulary

            if args.init_from_target != "none":
                print("jaxspec train: --init-from-head and --init-from-target exclude each other",
                      file=sys.stderr)  # fmt: skip
                return 2
            try:
                start_head = head_from_directory(args.init_from_head, args.method, model, capture)
            except (InputError, ModelLoadError, ValueError) as error:
                print(f"jaxspec train: --init-from-head {error}", file=sys.stderr)
                return 2
            from jaxspec.train.head_setup import with_decoder_layers, with_medusa_layers

            growths = (
                ("--head-layers", args.head_layers, lambda h, n: with_decoder_layers(h, n, seed=args.seed)),
                ("--medusa-layers", args.medusa_layers, with_medusa_layers),
            )  # (flag, layers or None, grow(head, layers)): the method checks above allow one at most
            for flag, layers, grow in growths:
                if layers is not None:
                    try:
                        start_head = grow(start_head, layers)
                    except ValueError as error:
                        print(f"jaxspec train: {flag}: {error}", file=sys.stderr)
                        return 2
            config = start_head.config
        else:
            config = head_config_for(
                args.method, model.config, depth=_depth(args),
                medusa_layers=args.medusa_layers or 1, mtp_modules=args.mtp_modules, eagle3_layers=capture,
                draft_vocab_size=args.draft_vocab or DEFAULT_DRAFT_VOCAB, head_layers=args.head_layers or 1,
            )  # fmt: skip
        draft_ids = None
        if args.method == "eagle3":  # fixed at the first run: more data later must not change it
            vocab_file = workdir / f"run_{args.method}" / "draft_vocab.npy"
            exists = vocab_file.exists()
            barrier("train/draft-vocab-checked")  # every process decides alike before process 0 writes it
            saved = np.load(vocab_file) if exists else None
            keeps_head_vocab = start_head is not None and args.draft_vocab is None
            if keeps_head_vocab:  # the head's own vocabulary; a resume without the flag keeps it
                draft_ids = draft_ids_of(start_head)
                if saved is not None and not np.array_equal(saved, draft_ids):
                    print(f"jaxspec train: {vocab_file} is not the draft vocabulary of --init-from-head "
                          f"{args.init_from_head} (another run's directory?)", file=sys.stderr)  # fmt: skip
                    return 2
            elif saved is not None:  # selected at the first run: a resume keeps it however the data grew
                draft_ids = saved
            else:  # the same ids on every process; one writes them
                size = args.draft_vocab or DEFAULT_DRAFT_VOCAB
                draft_ids = draft_vocabulary(vocab_rows, model.config.vocab_size, size)
            if start_head is not None and not keeps_head_vocab:  # --draft-vocab re-selects the head's
                if draft_ids.shape[0] != min(args.draft_vocab, model.config.vocab_size):
                    print(f"jaxspec train: {vocab_file} holds a draft vocabulary of {draft_ids.shape[0]}, "
                          f"not --draft-vocab {args.draft_vocab} (another run's directory?)",
                          file=sys.stderr)  # fmt: skip
                    return 2
                start_head = with_draft_vocabulary(start_head, draft_ids, model.graphdef, model.params)
                config = start_head.config
            if not exists:
                vocab_file.parent.mkdir(parents=True, exist_ok=True)
                if not multi or jax.process_index() == 0:
                    np.save(vocab_file, draft_ids)
        head = start_head if start_head is not None else new_head(config, seed=args.seed, draft_ids=draft_ids)
        if args.init_from_target != "none":
            from jaxspec.train.head_setup import init_from_target

            head = init_from_target(head, model.graphdef, model.params, layers=args.init_from_target == "all")
        trainable, head_fixed = split_trainable(head.params)
        objective = Objective(
            head.graphdef, config, model.graphdef, model.config,
            depth=_depth(args),
            num_positions=_num_positions(args), backbone_weight=args.backbone_weight,
            soft_weight=args.soft_weight, argmax_weight=args.argmax_weight,
        )  # fmt: skip
        train_config = TrainConfig(
            steps=args.steps, batch_size=args.batch_size, learning_rate=args.lr, warmup_steps=args.warmup,
            weight_decay=args.weight_decay, clip_norm=args.clip_norm, seed=args.seed,
            checkpoint_every=args.checkpoint_every, keep_checkpoints=args.keep_checkpoints,
            log_every=args.log_every,
            window=args.window, eval_every=args.eval_every, eval_batches=args.eval_batches,
        )  # fmt: skip
        online = args.feature_mode == "online" or args.backbone_weight > 0
        source = OnlineSource(rows, args.max_len) if online else FeatureStore.open(store_path)
        ids = [r["id"] for r in rows] if online else list(source.meta["ids"])[: source.num_sequences]
        if args.dataset_runs and not online:  # the store may hold more runs than the selected ones
            from jaxspec.train.trainer import SubsetSource

            wanted = {r["id"] for r in rows}
            missing = len(wanted - set(ids))
            if missing:
                print(f"jaxspec train: {store_path} lacks the features of {missing} of the {len(wanted)} "
                      f"sequences of --dataset-runs {args.dataset_runs} (run --stages features with it)",
                      file=sys.stderr)  # fmt: skip
                return 2
            keep = tuple(i for i, sequence in enumerate(ids) if sequence in wanted)
            source, ids = SubsetSource(source, keep), [ids[i] for i in keep]
        validation = None
        if args.val_fraction > 0:
            from jaxspec.train.trainer import SubsetSource, validation_split

            category = {r["id"]: r.get("category", "") for r in rows}
            train_idx, val_idx = validation_split(ids, [category.get(i, "") for i in ids], args.val_fraction)
            source, validation = SubsetSource(source, tuple(train_idx)), SubsetSource(source, tuple(val_idx))
            print(f"validation: {len(val_idx)} held-out sequences, {len(train_idx)} for training")
        params = {"head": trainable}
        if args.backbone_weight > 0:
            params["backbone"] = model.params
        t0 = time.perf_counter()
        result = train(
            objective, params, {"target": model.params, "head_fixed": head_fixed}, source,
            workdir / f"run_{args.method}", train_config, online=online,
            resume=args.resume or "train" not in stages, progress=progress,
            stop_after=None if "train" in stages else 0, validation=validation, mesh=mesh,
        )  # fmt: skip
        timings["train_s"] = time.perf_counter() - t0
        last = result.metrics[-1] if result.metrics else {}
        print(json.dumps({"method": args.method, "step": result.step, "last": last, **timings,
                          "throughput": result.throughput}))  # fmt: skip

    if "export" in stages and result is not None:
        from flax import nnx

        from jaxspec.distributed import to_host
        from jaxspec.train.export import save_head

        info = {
            "target": args.model, "command": "jaxspec " + " ".join(shlex.quote(a) for a in sys.argv[1:]),
            "steps": result.step, "sequences": len(rows), "dataset_runs": args.dataset_runs,
            "draft_vocab_runs": args.draft_vocab_runs,
            "train_sequences": source.num_sequences,
            "val_sequences": validation.num_sequences if validation is not None else 0, **timings,
            "final_depth_acc": result.metrics[-1]["depth_acc"] if result.metrics else None,
            "mesh": args.mesh or "1x1", "throughput": result.throughput,
        }  # fmt: skip
        if args.init_from_head:
            info["init_from_head"] = str(Path(args.init_from_head).absolute())
            info["head_source"] = head.source  # says when the draft vocabulary was re-selected
        # Host copies (every process takes part in gathering them): the exported head loads on one
        # device whatever mesh trained it. Process 0 writes it; the others wait until it is complete.
        params = nnx.merge_state(to_host(result.trainable["head"]), to_host(head_fixed))
        curves = workdir / f"run_{args.method}" / "curves.png"
        if not multi or jax.process_index() == 0:
            save_head(
                output, head.config, head.graphdef, params, dtype=args.save_dtype, info=info, curves=curves
            )
            calibrated = [e for e in result.metrics if "val_rank_acc" in e]
            if calibrated:  # Medusa: rank accuracies on held-out data, for trees calibrated to this head
                from jaxspec.drafters.tree_build import save_tree_calibration

                size = args.batch_size
                evaluated = min(args.eval_batches, validation.num_sequences // size) * size
                last = calibrated[-1]
                save_tree_calibration(
                    output, np.asarray(last["val_rank_acc"]), np.asarray(last["val_path_acc"]),
                    step=last["step"],
                    measured_on=f"{evaluated} of {validation.num_sequences} held-out sequences of "
                    f"{args.dataset or args.workdir}, {_num_positions(args)} positions each",
                )  # fmt: skip
            print(f"saved {args.method} head to {output}")
        barrier("export/saved")
    return 0


@dataclasses.dataclass
class OnlineSource:
    """Token sequences only; the train step runs the target for the features (--feature-mode online)."""

    rows: list[dict]
    max_len: int

    @property
    def num_sequences(self) -> int:
        return len(self.rows)

    def read(self, indices, names=None):
        from jaxspec.train.features import pack_sequences

        return pack_sequences([self.rows[i] for i in indices], self.max_len)
