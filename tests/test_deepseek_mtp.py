"""DeepSeek-V3's own MTP layer (model.layers.{L}) as the MTP drafter's module: its forward against a
torch composition of transformers' DeepSeek-V3 layer, and inside the speculative engine (greedy
speculative == greedy autoregressive, forced-acceptance runs, recorded draft logits recomputed from
scratch; chain and tree, batch 4 and 1), and the statistical exactness test."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import jaxspec
from jaxspec.cache import KVCache
from jaxspec.forward import causal_mask, model_forward
from jaxspec.models.deepseek_v3.config import DeepseekV3Config
from jaxspec.models.deepseek_v3.mtp import DeepseekMtpModule
from jaxspec.models.heads.mtp import mtp_sequence_forward
from jaxspec.models.heads.registry import head_for, make_head_drafter
from tests import test_heads_engine, test_heads_exactness
from tests.tiny_deepseek import mtp_reference_logits, save_deepseek, tiny_deepseek, tiny_mtp_layer

PROMPTS = [[3, 14, 15, 92, 65, 35, 89, 79, 3, 14], [50, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10], [7, 7, 7, 10, 20, 30],
           list(range(30, 45))]  # fmt: skip
DEPTH = test_heads_engine.DEPTH


@pytest.fixture(scope="module")
def with_mtp(tmp_path_factory):
    torch_model = tiny_deepseek()
    torch_model.config._attn_implementation = "eager"
    tensors, parts = tiny_mtp_layer(torch_model)
    path = tmp_path_factory.mktemp("deepseek_mtp")
    save_deepseek(torch_model, path, mtp=(tensors, parts), fp8=True)
    return torch_model, parts, path, jaxspec.load(str(path), dtype="float32")


def test_mtp_layer_loads_and_matches_the_torch_reference(with_mtp):
    torch_model, parts, path, model = with_mtp
    head = head_for(model, jaxspec.SpecConfig(method="mtp", head=str(path)))
    assert isinstance(head.config.layer, DeepseekV3Config) and head.config.num_modules == 1
    assert isinstance(nnx.merge(head.graphdef, jax_tree_first(head.params)), DeepseekMtpModule)
    assert head.params["block"]["mlp"]["experts"]["gate_up_proj"].get_value().shape == (1, 8, 2, 16, 32)
    ids = [5, 17, 9, 3, 44, 12, 80, 1, 2, 60]
    n = len(ids)
    hidden, _, _ = model_forward(
        model.graphdef, model.params, jnp.asarray([ids]), jnp.arange(n)[None],
        KVCache.zeros(model.config, 1, n, jnp.float32), causal_mask(1, n),
    )  # fmt: skip
    target = nnx.merge(model.graphdef, model.params)
    _, normed = mtp_sequence_forward(
        head.graphdef, head.params, 0, target.embed(jnp.asarray([ids[1:]])), hidden[:, :-1]
    )
    ours = np.asarray(target.lm_logits(normed))[0]
    ref = mtp_reference_logits(torch_model, parts, ids).numpy()
    assert np.abs(ours - ref).max() <= 1e-4


def jax_tree_first(stacked):
    import jax

    return jax.tree.map(lambda x: x[0], stacked)


SHAPES = {
    "deepseek-mtp-chain": {"method": "mtp", "num_speculative_tokens": DEPTH},
    "deepseek-mtp-tree": {"method": "mtp", "num_speculative_tokens": DEPTH, "topk": 2, "num_draft_tokens": 5},
}


@pytest.mark.parametrize(
    "name,rows",
    [
        ("deepseek-mtp-chain", 4),
        pytest.param("deepseek-mtp-tree", 4, marks=pytest.mark.slow),
        pytest.param("deepseek-mtp-chain", 1, marks=pytest.mark.slow),
        pytest.param("deepseek-mtp-tree", 1, marks=pytest.mark.slow),
    ],
)
def test_deepseek_mtp_drafter_in_the_engine(monkeypatch, with_mtp, name, rows):
    """`test_heads_engine.check_runs` with the checkpoint's MTP layer: plain greedy == autoregressive,
    oracle-forced drafts all accepted, partial acceptance, every recorded draft logits recomputed."""
    _, _, path, model = with_mtp
    monkeypatch.setitem(test_heads_engine.SHAPES, name, dict(SHAPES[name], head=str(path)))
    test_heads_engine.check_runs(monkeypatch, model, name, PROMPTS[:rows])


@pytest.fixture(scope="module")
def small_vocab(tmp_path_factory):
    path = tmp_path_factory.mktemp("deepseek_vocab16")
    save_deepseek(tiny_deepseek(vocab_size=test_heads_exactness.VOCAB), path)
    return jaxspec.load(str(path), dtype="float32")


@pytest.mark.slow
def test_deepseek_mtp_drafts_keep_the_target_distribution(monkeypatch, small_vocab):
    """The statistical exactness test of the other heads, with a random DeepSeek-V3 MTP module (MLA +
    MoE block) drafting for a DeepSeek-V3 target."""
    spec = test_heads_exactness.SPECS["mtp"]
    drafter, _ = make_head_drafter(small_vocab, spec)
    assert isinstance(drafter.config.layer, DeepseekV3Config)
    monkeypatch.setitem(test_heads_exactness.SPECS, "deepseek-mtp", spec)
    test_heads_exactness.test_head_drafts_keep_the_target_distribution(small_vocab, "deepseek-mtp")
