"""Tiny random DeepSeek-V3 models (MLA + MoE + MTP layer) saved in the Hugging Face layout."""

from __future__ import annotations

import json
import math
from pathlib import Path

import torch

# >= 3 layers, the first dense; 8 routed experts in 2 groups (top-1 group, top-2 experts); 1 shared
# expert; q LoRA and kv LoRA on; YaRN rope over the interleaved rope part.
TINY_DEEPSEEK = dict(
    vocab_size=96,
    hidden_size=32,
    intermediate_size=48,
    moe_intermediate_size=16,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=4,
    n_routed_experts=8,
    n_group=2,
    topk_group=1,
    num_experts_per_tok=2,
    n_shared_experts=1,
    first_k_dense_replace=1,
    q_lora_rank=24,
    kv_lora_rank=16,
    qk_rope_head_dim=8,
    qk_nope_head_dim=8,
    v_head_dim=12,
    routed_scaling_factor=2.5,
    max_position_embeddings=256,
    rope_parameters={
        "rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64, "beta_fast": 32,
        "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0, "rope_theta": 10000.0,
    },
    bos_token_id=None,
    eos_token_id=None,
    pad_token_id=0,
)  # fmt: skip
FP8_BLOCK = (16, 16)


def tiny_deepseek(seed: int = 0, **overrides) -> torch.nn.Module:
    """A tiny random transformers DeepseekV3ForCausalLM (float32, eval), weights scaled up for decisive
    greedy steps, a random e_score_correction_bias."""
    import transformers

    torch.manual_seed(seed)
    config = transformers.DeepseekV3Config(**dict(TINY_DEEPSEEK, **overrides))
    model = transformers.DeepseekV3ForCausalLM(config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" not in name:
                p.mul_(3.0)
        for layer in model.model.layers[config.first_k_dense_replace :]:
            layer.mlp.gate.e_score_correction_bias.copy_(torch.randn(config.n_routed_experts) * 0.3)
    return model


def quantize_fp8(weight: torch.Tensor, block=FP8_BLOCK) -> tuple[torch.Tensor, torch.Tensor]:
    """[out, in] float -> (float8_e4m3fn weight, float32 scale_inv [ceil(out/b0), ceil(in/b1)])."""
    rows, cols = weight.shape
    scale = torch.zeros(math.ceil(rows / block[0]), math.ceil(cols / block[1]))
    quant = torch.zeros_like(weight)
    for i in range(scale.shape[0]):
        for j in range(scale.shape[1]):
            tile = weight[i * block[0] : (i + 1) * block[0], j * block[1] : (j + 1) * block[1]]
            scale[i, j] = tile.abs().max().clamp(min=1e-12) / 448.0
            quant[i * block[0] : (i + 1) * block[0], j * block[1] : (j + 1) * block[1]] = tile / scale[i, j]
    return quant.to(torch.float8_e4m3fn), scale


def dequantize_fp8(quant: torch.Tensor, scale: torch.Tensor, block=FP8_BLOCK) -> torch.Tensor:
    full = scale.repeat_interleave(block[0], 0).repeat_interleave(block[1], 1)
    return quant.float() * full[: quant.shape[0], : quant.shape[1]]


def is_fp8_weight(name: str, value: torch.Tensor) -> bool:
    """Which tensors DeepSeek-V3 stores as fp8: the 2-D linear weights of the layers but the router
    (and the MTP layer's copies of the embedding and LM head)."""
    return (
        name.startswith("model.layers.")
        and name.endswith(".weight")
        and value.ndim == 2
        and ".mlp.gate." not in name
        and not name.endswith(("embed_tokens.weight", "shared_head.head.weight"))
    )


def save_deepseek(
    model: torch.nn.Module,
    directory: Path,
    *,
    fp8: bool = False,
    mtp: tuple[dict, dict] | None = None,
    shards: int = 2,
) -> None:
    """Write `model` (and the optional MTP layer `tiny_mtp_layer` gives) in DeepSeek-V3's layout: config.json,
    `shards` safetensors files + model.safetensors.index.json; fp8 = linear weights as float8_e4m3fn +
    weight_scale_inv (and the model's own weights replaced by their dequantised values, so it stays
    the reference)."""
    from safetensors.torch import save_file

    directory.mkdir(parents=True, exist_ok=True)
    model.config.save_pretrained(directory)
    tensors = {k: v.detach().clone().contiguous() for k, v in model.state_dict().items()}
    mtp_tensors, mtp_parts = mtp if mtp is not None else ({}, None)
    tensors.update({k: v.detach().clone().contiguous() for k, v in mtp_tensors.items()})
    # transformers' in-memory experts are fused; the checkpoint layout has one tensor per expert.
    for name in [n for n in tensors if n.endswith("mlp.experts.gate_up_proj")]:
        base = name.removesuffix("gate_up_proj")
        gate_up, down = tensors.pop(name), tensors.pop(base + "down_proj")
        half = gate_up.shape[1] // 2
        for e in range(gate_up.shape[0]):
            tensors[f"{base}{e}.gate_proj.weight"] = gate_up[e, :half].contiguous()
            tensors[f"{base}{e}.up_proj.weight"] = gate_up[e, half:].contiguous()
            tensors[f"{base}{e}.down_proj.weight"] = down[e].contiguous()
    if fp8:
        for name in [n for n, v in tensors.items() if is_fp8_weight(n, v)]:
            quant, scale = quantize_fp8(tensors[name])
            tensors[name], tensors[name + "_scale_inv"] = quant, scale
        dequantised = {
            n: dequantize_fp8(v, tensors[n + "_scale_inv"])
            for n, v in tensors.items()
            if v.dtype == torch.float8_e4m3fn
        }
        load_dequantised(model, dequantised, mtp_parts)
        config = json.loads((directory / "config.json").read_text())
        config["quantization_config"] = {
            "activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8",
            "weight_block_size": list(FP8_BLOCK),
        }  # fmt: skip
        (directory / "config.json").write_text(json.dumps(config, indent=2))
    names = sorted(tensors)
    weight_map = {}
    for s in range(shards):
        part = names[s::shards]
        file = f"model-{s + 1:05d}-of-{shards:05d}.safetensors"
        save_file({n: tensors[n] for n in part}, str(directory / file))
        weight_map.update(dict.fromkeys(part, file))
    (directory / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {}, "weight_map": weight_map})
    )


def load_dequantised(
    model: torch.nn.Module, dequantised: dict[str, torch.Tensor], mtp_parts: dict | None
) -> None:
    """Put dequantised checkpoint weights back into the transformers model and the MTP layer's torch
    modules (`tiny_mtp_layer`), experts fused again."""
    mtp_prefix = f"model.layers.{model.config.num_hidden_layers}."
    for name, value in dequantised.items():
        if name.startswith(mtp_prefix):
            rest = name.removeprefix(mtp_prefix)
            if rest.startswith("eh_proj."):
                _copy_into(mtp_parts["eh_proj"], rest.removeprefix("eh_proj."), value)
            else:
                _copy_into(mtp_parts["block"], rest, value)
        else:
            _copy_into(model, name, value)


def _copy_into(module: torch.nn.Module, name: str, value: torch.Tensor) -> None:
    state = module.state_dict()
    with torch.no_grad():
        if name in state:
            state[name].copy_(value)
            return
        base, e, part = name.rsplit(".", 3)[0], int(name.split(".")[-3]), name.split(".")[-2]
        half = state[base + ".gate_up_proj"].shape[1] // 2
        if part == "gate_proj":
            state[base + ".gate_up_proj"][e, :half].copy_(value)
        elif part == "up_proj":
            state[base + ".gate_up_proj"][e, half:].copy_(value)
        else:
            state[base + ".down_proj"][e].copy_(value)


def tiny_mtp_layer(model: torch.nn.Module, seed: int = 1) -> tuple[dict[str, torch.Tensor], dict]:
    """DeepSeek-V3 MTP-layer tensors for `model` (HF names at model.layers.{L}.*) and the torch modules
    they come from: {"block", "enorm", "hnorm", "eh_proj", "norm"} (for a reference forward)."""
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3RMSNorm

    c = model.config
    n, d = c.num_hidden_layers, c.hidden_size
    block = tiny_deepseek(seed, num_hidden_layers=n + 1, **_overrides(model)).model.layers[n]
    torch.manual_seed(seed)
    parts = {"block": block, "eh_proj": torch.nn.Linear(2 * d, d, bias=False)}
    for name in ("enorm", "hnorm", "norm"):
        parts[name] = DeepseekV3RMSNorm(d, eps=c.rms_norm_eps)
        with torch.no_grad():
            parts[name].weight.copy_(1 + 0.1 * torch.randn(d))
    prefix = f"model.layers.{n}."
    tensors = {prefix + k: v for k, v in block.state_dict().items()}
    tensors[prefix + "enorm.weight"] = parts["enorm"].weight
    tensors[prefix + "hnorm.weight"] = parts["hnorm"].weight
    tensors[prefix + "eh_proj.weight"] = parts["eh_proj"].weight
    tensors[prefix + "shared_head.norm.weight"] = parts["norm"].weight
    tensors[prefix + "shared_head.head.weight"] = model.lm_head.weight
    tensors[prefix + "embed_tokens.weight"] = model.model.embed_tokens.weight
    return tensors, parts


def _overrides(model: torch.nn.Module) -> dict:
    """The TINY_DEEPSEEK fields `model` was built with differently (vocab size and the like)."""
    config = model.config.to_dict()
    return {
        k: config[k]
        for k in TINY_DEEPSEEK
        if k in config
        and config[k] != TINY_DEEPSEEK[k]
        and k != "num_hidden_layers"
        and not k.startswith("rope")
    }


def mtp_reference_logits(model: torch.nn.Module, parts: dict, ids: list[int]) -> torch.Tensor:
    """Torch MTP logits for positions 0..T-2 of `ids` (predicting ids[i + 2]): eh_proj([enorm(Emb(t_(i+1)));
    hnorm(h_i)]) through the block (causal), shared_head.norm, the LM head."""
    with torch.no_grad():
        tokens = torch.tensor([ids])
        hidden = model.model(tokens).last_hidden_state[:, :-1]
        emb = model.model.embed_tokens(tokens[:, 1:])
        x = parts["eh_proj"](torch.cat([parts["enorm"](emb), parts["hnorm"](hidden)], -1))
        t = x.shape[1]
        positions = torch.arange(t)[None]
        mask = torch.full((t, t), float("-inf")).triu(1)[None, None]
        out = parts["block"](x, attention_mask=mask, position_ids=positions,
                             position_embeddings=model.model.rotary_emb(x, positions))  # fmt: skip
        return model.lm_head(parts["norm"](out))[0]
