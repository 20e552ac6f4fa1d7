"""DeepSeek-V3's MTP layer as a jaxspec MTP head (`drafters.heads.mtp.module`, `drafters.heads.mtp.drafter`).

The checkpoint stores module i at `model.layers.{num_hidden_layers + i}.`: enorm, hnorm (RMSNorm),
eh_proj [d, 2 d], a full decoder block (input_layernorm, MLA self_attn, post_attention_layernorm, the
MoE mlp), shared_head.norm, and copies of the target's embedding (embed_tokens) and LM head
(shared_head.head), whose shapes are checked and which are shared with the target, as in DeepSeek's
and vLLM's inference code. At position i, with h = the target's final-normed hidden state (or the
previous module's block output):
  x = eh_proj([enorm(Emb(t_(i+k))); hnorm(h_i)]),  h' = block(x),  logits = lm_head(shared_head.norm(h'))
and h' (before the norm) is what the next draft step reads. The block's attention caches its latents
and rope keys like the target's (`HeadCache.keys` / `.values`: [.., B, 1, S, r] / [.., B, 1, S, dr]).
"""

from __future__ import annotations

from pathlib import Path

import jax
import jax.numpy as jnp
from flax import nnx

from jaxspec.drafters.heads.configs import MtpConfig
from jaxspec.drafters.heads.layers import AttentionInputs
from jaxspec.drafters.heads.mtp.module import MtpModule, abstract_module, stack_modules
from jaxspec.errors import ModelLoadError
from jaxspec.model.deepseek_v3.config import DeepseekV3Config, fp8_block_size
from jaxspec.model.deepseek_v3.model import (
    DeepseekV3DecoderLayer,
    latent_attention,
    rope_cos_sin,
    softmax_scale,
)


def head_attention(inputs: AttentionInputs, scale: float):
    """An MLA attention step over a head's key sets: the committed cache, this round's earlier draft
    steps (optional) and the queries' own new entries (`jaxspec.drafters.heads.layers` for the masks)."""

    def attend(q_lat, q_pe, latent, k_pe):
        n = latent.shape[1]
        own_visible = jnp.broadcast_to(inputs.own_visible, (latent.shape[0], n, n)) | jnp.eye(n, dtype=bool)
        parts = [(inputs.cache_keys[:, 0], inputs.cache_values[:, 0], inputs.cache_visible)]
        if inputs.extra_keys is not None:
            parts.append((inputs.extra_keys[:, 0], inputs.extra_values[:, 0], inputs.extra_visible))
        parts.append((latent, k_pe, own_visible))
        return latent_attention(q_lat, q_pe, parts, scale), (latent[:, None], k_pe[:, None])

    return attend


class DeepseekMtpModule(MtpModule):
    """One DeepSeek-V3 MTP module: `MtpModule` (enorm, hnorm, eh_proj, final_norm = shared_head.norm)
    with an MLA + MoE block; its own keys / values are latents [B, 1, N, r] / rope keys [B, 1, N, dr]."""

    def make_block(self, layer: DeepseekV3Config, dtype: jnp.dtype, rngs: nnx.Rngs) -> nnx.Module:
        # The MTP layers sit at index num_hidden_layers, past the first dense layers: always MoE (a head's
        # layer config may carry num_layers=1, `head_layer_config`, so the index is not read from it).
        return DeepseekV3DecoderLayer(layer, dtype, rngs, moe=True)

    def run_block(
        self, x: jax.Array, positions: jax.Array, inputs: AttentionInputs
    ) -> tuple[jax.Array, jax.Array, jax.Array]:
        layer = self.config.layer
        cos, sin = rope_cos_sin(layer, positions)
        out, (latent, k_pe) = self.block(x, cos, sin, head_attention(inputs, softmax_scale(layer)))
        return out, latent, k_pe


def load_mtp_head(directory: Path, target: DeepseekV3Config, dtype: jnp.dtype):
    """The MTP layers of a DeepSeek-V3 checkpoint directory as a DraftHead (stacked modules)."""
    from jaxspec.drafters.heads.head import DraftHead
    from jaxspec.loading.checkpoint_io import TensorSource
    from jaxspec.loading.deepseek_v3 import fill_state, read_checkpoint
    from jaxspec.loading.hf_dir import read_json_object

    config_path = directory / "config.json"
    raw = read_json_object(config_path)
    count = int(raw.get("num_nextn_predict_layers") or 0)
    if count < 1:
        raise ModelLoadError(f"{config_path}: field 'num_nextn_predict_layers' is {count}: no MTP layers")
    prefixes = tuple(f"model.layers.{target.num_layers + i}." for i in range(count))
    block = fp8_block_size(raw, str(config_path))
    tensors = TensorSource(
        read_checkpoint(directory, lambda n: n.startswith(prefixes), block), str(directory)
    )
    if not tensors.tensors:
        raise ModelLoadError(f"{directory}: no MTP tensors ('{prefixes[0]}*')")
    config = MtpConfig(layer=target, num_modules=count, embedding_first=True, recycle_normed=False)
    graphdef, abstract = abstract_module(config, dtype)

    def key_of(prefix: str):
        def key(path: tuple) -> tuple[str, tuple]:
            if path[0] == "block":
                return prefix, path[1:]
            if path[0] == "final_norm":
                return prefix, ("shared_head", "norm", *path[1:])
            return prefix, path

        return key

    states = [fill_state(abstract, key_of(prefix), tensors, dtype) for prefix in prefixes]
    for prefix in prefixes:  # copies of the target's embedding and LM head: shared, shapes checked
        for name in ("embed_tokens.weight", "shared_head.head.weight"):
            if prefix + name in tensors:
                tensors.take(prefix + name, (target.vocab_size, target.hidden_size))
    tensors.check_all_used()
    return DraftHead(config=config, graphdef=graphdef, params=stack_modules(states), source=str(directory))
