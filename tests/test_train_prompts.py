"""The training prompt set: size, variety, and disjointness from the development prompts."""

from pathlib import Path

import pytest

from jaxspec.train.prompts import (
    NearDuplicateIndex,
    is_near_duplicate,
    load_prompt_texts,
    shingles,
    training_prompts,
)

DEV = Path(__file__).resolve().parents[2] / "shared" / "prompts_dev.jsonl"


@pytest.fixture(scope="module")
def dev_prompts():
    if not DEV.exists():
        pytest.skip(f"{DEV} not present")
    return load_prompt_texts(DEV)


@pytest.fixture(scope="module")
def prompts(dev_prompts):
    return training_prompts(exclude=dev_prompts)


def test_at_least_2000_distinct_prompts_in_six_categories(prompts):
    texts = [p["prompt"] for p in prompts]
    assert len(texts) >= 2000
    assert len(set(texts)) == len(texts)
    assert len({p["id"] for p in prompts}) == len(prompts)
    categories = {p["category"] for p in prompts}
    assert {"coding", "rewrite", "summarise", "extraction", "chat", "reasoning", "knowledge"} <= categories


def test_disjoint_from_dev_exact_and_near_duplicates(prompts, dev_prompts):
    texts = {p["prompt"] for p in prompts}
    assert not texts & set(dev_prompts)
    index = NearDuplicateIndex(dev_prompts)
    assert not [t for t in texts if index.contains(t)]


def test_near_duplicate_detector_catches_paraphrase_and_case():
    dev = [
        "Write a Python function that returns the n-th Fibonacci number using a loop instead of recursion."
    ]
    assert is_near_duplicate(
        "write a python function that returns the n-th fibonacci number using a loop!", dev
    )
    assert is_near_duplicate(dev[0].upper(), dev)
    assert not is_near_duplicate("Explain volcanoes to a high-school student.", dev)
    assert shingles("a b c d e") == {("a", "b", "c", "d"), ("b", "c", "d", "e")}


def test_order_is_deterministic_and_excluding_removes_matches():
    a = training_prompts()
    b = training_prompts()
    assert a == b
    first = a[0]["prompt"]
    c = training_prompts(exclude=[first])
    assert first not in {p["prompt"] for p in c}
    assert len(c) < len(a)
