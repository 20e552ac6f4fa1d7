"""The human-written passage prompt source: the shipped file, the prompts built from it, bad input."""

from __future__ import annotations

from pathlib import Path

import pytest

from jaxspec.train.passages import PASSAGE_TASKS, default_passage_file, load_passages, passage_prompts
from jaxspec.train.prompts import NearDuplicateIndex, load_prompt_texts

DEV = Path(__file__).resolve().parents[2] / "shared" / "prompts_dev.jsonl"


@pytest.fixture(scope="module")
def passages():
    return load_passages(default_passage_file())


def test_shipped_passages_are_many_distinct_and_of_passage_length(passages):
    assert len(passages) >= 120
    assert len({p["id"] for p in passages}) == len(passages)
    assert len({p["text"] for p in passages}) == len(passages)
    assert len({p["genre"] for p in passages}) >= 30
    words = [len(p["text"].split()) for p in passages]
    assert min(words) >= 60 and max(words) <= 120
    # No two passages near-duplicate each other.
    index = NearDuplicateIndex([])
    for p in passages:
        assert not index.contains(p["text"]), p["id"]
        index.add(p["text"])


def test_every_passage_gets_every_task_once_with_stable_ids(passages):
    rows = passage_prompts(passages)
    assert len(rows) == len(passages) * len(PASSAGE_TASKS)
    assert len({r["id"] for r in rows}) == len(rows) and len({r["prompt"] for r in rows}) == len(rows)
    by_id = {p["id"]: p["text"] for p in passages}
    for row in rows:
        assert row["category"] == "passage"
        assert by_id[row["source"]] in row["prompt"]
        assert row["id"].startswith(f"passage_{row['source']}_t")
    shuffled = passage_prompts(passages, seed=1)
    assert [r["id"] for r in shuffled] != [r["id"] for r in rows]
    assert sorted(shuffled, key=lambda r: r["id"]) == sorted(rows, key=lambda r: r["id"])


def test_excluded_prompts_are_dropped(passages):
    first = passage_prompts(passages[:2])
    # An excluded prompt (a dev-set stand-in) that repeats one passage with other wording around it.
    exclude = ["Please summarise this for me:\n\n" + passages[0]["text"]]
    kept = passage_prompts(passages[:2], exclude=exclude)
    assert {r["source"] for r in first} - {r["source"] for r in kept} == {passages[0]["id"]}
    assert len(kept) == len(PASSAGE_TASKS)


def test_shipped_passages_are_disjoint_from_the_dev_prompts(passages):
    if not DEV.exists():
        pytest.skip(f"{DEV} not present")
    dev = load_prompt_texts(DEV)
    assert len(passage_prompts(passages, exclude=dev)) == len(passages) * len(PASSAGE_TASKS)
