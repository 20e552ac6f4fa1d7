"""DeepSeek-V3-family targets (MLA + MoE): parity with transformers, the MLA cache, loading."""

from __future__ import annotations

import json
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from flax import nnx

import jaxspec
from jaxspec.errors import InputError, ModelLoadError
from jaxspec.model.deepseek_v3.config import DeepseekV3Config, read_deepseek_config
from jaxspec.model.deepseek_v3.model import DeepseekV3Model
from jaxspec.model.forward import causal_mask, lm_logits, model_forward
from jaxspec.model.kv_cache import KVCache, commit_path
from jaxspec.sampling.tree import ancestor_mask, tree_positions
from tests.test_tree_verify_commit import TOKENS, make_tree
from tests.test_tree_verify_commit import _prefill as prefill_cache
from tests.tiny_deepseek import save_deepseek, tiny_deepseek

PROMPTS = [[5, 17, 9, 3], list(range(30, 60)), [42], [7, 7, 7, 1, 2, 3, 4, 5, 6, 8, 90]]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    torch_model = tiny_deepseek()
    path = tmp_path_factory.mktemp("deepseek_tiny")
    save_deepseek(torch_model, path)
    return torch_model, jaxspec.load(str(path), dtype="float32")


def _check_parity(torch_model, model, num_prompts=4):
    worst = 0.0
    for ids in PROMPTS[:num_prompts]:
        with torch.no_grad():
            ref = torch_model(torch.tensor([ids])).logits[0].numpy()
        worst = max(worst, float(np.abs(model.logits(ids) - ref).max()))
    assert worst <= 1e-4, worst
    completions = jaxspec.generate(model, PROMPTS[:num_prompts], max_new_tokens=32)
    for ids, completion in zip(PROMPTS, completions, strict=False):
        with torch.no_grad():
            ref = torch_model.generate(
                torch.tensor([ids]), max_new_tokens=32, do_sample=False, eos_token_id=None, pad_token_id=0
            )[0, len(ids) :].tolist()
        assert completion.token_ids == ref
    return worst


def test_tiny_deepseek_logits_and_greedy_match_transformers(tiny):
    torch_model, model = tiny
    assert isinstance(model.config, DeepseekV3Config) and model.config.yarn is not None
    worst = _check_parity(torch_model, model)
    print(f"deepseek_v3 fp32 checkpoint: max |dlogit| = {worst:.2e}")


@pytest.mark.slow
def test_attention_pallas_is_refused_not_ignored(tiny):
    """MLA layers have no Pallas kernel: asking for one is an error that names the option, not a run that
    silently takes the jnp path; "reference" and "auto" run (and agree)."""
    _, model = tiny
    prompt = PROMPTS[0]
    with pytest.raises(
        InputError, match=r"SpecConfig.attention='pallas'.*deepseek_v3 model runs auto \| reference"
    ):
        jaxspec.generate(
            model, [prompt], max_new_tokens=2, spec=jaxspec.SpecConfig(method="ngram", attention="pallas")
        )
    runs = [
        jaxspec.generate(
            model, [prompt], max_new_tokens=3, spec=jaxspec.SpecConfig(method="ngram", attention=a)
        )
        for a in ("reference", "auto")
    ]
    assert runs[0][0].token_ids == runs[1][0].token_ids


def test_fp8_block_scaled_checkpoint_is_dequantised_at_load(tmp_path):
    torch_model = tiny_deepseek(seed=1)
    save_deepseek(torch_model, tmp_path, fp8=True, shards=3)  # torch_model now holds the dequantised weights
    files = sorted(p.name for p in tmp_path.glob("*.safetensors"))
    assert len(files) == 3
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())["weight_map"]
    assert "model.layers.1.self_attn.q_b_proj.weight_scale_inv" in index
    model = jaxspec.load(str(tmp_path), dtype="float32")
    worst = _check_parity(torch_model, model, num_prompts=2)
    print(f"deepseek_v3 fp8 checkpoint: max |dlogit| = {worst:.2e}")


REAL_CONFIG = Path(__file__).resolve().parents[1] / "configs" / "deepseek_v3_config.json"
# The real config's sizes shrunk to what a test can write (every other field kept as published).
SHRUNK = dict(
    hidden_size=32, intermediate_size=48, moe_intermediate_size=16, num_hidden_layers=4,
    num_attention_heads=4, num_key_value_heads=4, n_routed_experts=16, kv_lora_rank=16,
    q_lora_rank=24, qk_nope_head_dim=8, qk_rope_head_dim=8, v_head_dim=12, vocab_size=96,
    max_position_embeddings=2048,
)  # fmt: skip


def test_the_mla_cache_holds_only_latent_and_rope_key(tiny):
    _, model = tiny
    c = model.config
    cache = KVCache.zeros(c, 2, 40, jnp.float32)
    assert len(cache.keys) == len(cache.values) == c.num_layers
    for latent, rope in zip(cache.keys, cache.values, strict=True):
        assert latent.shape == (2, 1, 40, c.kv_lora_rank)
        assert rope.shape == (2, 1, 40, c.qk_rope_head_dim)
    n = len(PROMPTS[1])
    _, _, written = model_forward(
        model.graphdef, model.params, jnp.asarray([PROMPTS[1]] * 2), jnp.broadcast_to(jnp.arange(n), (2, n)),
        cache, causal_mask(2, n),
    )  # fmt: skip
    assert jax.tree.map(jnp.shape, written) == jax.tree.map(jnp.shape, cache)
    assert float(jnp.abs(written.keys[0][:, :, :n]).min(axis=-1).max()) > 0  # latents were written
    assert float(jnp.abs(written.keys[0][:, :, n:]).max()) == 0


@pytest.mark.parametrize(
    "path",
    [
        [0, 1, 4, 6],
        pytest.param([0, 2, 5], marks=pytest.mark.slow),
        pytest.param([0], marks=pytest.mark.slow),
    ],
)
def test_tree_verify_and_commit_match_autoregressive(tiny, path):
    """One forward over a draft tree (ancestor mask, positions prefix + depth) gives each node the logits
    of its path fed token by token, and committing a path leaves the cache autoregressive feeding gives."""
    _, model = tiny
    prompt = [5, 9, 70, 31, 7]
    tree = make_tree()
    cache = prefill_cache(model, prompt)
    hidden, _, tree_cache = model_forward(
        model.graphdef,
        model.params,
        tree.tokens,
        tree_positions(tree, cache.lengths),
        cache,
        ancestor_mask(tree),
    )
    tree_logits = np.asarray(lm_logits(model.graphdef, model.params, hidden))[0]
    committed = commit_path(
        tree_cache, jnp.asarray([path + [-1] * (4 - len(path))]), jnp.asarray([len(path)]), window=7
    )
    sequence = prompt + [int(TOKENS[i]) for i in path]
    reference = model.logits(sequence)
    for j, node in enumerate(path):
        np.testing.assert_allclose(tree_logits[node], reference[len(prompt) + j], atol=1e-4)
    ref_cache = prefill_cache(model, sequence)
    n = len(sequence)
    for ours, ref in zip(committed.keys + committed.values, ref_cache.keys + ref_cache.values, strict=True):
        np.testing.assert_allclose(ours[0, :, :n], ref[0, :, :n], atol=1e-5)


@pytest.mark.slow  # ~30 s to trace the 671B module tree's shapes
def test_real_deepseek_v3_config_builds_the_module_tree():
    config = read_deepseek_config(REAL_CONFIG)
    assert (config.num_layers, config.n_routed_experts, config.kv_cache_dims()) == (
        61,
        256,
        ((1, 512), (1, 64)),
    )
    assert config.yarn == (40.0, 4096, 32.0, 1.0, 1.0, 1.0) and config.first_k_dense_replace == 3
    _, abstract = nnx.split(nnx.eval_shape(lambda: DeepseekV3Model(config, jnp.bfloat16, rngs=nnx.Rngs(0))))
    flat = dict(nnx.to_flat_state(abstract))
    total = sum(int(np.prod(v.get_value().shape)) for v in flat.values())
    assert round(total / 1e9) == 671  # the published main-model count (the MTP layer's 11.5B apart)
    assert flat[("layers", 3, "mlp", "experts", "gate_up_proj")].get_value().shape == (256, 2, 2048, 7168)
    assert flat[("layers", 0, "mlp", "gate_up_proj", "weight")].get_value().shape == (2, 18432, 7168)
    assert flat[("layers", 5, "self_attn", "kv_b_proj", "weight")].get_value().shape == (128, 256, 512)
    assert flat[("layers", 5, "self_attn", "q_b_proj", "weight")].get_value().shape == (128, 192, 1536)


def _write_shrunk(directory: Path, **changes) -> dict:
    raw = json.loads(REAL_CONFIG.read_text())
    raw.update(SHRUNK)
    raw["quantization_config"]["weight_block_size"] = [16, 16]
    raw.update(changes)
    return raw


def test_load_a_directory_with_the_real_config_fields(tmp_path):
    """The published config.json (sizes shrunk, every other field as published: fp8 quantization_config,
    YaRN rope_scaling, sigmoid / noaux_tc routing) with fp8 weights written by the test."""
    import transformers

    raw = _write_shrunk(tmp_path)
    hf_fields = {
        k: v for k, v in raw.items() if k not in ("auto_map", "quantization_config", "architectures")
    }
    torch.manual_seed(0)
    torch_model = transformers.DeepseekV3ForCausalLM(transformers.DeepseekV3Config(**hf_fields)).eval()
    save_deepseek(torch_model, tmp_path, fp8=True)
    (tmp_path / "config.json").write_text(json.dumps(raw))
    model = jaxspec.load(str(tmp_path), dtype="float32")
    assert isinstance(model.graphdef, nnx.GraphDef) and model.config.num_layers == 4
    layers = nnx.merge(model.graphdef, model.params).layers
    assert [type(layer.mlp).__name__ for layer in layers] == ["MLP", "MLP", "MLP", "MoE"]
    ids = [3, 50, 7, 12, 90]
    with torch.no_grad():
        ref = torch_model(torch.tensor([ids])).logits[0].numpy()
    np.testing.assert_allclose(model.logits(ids), ref, atol=1e-4)


@pytest.mark.parametrize(
    "field,value",
    [("scoring_func", "softmax"), ("index_topk", 2048), ("topk_method", "greedy"), ("hidden_act", "gelu")],
)
def test_an_unsupported_config_field_is_named(tmp_path, field, value):
    raw = _write_shrunk(tmp_path, **{field: value})
    (tmp_path / "config.json").write_text(json.dumps(raw))
    with pytest.raises(ModelLoadError, match=field):
        jaxspec.load(str(tmp_path))
