"""Per-step cost measurement: steps are timed inside one compiled loop, with nothing hoisted out of it."""

import jax
import jax.numpy as jnp
import pytest

import jaxspec
from jaxspec.bench.compute_bound import token_flops, workload_flops
from jaxspec.bench.step_costs import measure_step_costs, step_loop
from jaxspec.config import SpecConfig
from tests.tiny_models import save_tiny


def _entry_computation(hlo_text: str) -> str:
    return hlo_text[hlo_text.index("ENTRY") :]


def _step(carry, x):
    return carry + jnp.sum(x @ x)


def test_step_loop_keeps_carry_independent_work_inside_the_loop():
    x = jnp.arange(64 * 64, dtype=jnp.int32).reshape(64, 64) % 5
    carry = jnp.zeros((), jnp.int32)
    zero = jnp.zeros((), jnp.int32)
    loop = step_loop(_step, 5)
    entry = _entry_computation(loop.lower(carry, (x,), zero).compile().as_text())
    assert "while(" in entry
    assert "dot(" not in entry and "fusion(" not in entry, "the step's product was hoisted out of the loop"
    assert int(loop(carry, (x,), zero)) == 5 * int(jnp.sum(x @ x))

    # The check above catches the naive loop: XLA hoists the loop-invariant product out of it (an
    # optimization barrier does not prevent that on XLA:CPU, hence step_loop's runtime-zero offset).
    naive = jax.jit(lambda c, x: jax.lax.fori_loop(0, 5, lambda i, c: _step(c, x), c))
    naive_entry = _entry_computation(naive.lower(carry, x).compile().as_text())
    assert "dot(" in naive_entry or "fusion(" in naive_entry


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny_costs")
    save_tiny("llama", path)
    return jaxspec.load(str(path))


def test_measure_step_costs_times_every_part_of_a_round(tiny):
    costs = measure_step_costs(
        tiny, SpecConfig(method="ngram", num_speculative_tokens=2), [5, 6, 7, 5, 6, 7, 5], iters=3
    )
    assert costs.num_nodes == 3 and costs.gamma == 2
    for name in ("prefill_s", "decode_s", "verify_s", "draft_s"):
        assert 0 < getattr(costs, name) < 10, name
    autoregressive = measure_step_costs(tiny, None, [5, 6, 7], iters=3)
    assert autoregressive.verify_s == autoregressive.decode_s and autoregressive.draft_s == 0.0


def test_token_flops_count_every_layer_weight_once(tmp_path):
    torch_model = save_tiny("llama", tmp_path)
    flops = token_flops(jaxspec.load(str(tmp_path)))
    layer_weights = sum(p.numel() for p in torch_model.model.layers.parameters() if p.dim() >= 2)
    config = torch_model.config
    assert flops.layers == 2 * layer_weights  # q, k, v, o, gate, up, down of every layer, norms left out
    assert flops.lm_head == 2 * config.vocab_size * config.hidden_size
    # 3 requests, 10 prompt tokens, 7 new tokens: 3 first tokens from the prefills, 4 decoded.
    assert workload_flops(flops, 10, 7, 3) == 10 * flops.layers + 3 * flops.lm_head + 4 * (
        flops.layers + flops.lm_head
    )
    with pytest.raises(ValueError, match="2 new tokens for 3 requests"):
        workload_flops(flops, 10, 2, 3)
