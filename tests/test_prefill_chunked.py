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
from jaxspec.decoding.prefill import PREFILL_CHUNK, prefill, prefill_chunk_size
from tests.tiny_models import save_tiny


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny_prefill")
    save_tiny("llama", path, max_position_embeddings=4096)
    return jaxspec.load(str(path))


def _prefill(model, prompt, max_len, attention, chunk):
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
    return run(params=model.params, requests=requests)


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
