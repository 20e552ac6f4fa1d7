"""Datastore drafting: the target's own answers (the distilled data set, `jaxspec.loading.dataset`) as a
table of n-gram continuations, retrieval in the spirit of REST (He et al., 2024) without a suffix array.

The table: for every n-gram (n = 1..max_match) that occurs in the data set's answers, with the last
max_match tokens of each prompt in front (the chat template's assistant header, so that the first tokens
of an answer have a context too), the token that followed it most often (ties: the smaller id). A row
drafts K tokens one at a time: the longest suffix of its history, plus the tokens drafted so far, that
the table holds gives the next token; a row with no such suffix stops there (the rest is invalid).

Layout: one sorted uint32 array of keys and the next token per key. A key hashes an n-gram read newest
token first, so the keys of every suffix length of a history come from one pass over its last max_match
tokens; the length is part of the hash (an n-gram and a longer one ending in it differ in what was
absorbed). Lookups are `jnp.searchsorted` inside the jitted round: K * max_match binary searches per row,
microseconds next to a target forward. A hash collision can only draft a wrong token, which verification
rejects.

Lossless: the drafts are a function of the row's history and the fixed table, never of a sample, so
their draft distribution is one-hot on the drafted token, as for prompt lookup
(tests/test_heads_exactness.py).

Why: on the dev prompts' greedy answers (first 64 tokens), a chain of 6 from the shipped data set's
table (3.1 M answer tokens, max_match 8) accepts 0.99 tokens per position against 0.73 for prompt lookup
at a minimum match of 1, and the two are right at different places (the better of the two: 1.57).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Iterable
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from jaxspec.errors import InputError

_SEED = 0x9E3779B9
_MUL = 0x85EBCA6B


def _absorb(h, token):
    """One more (older) token into the running hash: uint32 arithmetic that numpy and jax share."""
    h = (h ^ (token.astype(np.uint32) + np.uint32(1))) * np.uint32(_MUL)
    return h ^ (h >> np.uint32(15))


def _finish(h):
    """murmur3's 32-bit finaliser: every input bit reaches every output bit."""
    h = h ^ (h >> np.uint32(16))
    h = h * np.uint32(0x85EBCA6B)
    h = h ^ (h >> np.uint32(13))
    h = h * np.uint32(0xC2B2AE35)
    return h ^ (h >> np.uint32(16))


def ngram_keys(tokens: np.ndarray, max_match: int) -> np.ndarray:
    """Keys of the suffixes of `tokens` [T] (oldest first): [min(T, max_match)] uint32, entry j the key of
    the last j + 1 tokens. The host twin of the lookup's hashing (tests)."""
    tokens = np.asarray(tokens).reshape(-1)
    h = np.full((1,), _SEED, np.uint32)
    keys = []
    for j in range(min(max_match, tokens.size)):
        h = _absorb(h, tokens[tokens.size - 1 - j : tokens.size - j])
        keys.append(_finish(h)[0])
    return np.asarray(keys, np.uint32)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class NgramTable:
    """keys: [M] uint32, sorted, unique: hashes of n-grams (n <= max_match) read newest first.
    next_token: [M] int32, the token that most often followed each. Built by `build_table`."""

    keys: jax.Array
    next_token: jax.Array
    max_match: int = dataclasses.field(metadata=dict(static=True))

    @property
    def size(self) -> int:
        return int(self.keys.shape[0])


def build_table(sequences: Iterable[tuple[np.ndarray, int]], max_match: int) -> NgramTable:
    """The table of `sequences`: (tokens [T], first) pairs, where tokens[first:] are the continuations to
    learn (an answer) and tokens[:first] context only (the end of its prompt). Numpy, on the host:
    ~15 s and ~1 GB of transient memory for 3 M tokens at max_match 8."""
    if max_match < 1:
        raise ValueError(f"build_table: max_match must be >= 1, got {max_match}")
    parts, starts, firsts = [], [], []
    offset = 0
    for tokens, first in sequences:
        tokens = np.asarray(tokens, np.int64).reshape(-1)
        parts.append(tokens)
        starts.append(np.full(len(tokens), offset, np.int64))
        firsts.append(np.full(len(tokens), offset + max(int(first), 1), np.int64))
        offset += len(tokens)
    if not offset:
        raise InputError("datastore: no tokens to build an n-gram table from")
    flat, start, first = np.concatenate(parts), np.concatenate(starts), np.concatenate(firsts)
    end = np.empty_like(start)  # one past each position's sequence
    bounds = np.flatnonzero(np.r_[start[1:] != start[:-1], True]) + 1
    end[:] = np.repeat(bounds, np.diff(np.r_[0, bounds]))
    pos = np.arange(offset)
    # a window ending at e predicts flat[e + 1]: inside the sequence and part of its answer
    learnable = (pos + 1 < end) & (pos + 1 >= first)
    nxt = np.where(learnable, flat[np.minimum(pos + 1, offset - 1)], 0)
    h = np.full(offset, _SEED, np.uint32)
    keys, nexts = [], []
    for j in range(max_match):
        older = pos - j
        h = _absorb(h, flat[np.maximum(older, 0)])
        ok = learnable & (older >= start)
        keys.append(_finish(h)[ok])
        nexts.append(nxt[ok])
    key, token = np.concatenate(keys), np.concatenate(nexts)
    if not key.size:
        raise InputError("datastore: no answer tokens with a context (every sequence is too short)")
    order = np.lexsort((token, key))
    key, token = key[order], token[order]
    new = np.r_[True, (key[1:] != key[:-1]) | (token[1:] != token[:-1])]
    run_start = np.flatnonzero(new)
    counts = np.diff(np.r_[run_start, key.size])
    key, token = key[run_start], token[run_start]
    order = np.lexsort((token, -counts, key))  # per key: most frequent first, then the smaller id
    key, token = key[order], token[order]
    first_of_key = np.r_[True, key[1:] != key[:-1]]
    return NgramTable(
        keys=jnp.asarray(key[first_of_key]), next_token=jnp.asarray(token[first_of_key].astype(np.int32)),
        max_match=max_match,
    )  # fmt: skip


@functools.lru_cache(maxsize=2)
def _table_of_dataset(path: str, manifest: str, max_match: int) -> NgramTable:
    from jaxspec.loading.dataset import DistilledDataset

    del manifest  # part of the cache key: a data set that grew builds a new table
    sequences = (
        (np.asarray(r["prompt_ids"][-max_match:] + r["response_ids"]), len(r["prompt_ids"][-max_match:]))
        for r in DistilledDataset.open(path).rows()
    )
    return build_table(sequences, max_match)


def load_table(path: str, max_match: int, vocab_size: int) -> NgramTable:
    """The table of the distilled data set in directory `path` (`jaxspec.loading.dataset`), cached per
    process (a benchmark makes each drafter several times) and rebuilt when its manifest changed.
    A missing or corrupt data set raises DatasetError naming the file; another model's, InputError."""
    from jaxspec.loading.dataset import MANIFEST, DistilledDataset

    theirs = int(DistilledDataset.open(path).manifest.get("vocab_size", -1))
    if theirs != vocab_size:
        raise InputError(
            f"SpecConfig.datastore: {Path(path) / MANIFEST} is a data set of a {theirs}-token vocabulary; "
            f"the model has {vocab_size} (a data set of another model)"
        )
    manifest = (Path(path) / MANIFEST).read_text()
    return _table_of_dataset(str(Path(path).resolve()), manifest, max_match)


def datastore_chain(
    table: NgramTable, history: jax.Array, length: jax.Array, num_tokens: int
) -> tuple[jax.Array, jax.Array]:
    """The table's chain of K = num_tokens drafts for each row.

    history: [B, T] int32 prompt + emitted tokens; entries at index >= length are ignored.
    length: [B] int32 >= 1; history[b, length[b] - 1] is the root (the pending token).
    Returns tokens [B, K + 1] (root first, like `ngram.ngram_chain`) and valid [B, K + 1]: a row's
    drafts are valid up to the first step whose history suffix is in no n-gram of the table.
    """
    n = table.max_match
    batch = history.shape[0]
    index = length[:, None] - n + jnp.arange(n)[None, :]  # [B, n]: the last n positions, oldest first
    tail = jnp.take_along_axis(history, jnp.maximum(index, 0), axis=1).astype(jnp.int32)
    have = jnp.minimum(length, n)  # [B] real tokens in the tail
    last = table.keys.shape[0] - 1
    tokens, valid = [tail[:, -1]], [jnp.ones((batch,), bool)]
    for _ in range(num_tokens):
        h = jnp.full((batch,), _SEED, jnp.uint32)
        queries = []
        for j in range(n):
            h = _absorb(h, tail[:, n - 1 - j])
            queries.append(_finish(h))
        query = jnp.stack(queries, axis=1)  # [B, n]: key of the last j + 1 tokens
        at = jnp.minimum(jnp.searchsorted(table.keys, query.reshape(-1)).reshape(batch, n), last)
        hit = (table.keys[at] == query) & (jnp.arange(n)[None, :] < have[:, None])
        longest = n - 1 - jnp.argmax(hit[:, ::-1], axis=1)  # [B]; meaningless where nothing hit
        token = table.next_token[jnp.take_along_axis(at, longest[:, None], axis=1)[:, 0]]
        valid.append(valid[-1] & jnp.any(hit, axis=1))
        tokens.append(jnp.where(valid[-1], token, 0))
        tail = jnp.concatenate([tail[:, 1:], tokens[-1][:, None]], axis=1)
        have = jnp.minimum(have + 1, n)
    return jnp.stack(tokens, axis=1), jnp.stack(valid, axis=1)
