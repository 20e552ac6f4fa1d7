"""Train a draft head for a model: same as `jaxspec train` (distil -> features -> train -> export).

    python scripts/train_heads.py --method eagle3 --model smollm2-135m --workdir ../train_runs/smollm2 \
        --output configs/heads/smollm2-135m/eagle3 --exclude ../shared/prompts_dev.jsonl

Rerun the same command to continue an interrupted stage; add --resume after a kill during training.
"""

import sys

from jaxspec.cli import main

if __name__ == "__main__":
    sys.exit(main(["train", *sys.argv[1:]]))
