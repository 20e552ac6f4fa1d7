"""Benchmark speculative methods against autoregressive decoding: same as `jaxspec bench`.

python scripts/bench.py --prompts prompts.jsonl --methods ar,ngram --peer --out-dir docs/bench
"""

import sys

from jaxspec.cli import main

if __name__ == "__main__":
    sys.exit(main(["bench", *sys.argv[1:]]))
