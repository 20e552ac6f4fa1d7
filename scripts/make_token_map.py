"""A token map for heads that draft through the target's LM head (SpecConfig.token_map, FR-Spec): the
`--size` most frequent response tokens of a distilled data set, the same selection as EAGLE-3's draft
vocabulary (`jaxspec.train.head_setup.draft_vocabulary`).

    python scripts/make_token_map.py --dataset configs/distilled/smollm2-135m --size 8192 \
        --out configs/heads/smollm2-135m/token_map.npy

Prints the share of the data set's response tokens the map holds; with `--answers OUT_DIR` (a `jaxspec
bench --out-dir`) also the share of that run's autoregressive answer tokens, e.g. the dev prompts' greedy
answers: a measurement only, the map is chosen from the data set alone.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np

from jaxspec.loading.dataset import DistilledDataset
from jaxspec.train.head_setup import draft_vocabulary


def answer_tokens(out_dir: str) -> np.ndarray:
    """Token ids of every autoregressive answer that `jaxspec bench --out-dir OUT_DIR` recorded."""
    bench = json.loads((Path(out_dir) / "bench.json").read_text())["raw"]
    ids = [
        t
        for run in bench["runs"]
        if run["label"] == "ar"
        for stats in run["stats"]
        for t in stats["token_ids"]
    ]
    return np.asarray(ids, np.int64)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dataset", required=True, help="a distilled data set directory")
    p.add_argument("--size", type=int, default=8192)
    p.add_argument("--out", required=True, help="the .npy file to write")
    p.add_argument(
        "--answers", help="a jaxspec bench --out-dir: report the map's share of its answers' tokens"
    )
    args = p.parse_args()
    dataset = DistilledDataset.open(args.dataset)
    rows = list(dataset.rows())
    vocab_size = int(dataset.manifest["vocab_size"])
    ids = draft_vocabulary(rows, vocab_size, args.size).astype(np.int32)
    np.save(args.out, ids)
    kept = np.zeros(vocab_size, bool)
    kept[ids] = True
    response = np.concatenate([np.asarray(r["response_ids"], np.int64) for r in rows])
    print(f"{args.out}: {ids.size} of {vocab_size} tokens, {kept[response].mean():.4f} of the data set's "
          f"{response.size} response tokens")  # fmt: skip
    if args.answers:
        answers = answer_tokens(args.answers)
        print(f"{kept[answers].mean():.4f} of the {answers.size} answer tokens in {args.answers}")


if __name__ == "__main__":
    main()
