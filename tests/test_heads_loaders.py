"""Draft-head checkpoints: published layouts (synthetic files with the exact public key names and
shapes) and jaxspec's own Orbax format.

Each published layout is checked twice: the tensors land in the right parameters, and the loaded head
computes what an independent numpy re-implementation of the reference code computes from the raw
tensors (so a swapped concatenation order or a missing norm is caught, not just a renamed key).
"""

from __future__ import annotations

import json

import jax.numpy as jnp
import numpy as np
import pytest
from safetensors.numpy import save_file

from jaxspec.config import SpecConfig
from jaxspec.drafters.heads import Eagle3Config, EagleConfig, MedusaConfig, MtpConfig, init_head
from jaxspec.drafters.heads.configs import head_layer_config
from jaxspec.drafters.heads.eagle.eagle import eagle_sequence_forward
from jaxspec.drafters.heads.loaders import load_head
from jaxspec.drafters.heads.medusa.module import medusa_logits
from jaxspec.drafters.heads.mtp.module import mtp_sequence_forward
from jaxspec.drafters.heads.orbax_io import save_head
from jaxspec.errors import ModelLoadError
from jaxspec.model.config import ModelConfig

TARGET = ModelConfig(
    vocab_size=48,
    hidden_size=32,
    intermediate_size=40,
    num_layers=6,
    num_heads=4,
    num_kv_heads=2,
    head_dim=8,
    rms_norm_eps=1e-6,
)
D, V, F = TARGET.hidden_size, TARGET.vocab_size, TARGET.intermediate_size
HQ, HKV, HD = TARGET.num_heads, TARGET.num_kv_heads, TARGET.head_dim
LLAMA_JSON = {
    "model_type": "llama",
    "hidden_size": D,
    "intermediate_size": F,
    "num_attention_heads": HQ,
    "num_key_value_heads": HKV,
    "rms_norm_eps": 1e-6,
    "rope_theta": 10000.0,
    "vocab_size": V,
}


# ---------------------------------------------------------------------------------------------------
# numpy reference (Hugging Face Llama semantics, float64)
# ---------------------------------------------------------------------------------------------------


def rms(x, w, eps=1e-6):
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * w


def silu(x):
    return x / (1 + np.exp(-x))


def rope(x, positions):
    """x [N, H, Dh] rotate-half rope."""
    inv = 1.0 / (10000.0 ** (np.arange(0, HD, 2) / HD))
    ang = positions[:, None] * inv
    cos, sin = np.cos(np.concatenate([ang, ang], -1)), np.sin(np.concatenate([ang, ang], -1))
    rotated = np.concatenate([-x[..., HD // 2 :], x[..., : HD // 2]], -1)
    return x * cos[:, None] + rotated * sin[:, None]


def ref_attention(x, t, p, positions):
    """x [N, Din]; causal grouped-query attention with weights t[p + 'self_attn.*']."""
    n = x.shape[0]

    def proj(name, heads):
        y = x @ t[f"{p}self_attn.{name}.weight"].T
        if f"{p}self_attn.{name}.bias" in t:
            y = y + t[f"{p}self_attn.{name}.bias"]
        return y.reshape(n, heads, HD)

    q, k, v = rope(proj("q_proj", HQ), positions), rope(proj("k_proj", HKV), positions), proj("v_proj", HKV)
    k, v = np.repeat(k, HQ // HKV, axis=1), np.repeat(v, HQ // HKV, axis=1)
    scores = np.einsum("nhd,mhd->hnm", q, k) / np.sqrt(HD)
    scores = np.where(np.tril(np.ones((n, n), bool))[None], scores, -np.inf)
    probs = np.exp(scores - scores.max(-1, keepdims=True))
    probs /= probs.sum(-1, keepdims=True)
    out = np.einsum("hnm,mhd->nhd", probs, v).reshape(n, HQ * HD)
    return out @ t[f"{p}self_attn.o_proj.weight"].T


def ref_layer(residual, attn_in, t, p, positions):
    h = residual + ref_attention(attn_in, t, p, positions)
    m = rms(h, t[f"{p}post_attention_layernorm.weight"])
    gate, up = m @ t[f"{p}mlp.gate_proj.weight"].T, m @ t[f"{p}mlp.up_proj.weight"].T
    return h + (silu(gate) * up) @ t[f"{p}mlp.down_proj.weight"].T


def layer_tensors(rng, prefix, attn_in=D, bias=False, input_norm=True, extra_norms=()):
    t = {}
    for name, rows in (("q_proj", HQ * HD), ("k_proj", HKV * HD), ("v_proj", HKV * HD)):
        t[f"{prefix}self_attn.{name}.weight"] = rng.normal(0, 0.2, (rows, attn_in))
        if bias:
            t[f"{prefix}self_attn.{name}.bias"] = rng.normal(0, 0.2, (rows,))
    t[f"{prefix}self_attn.o_proj.weight"] = rng.normal(0, 0.2, (D, HQ * HD))
    t[f"{prefix}mlp.gate_proj.weight"] = rng.normal(0, 0.2, (F, D))
    t[f"{prefix}mlp.up_proj.weight"] = rng.normal(0, 0.2, (F, D))
    t[f"{prefix}mlp.down_proj.weight"] = rng.normal(0, 0.2, (D, F))
    norms = ("post_attention_layernorm",) + (("input_layernorm",) if input_norm else ()) + tuple(extra_norms)
    for name in norms:
        t[f"{prefix}{name}.weight"] = 1.0 + rng.normal(0, 0.1, (D,))
    return t


def f32(tensors):
    return {k: (v.astype(np.float32) if v.dtype.kind == "f" else v) for k, v in tensors.items()}


def write(directory, tensors, config, filename="model.safetensors"):
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(config))
    if filename.endswith(".safetensors"):
        save_file(f32(tensors), str(directory / filename))
    else:
        import torch

        torch.save(
            {k: torch.from_numpy(np.ascontiguousarray(v)) for k, v in f32(tensors).items()},
            directory / filename,
        )
    return directory


# ---------------------------------------------------------------------------------------------------
# Published layouts
# ---------------------------------------------------------------------------------------------------


def medusa_checkpoint(rng, num_heads=3):
    t = {}
    for i in range(num_heads):
        t[f"{i}.0.linear.weight"] = rng.normal(0, 0.2, (D, D))
        t[f"{i}.0.linear.bias"] = rng.normal(0, 0.2, (D,))
        t[f"{i}.1.weight"] = rng.normal(0, 0.2, (V, D))
    return t, {"medusa_num_heads": num_heads, "medusa_num_layers": 1, "base_model_name_or_path": "x"}


def eagle_checkpoint(rng):
    t = layer_tensors(rng, "layers.0.", input_norm=False)
    t["fc.weight"] = rng.normal(0, 0.2, (D, 2 * D))
    t["fc.bias"] = rng.normal(0, 0.2, (D,))
    t["embed_tokens.weight"] = rng.normal(0, 0.2, (V, D))
    return t, dict(LLAMA_JSON, num_hidden_layers=1, bias=True, architectures=["LlamaForCausalLM"])


DRAFT_IDS = np.array([0, 3, 4, 9, 10, 11, 20, 33, 40, 47])


def eagle3_checkpoint(rng):
    t = layer_tensors(rng, "midlayer.", attn_in=2 * D, extra_norms=("hidden_norm",))
    t["fc.weight"] = rng.normal(0, 0.2, (D, 3 * D))
    t["norm.weight"] = 1.0 + rng.normal(0, 0.1, (D,))
    t["lm_head.weight"] = rng.normal(0, 0.2, (len(DRAFT_IDS), D))
    t["d2t"] = (DRAFT_IDS - np.arange(len(DRAFT_IDS))).astype(np.int64)
    t["t2d"] = np.isin(np.arange(V), DRAFT_IDS)
    t["embed_tokens.weight"] = rng.normal(0, 0.2, (V, D))
    config = dict(
        LLAMA_JSON,
        num_hidden_layers=1,
        draft_vocab_size=len(DRAFT_IDS),
        architectures=["LlamaForCausalLMEagle3"],
    )
    config["eagle_config"] = {"eagle_aux_hidden_state_layer_ids": [2, 4, 5]}
    return t, config


def mimo_mtp_checkpoint(rng):
    p = "model.mtp_layers.0."
    t = layer_tensors(rng, p, bias=True)
    for name in ("token_layernorm", "hidden_layernorm", "final_layernorm"):
        t[f"{p}{name}.weight"] = 1 + rng.normal(0, 0.1, (D,))
    t[f"{p}input_proj.weight"] = rng.normal(0, 0.2, (D, 2 * D))
    t["model.norm.weight"] = np.ones((D,))  # a target weight: ignored
    config = dict(
        LLAMA_JSON, model_type="mimo", num_hidden_layers=TARGET.num_layers, num_nextn_predict_layers=1
    )
    return t, config


LAYOUTS = {
    "medusa": ("medusa", medusa_checkpoint, "medusa_lm_head.safetensors"),
    "eagle": ("eagle", eagle_checkpoint, "pytorch_model.bin"),
    "eagle3": ("eagle3", eagle3_checkpoint, "model.safetensors"),
    "mimo_mtp": ("mtp", mimo_mtp_checkpoint, "model.safetensors"),
}


def load(tmp_path, layout, mutate=None, filename=None):
    method, make, default_file = LAYOUTS[layout]
    tensors, config = make(np.random.default_rng(0))
    if mutate is not None:
        mutate(tensors)
    write(tmp_path / layout, tensors, config, filename or default_file)
    return tensors, load_head(tmp_path / layout, method, TARGET, jnp.float32)


@pytest.mark.parametrize("filename", ["medusa_lm_head.safetensors", "medusa_lm_head.pt"])
def test_medusa_layout(tmp_path, filename):
    t, head = load(tmp_path, "medusa", filename=filename)
    assert head.config == MedusaConfig(
        num_heads=3, num_layers=1, hidden_size=D, vocab_size=V, own_lm_head=True
    )
    hidden = np.random.default_rng(1).normal(size=(2, D))
    logits = np.asarray(medusa_logits(head.graphdef, head.params, jnp.asarray(hidden, jnp.float32), None))
    for i in range(3):
        x = hidden + silu(hidden @ t[f"{i}.0.linear.weight"].T + t[f"{i}.0.linear.bias"])
        np.testing.assert_allclose(logits[:, i], x @ t[f"{i}.1.weight"].T, rtol=2e-4, atol=2e-4)


def _sequence_inputs(rng, n=5, feature_width=D):
    return rng.normal(size=(n, D)), rng.normal(size=(n, feature_width))


@pytest.mark.parametrize("filename", ["pytorch_model.bin", "model.safetensors"])
def test_eagle_layout(tmp_path, filename):
    t, head = load(tmp_path, "eagle", filename=filename)
    assert isinstance(head.config, EagleConfig) and head.config.fc_bias and not head.config.input_norm
    emb, feat = _sequence_inputs(np.random.default_rng(2))
    out = eagle_sequence_forward(
        head.graphdef, head.params, jnp.asarray(emb[None], jnp.float32), jnp.asarray(feat[None], jnp.float32)
    )[0]
    x = np.concatenate([emb, feat], -1) @ t["fc.weight"].T + t["fc.bias"]
    expected = ref_layer(x, x, t, "layers.0.", np.arange(5))  # EAGLE-1 layer 0: no input norm
    np.testing.assert_allclose(np.asarray(out), expected, rtol=2e-4, atol=2e-4)


def test_eagle3_layout(tmp_path):
    t, head = load(tmp_path, "eagle3")
    config = head.config
    assert isinstance(config, Eagle3Config)
    assert config.target_layers == (1, 3, 4)  # vLLM's layer-input ids (2, 4, 5) minus one
    assert config.draft_vocab_size == len(DRAFT_IDS) and not config.own_embedding
    logits = check_eagle3_forward(t, head, ["midlayer."])
    assert np.all(np.isneginf(np.delete(logits, DRAFT_IDS, axis=1)))


def check_eagle3_forward(t, head, prefixes) -> np.ndarray:
    """The head's teacher-forced features and draft logits against numpy over the published tensors `t`
    (decoder layers under `prefixes`, the first the fused-input one); returns its target-vocabulary
    logits [N, V] (-inf outside the draft vocabulary)."""
    from flax import nnx

    emb, feat = _sequence_inputs(np.random.default_rng(3), feature_width=3 * D)
    out = eagle_sequence_forward(
        head.graphdef, head.params, jnp.asarray(emb[None], jnp.float32), jnp.asarray(feat[None], jnp.float32)
    )[0]
    expected = feat @ t["fc.weight"].T
    first = prefixes[0]
    attn_in = np.concatenate(
        [rms(emb, t[f"{first}input_layernorm.weight"]), rms(expected, t[f"{first}hidden_norm.weight"])], -1
    )
    expected = ref_layer(expected, attn_in, t, first, np.arange(5))
    for prefix in prefixes[1:]:
        expected = ref_layer(
            expected, rms(expected, t[f"{prefix}input_layernorm.weight"]), t, prefix, np.arange(5)
        )
    np.testing.assert_allclose(np.asarray(out), expected, rtol=2e-4, atol=2e-4)
    logits = np.asarray(nnx.merge(head.graphdef, head.params).logits(out))
    draft = rms(expected, t["norm.weight"]) @ t["lm_head.weight"].T
    np.testing.assert_allclose(logits[:, DRAFT_IDS], draft, rtol=2e-4, atol=2e-4)
    return logits


def test_eagle3_with_two_decoder_layers_in_vllm_naming(tmp_path):
    """vLLM's multi-layer EAGLE-3: "layers.0" (the fused-input layer) then "layers.1", a standard layer on
    the residual stream; num_hidden_layers must match the weights (an error names config.json)."""
    rng = np.random.default_rng(0)
    t, config = eagle3_checkpoint(rng)
    t = {k.replace("midlayer.", "layers.0."): v for k, v in t.items()}
    t.update(layer_tensors(rng, "layers.1."))
    write(tmp_path / "two", t, dict(config, num_hidden_layers=2), "model.safetensors")
    head = load_head(tmp_path / "two", "eagle3", TARGET, jnp.float32)
    assert head.config.layer.num_layers == 2
    check_eagle3_forward(t, head, ["layers.0.", "layers.1."])

    write(tmp_path / "bad", t, dict(config, num_hidden_layers=1), "model.safetensors")
    with pytest.raises(ModelLoadError, match=r"config.json: num_hidden_layers is 1, the weights hold 2"):
        load_head(tmp_path / "bad", "eagle3", TARGET, jnp.float32)


def test_eagle3_vocab_maps_must_agree(tmp_path):
    def shift(t):
        t["d2t"] = t["d2t"] + 1

    with pytest.raises(ModelLoadError, match="d2t"):
        load(tmp_path, "eagle3", mutate=shift)


def test_mimo_mtp_layout(tmp_path):
    t, head = load(tmp_path, "mimo_mtp")
    config = head.config
    assert isinstance(config, MtpConfig) and config.num_modules == 1
    emb, hidden = _sequence_inputs(np.random.default_rng(4))
    passed, normed = mtp_sequence_forward(
        head.graphdef,
        head.params,
        0,
        jnp.asarray(emb[None], jnp.float32),
        jnp.asarray(hidden[None], jnp.float32),
        first_position=1,
    )
    p = "model.mtp_layers.0."
    e, h = rms(emb, t[p + "token_layernorm.weight"]), rms(hidden, t[p + "hidden_layernorm.weight"])
    x = np.concatenate([h, e], -1) @ t[p + "input_proj.weight"].T  # MiMo: hidden first
    block = ref_layer(x, rms(x, t[p + "input_layernorm.weight"]), t, p, np.arange(1, 6))
    final = rms(block, t[p + "final_layernorm.weight"])
    np.testing.assert_allclose(np.asarray(normed[0]), final, rtol=2e-4, atol=2e-4)
    np.testing.assert_allclose(np.asarray(passed[0]), final, rtol=2e-4, atol=2e-4)  # MiMo recycles it


def deepseek_v3_mtp_layer(rng, experts=2, rank=4):
    """The key layout of a real DeepSeek-V3 MTP layer (model.layers.{L}.*): MLA attention (low-rank q
    and kv projections) and a mixture-of-experts MLP with a router and shared experts (shapes shrunk)."""
    p = f"model.layers.{TARGET.num_layers}."
    t = {f"{p}{n}.weight": 1 + rng.normal(0, 0.1, (D,)) for n in ("enorm", "hnorm", "input_layernorm")}
    t[f"{p}post_attention_layernorm.weight"] = np.ones((D,))
    t[f"{p}eh_proj.weight"] = rng.normal(0, 0.2, (D, 2 * D))
    t[f"{p}shared_head.norm.weight"] = np.ones((D,))
    t[f"{p}shared_head.head.weight"] = rng.normal(0, 0.2, (V, D))
    t[f"{p}embed_tokens.weight"] = rng.normal(0, 0.2, (V, D))
    attn = f"{p}self_attn."
    t[attn + "q_a_proj.weight"] = rng.normal(0, 0.2, (rank, D))
    t[attn + "q_a_layernorm.weight"] = np.ones((rank,))
    t[attn + "q_b_proj.weight"] = rng.normal(0, 0.2, (D, rank))
    t[attn + "kv_a_proj_with_mqa.weight"] = rng.normal(0, 0.2, (rank + 2, D))
    t[attn + "kv_a_layernorm.weight"] = np.ones((rank,))
    t[attn + "kv_b_proj.weight"] = rng.normal(0, 0.2, (2 * D, rank))
    t[attn + "o_proj.weight"] = rng.normal(0, 0.2, (D, D))
    t[f"{p}mlp.gate.weight"] = rng.normal(0, 0.2, (experts, D))
    t[f"{p}mlp.gate.e_score_correction_bias"] = np.zeros((experts,))
    for e in [str(i) for i in range(experts)]:
        for name, shape in (("gate_proj", (F, D)), ("up_proj", (F, D)), ("down_proj", (D, F))):
            t[f"{p}mlp.experts.{e}.{name}.weight"] = rng.normal(0, 0.2, shape)
    for name, shape in (("gate_proj", (F, D)), ("up_proj", (F, D)), ("down_proj", (D, F))):
        t[f"{p}mlp.shared_experts.{name}.weight"] = rng.normal(0, 0.2, shape)
    config = dict(
        LLAMA_JSON, model_type="deepseek_v3", num_hidden_layers=TARGET.num_layers, num_nextn_predict_layers=1
    )
    return t, config


def test_deepseek_v3_mtp_layers_need_a_deepseek_v3_target(tmp_path):
    """(DeepSeek-V3 targets load them: tests/test_deepseek_mtp.py.)"""
    tensors, config = deepseek_v3_mtp_layer(np.random.default_rng(5))
    write(tmp_path / "ds", tensors, config, "model.safetensors")
    with pytest.raises(
        ModelLoadError, match=r"DeepSeek-V3 MTP layers .*MLA.* need a DeepSeek-V3 target, not a llama"
    ):
        load_head(tmp_path / "ds", "mtp", TARGET, jnp.float32)


# ---------------------------------------------------------------------------------------------------
# Errors name the key
# ---------------------------------------------------------------------------------------------------

MISSING = {
    "medusa": "2.0.linear.bias",
    "eagle": "layers.0.self_attn.k_proj.weight",
    "eagle3": "midlayer.hidden_norm.weight",
    "mimo_mtp": "model.mtp_layers.0.self_attn.q_proj.bias",
}
RESHAPED = {
    "medusa": "1.1.weight",
    "eagle": "fc.weight",
    "eagle3": "lm_head.weight",
    "mimo_mtp": "model.mtp_layers.0.input_proj.weight",
}
UNEXPECTED = {
    "medusa": "0.2.weight",
    "eagle": "layers.1.mlp.up_proj.weight",
    "eagle3": "midlayer.extra.weight",
    "mimo_mtp": "model.mtp_layers.0.self_attn.o_proj.bias",
}


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_missing_key_is_named(tmp_path, layout):
    key = MISSING[layout]
    with pytest.raises(ModelLoadError, match=f"missing tensor '{key}'"):
        load(tmp_path, layout, mutate=lambda t: t.pop(key))


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_bad_shape_is_named(tmp_path, layout):
    key = RESHAPED[layout]

    def cut(t):
        t[key] = t[key][:, :-1]

    with pytest.raises(ModelLoadError, match=f"tensor '{key}' has shape"):
        load(tmp_path, layout, mutate=cut)


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_unexpected_key_is_named(tmp_path, layout):
    key = UNEXPECTED[layout]

    def add(t):
        t[key] = np.zeros((3,))

    with pytest.raises(ModelLoadError, match=f"unexpected tensor '{key}'"):
        load(tmp_path, layout, mutate=add)


def test_config_json_errors_name_the_field(tmp_path):
    def no_heads(directory):
        config = json.loads((directory / "config.json").read_text())
        del config["medusa_num_heads"]
        (directory / "config.json").write_text(json.dumps(config))

    load(tmp_path, "medusa")
    no_heads(tmp_path / "medusa")
    with pytest.raises(ModelLoadError, match="medusa_num_heads"):
        load_head(tmp_path / "medusa", "medusa", TARGET, jnp.float32)
    with pytest.raises(ModelLoadError, match="no such draft head directory"):
        load_head(tmp_path / "nowhere", "eagle", TARGET, jnp.float32)


# ---------------------------------------------------------------------------------------------------
# jaxspec's own format (Orbax)
# ---------------------------------------------------------------------------------------------------

LAYER = head_layer_config(TARGET)
OWN_CONFIGS = {
    "medusa": MedusaConfig(num_heads=2, num_layers=2, hidden_size=D, vocab_size=V, own_lm_head=False),
    "eagle": EagleConfig(layer=LAYER),
    "eagle3": Eagle3Config(layer=LAYER, target_hidden_size=D, draft_vocab_size=12, target_layers=(1, 2, 3)),
    "mtp": MtpConfig(layer=LAYER, num_modules=2, embedding_first=False, recycle_normed=True),
}


@pytest.mark.parametrize("method", sorted(OWN_CONFIGS))
def test_own_format_round_trip(tmp_path, method):
    head = init_head(OWN_CONFIGS[method], jnp.float32, seed=5)
    save_head(head, tmp_path / "head")
    loaded = load_head(tmp_path / "head", method, TARGET, jnp.float32)
    assert loaded.config == head.config
    from flax import nnx

    original, restored = nnx.to_flat_state(head.params), dict(nnx.to_flat_state(loaded.params))
    assert len(original) == len(restored)
    for path, variable in original:
        np.testing.assert_array_equal(
            np.asarray(variable.get_value()), np.asarray(restored[path].get_value())
        )
    other = "eagle" if method != "eagle" else "mtp"
    with pytest.raises(ModelLoadError, match=f"asks for {other}"):
        load_head(tmp_path / "head", other, TARGET, jnp.float32)
    with pytest.raises(FileExistsError):
        save_head(head, tmp_path / "head")


def test_spec_head_path_reaches_the_drafter(tmp_path):
    """SpecConfig(head=dir) loads that head (here jaxspec's own format) for make_head_drafter."""
    import dataclasses

    from jaxspec.drafters.heads.registry import make_head_drafter

    head = init_head(OWN_CONFIGS["eagle"], jnp.float32, seed=9)
    save_head(head, tmp_path / "eagle")
    model = dataclasses.make_dataclass("FakeModel", ["config", "graphdef", "dtype"], eq=False)(
        TARGET, None, jnp.float32
    )
    drafter, params = make_head_drafter(
        model, SpecConfig(method="eagle", head=str(tmp_path / "eagle"), topk=2)
    )
    assert drafter.num_draft_tokens == 2 * 4 and drafter.max_depth == 4
    np.testing.assert_array_equal(
        np.asarray(params["head"]["fc"]["kernel"].get_value()),
        np.asarray(head.params["fc"]["kernel"].get_value()),
    )
