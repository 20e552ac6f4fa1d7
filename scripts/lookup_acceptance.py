"""How well prompt lookup would draft at every position of the target's own greedy answers.

    python scripts/lookup_acceptance.py docs/bench/heads_s19_tree31 [--draft-length 3]

Reads the autoregressive outputs a `jaxspec bench --out-dir OUT_DIR` run recorded (bench.json) and, at
every position of every answer, drafts with `jaxspec.drafters.ngram.ngram_chain` (the longest suffix
n-gram, n = 4..1, of prompt + answer so far that occurred before; its most recent occurrence's next
`--draft-length` tokens) and counts how many the answer accepts in a row. Prints, per match length n
(0 = no match) and prompt category, the positions and the mean accepted drafts: what
`SpecConfig.lookup_min_match` chooses between (README, "Shipped draft heads").
"""

from __future__ import annotations

import argparse
import collections
import json
import sys
from pathlib import Path


def lookup_runs(sequence: list[int], first_root: int, draft_length: int) -> tuple[list[int], list[int]]:
    """For every root position r >= first_root of `sequence` (history = sequence[: r + 1]): the longest
    matching suffix n-gram's n (0 = no match, n = 4..1) and how many of the drafts
    `jaxspec.drafters.ngram.ngram_chain` makes there the sequence accepts in a row."""
    import numpy as np

    from jaxspec.drafters.ngram import ngram_chain

    tokens = np.asarray(sequence, np.int32)
    roots = np.arange(first_root, len(sequence) - 1)
    history = np.broadcast_to(tokens, (roots.size, tokens.size))
    lengths = roots + 1
    chain = ngram_chain(history, lengths, num_tokens=draft_length, ngram_min=1, ngram_max=4)
    drafts, valid = np.asarray(chain.tokens[:, 1:]), np.asarray(chain.valid[:, 1:])
    ahead = roots[:, None] + 1 + np.arange(draft_length)[None, :]
    right = valid & (ahead < tokens.size) & (drafts == tokens[np.minimum(ahead, tokens.size - 1)])
    runs = np.cumprod(right, axis=1).sum(axis=1)
    match = valid[:, 0].astype(np.int64)  # a match of at least 1 token
    for n in range(2, 5):  # the longest n with a match is the one the drafter used
        longer = ngram_chain(history, lengths, num_tokens=draft_length, ngram_min=n, ngram_max=4)
        match[np.asarray(longer.valid[:, 1])] = n
    return match.tolist(), runs.tolist()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out_dir", help="directory holding bench.json with an 'ar' variant")
    parser.add_argument("--draft-length", type=int, default=3)
    args = parser.parse_args(argv)

    import jaxspec
    from jaxspec.bench.runner import read_prompts

    bench = json.loads((Path(args.out_dir) / "bench.json").read_text())["raw"]
    model = jaxspec.load(bench["settings"]["model"])
    prompts = read_prompts(bench["settings"]["prompts"], model, chat=True)
    prompt_ids = dict(zip(prompts.ids, prompts.token_ids, strict=True))
    accepted: dict[tuple[str, int], list[int]] = collections.defaultdict(list)
    for run in bench["runs"]:
        if run["label"] != "ar":
            continue
        for pid, stats in zip(run["prompt_ids"], run["stats"], strict=True):
            prompt = list(prompt_ids[pid])
            matches, runs = lookup_runs(prompt + stats["token_ids"], len(prompt), args.draft_length)
            for n, run_length in zip(matches, runs, strict=True):
                for category in ("all", pid.split("_")[0]):
                    accepted[(category, n)].append(run_length)
    print(f"{args.out_dir}/bench.json, draft length {args.draft_length}")
    print("category  n  positions  mean accepted")
    for (category, n), runs in sorted(accepted.items()):
        print(f"{category:<8} {n:>2} {len(runs):>10} {sum(runs) / len(runs):>14.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
