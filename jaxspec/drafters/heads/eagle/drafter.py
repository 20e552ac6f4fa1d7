"""EAGLE-1/2 and EAGLE-3 drafting: feature-level autoregression with the head's own KV cache.

Pairs (see `jaxspec.drafters.heads.eagle.eagle`): pair i = (target feature of token i, token i + 1) at rotary
position i. With c target tokens committed and the root t_c pending, the head cache must hold pairs
0..c-1 built from TRUE target features; pair c-1 = (f_(c-1), root) predicts the first draft.

Each round:
  1. propose commits the pairs the last round produced (up to depth + 1: the accepted path's target
     features, handed over by `update` with the emitted tokens, no second target pass) as one causal
     chunk at positions [length, length + depth + 1) with its padding masked, writes their keys/values at
     those slots and advances `length` by the number of real pairs. Rejected drafts never reach the cache:
     the draft steps below keep their keys in a per-round buffer that is dropped afterwards.
  2. The chunk's last real output is the predicted feature at the root; its logits give depth 1.
  3. Chain: `sampled_chain`, step k runs pair (predicted feature, draft k) at position c + k - 1.
     Tree: `dynamic_tree`, the depth-s frontier (topk nodes) runs at position c + s - 1, each node seeing
     the committed cache, its ancestors' buffered keys and itself.
The prompt's pairs are built in `init` from the prefill features; the pair of the first token waits as
the pending chunk of round 1. Keys and values carry a leading axis of the head's decoder layers ([L, B,
Hkv, ., D]: one for EAGLE-1, `layer.num_layers` for EAGLE-3), in the cache and in the round's buffers.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from jaxspec.drafters.heads.configs import Eagle3Config, EagleConfig
from jaxspec.drafters.heads.drafting import (
    ChainOrDynamicTreeShape,
    DraftVocabulary,
    apply_hook,
    candidate_scores,
    dynamic_tree,
    sampled_chain,
    token_map_logits,
)
from jaxspec.drafters.heads.layers import AttentionInputs, causal_visible, empty_cache_inputs
from jaxspec.drafters.protocol import RoundContext, root_token
from jaxspec.model.kv_cache import HeadCache, write_window
from jaxspec.sampling.tree import gather_nodes
from jaxspec.sampling.verify import emitted_tokens


def _write_layers(buffer: jax.Array, new: jax.Array, lengths: jax.Array) -> jax.Array:
    """`write_window` for every decoder layer: buffer [L, B, Hkv, S, D], new [L, B, Hkv, N, D] at each
    row's `lengths` [B]."""
    return jax.vmap(write_window, in_axes=(0, 0, None))(buffer, new, lengths)


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class EagleState:
    """cache: committed pairs' keys/values [L, B, Hkv, S, D]; length [B]: committed pairs.
    pending_features [B, depth + 1, F] raw target features, pending_tokens [B, depth + 1], pending_count
    [B]: the pairs committed by the last round, not yet in the cache."""

    cache: HeadCache
    length: jax.Array
    pending_features: jax.Array
    pending_tokens: jax.Array
    pending_count: jax.Array


@dataclasses.dataclass(frozen=True)
class EagleDrafter(ChainOrDynamicTreeShape):
    target_graphdef: nnx.GraphDef
    head_graphdef: nnx.GraphDef
    config: EagleConfig | Eagle3Config
    depth: int
    topk: int = 1
    num_draft_tokens: int | None = None  # dynamic tree size; None = chain
    logits_hook: Any = None
    capture_layers: tuple[int, ...] = ()
    token_map: bool = False  # EAGLE-1: draft over draft_params["token_map"] (SpecConfig.token_map)
    # the most drafts a round can accept, when a deeper chain is merged into the tree
    # (`LookupFirstDrafter.branch_tokens`); None = depth
    max_accept: int | None = None

    @property
    def commit_size(self) -> int:
        """Tokens a round can commit: the accepted drafts + the bonus token."""
        return max(self.depth, self.max_accept or 0) + 1

    def _modules(self, draft_params, target_params):
        head = nnx.merge(self.head_graphdef, draft_params["head"])
        return head, nnx.merge(self.target_graphdef, target_params)

    def draft_vocabulary(self, head, draft_params) -> DraftVocabulary | None:
        """EAGLE-3 drafts over its own draft vocabulary, EAGLE-1 with a token map over the map; EAGLE-1
        otherwise (the target's LM head) and a drafter with a logits hook (which rewrites
        target-vocabulary logits) over the target vocabulary."""
        if isinstance(self.config, Eagle3Config) and self.logits_hook is None:
            return DraftVocabulary(head.target_ids(), self.config.layer.vocab_size)
        if self.token_map:
            return DraftVocabulary(draft_params["token_map"]["ids"], self.config.layer.vocab_size)
        return None

    def _logits(self, head, target, vocab, draft_params, hidden: jax.Array, predicted_index) -> jax.Array:
        """hidden [..., d] -> logits [..., V_d] over `vocab`, or [..., V] (hook applied) without one."""
        if self.token_map:
            return head.logits(hidden, lambda normed: token_map_logits(draft_params, normed))
        if vocab is not None:
            return head.draft_logits(hidden)
        logits = head.logits(hidden, target.lm_logits)
        return apply_hook(self.logits_hook, draft_params, logits, predicted_index)

    def target_features(self, hidden: jax.Array, captured: tuple[jax.Array, ...]) -> jax.Array:
        """The raw target features the head reads: [..., d] (EAGLE-1) or [..., 3 d] (EAGLE-3)."""
        if isinstance(self.config, Eagle3Config):
            return jnp.concatenate(captured, axis=-1)
        return hidden

    def init(self, draft_params, target_params, pre, requests, max_len) -> EagleState:
        head, target = self._modules(draft_params, target_params)
        layer = self.config.layer
        tokens, lengths = requests.prompt_tokens, requests.prompt_lengths
        batch, p = tokens.shape
        index = jnp.arange(p)[None, :]
        following = jnp.concatenate([tokens[:, 1:], jnp.zeros_like(tokens[:, :1])], axis=1)
        following = jnp.where(index == lengths[:, None] - 1, pre.first_token[:, None], following)
        raw = self.target_features(pre.hidden, pre.captured)
        dtype = head.fc.kernel[...].dtype
        inputs = empty_cache_inputs(batch, layer.num_kv_heads, layer.head_dim, causal_visible(p), dtype)
        positions = jnp.broadcast_to(index, (batch, p))
        _, k, v = head(
            head.embed(following, target.embed), head.project_target_features(raw), positions, inputs
        )
        shape = (k.shape[0], batch, layer.num_kv_heads, max_len + self.commit_size, layer.head_dim)
        zeros = jnp.zeros(shape, dtype)
        start = jnp.zeros((batch,), jnp.int32)
        cache = HeadCache(keys=_write_layers(zeros, k, start), values=_write_layers(zeros, v, start))
        last = jnp.take_along_axis(raw, (lengths - 1)[:, None, None], axis=1)  # [B, 1, F]
        pending = jnp.zeros((batch, self.commit_size, raw.shape[-1]), raw.dtype).at[:, :1].set(last)
        pending_tokens = jnp.zeros((batch, self.commit_size), jnp.int32).at[:, 0].set(pre.first_token)
        return EagleState(
            cache=cache,
            length=(lengths - 1).astype(jnp.int32),
            pending_features=pending,
            pending_tokens=pending_tokens,
            pending_count=jnp.ones((batch,), jnp.int32),
        )

    def propose(self, draft_params, target_params, state: EagleState, ctx: RoundContext):
        head, target = self._modules(draft_params, target_params)
        batch, n = state.pending_tokens.shape
        slots = jnp.arange(state.cache.keys.shape[3])

        # 1. commit last round's pairs as one causal chunk.
        positions = state.length[:, None] + jnp.arange(n)[None, :]
        real = jnp.arange(n)[None, :] < state.pending_count[:, None]
        inputs = AttentionInputs(
            state.cache.keys,
            state.cache.values,
            (slots[None, :] < state.length[:, None])[:, None, :],
            causal_visible(n)[None] & real[:, None, :],
        )
        features = head.project_target_features(state.pending_features)
        out, k, v = head(head.embed(state.pending_tokens, target.embed), features, positions, inputs)
        cache = HeadCache(
            keys=_write_layers(state.cache.keys, k, state.length),
            values=_write_layers(state.cache.values, v, state.length),
        )
        count = state.pending_count
        length = state.length + count
        state = EagleState(cache, length, state.pending_features, state.pending_tokens, jnp.zeros_like(count))

        # 2. the predicted feature at the root (the chunk's last real pair) and the depth-1 logits.
        root_hidden = jnp.take_along_axis(out, jnp.maximum(count - 1, 0)[:, None, None], axis=1)[:, 0]
        c = ctx.cache_lengths
        vocab = self.draft_vocabulary(head, draft_params)
        root_logits = self._logits(head, target, vocab, draft_params, root_hidden, c + 1)
        committed = (slots[None, :] < length[:, None])[:, None, :]

        def run(tokens: jax.Array, hidden: jax.Array, position: jax.Array, extra_k, extra_v, extra_visible):
            """tokens [B, K] with input features hidden [B, K, d] at `position` [B] -> (out, k, v)."""
            step_inputs = AttentionInputs(
                cache.keys,
                cache.values,
                committed,
                jnp.eye(tokens.shape[1], dtype=bool)[None],
                extra_k,
                extra_v,
                extra_visible,
            )
            pos = jnp.broadcast_to(position[:, None], tokens.shape)
            return head(head.embed(tokens, target.embed), hidden, pos, step_inputs)

        root = root_token(ctx)
        layer = self.config.layer
        if not self.is_tree:
            buffer = jnp.zeros(
                (k.shape[0], batch, layer.num_kv_heads, max(self.depth - 1, 1), layer.head_dim), k.dtype
            )

            def chain_step(carry, token, step):
                hidden, buf_k, buf_v = carry
                visible = jnp.broadcast_to(
                    jnp.arange(buf_k.shape[3])[None, None, :] < step - 1, (batch, 1, buf_k.shape[3])
                )
                out, kk, vv = run(token[:, None], hidden[:, None], length + step - 1, buf_k, buf_v, visible)
                buf_k = jax.lax.dynamic_update_slice_in_dim(buf_k, kk.astype(buf_k.dtype), step - 1, axis=3)
                buf_v = jax.lax.dynamic_update_slice_in_dim(buf_v, vv.astype(buf_v.dtype), step - 1, axis=3)
                logits = self._logits(head, target, vocab, draft_params, out[:, 0], c + step + 1)
                return logits, (out[:, 0], buf_k, buf_v)

            tree, _ = sampled_chain(
                root, root_logits, chain_step, (root_hidden, buffer, buffer), depth=self.depth, ctx=ctx,
                vocab=vocab,
            )  # fmt: skip
            return tree, state

        width = self.topk
        slots_total = max(self.depth - 1, 1) * width
        buffer = jnp.zeros((k.shape[0], batch, layer.num_kv_heads, slots_total, layer.head_dim), k.dtype)

        def tree_step(carry, tokens, source, step):
            outs, ancestors, buf_k, buf_v = carry
            hidden, seen = gather_nodes(outs, source), gather_nodes(ancestors, source)
            out, kk, vv = run(tokens, hidden, length + step - 1, buf_k, buf_v, seen)
            offset = (step - 1) * width
            buf_k = jax.lax.dynamic_update_slice_in_dim(buf_k, kk.astype(buf_k.dtype), offset, axis=3)
            buf_v = jax.lax.dynamic_update_slice_in_dim(buf_v, vv.astype(buf_v.dtype), offset, axis=3)
            own = jnp.arange(slots_total)[None, :] == offset + jnp.arange(width)[:, None]  # [K, T]
            logits = self._logits(head, target, vocab, draft_params, out, (c + step + 1)[:, None])
            return candidate_scores(logits, ctx.sampling), (out, seen | own[None], buf_k, buf_v)

        carry = (
            jnp.broadcast_to(root_hidden[:, None], (batch, width, root_hidden.shape[-1])),
            jnp.zeros((batch, width, slots_total), bool),
            buffer,
            buffer,
        )
        tree, _ = dynamic_tree(
            root,
            candidate_scores(root_logits, ctx.sampling),
            tree_step,
            carry,
            topk=width,
            num_steps=self.depth,
            num_draft_tokens=self.num_draft_tokens,
            vocab=vocab,
        )
        return tree, state

    def update(self, draft_params, target_params, state: EagleState, ctx, tree, result, features, active):
        num_accepted = jnp.where(active, result.num_accepted, 0)
        size = self.commit_size
        raw = self.target_features(features["hidden"], features["captured"])
        return dataclasses.replace(
            state,
            pending_features=raw.astype(state.pending_features.dtype),
            pending_tokens=emitted_tokens(result, num_accepted, size, pad=0),
            pending_count=jnp.where(active, num_accepted + 1, 0).astype(jnp.int32),
        )
