"""MiMo-style MTP drafting, the chained semantics of the DeepSeek-V3 paper (`drafters.heads.mtp.module`).

Draft step k (k = 0..D-1, D = depth) runs virtual module k (weights k mod num_modules, its own KV
cache) at position i = c - 1, where c is the number of committed target tokens and t_c the root:
input h_(c-1)^k and token t_(c+k) (root for k = 0, else draft k), output the logits of draft k + 1.
Module k's cache must hold positions i < c - 1 with their own inputs (h_i^(k-1), t_(i+k+1)); for the
last k positions those tokens include this round's drafts, and h^(k-1) there comes from module k-1.

Fixed shapes: every step runs its module over the window of the last W = 2 D + 1 positions
[c - W, c) (the target features h^0 of the window are kept in the state), attending to its cache for
positions < c - W and causally within the window. Tokens come from the history, or from the drafts of
the path being expanded where position + k + 1 > c. The window's keys/values are written back to the
module's cache (slot = position + W); window positions that were only speculative are rewritten by a
later round before any query reads them as cache (a position p leaves the window only once c > p + W,
and by then all its inputs are committed: p + D + 1 <= c). Dynamic trees run the window once per
frontier path (the paths' windows are flattened into one forward with a block-diagonal mask).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from jaxspec.drafters.heads.configs import MtpConfig
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
from jaxspec.drafters.heads.mtp.module import mtp_logits, mtp_module_forward
from jaxspec.drafters.protocol import RoundContext, root_token
from jaxspec.model.kv_cache import HeadCache
from jaxspec.sampling.tree import gather_nodes


def block_causal(num_paths: int, width: int) -> jax.Array:
    """[P * W, P * W] visibility: causal inside each path's window, nothing across paths."""
    path = jnp.repeat(jnp.arange(num_paths), width)
    position = jnp.tile(jnp.arange(width), num_paths)
    return (path[:, None] == path[None, :]) & (position[None, :] <= position[:, None])


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class MtpState:
    """cache: keys/values [D, B, Hkv, S + W, Dh], one cache per draft step, slot = position + W.
    features: [B, W, d] target final hidden states at positions [c - W, c) (zeros before position 0)."""

    cache: HeadCache
    features: jax.Array


@dataclasses.dataclass(frozen=True)
class MtpDrafter(ChainOrDynamicTreeShape):
    target_graphdef: nnx.GraphDef
    module_graphdef: nnx.GraphDef
    config: MtpConfig
    depth: int
    topk: int = 1
    num_draft_tokens: int | None = None  # dynamic tree size; None = chain
    logits_hook: Any = None
    capture_layers: tuple[int, ...] = ()
    token_map: bool = False  # draft over draft_params["token_map"] (SpecConfig.token_map)

    @property
    def window(self) -> int:
        return 2 * self.depth + 1

    def _module_index(self, step: jax.Array | int) -> jax.Array | int:
        return step % self.config.num_modules

    def init(self, draft_params, target_params, pre, requests, max_len) -> MtpState:
        target = nnx.merge(self.target_graphdef, target_params)
        layer = self.config.layer
        tokens, lengths = requests.prompt_tokens, requests.prompt_lengths
        batch, p = tokens.shape
        w, depth = self.window, self.depth
        history = jnp.zeros((batch, p + depth + 1), jnp.int32).at[:, :p].set(tokens)
        history = jax.vmap(lambda row, at, tok: row.at[at].set(tok))(history, lengths, pre.first_token)
        dtype = jax.tree.leaves(draft_params["head"])[0].dtype
        inputs = empty_cache_inputs(batch, layer.num_kv_heads, layer.head_dim, causal_visible(p), dtype)

        def module_over_prompt(hidden, step):
            step_tokens = jax.lax.dynamic_slice_in_dim(history, step + 1, p, axis=1)
            positions = jnp.broadcast_to(jnp.arange(p)[None, :] + step + 1, (batch, p))
            passed, _, k, v = mtp_module_forward(
                self.module_graphdef,
                draft_params["head"],
                self._module_index(step),
                target.embed(step_tokens),
                hidden,
                positions,
                inputs,
            )
            return passed, (k, v)

        _, (keys, values) = jax.lax.scan(module_over_prompt, pre.hidden.astype(dtype), jnp.arange(depth))
        (key_heads, key_dim), (value_heads, value_dim) = layer.kv_cache_dims()
        cache = HeadCache(
            keys=jnp.zeros((depth, batch, key_heads, max_len + w, key_dim), dtype)
            .at[:, :, :, w : w + p]
            .set(keys),
            values=jnp.zeros((depth, batch, value_heads, max_len + w, value_dim), dtype)
            .at[:, :, :, w : w + p]
            .set(values),
        )
        index = lengths[:, None] - w + jnp.arange(w)[None, :]
        window = jnp.take_along_axis(pre.hidden, jnp.clip(index, 0, p - 1)[:, :, None], axis=1)
        return MtpState(cache=cache, features=jnp.where((index >= 0)[:, :, None], window, 0).astype(dtype))

    def propose(self, draft_params, target_params, state: MtpState, ctx: RoundContext):
        target = nnx.merge(self.target_graphdef, target_params)
        w, depth = self.window, self.depth
        batch = ctx.history.shape[0]
        c = ctx.cache_lengths
        positions = c[:, None] - w + jnp.arange(w)[None, :]  # [B, W]
        in_sequence = positions >= 0
        slots = jnp.arange(state.cache.keys.shape[3])
        cache_visible = ((slots[None, :] >= w) & (slots[None, :] < c[:, None]))[:, None, :]

        def window_tokens(step, paths):
            """Token t_(p + step + 1) at every window position p of every path: [B, P, W]."""
            index = positions + step + 1
            committed = jnp.take_along_axis(ctx.history, jnp.clip(index, 0, ctx.history.shape[1] - 1), axis=1)
            draft_index = index - c[:, None] - 1  # >= 0: this round's draft number draft_index + 1
            where = jnp.broadcast_to(jnp.clip(draft_index, 0, depth - 1)[:, None, :], paths.shape[:2] + (w,))
            drafted = jnp.take_along_axis(paths, where, axis=2)
            return jnp.where((draft_index >= 0)[:, None, :], drafted, committed[:, None, :])

        def run_module(step, hidden, paths):
            """Module `step` over the window of each path: hidden [B, P, W, d], paths [B, P, D] ->
            (h^step [B, P, W, d], logits at position c - 1 [B, P, V], path 0's window keys/values)."""
            num_paths = hidden.shape[1]
            tokens = window_tokens(step, paths).reshape(batch, num_paths * w)
            own = block_causal(num_paths, w)[None] & jnp.tile(in_sequence, (1, num_paths))[:, None, :]
            inputs = AttentionInputs(
                jax.lax.dynamic_index_in_dim(state.cache.keys, step, keepdims=False),
                jax.lax.dynamic_index_in_dim(state.cache.values, step, keepdims=False),
                cache_visible,
                own,
            )
            pos = jnp.tile(positions + step + 1, (1, num_paths))
            passed, normed, k, v = mtp_module_forward(
                self.module_graphdef,
                draft_params["head"],
                self._module_index(step),
                target.embed(tokens),
                hidden.reshape(batch, num_paths * w, -1),
                pos,
                inputs,
            )
            last = normed.reshape(batch, num_paths, w, -1)[:, :, w - 1]
            if self.token_map:  # [B, P, V_d] over the map's tokens
                logits = mtp_logits(last, lambda x: token_map_logits(draft_params, x))
            else:
                lm = mtp_logits(last, target.lm_logits)
                logits = apply_hook(self.logits_hook, draft_params, lm, (c + step + 1)[:, None])
            return passed.reshape(batch, num_paths, w, -1), logits, (k[:, :, :w], v[:, :, :w])

        def record(stack, step, kv):
            keys, values = stack
            return (
                jax.lax.dynamic_update_index_in_dim(keys, kv[0].astype(keys.dtype), step, axis=0),
                jax.lax.dynamic_update_index_in_dim(values, kv[1].astype(values.dtype), step, axis=0),
            )

        (key_heads, key_dim), (value_heads, value_dim) = self.config.layer.kv_cache_dims()
        stack = (
            jnp.zeros((depth, batch, key_heads, w, key_dim), state.cache.keys.dtype),
            jnp.zeros((depth, batch, value_heads, w, value_dim), state.cache.keys.dtype),
        )
        vocab = None
        if self.token_map:
            vocab = DraftVocabulary(draft_params["token_map"]["ids"], self.config.layer.vocab_size)
        no_drafts = jnp.zeros((batch, 1, depth), jnp.int32)
        passed, logits, kv = run_module(0, state.features[:, None], no_drafts)
        stack = record(stack, 0, kv)
        root = root_token(ctx)

        if not self.is_tree:

            def chain_step(carry, token, step):
                hidden, paths, kv_stack = carry
                paths = jnp.where(jnp.arange(depth)[None, None, :] == step - 1, token[:, None, None], paths)
                hidden, logits, kv = run_module(step, hidden, paths)
                return logits[:, 0], (hidden, paths, record(kv_stack, step, kv))

            tree, (_, _, stack) = sampled_chain(
                root, logits[:, 0], chain_step, (passed, no_drafts, stack), depth=depth, ctx=ctx, vocab=vocab
            )
        else:
            width = self.topk

            def tree_step(carry, tokens, source, step):
                outs, paths, kv_stack = carry
                hidden, paths = gather_nodes(outs, source), gather_nodes(paths, source)
                paths = jnp.where(jnp.arange(depth)[None, None, :] == step - 1, tokens[:, :, None], paths)
                hidden, logits, kv = run_module(step, hidden, paths)
                return candidate_scores(logits, ctx.sampling), (hidden, paths, record(kv_stack, step, kv))

            carry = (
                jnp.broadcast_to(passed, (batch, width) + passed.shape[2:]),
                jnp.zeros((batch, width, depth), jnp.int32),
                stack,
            )
            tree, (_, _, stack) = dynamic_tree(
                root,
                candidate_scores(logits[:, 0], ctx.sampling),
                tree_step,
                carry,
                topk=width,
                num_steps=depth,
                num_draft_tokens=self.num_draft_tokens,
                vocab=vocab,
            )

        write = jax.vmap(
            lambda buf, new: jax.vmap(lambda b, n, s: jax.lax.dynamic_update_slice(b, n, (0, s, 0)))(
                buf, new, c
            )
        )
        cache = HeadCache(keys=write(state.cache.keys, stack[0]), values=write(state.cache.values, stack[1]))
        return tree, MtpState(cache=cache, features=state.features)

    def update(self, draft_params, target_params, state: MtpState, ctx, tree, result, features, active):
        count = jnp.where(active, result.num_accepted + 1, 0)
        merged = jnp.concatenate([state.features, features["hidden"].astype(state.features.dtype)], axis=1)
        window = jax.vmap(lambda rows, start: jax.lax.dynamic_slice_in_dim(rows, start, self.window, axis=0))
        return MtpState(cache=state.cache, features=window(merged, count))
