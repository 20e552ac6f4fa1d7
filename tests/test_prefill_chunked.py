"""Prefill in chunks (the kernel path) against one forward over the whole prompt (the reference path)."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxspec
from jaxspec.bench.step_costs import single_request
from jaxspec.config import SamplingParams
from jaxspec.decoding.prefill import (
    PREFILL_CHUNK,
    longest_shared_prefix,
    prefill,
    prefill_chunk_size,
    prefill_shared_prefix,
)
from tests.tiny_models import save_tiny


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny_prefill")
    save_tiny("llama", path, max_position_embeddings=4096)
    return jaxspec.load(str(path))


def _prefill(model, prompt, max_len, attention, chunk, prefix=None):
    requests = single_request(prompt, 8, SamplingParams())
    run = jax.jit(
        functools.partial(
            prefill,
            model.graphdef,
            config=model.config,
            max_len=max_len,
            attention=attention,
            capture_layers=(0,),
            chunk=chunk,
        ),  # fmt: skip
    )
    return run(params=model.params, requests=requests, prefix=prefix)


def _assert_same_prefill(got, want, prompt_len: int, atol: float) -> None:
    np.testing.assert_allclose(got.hidden[:, :prompt_len], want.hidden[:, :prompt_len], atol=atol, rtol=atol)
    np.testing.assert_allclose(
        got.captured[0][:, :prompt_len], want.captured[0][:, :prompt_len], atol=atol, rtol=atol
    )
    for got_k, want_k in zip(
        got.cache.keys + got.cache.values, want.cache.keys + want.cache.values, strict=True
    ):
        np.testing.assert_allclose(got_k[:, :, :prompt_len], want_k[:, :, :prompt_len], atol=atol, rtol=atol)
    np.testing.assert_array_equal(got.cache.lengths, want.cache.lengths)
    np.testing.assert_array_equal(got.first_token, want.first_token)


def test_chunk_size_follows_the_attention_path():
    assert prefill_chunk_size("reference", 2048) == 2048  # CPU default: one forward, as before
    assert prefill_chunk_size("auto", 2048) == 2048  # "auto" is the reference on CPU
    assert prefill_chunk_size("pallas", 2048) == PREFILL_CHUNK
    assert prefill_chunk_size("pallas", 16) == 16
    assert prefill_chunk_size("reference", 100, chunk=32) == 32
    with pytest.raises(ValueError, match="chunk must be >= 1"):
        prefill_chunk_size("reference", 100, chunk=0)


@pytest.mark.parametrize("prompt_len", [64, 57])  # 57: the bucket (64) is padded to 5 chunks of 16
def test_chunked_prefill_matches_one_forward(tiny, prompt_len):
    prompt = list(np.random.default_rng(1).integers(1, tiny.config.vocab_size, prompt_len))
    chunk = 16 if prompt_len == 64 else 13
    want = _prefill(tiny, prompt, 128, "reference", None)
    got = _prefill(tiny, prompt, 128, "reference", chunk)
    _assert_same_prefill(got, want, prompt_len, atol=2e-5)


def test_chunked_prefill_needs_room_for_the_padded_prompt(tiny):
    with pytest.raises(ValueError, match="need 65 cache slots, the cache has 64"):
        _prefill(tiny, list(range(1, 60)), 64, "reference", 13)


def test_prefill_2048_tokens_through_the_pallas_kernel_matches_reference(tiny):
    """2,048 prompt tokens through the TPU kernel in interpret mode (16 chunks of 128, each attending
    to the cache prefix plus itself) against the reference path's one forward over the whole prompt."""
    prompt_len = 2048
    prompt = list(np.random.default_rng(2).integers(1, tiny.config.vocab_size, prompt_len))
    want = _prefill(tiny, prompt, 4096, "reference", None)
    got = _prefill(tiny, prompt, 4096, "pallas", None)
    _assert_same_prefill(got, want, prompt_len, atol=1e-4)
    assert jnp.all(jnp.isfinite(got.hidden))


def test_longest_shared_prefix_leaves_every_prompt_a_token_to_prefill():
    assert longest_shared_prefix([[1, 2, 3, 4], [1, 2, 3, 5, 6], [1, 2, 3, 4, 7]]) == 3
    assert longest_shared_prefix([[1, 2, 3], [1, 2, 3, 4]]) == 2  # the shorter prompt keeps its last token
    assert longest_shared_prefix([[5, 6], [7, 6]]) == 0
    assert longest_shared_prefix([[4, 4, 4, 4]]) == 3


@pytest.mark.parametrize(
    "attention, chunk", [("reference", None), ("reference", 5), ("pallas", 16)],
    ids=["one-forward", "chunks-of-5", "pallas-interpret"],
)  # fmt: skip
def test_prefill_after_a_shared_prefix_equals_a_full_prefill(tiny, attention, chunk):
    """A prefix of 11 tokens prefilled once (`prefill_shared_prefix`) and copied into the row, then the
    other 38 prompt positions through the target (in one forward, in chunks that start off the chunk
    grid, through the Pallas kernel): the same cache, hidden states, captured layer and first token as
    prefilling the whole prompt."""
    prompt = [int(t) for t in np.random.default_rng(3).integers(1, tiny.config.vocab_size, 49)]
    shared = 11
    prefix = jax.jit(
        prefill_shared_prefix, static_argnames=("graphdef", "config", "attention", "capture_layers")
    )(
        tiny.graphdef, tiny.params, config=tiny.config, tokens=jnp.asarray(prompt[:shared], jnp.int32),
        attention=attention, capture_layers=(0,),
    )  # fmt: skip
    assert prefix.length == shared and prefix.hidden.shape[:2] == (1, shared)
    want = _prefill(tiny, prompt, 128, "reference", None)
    got = _prefill(tiny, prompt, 128, attention, chunk, prefix=prefix)
    _assert_same_prefill(got, want, len(prompt), atol=1e-4 if attention == "pallas" else 2e-5)
