"""How well prompt lookup would draft at every position of the target's own greedy answers.

    python scripts/lookup_acceptance.py docs/bench/heads_s19_tree31 [--draft-length 3]

Reads the autoregressive outputs a `jaxspec bench --out-dir OUT_DIR` run recorded (bench.json) and, at
every position of every answer, finds the longest suffix n-gram (n = 4..1) of prompt + answer so far
that occurred before (most recent occurrence, as `jaxspec.drafters.ngram` picks it), drafts its next
`--draft-length` tokens and counts how many the answer accepts in a row. Prints, per match length n
(0 = no match) and prompt category, the positions and the mean accepted drafts: what
`SpecConfig.lookup_min_match` chooses between (README, "Shipped draft heads").
"""

from __future__ import annotations

import argparse
import collections
import json
import sys
from pathlib import Path


def lookup(history: list[int], max_n: int = 4) -> tuple[int, int]:
    """(n, end) of the most recent earlier occurrence of the longest suffix n-gram, (0, -1) if none."""
    length = len(history)
    for n in range(min(max_n, length - 1), 0, -1):
        suffix = history[length - n :]
        for end in range(length - 2, n - 2, -1):
            if history[end - n + 1 : end + 1] == suffix:
                return n, end
    return 0, -1


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
            prompt, answer = list(prompt_ids[pid]), stats["token_ids"]
            sequence = prompt + answer
            for root in range(len(prompt), len(sequence) - 1):
                n, end = lookup(sequence[: root + 1])
                drafts = sequence[end + 1 : min(end + 1 + args.draft_length, root + 1)] if n else []
                run_length = 0
                for depth, token in enumerate(drafts):
                    if sequence[root + 1 + depth : root + 2 + depth] != [token]:
                        break
                    run_length += 1
                for category in ("all", pid.split("_")[0]):
                    accepted[(category, n)].append(run_length)
    print(f"{args.out_dir}/bench.json, draft length {args.draft_length}")
    print("category  n  positions  mean accepted")
    for (category, n), runs in sorted(accepted.items()):
        print(f"{category:<8} {n:>2} {len(runs):>10} {sum(runs) / len(runs):>14.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
