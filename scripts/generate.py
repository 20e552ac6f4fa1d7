"""Batch offline generation: `python scripts/generate.py --input IN.jsonl --output OUT.jsonl [...]`.

The same job as `jaxspec generate --input ... --output ...`; see jaxspec/batch/job.py for the input
and output formats, resuming, and the speculation flags (`--help` lists them all).
"""

import sys

from jaxspec.batch.job import main

if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
