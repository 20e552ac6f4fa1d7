"""EAGLE-3 head (Li et al. 2025): fused multi-layer target features and a reduced draft vocabulary.

The target's features are the outputs of three decoder layers, concatenated [..., 3 * d_target] and
fused by fc (no bias) to d. The decoder layer ("midlayer") attends over
[input_layernorm(Emb(t)); hidden_norm(h)] (2d wide) with residual h; its output h' is both the next
step's feature (drafting feeds it back, un-normed) and, after the head's own norm and LM head, logits
over the draft vocabulary. With `layer.num_layers` = L > 1 (vLLM's multi-layer EAGLE-3: its layers
1..L-1 are standard pre-norm Llama layers on the residual stream) the midlayer's output goes through
`later_layers` and h' is the last one's output. Draft id i is target id i + d2t[i]; t2d[v] says
whether target id v is in the draft vocabulary. Drafting processes the draft logits themselves and
maps the chosen indices to target ids (`jaxspec.drafters.heads.drafting.DraftVocabulary`); `logits`
puts them at their target ids with -inf elsewhere, one distribution over the target vocabulary (what
a logits hook rewrites).

Same drafter interface as `jaxspec.drafters.heads.eagle.eagle.EagleHead`.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxspec.drafters.heads.configs import Eagle3Config
from jaxspec.drafters.heads.layers import AttentionInputs, VocabMap, rope_for
from jaxspec.model.llama import DecoderLayer, RMSNorm, split_linear


class Eagle3Head(nnx.Module):
    def __init__(
        self, config: Eagle3Config, dtype: jnp.dtype, rngs: nnx.Rngs, draft_ids: np.ndarray | None = None
    ):
        """draft_ids: the sorted target ids of the draft vocabulary (default: the first draft_vocab_size)."""
        c = config.layer
        d, v, vd = c.hidden_size, c.vocab_size, config.draft_vocab_size
        self.config = config
        self.fc = split_linear(3 * config.target_hidden_size, d, False, dtype, rngs)
        self.layer = DecoderLayer(c, dtype, rngs, layout="split", input_norm="eagle3")
        self.later_layers = nnx.List(
            [DecoderLayer(c, dtype, rngs, layout="split") for _ in range(c.num_layers - 1)]
        )
        self.norm = RMSNorm(d, c.rms_norm_eps, dtype)
        self.lm_head = split_linear(d, vd, False, dtype, rngs)
        if config.own_embedding:
            self.embed_tokens = nnx.Embed(
                v, d, dtype=dtype, param_dtype=dtype, embedding_init=nnx.initializers.normal(0.02), rngs=rngs
            )
        ids = np.arange(vd) if draft_ids is None else np.asarray(draft_ids)
        self.d2t = VocabMap(jnp.asarray(ids - np.arange(vd), jnp.int32))
        self.t2d = VocabMap(jnp.zeros((v,), bool).at[ids].set(True))

    def embed(self, tokens: jax.Array, target_embed: Callable[[jax.Array], jax.Array]) -> jax.Array:
        if self.config.own_embedding:
            return self.embed_tokens(tokens)
        return target_embed(tokens)

    def project_target_features(self, features: jax.Array) -> jax.Array:
        """[..., 3 * d_target] concatenated layer outputs -> [..., d]."""
        return self.fc(features)

    def __call__(
        self, embeddings: jax.Array, hidden: jax.Array, positions: jax.Array, inputs: AttentionInputs
    ) -> tuple[jax.Array, jax.Array, jax.Array]:
        """embeddings/hidden [B, N, d], positions [B, N] -> (h' [B, N, d], own keys, own values), the keys
        and values [L, B, Hkv, N, D] (one per decoder layer; `inputs` per layer: `AttentionInputs.layer`)."""
        cos, sin = rope_for(self.config.layer, positions)
        hidden = hidden.astype(embeddings.dtype)
        out, k, v = self.layer(hidden, cos, sin, inputs.layer(0), embeddings=embeddings)
        keys, values = [k], [v]
        for index, layer in enumerate(self.later_layers, start=1):
            out, k, v = layer(out, cos, sin, inputs.layer(index))
            keys.append(k)
            values.append(v)
        return out, jnp.stack(keys), jnp.stack(values)

    def draft_logits(self, hidden: jax.Array) -> jax.Array:
        """hidden [..., d] -> float32 logits over the draft vocabulary [..., V_draft]."""
        return self.lm_head(self.norm(hidden)).astype(jnp.float32)

    def target_ids(self) -> jax.Array:
        """[V_draft] target id of every draft id."""
        return jnp.arange(self.config.draft_vocab_size, dtype=jnp.int32) + self.d2t[...]

    def logits(
        self, hidden: jax.Array, target_lm: Callable[[jax.Array], jax.Array] | None = None
    ) -> jax.Array:
        """hidden [..., d] -> target-vocabulary logits [..., V], -inf outside the draft vocabulary."""
        draft = self.draft_logits(hidden)
        full = jnp.full(draft.shape[:-1] + (self.config.layer.vocab_size,), -jnp.inf, jnp.float32)
        return full.at[..., self.target_ids()].set(draft)


def init_eagle3(
    config: Eagle3Config, dtype: jnp.dtype, seed: int, draft_ids: np.ndarray | None = None
) -> tuple[nnx.GraphDef, nnx.State]:
    """Seeded random head (graphdef, params); draft_ids default: a seeded random sorted subset."""
    if draft_ids is None:
        rng = np.random.default_rng(seed)
        draft_ids = np.sort(rng.choice(config.layer.vocab_size, config.draft_vocab_size, replace=False))
    return nnx.split(Eagle3Head(config, dtype, nnx.Rngs(seed), draft_ids))
