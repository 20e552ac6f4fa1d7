"""Loaders for draft heads: jaxspec's own Orbax checkpoints and the published layouts people download.

`load_head(path, method, target_config, dtype, extra)` picks the format:
  * a directory with jaxspec_head.json: jaxspec's own head (`jaxspec.drafters.heads.orbax_io`);
  * method "medusa": FasterDecoding layout. medusa_lm_head.safetensors (or medusa_lm_head.pt) holds the
    `nn.ModuleList` of heads, head i = Sequential(ResBlock x L, Linear(d, V, bias=False)):
    `{i}.{j}.linear.weight` [d, d], `{i}.{j}.linear.bias` [d] (block j), `{i}.{L}.weight` [V, d];
    config.json: medusa_num_heads, medusa_num_layers.
    (FasterDecoding/Medusa medusa/model/medusa_model.py @ 60eeab92e98adb0e787987493b11fa38535a8260,
    the safetensors file name as written by huggingface/text-generation-inference's Medusa loader.)
  * method "eagle": SafeAILab EAGLE-1/2 layout. pytorch_model.bin or model.safetensors with fc.weight
    [d, 2d], fc.bias [d], layers.0.self_attn.{q,k,v,o}_proj.weight, layers.0.post_attention_layernorm
    .weight, layers.0.mlp.{gate,up,down}_proj.weight (no input_layernorm on layer 0), optionally
    embed_tokens.weight (the target's, frozen); config.json: a Llama config of one layer, "bias" for fc.
    (SafeAILab/EAGLE eagle/model/cnets1.py @ 2174a790d71a41a2e7549e14fef7d277435894b9: Model.fc,
    LlamaDecoderLayer(index=0) skips input_layernorm; eagle/model/ea_model.py loads pytorch_model.bin.)
  * method "eagle3": SafeAILab / SpecForge EAGLE-3 layout. fc.weight [d, 3 d_target],
    midlayer.{input_layernorm,hidden_norm,post_attention_layernorm}.weight,
    midlayer.self_attn.{q,k,v}_proj.weight [*, 2d], midlayer.self_attn.o_proj.weight, midlayer.mlp.*,
    norm.weight, lm_head.weight [V_draft, d], d2t [V_draft] (target id - draft id), t2d [V] (bool),
    optionally embed_tokens.weight; config.json: draft_vocab_size, optional target_hidden_size and
    eagle_aux_hidden_state_layer_ids (vLLM's layer-input numbering, = our layer outputs + 1).
    (SafeAILab/EAGLE eagle/traineagle3/cnets.py @ 09fe6a050421cc4dfb1e3f4dfbe4f65aa9b9f63c: Model,
    LlamaDecoderLayeremb, d2t/t2d; sgl-project/SpecForge specforge/modeling/draft/llama3_eagle.py
    @ 89241ea0299e4ac48a22d27d649182627d0e5e53: LlamaForCausalLMEagle3.)
  * method "mtp": MiMo-style MTP layers stored in the target model's checkpoint (*.safetensors +
    config.json with num_hidden_layers L and num_nextn_predict_layers D):
    MiMo: model.mtp_layers.{i}.{token_layernorm,hidden_layernorm,final_layernorm}.weight,
      .input_proj.weight [d, 2d] over [hidden; embedding], and a Qwen2 block (.input_layernorm,
      .self_attn.* with q/k/v biases, .post_attention_layernorm, .mlp.*).
      (vllm-project/vllm vllm/model_executor/models/mimo_mtp.py @ 0bb55d60cb667d2f4e263b55304a30b38fe2e55c)
    DeepSeek-V3 stores its MTP layers as model.layers.{L+i}.* with MLA attention and a mixture-of-experts
    MLP (vllm-project/vllm vllm/model_executor/models/deepseek_mtp.py): read for a DeepSeek-V3 target
    by `jaxspec.drafters.heads.mtp.loader.load_mtp_head`, refused for any other target.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import jax.numpy as jnp

from jaxspec.drafters.heads.configs import (
    method_of,
)
from jaxspec.drafters.heads.eagle.loader import load_eagle, load_eagle3
from jaxspec.drafters.heads.head import DraftHead
from jaxspec.drafters.heads.medusa.loader import load_medusa
from jaxspec.drafters.heads.mtp.loader import load_mtp
from jaxspec.drafters.heads.orbax_io import OWN_FORMAT_FILE, load_own_head
from jaxspec.errors import ModelLoadError
from jaxspec.model.config import ModelConfig


def load_head(
    path: str | Path, method: str, target: ModelConfig, dtype: jnp.dtype, extra: dict[str, Any] | None = None
) -> DraftHead:
    """Load the head of `method` from `path` (see the module docstring for the formats)."""
    directory = Path(path)
    if not directory.is_dir():
        raise ModelLoadError(f"{directory}: no such draft head directory")
    extra = extra or {}
    if (directory / OWN_FORMAT_FILE).is_file():
        head = load_own_head(directory, dtype)
        if method_of(head.config) != method:
            raise ModelLoadError(
                f"{directory}: a {method_of(head.config)} head, SpecConfig asks for {method}"
            )
        return head
    loaders = {"medusa": load_medusa, "eagle": load_eagle, "eagle3": load_eagle3, "mtp": load_mtp}
    if method not in loaders:
        raise ModelLoadError(f"{directory}: no loader for method {method!r}")
    return loaders[method](directory, target, dtype, extra)
