"""The compute bound of an offline workload: its matrix-product FLOPs at this machine's dense-product rate.

A target token costs 2 FLOPs per weight it passes through: every decoder layer's weights for each prompt
and decoded token, the LM head (vocabulary x hidden) for each token whose logits are needed (every decoded
token, and the last prompt token of each request, which gives the first new token). Attention, norms
and sampling are left out, and so is padding: the bound is what a run could reach if every product ran
at the rate of one large dense product measured here and nothing else cost anything, so no engine can
beat it on this machine.
"""

from __future__ import annotations

import dataclasses
import time

import jax
import jax.numpy as jnp
import numpy as np


@dataclasses.dataclass(frozen=True)
class TokenFlops:
    """FLOPs of one token: through the decoder layers (2 x their matrix weights) and the LM head."""

    layers: float
    lm_head: float


def token_flops(model) -> TokenFlops:
    """`TokenFlops` of a loaded jaxspec model: matrix weights (ndim >= 2) under its layers, and V x d."""
    leaves = jax.tree_util.tree_flatten_with_path(model.params)[0]
    layer_weights = sum(
        int(np.prod(x.shape)) for path, x in leaves if x.ndim >= 2 and "layers" in jax.tree_util.keystr(path)
    )
    config = model.config
    return TokenFlops(layers=2.0 * layer_weights, lm_head=2.0 * config.vocab_size * config.hidden_size)


def workload_flops(flops: TokenFlops, prompt_tokens: int, new_tokens: int, requests: int) -> float:
    """Matrix-product FLOPs of `requests` requests with `prompt_tokens` real prompt tokens and
    `new_tokens` generated tokens in all (each request's first new token comes from its prefill)."""
    if new_tokens < requests:
        raise ValueError(f"workload_flops: {new_tokens} new tokens for {requests} requests (each makes >= 1)")
    decoded = new_tokens - requests  # tokens that went through a decode step's forward
    return prompt_tokens * flops.layers + requests * flops.lm_head + decoded * (flops.layers + flops.lm_head)


def dense_product_rate(m: int = 2048, k: int = 576, n: int = 1536, repeats: int = 15) -> float:
    """FLOP/s of the fastest of `repeats` runs of one jitted float32 [m, k] x [k, n] product (default: a
    prefill MLP product of SmolLM2-135M), after a compiling run."""
    rng = np.random.default_rng(0)
    a = jnp.asarray(rng.standard_normal((m, k)), jnp.float32)
    b = jnp.asarray(rng.standard_normal((k, n)), jnp.float32)
    product = jax.jit(jnp.matmul)
    product(a, b).block_until_ready()
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        product(a, b).block_until_ready()
        best = min(best, time.perf_counter() - start)
    return 2.0 * m * k * n / best
