"""Training prompts that carry a human-written passage to work on (summarise, rewrite, extract, answer).

Real requests often bring text written by someone else: an email to shorten, a report to summarise, a
paragraph to simplify. The target's answers to them copy and paraphrase that text, and a draft head
learns to follow it only from such answers. The other sources cannot supply them: Magpie turns
(`jaxspec.train.magpie`) rarely carry a passage, and derived prompts (`jaxspec.train.derived_prompts`)
wrap the target's own earlier answers, whose wording the head already predicts well (teacher-forced
depth-1 agreement 0.78 on held-out derived answers against 0.40 on the dev set's passage tasks).

The passages are a file shipped in `configs/prompts/` (`passages_en.jsonl`: 173 passages of 73-102 words
in 39 genres: news, emails, reviews, stories, science, history, instructions, ...), written for this
project by its engineers. Every passage is paired with every task of `PASSAGE_TASKS`, so one passage
gives the target several different jobs on the same text.

Line format: {"id": str, "genre": str, "text": str}; ids unique. Deterministic: rows come in a fixed
order shuffled by `seed`, with ids "passage_<passage id>_t<task index>" that do not depend on it.
"""

from __future__ import annotations

import random
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path

from jaxspec.train.prompts import NearDuplicateIndex, read_string_rows

PASSAGE_FILE = "prompts/passages_en.jsonl"  # under jaxspec.resources.configs_dir()

PASSAGE_TASKS = (
    "Summarize the following text in two or three sentences.\n\n{passage}",
    'Rewrite this passage in the past tense.\n\n"{passage}"',
    "Explain the following text to a ten-year-old, in simple words.\n\n{passage}",
    "List the main points of this text as short bullet points.\n\n{passage}",
    'Rewrite the following in a more formal and polite tone.\n\n"{passage}"',
    "Give this text a short title, then summarize it in one sentence.\n\n{passage}",
    'Write three questions about this passage and answer each one using only the passage.\n\n"{passage}"',
    "Shorten this text to about half its length, keeping the key details.\n\n{passage}",
    "What is the tone of the following text? Explain, quoting words from it.\n\n{passage}",
    "Extract every name, number and date mentioned in this text, as a list.\n\n{passage}",
    "Write a short reply to the following text, as if you were the person it is addressed to.\n\n{passage}",
    "Correct any grammar or spelling mistakes in the text below and return the corrected text.\n\n{passage}",
)
FIELDS = ("id", "genre", "text")


def default_passage_file() -> Path:
    from jaxspec.resources import configs_dir

    return configs_dir() / PASSAGE_FILE


def load_passages(path: str | Path) -> list[dict[str, str]]:
    """The passages of a JSONL file, checked: every line an object with non-empty string fields "id",
    "genre" and "text", ids unique. Raises InputError naming the file, line and field."""
    rows = read_string_rows(path, FIELDS, "passage")
    return [{field: row[field] for field in FIELDS} for row in rows]


def passage_prompts(
    passages: Sequence[Mapping[str, str]],
    *,
    exclude: Iterable[str] = (),
    tasks: Sequence[str] = PASSAGE_TASKS,
    seed: int = 0,
) -> list[dict[str, str]]:
    """Every passage x every task -> [{"id", "category": "passage", "prompt", "source"}] (source: the
    passage id), shuffled by `seed`; exact and near duplicates of `exclude` (e.g. the dev prompts)
    and of earlier rows dropped."""
    index = NearDuplicateIndex(list(exclude))
    rows, seen = [], set()
    for passage in passages:
        for k, task in enumerate(tasks):
            prompt = task.format(passage=passage["text"].strip())
            if prompt in seen or index.contains(prompt):
                continue
            seen.add(prompt)
            rows.append({
                "id": f"passage_{passage['id']}_t{k:02d}", "category": "passage", "prompt": prompt,
                "source": passage["id"],
            })  # fmt: skip
    random.Random(seed).shuffle(rows)
    return rows
