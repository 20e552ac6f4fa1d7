"""Magpie-style user turns sampled from the model itself: clean, deduplicated, excluded sets respected."""

from __future__ import annotations

import dataclasses

import pytest

from jaxspec.train.magpie import CATEGORIES, MagpieConfig, clean_turn, magpie_prompts, pre_query_ids
from jaxspec.train.prompts import NearDuplicateIndex


@pytest.fixture(scope="module")
def smollm2_tokenizer():
    from jaxspec.loading import Tokenizer, read_gguf_metadata, resolve_model_path

    return Tokenizer.from_gguf(read_gguf_metadata(resolve_model_path("smollm2-135m")))


@pytest.fixture(scope="module")
def tiny_chat_model(tmp_path_factory, smollm2_tokenizer):
    """A tiny random Llama over SmolLM2's vocabulary, with SmolLM2's tokenizer and chat template."""
    import jaxspec
    from tests.tiny_models import save_tiny

    directory = tmp_path_factory.mktemp("tiny_chat")
    save_tiny("llama", directory, vocab_size=smollm2_tokenizer.vocab_size)
    return dataclasses.replace(jaxspec.load(str(directory)), tokenizer=smollm2_tokenizer)


def test_pre_query_prefix_ends_where_the_user_text_starts(smollm2_tokenizer):
    ids = pre_query_ids(smollm2_tokenizer, CATEGORIES["code"])
    text = smollm2_tokenizer.decode(ids, skip_special_tokens=False)
    assert text.startswith("<|im_start|>system\n" + CATEGORIES["code"]) and text.endswith(
        "<|im_start|>user\n"
    )
    default = smollm2_tokenizer.decode(pre_query_ids(smollm2_tokenizer, None), skip_special_tokens=False)
    assert "SmolLM" in default and default.endswith("<|im_start|>user\n")


def test_clean_turn_drops_degenerate_text():
    config = MagpieConfig()
    assert clean_turn("  How do I sort a list in Python?\n", config) == "How do I sort a list in Python?"
    assert clean_turn("ok", config) is None  # too short
    assert clean_turn("the the the the the the the the the the the the the", config) is None  # a loop
    assert clean_turn("Write a poem <|im_start|>assistant", config) is None  # template marker
    assert clean_turn("12 34 56 78", config) is None  # no letters
    assert clean_turn("word " * 400, config) is None  # too long


def test_sampled_turns_are_non_empty_and_deduplicated(tiny_chat_model):
    config = MagpieConfig(max_new_tokens=12, require_stop=False, min_distinct_ratio=0.0)
    rows = magpie_prompts(tiny_chat_model, 6, categories=("code", "fact"), config=config, batch_size=8,
                          max_batches_per_category=1)  # fmt: skip
    assert rows and {r["category"] for r in rows} <= {"magpie_code", "magpie_fact"}
    assert len({r["id"] for r in rows}) == len(rows)
    index = NearDuplicateIndex([])
    for row in rows:
        assert row["prompt"].strip() and clean_turn(row["prompt"], config) == row["prompt"]
        assert not index.contains(row["prompt"]), row["prompt"]
        index.add(row["prompt"])
    # Same seed, same turns; another seed, other turns.
    again = magpie_prompts(tiny_chat_model, 6, categories=("code", "fact"), config=config, batch_size=8,
                           max_batches_per_category=1)  # fmt: skip
    assert again == rows
    other = magpie_prompts(tiny_chat_model, 6, categories=("code",), config=config, batch_size=8, seed=1,
                           max_batches_per_category=1)  # fmt: skip
    assert {r["prompt"] for r in other} != {r["prompt"] for r in rows if r["category"] == "magpie_code"}


def test_greedy_draws_collapse_to_one_turn_and_excluded_turns_are_dropped(tiny_chat_model):
    # Greedy decoding writes the same turn in every draw of a category: deduplication keeps one.
    config = MagpieConfig(temperature=0.0, max_new_tokens=12, require_stop=False, min_distinct_ratio=0.0)
    rows = magpie_prompts(tiny_chat_model, 4, categories=("chat",), config=config, batch_size=4,
                          max_batches_per_category=2)  # fmt: skip
    assert len(rows) == 1
    excluded = magpie_prompts(tiny_chat_model, 4, categories=("chat",), config=config, batch_size=4,
                              max_batches_per_category=2, exclude=[rows[0]["prompt"].upper()])  # fmt: skip
    assert excluded == []


def test_resumed_sampling_gives_the_uninterrupted_turns(tiny_chat_model):
    config = MagpieConfig(max_new_tokens=12, require_stop=False, min_distinct_ratio=0.0)
    kwargs = dict(categories=("code", "writing"), config=config, batch_size=4, max_batches_per_category=3)
    saved: list[list[dict]] = []
    full = magpie_prompts(tiny_chat_model, 9, on_batch=saved.append, **kwargs)
    assert len(saved) >= 4 and sum(len(b) for b in saved) == len(full)
    # Killed after the third batch: what was saved is `done`, sampling goes on from there.
    done = [row for batch in saved[:3] for row in batch]
    assert magpie_prompts(tiny_chat_model, 9, done=done, **kwargs) == full


def test_refilled_slots_sample_the_same_turns_as_static_batches(tiny_chat_model):
    # 3 slots refilled through 2 batches of 8 draws: each draw's text is the one `generate` gives its
    # (seed, request id) in a static batch, so the kept turns are the first clean, new ones in draw order.
    from jaxspec.config import SamplingParams
    from jaxspec.decoding.generate import generate

    config = MagpieConfig(max_new_tokens=12, require_stop=False, min_distinct_ratio=0.0)
    rows = magpie_prompts(tiny_chat_model, 10, categories=("fact",), config=config, batch_size=8, slots=3,
                          seed=2, max_batches_per_category=2)  # fmt: skip
    prefix = pre_query_ids(tiny_chat_model.tokenizer, CATEGORIES["fact"])
    sampling = SamplingParams(temperature=config.temperature, top_p=config.top_p)
    expected, index = [], NearDuplicateIndex([])
    for batch in range(2):
        draws = list(range(batch * 8, (batch + 1) * 8))
        static = generate(tiny_chat_model, [prefix] * 8, max_new_tokens=12, sampling=sampling, seed=2 * 1000,
                          request_ids=draws)  # fmt: skip
        for draw, completion in zip(draws, static, strict=True):
            text = clean_turn(completion.text, config)
            if len(expected) < 10 and text is not None and not index.contains(text):
                index.add(text)
                expected.append({"id": f"magpie-fact-s2-{draw}", "category": "magpie_fact", "prompt": text,
                                 "batch": batch})  # fmt: skip
    assert len(expected) >= 2 and rows == expected
