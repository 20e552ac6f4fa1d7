"""Prefill: run the padded prompts through the target as one causal chain and sample the first token."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import Mesh

from jaxspec.cache import KVCache
from jaxspec.config import ModelConfig
from jaxspec.forward import causal_mask, last_valid, lm_logits, model_forward
from jaxspec.sharding import constrain_cache
from jaxspec.spec import sampling


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class Requests:
    """Per-row request data of one compiled batch (all arrays [B] unless stated).

    prompt_tokens: [B, P] int32 left-aligned prompts, padded with 0.
    prompt_lengths: prompt length per row (>= 1); padding rows use 1.
    max_new_tokens: per-row budget of new tokens.
    seeds, request_ids: inputs of the stateless key derivation.
    sampling: per-row logits-processing parameters.
    """

    prompt_tokens: jax.Array
    prompt_lengths: jax.Array
    max_new_tokens: jax.Array
    seeds: jax.Array
    request_ids: jax.Array
    sampling: sampling.SamplingArrays


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class PrefillResult:
    """cache: prompts committed (lengths = prompt lengths); first_token [B]; hidden [B, P, d] final
    hidden states of the prompt; captured: chosen layers' outputs, each [B, P, d]."""

    cache: KVCache
    first_token: jax.Array
    hidden: jax.Array
    captured: tuple[jax.Array, ...]


def prefill(
    graphdef: nnx.GraphDef,
    params: nnx.State,
    config: ModelConfig,
    requests: Requests,
    max_len: int,
    *,
    attention: str = "auto",
    capture_layers: tuple[int, ...] = (),
    mesh: Mesh | None = None,
) -> PrefillResult:
    """Prefill the prompts into a fresh cache of max_len slots and sample the first new token.

    The first token is drawn with the key of round 0, purpose PURPOSE_BONUS, from the processed
    target distribution at each row's last prompt position. With a mesh the cache is created sharded
    (`jaxspec.sharding.cache_shardings`).
    """
    tokens = requests.prompt_tokens
    batch, p = tokens.shape
    dtype = params_dtype(params)
    # The barrier keeps XLA from constant-folding attention over the all-zero cache (minutes of
    # compile time for a 30-layer model); it is an identity at run time.
    cache = constrain_cache(jax.lax.optimization_barrier(KVCache.zeros(config, batch, max_len, dtype)), mesh)
    positions = jnp.broadcast_to(jnp.arange(p, dtype=jnp.int32), (batch, p))
    hidden, captured, cache = model_forward(
        graphdef, params, tokens, positions, cache, causal_mask(batch, p),
        attention=attention, capture_layers=capture_layers, mesh=mesh,
    )  # fmt: skip
    logits = lm_logits(graphdef, params, last_valid(hidden, requests.prompt_lengths))
    probs = sampling.process_logits(logits, requests.sampling)
    keys = sampling.derive_key(requests.seeds, requests.request_ids, 0, sampling.PURPOSE_BONUS)
    first = sampling.sample_from_probs(probs, keys)
    cache = dataclasses.replace(cache, lengths=requests.prompt_lengths.astype(jnp.int32))
    cache = constrain_cache(cache, mesh)
    return PrefillResult(cache=cache, first_token=first, hidden=hidden, captured=captured)


def params_dtype(params: nnx.State) -> jnp.dtype:
    return jax.tree.leaves(params)[0].dtype
