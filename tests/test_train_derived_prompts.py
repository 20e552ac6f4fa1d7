"""Second-round prompts built from the target's own answers: passages and code blocks put to work."""

from jaxspec.train.derived_prompts import (
    CODE_TEMPLATES,
    PROSE_TEMPLATES,
    derived_prompts,
    first_code_block,
    passage_of,
)

PROSE = (
    "## Volcanoes\n\n"
    "Volcanoes form where molten rock reaches the surface. **Most** of them sit on the edges of tectonic "
    "plates.\n"
    "- They can be active, dormant or extinct.\n"
    "1. Eruptions release ash, gas and lava into the air and over the land nearby. Scientists watch "
    "them with seismometers and satellites to warn the people who live close by. "
    "This last sentence is cut because it would go past the word limit of the passage that we build."
)
CODE = (
    "Here is a function:\n\n```python\ndef add(a, b):\n    total = a + b\n    return total\n```\n\n"
    "And another:\n\n```python\ndef sub(a, b):\n    return a - b\n```"
)


def test_passage_drops_markup_and_cuts_at_a_sentence_end():
    passage = passage_of(PROSE, max_words=60)
    assert passage.startswith("Volcanoes Volcanoes form where molten rock")
    assert "**" not in passage and "#" not in passage and "- They" not in passage and "1." not in passage
    assert passage.endswith("who live close by.")
    assert len(passage.split()) <= 60
    assert passage_of("Too short to use. Only eight words here.", max_words=60) is None


def test_first_code_block_respects_the_line_limits():
    assert first_code_block(CODE, max_lines=14) == (
        "python",
        "def add(a, b):\n    total = a + b\n    return total",
    )
    # The first block has 3 lines: with a 2-line limit the second (2 lines) is also too short to use.
    assert first_code_block(CODE, max_lines=2) is None
    assert first_code_block("no code here", max_lines=14) is None


def _distinct_prose(i: int) -> str:
    """A passage of 5 ten-word sentences whose words are unique to answer i (no near duplicates)."""
    words = [f"w{i}x{j}" for j in range(50)]
    return " ".join(" ".join(words[k : k + 10]).capitalize() + "." for k in range(0, 50, 10))


def _answers(distinct: bool = False):
    answers = []
    for i in range(12):
        if distinct:
            answers.append({"id": f"chat_{i:04d}", "category": "chat", "text": _distinct_prose(i)})
            continue
        answers.append(
            {
                "id": f"knowledge_{i:04d}",
                "category": "knowledge",
                "text": PROSE.replace("Volcanoes", f"Topic{i}"),
            }
        )
        answers.append(
            {"id": f"coding_{i:04d}", "category": "coding", "text": CODE.replace("add", f"add{i}")}
        )
    answers.append({"id": "reasoning_0001", "category": "reasoning", "text": PROSE})  # not a prose source
    return answers


def test_derived_prompts_interleave_kinds_use_every_template_and_are_deterministic():
    rows = derived_prompts(_answers())
    assert [r["category"] for r in rows[:4]] == ["derived_passage", "derived_code"] * 2
    assert len(rows) == 24 and len({r["id"] for r in rows}) == 24
    assert {r["source"] for r in rows}.isdisjoint({"reasoning_0001"})
    prose = [r for r in rows if r["category"] == "derived_passage"]
    code = [r for r in rows if r["category"] == "derived_code"]
    assert all("Topic" in r["prompt"] and "molten rock" in r["prompt"] for r in prose)
    assert all("```python\ndef add" in r["prompt"] for r in code)
    heads = {t.split("{")[0][:30] for t in PROSE_TEMPLATES}
    assert {r["prompt"][:30] for r in prose[: len(PROSE_TEMPLATES)]} == {h[:30] for h in heads}
    assert len({r["prompt"][:20] for r in code}) == len(CODE_TEMPLATES)
    assert derived_prompts(list(reversed(_answers()))) == rows


def test_derived_prompts_drop_what_the_exclude_list_holds():
    rows = derived_prompts(_answers(distinct=True))
    assert len(rows) == 12
    excluded = [rows[0]["prompt"], rows[1]["prompt"].replace("\n", " ").upper()]
    kept = derived_prompts(_answers(distinct=True), exclude=excluded)
    assert rows[0]["prompt"] not in {r["prompt"] for r in kept}
    assert rows[1]["prompt"] not in {r["prompt"] for r in kept}
    assert len(kept) == len(rows) - 2
