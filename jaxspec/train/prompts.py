"""The project's own training prompt set: templated task x topic instructions in six categories.

Deterministic (no randomness beyond a fixed-seed shuffle), so every machine builds the same list. The
set is kept disjoint from the development prompts (`../shared/prompts_dev.jsonl`): exact and near
duplicates (word 4-gram Jaccard >= `NEAR_DUPLICATE_JACCARD`) are dropped by `training_prompts`.
"""

from __future__ import annotations

import itertools
import json
import random
import re
from collections.abc import Iterable
from pathlib import Path

from jaxspec.errors import InputError

NEAR_DUPLICATE_JACCARD = 0.5

LANGUAGES = ("Python", "JavaScript", "Go", "Rust", "Java", "C++", "TypeScript", "Ruby")
CODING_TASKS = (
    "reverses the words in a sentence",
    "counts how many vowels a string contains",
    "checks whether two strings are anagrams of each other",
    "returns the largest and smallest value in a list",
    "flattens a nested list of integers",
    "converts a temperature from Celsius to Fahrenheit",
    "computes the factorial of a non-negative integer",
    "merges two sorted lists into one sorted list",
    "finds the second largest number in an array",
    "removes all whitespace from a string",
    "checks whether a year is a leap year",
    "computes the greatest common divisor of two integers",
    "groups a list of words by their first letter",
    "counts the frequency of each word in a text",
    "rotates a list to the right by k positions",
    "validates that a string looks like an email address",
    "converts a Roman numeral to an integer",
    "returns the running sum of a list of numbers",
    "splits a list into chunks of a given size",
    "capitalizes the first letter of every word",
    "finds the longest common prefix of a list of strings",
    "performs binary search on a sorted array",
    "transposes a matrix given as a list of rows",
    "parses a date string in the form YYYY-MM-DD",
    "returns the prime factors of an integer",
    "computes the average of the even numbers in a list",
    "implements a simple stack with push and pop",
    "checks whether parentheses in a string are balanced",
    "converts a decimal number to binary",
    "returns the n most common characters in a string",
)
CODING_TEMPLATES = (
    "Write a {lang} function that {task}.",
    "Show me how to write a {lang} program that {task}, and explain each step briefly.",
    "In {lang}, implement a function that {task}. Add a short usage example.",
    "Write a {lang} function that {task}, then list two edge cases a test should cover.",
)

TOPICS = (
    "volcanoes",
    "the water cycle",
    "honey bees",
    "the printing press",
    "black holes",
    "coral reefs",
    "the Roman Empire",
    "electric cars",
    "sleep",
    "the human heart",
    "rainforests",
    "the internet",
    "recycling",
    "earthquakes",
    "the moon landing",
    "vaccines",
    "solar panels",
    "chess",
    "coffee",
    "the Silk Road",
    "glaciers",
    "migratory birds",
    "the stock market",
    "photosynthesis",
    "jazz music",
    "the Great Wall of China",
    "antibiotics",
    "wind turbines",
    "the immune system",
    "deserts",
    "the French Revolution",
    "octopuses",
    "3D printing",
    "tea ceremonies",
    "the Olympic Games",
    "bread baking",
    "lighthouses",
    "the periodic table",
    "renewable energy",
    "public libraries",
    "urban gardening",
    "the Amazon river",
    "dinosaurs",
    "satellites",
    "marathon running",
    "origami",
    "the Renaissance",
    "tides",
    "bicycles",
    "clouds",
    "inflation",
    "the human brain",
    "penguins",
    "ancient Egypt",
    "composting",
    "trains",
    "rainbows",
    "the Industrial Revolution",
    "whales",
    "bridges",
)
KNOWLEDGE_TEMPLATES = (
    "Explain {topic} to a high-school student.",
    "What are three surprising facts about {topic}?",
    "Give a short overview of the history of {topic}.",
    "Why does {topic} matter for everyday life? Answer in a paragraph.",
    "What are common misconceptions about {topic}?",
    "Describe how scientists or historians study {topic}.",
)
WRITING_TEMPLATES = (
    "Write a short paragraph about {topic}, then summarize it in one sentence.",
    "Write two sentences about {topic} in a formal tone, then rewrite them in a casual tone.",
    "Write a short informative paragraph about {topic} for a children's magazine.",
    "Write a tweet-length summary of why {topic} is interesting.",
    "Write a brief encyclopedia-style introduction to {topic}, then condense it into three bullet points.",
)
REWRITE_SENTENCES = (
    "the report about {topic} is late again and nobody knows why",
    "i think {topic} is kinda overrated but my friends love it",
    "we need more money for the {topic} project or it will fail",
    "the new exhibit on {topic} was super crowded and the lights were bad",
    "can u send me the notes on {topic} before friday",
)
REWRITE_TEMPLATES = (
    'Rewrite this sentence in a polite, professional tone: "{sentence}."',
    'Correct the grammar and punctuation of this sentence: "{sentence}"',
)
EXTRACTION_PEOPLE = ("Maria Lopez", "Kenji Sato", "Amara Okafor", "Lukas Berg", "Priya Nair", "Tom Walsh")
EXTRACTION_CITIES = ("Lisbon", "Osaka", "Nairobi", "Toronto", "Krakow", "Melbourne")
EXTRACTION_TEMPLATES = (
    'Extract every person, city and date from this text as a JSON object: "{text}"',
    'List the names, places and numbers mentioned in the following note: "{text}"',
    'From this message, pull out who is involved, where, and when, as a bulleted list: "{text}"',
)
CHAT_SITUATIONS = (
    "starting a new job",
    "moving to a new city",
    "learning to cook",
    "giving a wedding speech",
    "running my first 10k race",
    "learning a second language",
    "adopting a dog",
    "planning a budget",
    "preparing for an exam",
    "making new friends as an adult",
    "working from home",
    "starting a podcast",
    "hosting a dinner party",
    "learning to play the guitar",
    "travelling alone for the first time",
    "asking for a raise",
    "keeping a houseplant alive",
    "writing a novel",
    "getting up earlier",
    "organizing a messy garage",
)
CHAT_TEMPLATES = (
    "I'm nervous about {situation}. What advice would you give me?",
    "Can you make me a simple step-by-step plan for {situation}?",
    "What are the most common mistakes people make when {situation}?",
    "My friend is {situation} next month. What small gift or message could encourage them?",
    "Write a short, upbeat pep talk for someone who is {situation}.",
)
REASONING_ITEMS = ("apples", "books", "tickets", "marbles", "pencils", "cookies", "stamps", "shells")
REASONING_TEMPLATES = (
    "A shop sells {item} in packs of {a}. Sam buys {b} packs and gives away {c} {item}. How many {item} "
    "does Sam have left? Explain your reasoning step by step.",
    "Lena has {a} {item}. She gets {b} more each day for {c} days. How many {item} does she have at the "
    "end? Show your work.",
    "If {a} friends share {b} {item} equally and {c} {item} are lost first, how many does each friend "
    "get, and how many are left over? Think step by step.",
)


def _coding() -> Iterable[tuple[str, str]]:
    for template, lang, task in itertools.product(CODING_TEMPLATES, LANGUAGES, CODING_TASKS):
        yield "coding", template.format(lang=lang, task=task)


def _knowledge() -> Iterable[tuple[str, str]]:
    for template, topic in itertools.product(KNOWLEDGE_TEMPLATES, TOPICS):
        yield "knowledge", template.format(topic=topic)


def _writing() -> Iterable[tuple[str, str]]:
    for template, topic in itertools.product(WRITING_TEMPLATES, TOPICS):
        yield "summarise", template.format(topic=topic)
    for template, sentence, topic in itertools.product(REWRITE_TEMPLATES, REWRITE_SENTENCES, TOPICS):
        yield "rewrite", template.format(sentence=sentence.format(topic=topic))


def _extraction() -> Iterable[tuple[str, str]]:
    people = list(itertools.permutations(EXTRACTION_PEOPLE, 2))
    for i, ((p1, p2), city) in enumerate(itertools.product(people, EXTRACTION_CITIES)):
        day, month = 1 + (i * 7) % 28, ("March", "June", "September", "November")[i % 4]
        text = (
            f"{p1} will meet {p2} in {city} on {month} {day} to review the {TOPICS[i % len(TOPICS)]} "
            f"proposal; the budget is {100 + 25 * (i % 40)} euros."
        )
        yield "extraction", EXTRACTION_TEMPLATES[i % len(EXTRACTION_TEMPLATES)].format(text=text)


def _chat() -> Iterable[tuple[str, str]]:
    for template, situation in itertools.product(CHAT_TEMPLATES, CHAT_SITUATIONS):
        yield "chat", template.format(situation=situation)


def _reasoning() -> Iterable[tuple[str, str]]:
    for i, (template, item) in enumerate(itertools.product(REASONING_TEMPLATES, REASONING_ITEMS * 12)):
        a, b, c = 3 + (i * 5) % 17, 2 + (i * 3) % 11, 1 + (i * 7) % 9
        yield "reasoning", template.format(item=item, a=a, b=b, c=c)


def _words(text: str) -> list[str]:
    return re.findall(r"[a-z0-9]+", text.lower())


def shingles(text: str, n: int = 4) -> set[tuple[str, ...]]:
    """Word n-grams of `text` (lower-cased alphanumeric words); short texts give one shingle."""
    words = _words(text)
    if len(words) < n:
        return {tuple(words)}
    return {tuple(words[i : i + n]) for i in range(len(words) - n + 1)}


def jaccard(a: set, b: set) -> float:
    return len(a & b) / max(1, len(a | b))


class NearDuplicateIndex:
    """Word-normalised texts and their 4-gram shingles, for `contains` checks against many candidates.

    An inverted index (shingle -> texts holding it) limits the Jaccard computations to texts that share
    shingles with the candidate, so checks stay fast with tens of thousands of texts; `add` grows it.
    """

    def __init__(self, texts: Iterable[str], threshold: float = NEAR_DUPLICATE_JACCARD):
        self.threshold = threshold
        self.keys: set[str] = set()
        self.shingle_sets: list[set[tuple[str, ...]]] = []
        self._holders: dict[tuple[str, ...], list[int]] = {}
        for text in texts:
            self.add(text)

    def add(self, text: str) -> None:
        key = " ".join(_words(text))
        if key in self.keys:
            return
        self.keys.add(key)
        mine = shingles(text)
        for shingle in mine:
            self._holders.setdefault(shingle, []).append(len(self.shingle_sets))
        self.shingle_sets.append(mine)

    def contains(self, text: str) -> bool:
        """True when `text` equals (ignoring case/punctuation) or closely paraphrases an indexed text."""
        if " ".join(_words(text)) in self.keys:
            return True
        mine = shingles(text)
        shared: dict[int, int] = {}
        for shingle in mine:
            for i in self._holders.get(shingle, ()):
                shared[i] = shared.get(i, 0) + 1
        # |A & B| / |A | B| >= t needs |A & B| >= t * max(|A|, |B|): check the exact Jaccard only then.
        return any(
            n >= self.threshold * len(mine) and jaccard(mine, self.shingle_sets[i]) >= self.threshold
            for i, n in shared.items()
        )


def is_near_duplicate(text: str, others: Iterable[str], threshold: float = NEAR_DUPLICATE_JACCARD) -> bool:
    """True when `text` equals (ignoring case/punctuation) or closely paraphrases one of `others`."""
    return NearDuplicateIndex(others, threshold).contains(text)


def read_string_rows(
    path: str | Path, fields: tuple[str, ...], kind: str, optional: tuple[str, ...] = ()
) -> list[dict[str, str]]:
    """The rows of a JSONL file of `kind` ("prompt", "passage"), checked: every line an object whose
    `fields` (and `optional` fields when present) are non-empty strings, the "id" field unique when it
    is one of `fields`. Raises InputError naming the file, line and field. Extra fields are kept."""
    path = Path(path)
    if not path.is_file():
        raise InputError(f"{path}: {kind} file not found")
    rows: list[dict[str, str]] = []
    seen: dict[str, int] = {}
    with open(path, encoding="utf-8") as f:
        for number, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as error:
                raise InputError(f"{path}:{number}: not valid JSON ({error.msg})") from None
            if not isinstance(row, dict):
                raise InputError(f"{path}:{number}: expected an object with fields {', '.join(fields)}")
            for field in fields + tuple(f for f in optional if f in row):
                value = row.get(field)
                if not isinstance(value, str) or not value.strip():
                    raise InputError(f"{path}:{number}: field '{field}' must be a non-empty string")
            if "id" in fields:
                if row["id"] in seen:
                    raise InputError(
                        f"{path}:{number}: id '{row['id']}' already used on line {seen[row['id']]}"
                    )
                seen[row["id"]] = number
            rows.append(row)
    if not rows:
        raise InputError(f"{path}: no {kind}s")
    return rows


def load_prompt_rows(path: str | Path) -> list[dict[str, str]]:
    """The rows of a prompt JSONL file ({"id": str, "prompt": str, "category": str (optional)}), checked
    by `read_string_rows`: errors name the file, line and field."""
    return read_string_rows(path, ("id", "prompt"), "prompt", optional=("category",))


def load_prompt_texts(path: str | Path) -> list[str]:
    """The "prompt" field of every line of a JSONL file (e.g. an --exclude set; ids not needed), checked
    by `read_string_rows`: errors name the file, line and field."""
    return [row["prompt"] for row in read_string_rows(path, ("prompt",), "prompt")]


def training_prompts(exclude: Iterable[str] = (), seed: int = 0) -> list[dict[str, str]]:
    """All training prompts, shuffled with a fixed seed: [{"id", "category", "prompt"}].

    `exclude` (e.g. the dev prompts) removes exact and near duplicates. Ids are stable: "<category>_<n>"
    numbered in generation order before the shuffle, so a shuffled subset keeps its ids.
    """
    index = NearDuplicateIndex(list(exclude))
    seen: set[str] = set()
    rows = []
    counters: dict[str, int] = {}
    for category, prompt in itertools.chain(
        _coding(), _knowledge(), _writing(), _extraction(), _chat(), _reasoning()
    ):
        if prompt in seen or index.contains(prompt):
            continue
        seen.add(prompt)
        counters[category] = counters.get(category, 0) + 1
        rows.append({"id": f"{category}_{counters[category]:04d}", "category": category, "prompt": prompt})
    random.Random(seed).shuffle(rows)
    return rows
