"""The autoregressive generate API: batching, buckets without retrace, and clear errors."""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import pytest

import jaxspec
import jaxspec.model.forward as forward
from jaxspec.bench.step_costs import single_request
from jaxspec.decoding.autoregressive import generate_autoregressive
from jaxspec.model.kv_cache import write_window
from pallas_kernels import tree_attention
from tests.tiny_models import save_tiny

RAGGED = [[5, 17, 99, 3], [250, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10], [42], list(range(30, 50))]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny_gen")
    save_tiny("llama", path, eos_token_id=7)
    return jaxspec.load(str(path))


def test_ragged_batch_equals_each_prompt_alone(tiny):
    batch = jaxspec.generate(tiny, RAGGED, max_new_tokens=24)
    for prompt, together in zip(RAGGED, batch, strict=True):
        (alone,) = jaxspec.generate(tiny, [prompt], max_new_tokens=24)
        assert alone.token_ids == together.token_ids


def test_repeated_calls_in_the_same_bucket_do_not_retrace(tiny):
    jaxspec.generate(tiny, RAGGED[:3], max_new_tokens=20)
    before = generate_autoregressive._cache_size()
    # Same buckets (3 -> 4 rows, prompts <= 16 tokens, 20 -> 32 new tokens): no new compilation.
    jaxspec.generate(tiny, [[1, 2], [3, 4, 5], [6]], max_new_tokens=30, seed=4)
    jaxspec.generate(tiny, [[9] * 16], max_new_tokens=17, sampling=jaxspec.SamplingParams(temperature=0.8))
    assert generate_autoregressive._cache_size() == before


def test_eos_stops_a_row_and_per_row_budgets(tiny):
    completions = jaxspec.generate(tiny, RAGGED, max_new_tokens=[5, 40, 40, 3])
    assert len(completions[0].token_ids) <= 5 and len(completions[3].token_ids) <= 3
    for c in completions:
        if c.finish_reason == "stop":
            assert c.token_ids[-1] == 7 and 7 not in c.token_ids[:-1]
        else:
            assert 7 not in c.token_ids


def test_sampled_generation_is_reproducible_and_seed_dependent(tiny):
    sampling = jaxspec.SamplingParams(temperature=1.0, top_p=0.9)
    a = jaxspec.generate(tiny, RAGGED, max_new_tokens=16, sampling=sampling, seed=1)
    b = jaxspec.generate(tiny, RAGGED, max_new_tokens=16, sampling=sampling, seed=1)
    c = jaxspec.generate(tiny, RAGGED, max_new_tokens=16, sampling=sampling, seed=2)
    assert [x.token_ids for x in a] == [x.token_ids for x in b]
    assert [x.token_ids for x in a] != [x.token_ids for x in c]


@pytest.mark.parametrize(
    "kwargs,message",
    [
        ({"prompts": [[]]}, "prompt 0 is empty"),
        ({"prompts": [[1, 2], ""]}, "prompt 1 is text but the model has no tokenizer"),
        ({"prompts": [[1, 999999]]}, "token id 999999 outside"),
        ({"prompts": [[1, 2]], "max_new_tokens": 0}, "max_new_tokens for prompt 0 must be >= 1"),
        ({"prompts": [[1, 2]], "max_new_tokens": 100000}, "beyond the model's context of 512"),
        ({"prompts": [[1], [2]], "seed": [1, 2, 3]}, "seed has 3 entries for 2 prompts"),
        ({"prompts": [[1]], "spec": {"method": "ngram", "bogus": 1}}, "unknown field 'bogus'"),
    ],
)
def test_bad_generate_input_names_the_problem(tiny, kwargs, message):
    with pytest.raises((jaxspec.JaxspecError, ValueError), match=message):
        jaxspec.generate(tiny, **kwargs)


def test_bad_sampling_params_name_the_field():
    with pytest.raises(ValueError, match="top_p"):
        jaxspec.SamplingParams(top_p=0.0)
    with pytest.raises(ValueError, match="temperature"):
        jaxspec.SamplingParams(temperature=-1.0)


def test_missing_model_path_names_it(tmp_path):
    with pytest.raises(jaxspec.ModelLoadError, match="does-not-exist"):
        jaxspec.load(str(tmp_path / "does-not-exist"))


def _decode_program_cache_copies(model, max_len: int) -> int:
    """Copies of whole KV-cache layer buffers in the compiled generate loop (batch 4)."""
    requests = single_request([5, 17, 99, 3], 16, jaxspec.SamplingParams())
    requests = jax.tree.map(lambda a: jnp.concatenate([a] * 4) if jnp.ndim(a) else a, requests)
    c = model.config
    hlo = generate_autoregressive.lower(
        model.graphdef, model.params, requests, config=c, max_len=max_len, capacity=17, eos_ids=()
    ).compile().as_text()  # fmt: skip
    return len(re.findall(rf"f32\[4,{c.num_kv_heads},{max_len},{c.head_dim}\]\{{[0-9,]+\}} copy\(", hlo))


def test_decode_loop_updates_the_kv_cache_in_place(tiny, monkeypatch):
    """Each layer writes its new keys/values, then attends over the written buffer: XLA keeps every
    layer's cache in place. Attending over the old buffer and then writing made XLA:CPU copy every
    layer's cache twice per step (the broken variant below shows the check sees those copies)."""
    assert _decode_program_cache_copies(tiny, max_len=48) == 0

    def read_then_write(impl, mesh=None, attend=None):
        def attend(q, k_cache, v_cache, lengths, k_new, v_new, tree_mask, *, scale):
            out = tree_attention(q, k_cache, v_cache, lengths, k_new, v_new, tree_mask, scale=scale)
            return out, write_window(k_cache, k_new, lengths), write_window(v_cache, v_new, lengths)

        return attend

    monkeypatch.setattr(forward, "cached_attention", read_then_write)
    assert _decode_program_cache_copies(tiny, max_len=56) >= 2 * tiny.config.num_layers


@pytest.mark.parametrize("spec", [None, {"method": "ngram", "num_speculative_tokens": 3}])
def test_streaming_hands_over_tokens_while_the_loop_runs(tiny, spec):
    """generate(stream=fn): fn sees growing prefixes of the first prompt's tokens from inside the
    compiled loop (one call per step / round), ending with the final tokens; outputs unchanged."""
    prompt = [3, 14, 15, 92, 65, 35, 3, 14, 15, 92]
    seen: list[list[int]] = []
    (streamed,) = jaxspec.generate(tiny, [prompt], max_new_tokens=20, spec=spec, stream=seen.append)
    (plain,) = jaxspec.generate(tiny, [prompt], max_new_tokens=20, spec=spec)
    assert streamed.token_ids == plain.token_ids
    longest = max(seen, key=len)
    assert longest == streamed.token_ids
    assert all(s == longest[: len(s)] for s in seen)
    assert len({len(s) for s in seen}) >= min(5, streamed.stats["rounds"])  # many snapshots, not one
