"""Prompt files (`jaxspec train --prompts FILE`): the shipped human-written questions, and bad input
(prompt and passage files share one checked reader)."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import pytest

from jaxspec.errors import InputError
from jaxspec.resources import configs_dir
from jaxspec.train.passages import load_passages
from jaxspec.train.prompts import NearDuplicateIndex, load_prompt_rows, load_prompt_texts

DEV = Path(__file__).resolve().parents[2] / "shared" / "prompts_dev.jsonl"
QUESTIONS = configs_dir() / "prompts" / "questions_en.jsonl"
PUBLIC = configs_dir() / "prompts" / "public_en.jsonl"


@pytest.fixture(scope="module")
def questions():
    return load_prompt_rows(QUESTIONS)


def test_shipped_questions_are_many_distinct_and_in_four_categories(questions):
    assert len(questions) >= 500
    assert len({q["id"] for q in questions}) == len(questions)
    counts = Counter(q["category"] for q in questions)
    assert set(counts) == {"question_fact", "question_chat", "question_code", "question_writing"}
    assert counts["question_fact"] >= 250
    index = NearDuplicateIndex([])
    for q in questions:
        assert not index.contains(q["prompt"]), q["id"]
        index.add(q["prompt"])


def test_shipped_questions_are_disjoint_from_the_dev_prompts(questions):
    if not DEV.exists():
        pytest.skip(f"{DEV} not present")
    index = NearDuplicateIndex(load_prompt_texts(DEV))
    assert [q["id"] for q in questions if index.contains(q["prompt"])] == []


def test_public_benchmark_prompts_are_attributed_distinct_and_disjoint_from_the_dev_prompts():
    """configs/prompts/public_en.jsonl (scripts/import_public_prompts.py): MT-Bench first turns and IFEval
    prompts, each naming its source and licence, no two near duplicates, none near a dev prompt."""
    rows = [json.loads(line) for line in PUBLIC.open()]
    assert len(load_prompt_rows(PUBLIC)) == len(rows) >= 600
    sources = Counter(r["source"] for r in rows)
    assert set(sources) == {"MT-Bench (FastChat), Apache-2.0", "IFEval (Google Research), Apache-2.0"}
    assert sources["MT-Bench (FastChat), Apache-2.0"] == 80
    index = NearDuplicateIndex(load_prompt_texts(DEV) if DEV.exists() else [])
    for row in rows:
        assert not index.contains(row["prompt"]), row["id"]
        index.add(row["prompt"])


GOOD_PROMPT = {"id": "ok", "prompt": "A fine question?"}
GOOD_PASSAGE = {"id": "ok", "genre": "news", "text": "A fine passage."}


@pytest.mark.parametrize(
    "load,good,line,message",
    [
        (load_prompt_rows, GOOD_PROMPT, "{not json", "not valid JSON"),
        (load_prompt_rows, GOOD_PROMPT, '["a list"]', "expected an object with fields id, prompt"),
        (load_prompt_rows, GOOD_PROMPT, '{"id": "a"}', "field 'prompt'"),
        (load_prompt_rows, GOOD_PROMPT, '{"id": "a", "prompt": "  "}', "field 'prompt'"),
        (load_prompt_rows, GOOD_PROMPT, '{"id": 3, "prompt": "Hello?"}', "field 'id'"),
        (load_prompt_rows, GOOD_PROMPT, '{"id": "a", "prompt": "Hi?", "category": 7}', "field 'category'"),
        (load_prompt_texts, GOOD_PROMPT, '{"id": "a", "text": "Hello?"}', "field 'prompt'"),
        (load_passages, GOOD_PASSAGE, "{not json", "not valid JSON"),
        (load_passages, GOOD_PASSAGE, '["a list"]', "expected an object with fields id, genre, text"),
        (load_passages, GOOD_PASSAGE, '{"id": "a", "genre": "news"}', "field 'text'"),
        (load_passages, GOOD_PASSAGE, '{"id": "a", "genre": "", "text": "Some text."}', "field 'genre'"),
        (load_passages, GOOD_PASSAGE, '{"id": 3, "genre": "news", "text": "Some text."}', "field 'id'"),
    ],
)
def test_a_bad_line_names_the_file_line_and_field(tmp_path, load, good, line, message):
    path = tmp_path / "rows.jsonl"
    path.write_text(json.dumps(good) + "\n\n" + line + "\n")
    with pytest.raises(InputError, match=rf"rows.jsonl:3: .*{message}"):
        load(path)


@pytest.mark.parametrize(
    "load,good,kind", [(load_prompt_rows, GOOD_PROMPT, "prompt"), (load_passages, GOOD_PASSAGE, "passage")]
)
def test_duplicate_ids_missing_and_empty_files_are_refused(tmp_path, load, good, kind):
    path = tmp_path / "dup.jsonl"
    path.write_text(json.dumps(good) + "\n" + json.dumps(good) + "\n")
    with pytest.raises(InputError, match=r"dup.jsonl:2: id 'ok' already used on line 1"):
        load(path)
    with pytest.raises(InputError, match=f"{kind} file not found"):
        load(tmp_path / "missing.jsonl")
    (tmp_path / "empty.jsonl").write_text("\n")
    with pytest.raises(InputError, match=f"no {kind}s"):
        load(tmp_path / "empty.jsonl")


def test_an_exclude_file_needs_prompts_but_no_ids(tmp_path):
    path = tmp_path / "exclude.jsonl"
    path.write_text(json.dumps({"prompt": "First?"}) + "\n" + json.dumps({"prompt": "Second?"}) + "\n")
    assert load_prompt_texts(path) == ["First?", "Second?"]
    with pytest.raises(InputError, match=r"exclude.jsonl:1: field 'id'"):
        load_prompt_rows(path)


def test_train_cli_names_the_bad_prompt_line_before_loading_anything(tmp_path, capsys):
    from jaxspec.cli import main

    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"id": "a", "prompt": "Fine?"}) + "\n" + json.dumps({"id": "b"}) + "\n")
    code = main([
        "train", "--method", "eagle3", "--model", "no-such-model", "--workdir", str(tmp_path / "w"),
        "--prompts", str(bad), "--stages", "distill", "--no-progress",
    ])  # fmt: skip
    assert code == 2
    assert f"{bad}:2: field 'prompt' must be a non-empty string" in capsys.readouterr().err
