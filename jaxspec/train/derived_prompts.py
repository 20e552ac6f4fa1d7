"""Second-round training prompts built from the target's own earlier answers (a self-instruct step).

The templated set (`jaxspec.train.prompts`) asks short, self-contained questions. Real requests often
carry material to work on: a passage to summarise or rewrite, a function to fix, document or test. Its
responses are where a draft head must learn to copy from the context, and the templated set has none.
`derived_prompts` takes the distilled answers of the first round (text written by the target itself,
so no outside corpus is needed) and wraps them in such tasks:

  prose answers (knowledge, summarise, chat, rewrite)  -> summarise / simplify / bullet / retitle / quiz
                                                         / shorten / email / tone of a passage
  coding answers                                      -> document / explain / test / review / port /
                                                         simplify the first fenced code block

Deterministic: the sources are taken in id order and template k goes to the k-th usable source of
its kind, so every machine derives the same prompts from the same distill.jsonl. Passages are cut at
a sentence end to at most `max_passage_words` words, code blocks to at most `max_code_lines` lines.
"""

from __future__ import annotations

import itertools
import re
from collections.abc import Iterable, Mapping, Sequence

from jaxspec.train.prompts import NearDuplicateIndex

PROSE_CATEGORIES = ("knowledge", "summarise", "chat", "rewrite")
CODE_CATEGORIES = ("coding",)

PROSE_TEMPLATES = (
    'Summarize the following passage in two sentences.\n\n"{passage}"',
    'Rewrite this paragraph in plain, simple words that a child could follow.\n\n"{passage}"',
    "Turn the text below into a bulleted list of its main points.\n\n{passage}",
    'Give this paragraph a short title, then state its main idea in one sentence.\n\n"{passage}"',
    'Write three quiz questions, with their answers, based only on this passage:\n\n"{passage}"',
    "Make the following paragraph shorter without dropping any facts.\n\n{passage}",
    'Rewrite this text as a short, friendly email to a colleague.\n\n"{passage}"',
    'Summarize this in one sentence, then list two questions a reader might still have.\n\n"{passage}"',
    "What is the main claim of the following text, and what supports it?\n\n{passage}",
    'Rewrite the passage below in a formal, academic tone.\n\n"{passage}"',
)
CODE_TEMPLATES = (
    "Add type hints and a docstring to this code, and keep its behaviour the same:\n\n```{lang}\n{code}\n```",
    "Explain what this code does, step by step.\n\n```{lang}\n{code}\n```",
    "Write two unit tests for this code.\n\n```{lang}\n{code}\n```",
    "Review this code: is there a bug or an input it does not handle? Give a corrected version.\n\n"
    "```{lang}\n{code}\n```",
    "Rewrite this code in {other}.\n\n```{lang}\n{code}\n```",
    "Make this code shorter and easier to read without changing what it does.\n\n```{lang}\n{code}\n```",
)
PORT_TARGETS = ("Python", "JavaScript", "Go", "Java")

_FENCE = re.compile(r"```([A-Za-z+#]*)[ \t]*\n(.*?)```", re.DOTALL)
_SENTENCE_END = re.compile(r"(?<=[.!?])\s+")


def first_code_block(text: str, max_lines: int) -> tuple[str, str] | None:
    """(language tag, code) of the first fenced block of `text` with 3..max_lines non-empty lines."""
    for match in _FENCE.finditer(text):
        lines = [line.rstrip() for line in match.group(2).strip("\n").splitlines()]
        if 3 <= sum(1 for line in lines if line.strip()) and len(lines) <= max_lines:
            return match.group(1).lower() or "text", "\n".join(lines)
    return None


def passage_of(text: str, max_words: int, min_words: int = 25) -> str | None:
    """The prose of `text` (headings, list markers, code and markup dropped) cut at a sentence end to at
    most `max_words` words; None when fewer than `min_words` words remain."""
    text = _FENCE.sub(" ", text)
    kept = []
    for line in text.splitlines():
        line = re.sub(r"^\s*(#+|[-*]|\d+[.)])\s*", "", line).replace("**", "").strip()
        if line:
            kept.append(line)
    words_so_far, out = 0, []
    for sentence in _SENTENCE_END.split(" ".join(kept)):
        n = len(sentence.split())
        if words_so_far + n > max_words:
            break
        out.append(sentence)
        words_so_far += n
    if words_so_far < min_words or not out[-1].endswith((".", "!", "?")):
        return None
    return " ".join(out)


def derived_prompts(
    answers: Sequence[Mapping[str, str]],
    *,
    exclude: Iterable[str] = (),
    max_passage_words: int = 70,
    max_code_lines: int = 14,
) -> list[dict[str, str]]:
    """Prompts built from earlier answers: answers = [{"id", "category", "text"}] (the decoded responses).

    Returns [{"id": "derived_<kind>_<n>", "category", "prompt", "source"}] with prose and code prompts
    interleaved, exact and near duplicates of `exclude` (e.g. the dev prompts) dropped.
    """
    index = NearDuplicateIndex(list(exclude))
    ordered = sorted(answers, key=lambda a: a["id"])
    prose, code = [], []
    for answer in ordered:
        if answer["category"] in PROSE_CATEGORIES:
            passage = passage_of(answer["text"], max_passage_words)
            if passage is not None:
                prose.append((answer["id"], passage))
        elif answer["category"] in CODE_CATEGORIES:
            block = first_code_block(answer["text"], max_code_lines)
            if block is not None:
                code.append((answer["id"], *block))
    passage_prompts = [
        ("passage", source, PROSE_TEMPLATES[k % len(PROSE_TEMPLATES)].format(passage=passage))
        for k, (source, passage) in enumerate(prose)
    ]
    code_prompts = []
    for k, (source, lang, block) in enumerate(code):
        other = next(t for t in itertools.islice(itertools.cycle(PORT_TARGETS), k, None) if t.lower() != lang)
        prompt = CODE_TEMPLATES[k % len(CODE_TEMPLATES)].format(lang=lang, code=block, other=other)
        code_prompts.append(("code", source, prompt))
    # Interleave the two kinds so that any prefix of the list mixes them.
    mixed = [m for pair in itertools.zip_longest(passage_prompts, code_prompts) for m in pair if m]
    rows, seen, counters = [], set(), {"passage": 0, "code": 0}
    for kind, source, prompt in mixed:
        if prompt in seen or index.contains(prompt):
            continue
        seen.add(prompt)
        counters[kind] += 1
        rows.append({
            "id": f"derived_{kind}_{counters[kind]:04d}", "category": f"derived_{kind}",
            "prompt": prompt, "source": source,
        })  # fmt: skip
    return rows
