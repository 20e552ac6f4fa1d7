"""Per-program VMEM of every tree-attention launch that prefill, decode and verify make at
Llama-3-8B shapes with a 32k-token prompt, read from the BlockSpecs of the traced programs."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxspec.bench.step_costs import single_request
from jaxspec.config import SamplingParams
from jaxspec.decoding.prefill import prefill
from jaxspec.loading.weights import abstract_model
from jaxspec.model.config import ModelConfig
from jaxspec.model.forward import model_forward
from jaxspec.model.kv_cache import KVCache
from pallas_kernels import compat, tpu

LLAMA3_8B = ModelConfig(
    vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_layers=32, num_heads=32,
    num_kv_heads=8, head_dim=128, rope_theta=500000.0, max_position_embeddings=131072,
)  # fmt: skip
PROMPT = 32768
MAX_LEN = PROMPT + 2048  # 17 x 2048: every power-of-two block up to 2048 divides it


@pytest.fixture(scope="module")
def model():
    return abstract_model(LLAMA3_8B, jnp.bfloat16)


def _prefill_launches(graphdef, params, chunk=None):
    requests = single_request(list(np.ones(PROMPT, np.int32)), 128, SamplingParams())

    def run(params, requests):
        return prefill(graphdef, params, LLAMA3_8B, requests, MAX_LEN, attention="pallas", chunk=chunk)

    return compat.kernel_launches(jax.make_jaxpr(run)(params, requests))


def _step_launches(graphdef, params, nodes: int):
    """A decode (nodes=1) or verify (nodes > 1, a chain) forward over a cache holding the prompt."""
    cache = jax.eval_shape(lambda: KVCache.zeros(LLAMA3_8B, 1, MAX_LEN, jnp.bfloat16))
    tokens = jnp.zeros((1, nodes), jnp.int32)
    positions = PROMPT + jnp.arange(nodes, dtype=jnp.int32)[None]
    mask = jnp.tril(jnp.ones((1, nodes, nodes), bool))
    run = functools.partial(model_forward, graphdef, attention="pallas")
    return compat.kernel_launches(jax.make_jaxpr(run)(params, tokens, positions, cache, mask))


def test_every_prefill_decode_verify_launch_fits_16_mib_of_vmem(model):
    graphdef, params = model
    launches = {
        "prefill": _prefill_launches(graphdef, params),
        "decode": _step_launches(graphdef, params, 1),
        "verify": _step_launches(graphdef, params, 64),
    }
    worst = {}
    for step, found in launches.items():
        assert len(found) == LLAMA3_8B.num_layers, (step, len(found))  # one launch per layer
        worst[step] = max(tpu.launch_vmem_bytes(launch) for launch in found)
        assert worst[step] <= tpu.VMEM_BUDGET_BYTES, f"{step}: {worst[step] / 2**20:.1f} MiB per program"
    # The prefill chunk's [G * C, C] mask block is what a whole-prompt "tree" would blow up.
    prefill_mask = launches["prefill"][0].blocks[5][0]
    assert prefill_mask == (1, 4 * 128, 128)
    print({k: f"{v / 2**20:.2f} MiB" for k, v in worst.items()})


def test_whole_prompt_as_one_tree_would_not_fit(model):
    """The check above catches the old prefill: the 32k prompt as one tree needs GiBs per program."""
    graphdef, params = model
    launch = _prefill_launches(graphdef, params, chunk=PROMPT)[0]
    assert tpu.launch_vmem_bytes(launch) > 2**30
