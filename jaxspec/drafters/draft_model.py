"""Loading the independent draft model of `method="draft_model"`."""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from flax import nnx

from jaxspec import sampling
from jaxspec.config import SpecConfig
from jaxspec.drafters.protocol import RoundContext, root_token
from jaxspec.errors import InputError
from jaxspec.loading.loader import load
from jaxspec.model.config import ModelConfig
from jaxspec.model.forward import lm_logits, model_forward
from jaxspec.model.kv_cache import KVCache
from jaxspec.model.target import Model
from jaxspec.sampling.tree import chain_tree


@functools.lru_cache(maxsize=4)
def _load_cached(name_or_path: str, dtype_name: str) -> Model:
    return load(name_or_path, dtype=dtype_name)


@functools.lru_cache(maxsize=8)
def truncate_layers(model: Model, num_layers: int) -> Model:
    """A draft made of the first `num_layers` decoder layers + the final norm and LM head."""
    if not 1 <= num_layers <= model.config.num_layers:
        raise InputError(f"draft_num_layers must be in [1, {model.config.num_layers}], got {num_layers}")
    from flax import nnx

    full = nnx.merge(model.graphdef, model.params)
    full.layers = nnx.List(list(full.layers)[:num_layers])
    config = model.config.replace(num_layers=num_layers)
    full.config = config
    for layer in full.layers:
        layer.self_attn.config = config
    graphdef, params = nnx.split(full)
    return dataclasses.replace(model, config=config, graphdef=graphdef, params=params)


def load_draft_model(target: Model, spec: SpecConfig) -> Model:
    """The draft model named by spec.head (default: the target itself), optionally truncated."""
    source = spec.head or target.source
    draft = target if source == target.source else _load_cached(source, target.dtype.name)
    if draft.config.vocab_size != target.config.vocab_size:
        raise InputError(
            f"draft model {source}: vocabulary {draft.config.vocab_size} "
            f"!= target's {target.config.vocab_size}"
        )
    if spec.draft_num_layers is not None:
        draft = truncate_layers(draft, spec.draft_num_layers)
    return draft


@dataclasses.dataclass(frozen=True)
class DraftModelDrafter:
    """An independent smaller Llama with the target's vocabulary and its own KV cache; drafts a chain
    with `lax.scan`, sampling each token from its processed distribution (q recorded for exact
    verification). Its cache holds committed tokens only: each round it feeds root, d1 .. dK (K + 1
    steps, the last only to keep d_K's KV in case all drafts are accepted)."""

    graphdef: nnx.GraphDef
    config: ModelConfig
    num_tokens: int
    capture_layers: tuple[int, ...] = ()

    @property
    def num_nodes(self) -> int:
        return 1 + self.num_tokens

    @property
    def max_depth(self) -> int:
        return self.num_tokens

    def init(self, draft_params, target_params, pre, requests, max_len):
        batch, p = requests.prompt_tokens.shape
        dtype = jax.tree.leaves(draft_params)[0].dtype
        cache = KVCache.zeros(self.config, batch, max_len, dtype)
        positions = jnp.broadcast_to(jnp.arange(p, dtype=jnp.int32), (batch, p))
        mask = jnp.broadcast_to(jnp.tril(jnp.ones((p, p), bool)), (batch, p, p))
        _, _, cache = model_forward(
            self.graphdef, draft_params, requests.prompt_tokens, positions, cache, mask
        )
        return dataclasses.replace(cache, lengths=requests.prompt_lengths.astype(jnp.int32))

    def propose(self, draft_params, target_params, cache: KVCache, ctx: RoundContext):
        batch = ctx.history.shape[0]
        root = root_token(ctx)
        one = jnp.ones((batch, 1, 1), bool)

        def step(carry, i):
            token, c = carry
            hidden, _, c = model_forward(
                self.graphdef, draft_params, token[:, None], c.lengths[:, None], c, one, attention="reference"
            )
            c = dataclasses.replace(c, lengths=c.lengths + 1)
            q = sampling.process_logits(lm_logits(self.graphdef, draft_params, hidden[:, 0]), ctx.sampling)
            keys = jax.vmap(jax.random.fold_in, in_axes=(0, None))(ctx.keys, i)
            nxt = sampling.sample_from_probs(q, keys)
            return (nxt, c), (nxt, q)

        start = cache.lengths
        (_, cache), (drafts, q) = jax.lax.scan(step, (root, cache), jnp.arange(self.num_tokens + 1))
        drafts = drafts[: self.num_tokens].T  # [B, K]
        q = jnp.swapaxes(q[: self.num_tokens], 0, 1)  # [B, K, V]
        cache = dataclasses.replace(cache, lengths=start)
        return chain_tree(root, drafts, q), cache

    def update(self, draft_params, target_params, cache: KVCache, ctx, tree, result, features, active):
        # Root and the accepted drafts are already in the draft cache at the right slots (a chain).
        committed = jnp.where(active, result.num_accepted + 1, 0)
        return dataclasses.replace(cache, lengths=cache.lengths + committed)
