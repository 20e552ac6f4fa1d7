"""Fresh heads to train: configs for a target, EAGLE-3's draft vocabulary from the training data."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import jax.numpy as jnp
import numpy as np

from jaxspec.drafters.heads.configs import (
    Eagle3Config,
    EagleConfig,
    HeadConfig,
    MedusaConfig,
    MtpConfig,
    default_eagle3_layers,
    head_layer_config,
    method_of,
)
from jaxspec.drafters.heads.head import DraftHead, init_head
from jaxspec.drafters.heads.orbax_io import load_own_head
from jaxspec.drafters.heads.registry import check_head_fits
from jaxspec.loading.weights import unpack_qkv
from jaxspec.model.config import ModelConfig
from jaxspec.model.target import Model


def draft_vocabulary(rows: Sequence[dict], vocab_size: int, size: int) -> np.ndarray:
    """The `size` most frequent target tokens of the responses (ties and the remainder filled by the
    prompts' tokens, then by the lowest ids), sorted ascending: the EAGLE-3 draft vocabulary."""
    size = min(size, vocab_size)
    response = np.zeros((vocab_size,), np.int64)
    prompt = np.zeros((vocab_size,), np.int64)
    for row in rows:
        np.add.at(response, np.asarray(row["response_ids"], np.int64), 1)
        np.add.at(prompt, np.asarray(row["prompt_ids"], np.int64), 1)
    # Lexicographic priority: response count, then prompt count, then lower id.
    order = np.lexsort((np.arange(vocab_size), -prompt, -response))
    return np.sort(order[:size])


def head_config_for(
    method: str, target: ModelConfig, *, depth: int, draft_vocab_size: int = 8192, medusa_layers: int = 1,
    mtp_modules: int = 1, eagle3_layers: tuple[int, ...] | None = None, head_layers: int = 1,
) -> HeadConfig:  # fmt: skip
    """A head config for `target`; Medusa shares the target's LM head (trains in minutes on a CPU).
    head_layers: EAGLE-3's decoder layers (the others have one)."""
    if head_layers != 1 and method != "eagle3":
        raise ValueError(f"only an EAGLE-3 head has a choice of decoder layers, not a {method} head")
    layer = head_layer_config(target)
    if method == "medusa":
        return MedusaConfig(
            num_heads=depth, num_layers=medusa_layers, hidden_size=target.hidden_size,
            vocab_size=target.vocab_size, own_lm_head=False,
        )  # fmt: skip
    if method == "eagle":
        return EagleConfig(layer=layer)
    if method == "eagle3":
        return Eagle3Config(
            layer=layer.replace(num_layers=head_layers), target_hidden_size=target.hidden_size,
            draft_vocab_size=min(draft_vocab_size, target.vocab_size),
            target_layers=tuple(eagle3_layers or default_eagle3_layers(target.num_layers)),
        )  # fmt: skip
    if method == "mtp":
        return MtpConfig(layer=layer, num_modules=mtp_modules)
    raise ValueError(f"unknown head method {method!r}")


def new_head(
    config: HeadConfig, *, seed: int = 0, draft_ids: np.ndarray | None = None,
    dtype=jnp.float32,
) -> DraftHead:  # fmt: skip
    """A randomly initialised head; EAGLE-3 gets `draft_ids` as its vocabulary."""
    if isinstance(config, Eagle3Config):
        from jaxspec.drafters.heads.eagle.eagle3 import init_eagle3

        graphdef, params = init_eagle3(config, dtype, seed, draft_ids)
        return DraftHead(config=config, graphdef=graphdef, params=params, source=f"<random seed={seed}>")
    return init_head(config, dtype, seed)


def head_from_directory(
    directory: str, method: str, model: Model, capture_layers: Sequence[int]
) -> DraftHead:
    """An exported head (jaxspec_head.json + Orbax params/) to continue training from: float32
    parameters, its own config and, for EAGLE-3, its own draft vocabulary (d2t / t2d, part of the head).

    Raises ModelLoadError when `directory` is not a readable head, InputError when it does not fit
    `model` (`check_head_fits`: hidden sizes, EAGLE-3's fused feature width and layers), ValueError when
    it is not a `method` head, has another vocabulary size, or (EAGLE-3) fuses other layers than the
    features' `capture_layers`.
    """
    head = load_own_head(directory, jnp.float32)
    config = head.config
    found = method_of(config)
    if found != method:
        raise ValueError(f"{directory}: holds a {found} head, not {method}")
    check_head_fits(head, model)
    vocab = config.vocab_size if isinstance(config, MedusaConfig) else config.layer.vocab_size
    if vocab != model.config.vocab_size:
        raise ValueError(
            f"{directory}: head for a vocabulary of {vocab}, this target has {model.config.vocab_size}"
        )
    if isinstance(config, Eagle3Config) and tuple(config.target_layers) != tuple(capture_layers):
        raise ValueError(
            f"{directory}: head fuses target layers {list(config.target_layers)}, the features hold "
            f"{list(capture_layers)}"
        )
    return dataclasses.replace(head, source=f"{head.source} (fine-tuned)")


def draft_ids_of(head: DraftHead) -> np.ndarray:
    """[V_draft] sorted target ids of an EAGLE-3 head's draft vocabulary (from its d2t map)."""
    d2t = np.asarray(head.params["d2t"].get_value())
    return np.arange(d2t.shape[0]) + d2t


def with_draft_vocabulary(
    head: DraftHead, draft_ids: np.ndarray, target_graphdef, target_params
) -> DraftHead:
    """The EAGLE-3 `head` over another draft vocabulary `draft_ids` ([V_draft'] sorted target ids),
    e.g. one re-selected from a larger data set: every weight but the draft LM head is the head's; the
    LM-head columns of tokens the head already drafted keep their trained values. A trained head's
    columns live in its own space (the shipped SmolLM2 head's are uncorrelated with the target's rows),
    so a new token's column is its target LM-head row mapped into that space: by the linear map A
    [d, d] that best takes the kept tokens' target rows to their trained columns (least squares;
    `kept.sum()` >= d needed, else the target rows as they are)."""
    from flax import nnx

    if not isinstance(head.config, Eagle3Config):
        raise ValueError(f"only an EAGLE-3 head has a draft vocabulary, not a {method_of(head.config)} head")
    draft_ids = np.asarray(draft_ids, np.int64)
    config = dataclasses.replace(head.config, draft_vocab_size=int(draft_ids.shape[0]))
    fresh = new_head(config, draft_ids=draft_ids)
    module = nnx.merge(fresh.graphdef, fresh.params)
    old = nnx.merge(head.graphdef, head.params)
    for name in ("fc", "layer", "later_layers", "norm", "embed_tokens"):
        if hasattr(old, name):
            setattr(module, name, getattr(old, name))
    old_ids = draft_ids_of(head)
    kept = np.isin(draft_ids, old_ids)
    rows = np.asarray(nnx.merge(target_graphdef, target_params).lm_head_rows())
    trained = np.asarray(old.lm_head.kernel[...])  # [d, V_draft]
    shared = trained[:, np.searchsorted(old_ids, draft_ids[kept])]  # [d, kept]
    new_rows = rows[draft_ids[~kept]].astype(np.float64)  # [new, d]
    if kept.sum() >= rows.shape[1]:  # fit Y ≈ X A on the kept tokens: X their target rows, Y columns
        fit, *_ = np.linalg.lstsq(rows[draft_ids[kept]].astype(np.float64), shared.T, rcond=None)
        new_rows = new_rows @ fit
    kernel = np.empty((trained.shape[0], draft_ids.shape[0]), trained.dtype)
    kernel[:, kept] = shared
    kernel[:, ~kept] = new_rows.T
    module.lm_head.kernel[...] = jnp.asarray(kernel)
    graphdef, params = nnx.split(module)
    resized = f"draft vocabulary {old_ids.shape[0]} -> {draft_ids.shape[0]}, {int(kept.sum())} kept"
    source = f"{head.source} ({resized})"
    return DraftHead(config=config, graphdef=graphdef, params=params, source=source)


def _zero_residual_branches(layer) -> None:
    """Zero a decoder layer's attention-output and MLP-down projections: on the residual stream the
    layer is then the identity (its other weights still get gradients once those move)."""
    layer.self_attn.o_proj.kernel[...] = jnp.zeros_like(layer.self_attn.o_proj.kernel[...])
    layer.mlp.down_proj.kernel[...] = jnp.zeros_like(layer.mlp.down_proj.kernel[...])


def with_decoder_layers(head: DraftHead, num_layers: int, *, seed: int = 0) -> DraftHead:
    """The EAGLE-3 `head` grown to `num_layers` decoder layers: its own layers and every other weight
    kept, each added layer (a standard Llama layer after the existing ones, vLLM's multi-layer EAGLE-3)
    seeded at random with its residual branches zeroed, so the grown head drafts exactly what `head`
    does until training moves them. Raises ValueError for another method or fewer layers."""
    from flax import nnx

    if not isinstance(head.config, Eagle3Config):
        raise ValueError(f"only an EAGLE-3 head can grow decoder layers, not a {method_of(head.config)} head")
    have = head.config.layer.num_layers
    if num_layers < have:
        raise ValueError(f"{head.source}: has {have} decoder layers; a head cannot shrink to {num_layers}")
    if num_layers == have:
        return head
    config = dataclasses.replace(head.config, layer=head.config.layer.replace(num_layers=num_layers))
    grown = new_head(config, seed=seed, draft_ids=draft_ids_of(head))
    module = nnx.merge(grown.graphdef, grown.params)
    old = nnx.merge(head.graphdef, head.params)
    for name in ("fc", "layer", "norm", "lm_head", "embed_tokens"):
        if hasattr(old, name):
            setattr(module, name, getattr(old, name))
    for index, layer in enumerate(module.later_layers):
        if index < len(old.later_layers):
            module.later_layers[index] = old.later_layers[index]
        else:
            _zero_residual_branches(layer)
    graphdef, params = nnx.split(module)
    source = f"{head.source} (decoder layers {have} -> {num_layers})"
    return DraftHead(config=config, graphdef=graphdef, params=params, source=source)


def with_medusa_layers(head: DraftHead, num_layers: int) -> DraftHead:
    """The Medusa `head` grown to `num_layers` residual blocks per head: its blocks and LM heads kept, each
    added block (after the existing ones) with a zero kernel and bias, so x + silu(0) = x and the grown
    head drafts exactly what `head` does until training moves them (their kernels get gradients at
    once: silu'(0) = 1/2). Raises ValueError for another method or fewer blocks."""
    if not isinstance(head.config, MedusaConfig):
        raise ValueError(f"only a Medusa head can grow residual blocks, not a {method_of(head.config)} head")
    have = head.config.num_layers
    if num_layers < have:
        raise ValueError(
            f"{head.source}: has {have} residual blocks per head; it cannot shrink to {num_layers}"
        )
    if num_layers == have:
        return head
    config = dataclasses.replace(head.config, num_layers=num_layers)
    grown = init_head(config, jnp.float32, 0)
    params = grown.params
    kernel, bias = head.params["res_kernel"].get_value(), head.params["res_bias"].get_value()
    k, _, d = bias.shape
    added = num_layers - have
    params["res_kernel"].set_value(jnp.concatenate([kernel, jnp.zeros((k, added, d, d), kernel.dtype)], 1))
    params["res_bias"].set_value(jnp.concatenate([bias, jnp.zeros((k, added, d), bias.dtype)], 1))
    if head.config.own_lm_head:
        params["lm_kernel"].set_value(head.params["lm_kernel"].get_value())
    source = f"{head.source} (residual blocks {have} -> {num_layers})"
    return DraftHead(config=config, graphdef=grown.graphdef, params=params, source=source)


def _copy_decoder_layer(head_layer, target_layer) -> None:
    """Copy a target decoder layer (fused [out, in] projections) into a head layer (NNX Linear kernels
    [in, out]). An EAGLE-3 layer's 2d-wide attention input gets the target's projections on its hidden
    half (the second d inputs) and keeps its own on the embedding half; both of its input norms start as
    the target's input norm."""
    attention = target_layer.self_attn
    names = ("q_proj", "k_proj", "v_proj")
    parts = dict(zip(names, unpack_qkv(attention.qkv_proj.weight[...]), strict=True))
    d = attention.qkv_proj.weight.shape[-1]
    has_bias = hasattr(attention.qkv_proj, "bias")
    biases = dict(zip(names, unpack_qkv(attention.qkv_proj.bias[...]), strict=True)) if has_bias else {}
    for name, weight in parts.items():
        linear = getattr(head_layer.self_attn, name)
        kernel = linear.kernel[...]
        linear.kernel[...] = kernel.at[kernel.shape[0] - d :].set(weight.T.astype(kernel.dtype))
        if name in biases and linear.bias is not None:
            linear.bias[...] = biases[name].astype(linear.bias.dtype)
    head_layer.self_attn.o_proj.kernel[...] = attention.o_proj.weight[...].T
    if hasattr(attention, "q_norm") and hasattr(head_layer.self_attn, "q_norm"):
        head_layer.self_attn.q_norm.weight[...] = attention.q_norm.weight[...]
        head_layer.self_attn.k_norm.weight[...] = attention.k_norm.weight[...]
    for norm in ("input_layernorm", "hidden_norm"):
        if hasattr(head_layer, norm):
            getattr(head_layer, norm).weight[...] = target_layer.input_layernorm.weight[...]
    head_layer.post_attention_layernorm.weight[...] = target_layer.post_attention_layernorm.weight[...]
    gate_up = target_layer.mlp.gate_up_proj.weight[...]  # [2, f, d]
    head_layer.mlp.gate_proj.kernel[...] = gate_up[0].T
    head_layer.mlp.up_proj.kernel[...] = gate_up[1].T
    head_layer.mlp.down_proj.kernel[...] = target_layer.mlp.down_proj.weight[...].T


EAGLE1_FROM_TARGET = (
    "EAGLE-1 cannot start from the target: it regresses the target's post-norm features and drafts "
    "through the target's own LM head (so there is no LM head to take), and the target's last decoder "
    "layer maps pre-norm residuals, on a different scale (measured on SmolLM2-135M: loss ~100 at the start, "
    "validation depth-1 agreement 0.03 after 500 steps); start it from noise (--init-from-target none)"
)


def init_from_target(head: DraftHead, target_graphdef, target_params, *, layers: bool = True) -> DraftHead:
    """A fresh head started from the target instead of noise (EAGLE-3, MTP; Medusa as is; EAGLE-1 is
    refused, see EAGLE1_FROM_TARGET).

    EAGLE-3's draft LM head starts as the target's LM-head rows of the draft vocabulary and its final
    norm as the target's; with `layers`, every head decoder layer (EAGLE-3's, each MTP module's block)
    starts as the target's last decoder layer, and MTP's final norm as the target's; an EAGLE-3 head of
    several decoder layers starts its first (the fused-input midlayer) from the target's last layer and
    the later ones as the identity (`_zero_residual_branches`), i.e. as the one-layer head from the target.
    """
    from flax import nnx

    from jaxspec.drafters.heads.mtp.module import module_params, stack_modules

    target = nnx.merge(target_graphdef, target_params)
    last = target.layers[len(target.layers) - 1]
    config = head.config
    if isinstance(config, MedusaConfig):
        return head
    if isinstance(config, EagleConfig):
        raise ValueError(EAGLE1_FROM_TARGET)
    if isinstance(config, MtpConfig):
        states = []
        for k in range(config.num_modules):
            module = nnx.merge(head.graphdef, module_params(head.params, k))
            if layers:
                _copy_decoder_layer(module.block, last)
            module.final_norm.weight[...] = target.norm.weight[...]
            states.append(nnx.split(module)[1])
        return dataclasses.replace(head, params=stack_modules(states), source=head.source + " from target")
    module = nnx.merge(head.graphdef, head.params)
    if isinstance(config, Eagle3Config):
        rows = target.lm_head_rows()
        module.lm_head.kernel[...] = rows[module.target_ids()].T.astype(module.lm_head.kernel.dtype)
        module.norm.weight[...] = target.norm.weight[...]
    if layers:
        _copy_decoder_layer(module.layer, last)
        for later in getattr(module, "later_layers", ()):
            _zero_residual_branches(later)
    graphdef, params = nnx.split(module)
    return dataclasses.replace(head, graphdef=graphdef, params=params, source=head.source + " from target")
