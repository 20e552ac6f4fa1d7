"""User turns written by the instruction-tuned target itself (the "Magpie" recipe).

The chat template is rendered up to the point where a user message starts (the "pre-query" prefix);
the model, sampled at a temperature, then writes what a user would send, and stops at its end-of-turn
token. A system message per category steers the subject (coding, facts, passages to summarise, ...),
and each category has its own seed, so categories can grow independently. Turns are kept only when
they are clean: finished with an end-of-turn token, of a sane length, not degenerate (repeated words,
template markers, no letters), and neither an exact nor a near duplicate of a kept turn or of an
excluded set (the dev prompts). Deterministic for a given model, seed and settings.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable, Iterable, Sequence

from jaxspec.config import SamplingParams
from jaxspec.train.prompts import NearDuplicateIndex

SENTINEL = "\x00MAGPIE_USER_TURN\x00"

# Category -> system message. The user turn is later answered under the model's default system prompt,
# so these only steer what the model imagines a user asking.
CATEGORIES: dict[str, str] = {
    "chat": "You are a friendly assistant. Users ask you for advice, opinions, plans and everyday help.",
    "code": "You are a programming assistant. Users ask you to write, fix, explain or review code, "
    "often pasting the code they are working on.",
    "fact": "You are a knowledgeable assistant. Users ask you factual questions about science, history, "
    "geography, health and technology.",
    "summ": "You are a writing assistant. Users paste a passage of several sentences (an article, an "
    "email, notes or a story) and ask you to summarise, shorten or rewrite it.",
    "writing": "You are a creative writing assistant. Users ask for stories, poems, letters, slogans "
    "and product descriptions.",
    "reasoning": "You are a careful tutor. Users ask math word problems, logic puzzles and questions "
    "that need step-by-step reasoning.",
}


@dataclasses.dataclass(frozen=True)
class MagpieConfig:
    """How user turns are sampled and filtered.

    temperature / top_p: sampling of the user turn (Magpie samples at temperature ~1).
    max_new_tokens: budget of a user turn; a turn without an end-of-turn token within it is dropped.
    min_words / max_chars: kept turns have at least `min_words` words and at most `max_chars` characters.
    min_distinct_ratio: distinct words / words, for turns of 12+ words (drops loops like "a a a a").
    require_stop: keep only turns that ended with the end-of-turn token (off for untrained test models).
    """

    temperature: float = 1.0
    top_p: float = 0.95
    max_new_tokens: int = 160
    min_words: int = 3
    max_chars: int = 1200
    min_distinct_ratio: float = 0.4
    require_stop: bool = True


def pre_query_ids(tokenizer, system: str | None) -> list[int]:
    """Token ids of the chat template rendered up to where the first user message's text starts
    (with `system` as the system message, or the template's default when None)."""
    messages = ([{"role": "system", "content": system}] if system else []) + [
        {"role": "user", "content": SENTINEL}
    ]
    text = tokenizer.render_chat(messages, add_generation_prompt=False)
    if SENTINEL not in text:
        raise ValueError("magpie: the chat template does not place the user message's text verbatim")
    return list(tokenizer.encode(text[: text.index(SENTINEL)]))


_MARKERS = re.compile(r"<\|[^|]*\|>|\b(?:assistant|user|system)\s*:?\s*$", re.IGNORECASE)


def clean_turn(text: str, config: MagpieConfig) -> str | None:
    """The stripped user turn, or None when it is degenerate (see the module docstring)."""
    text = text.strip()
    if not text or len(text) > config.max_chars or _MARKERS.search(text):
        return None
    words = re.findall(r"\w+", text.lower())
    if len(words) < config.min_words or not re.search(r"[A-Za-z]", text):
        return None
    if len(words) >= 12 and len(set(words)) / len(words) < config.min_distinct_ratio:
        return None
    return text


def magpie_prompts(
    model,
    per_category: int,
    *,
    categories: Sequence[str] = tuple(CATEGORIES),
    seed: int = 0,
    config: MagpieConfig = MagpieConfig(),
    exclude: Iterable[str] = (),
    batch_size: int = 32,
    slots: int | None = None,
    max_batches_per_category: int | None = None,
    done: Sequence[dict] = (),
    on_batch: Callable[[list[dict]], None] | None = None,
) -> list[dict]:
    """Up to `per_category` clean, deduplicated user turns per category:
    [{"id", "category", "prompt", "batch"}], in sampling order.

    Draws are sampled in batches of `batch_size` per category (seed = (seed, category), request ids =
    the draw's index) until `per_category` are kept or `max_batches_per_category` (default: enough for
    4x the target) were drawn. Ids are "magpie-{category}-s{seed}-{draw}". The next batch of every
    category that still needs turns is sampled in one continuous-batching call through `slots`
    refilled rows (default `batch_size`), so a short turn frees its row for the next draw; a draw's
    text depends only on its seed and request id, not on what it was batched with. Batches are then
    filtered in the order (batch, category), which fixes which of two near-duplicates is kept.
    Resumable: `done` holds rows of an earlier, interrupted call with the same arguments (e.g. what
    `on_batch`, called with each batch's kept rows, had saved); they are kept, count towards the
    targets, and sampling continues after the last batch each category had reached.
    """
    from jaxspec.decoding.continuous import generate_continuous

    if model.tokenizer is None:
        raise ValueError("magpie: the model has no tokenizer")
    unknown = [c for c in categories if c not in CATEGORIES]
    if unknown:
        raise ValueError(f"magpie: unknown categories {unknown}; choose from {sorted(CATEGORIES)}")
    seen = NearDuplicateIndex(list(exclude))
    rows = list(done)
    for row in rows:
        seen.add(row["prompt"])
    sampling = SamplingParams(temperature=config.temperature, top_p=config.top_p)
    limit = max_batches_per_category or max(1, -(-4 * per_category // batch_size))
    prefixes = {c: pre_query_ids(model.tokenizer, CATEGORIES[c]) for c in categories}
    earlier = {c: [r for r in rows if r["category"] == f"magpie_{c}"] for c in categories}
    kept = {c: len(earlier[c]) for c in categories}
    next_batch = {c: max((r["batch"] + 1 for r in earlier[c]), default=0) for c in categories}
    while True:
        # (batch, category index) of every category that still samples: the order its batch is filtered in.
        due = sorted(
            (next_batch[c], i)
            for i, c in enumerate(categories)
            if kept[c] < per_category and next_batch[c] < limit
        )
        if not due:
            return rows
        requests = [(i, draw) for batch, i in due
                    for draw in range(batch * batch_size, (batch + 1) * batch_size)]  # fmt: skip
        completions = generate_continuous(
            model, [prefixes[categories[i]] for i, _ in requests], max_new_tokens=config.max_new_tokens,
            sampling=sampling, seed=[seed * 1000 + i for i, _ in requests],
            request_ids=[draw for _, draw in requests], slots=slots or batch_size,
        )  # fmt: skip
        for k, (batch, i) in enumerate(due):
            category = categories[i]
            new = []
            for (_, draw), completion in zip(
                requests[k * batch_size : (k + 1) * batch_size],
                completions[k * batch_size : (k + 1) * batch_size],
                strict=True,
            ):
                if kept[category] + len(new) >= per_category:
                    break
                if config.require_stop and completion.finish_reason != "stop":
                    continue
                text = clean_turn(completion.text, config)
                if text is None or seen.contains(text):  # exact or near duplicate (or excluded)
                    continue
                seen.add(text)
                new.append({"id": f"magpie-{category}-s{seed}-{draw}", "category": f"magpie_{category}",
                            "prompt": text, "batch": batch})  # fmt: skip
            kept[category] += len(new)
            next_batch[category] = batch + 1
            rows.extend(new)
            if on_batch is not None:
                on_batch(new)
